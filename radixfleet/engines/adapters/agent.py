"""radixfleet's own worker agent (radixfleet_tools/agent/): it tells the router everything.

Cache truth: its exact KV events, pushed over HTTP (radixfleet.index.feedback,
radixfleet/server/agent_api.py).
Load: its load reports, pushed beside them (its own prefill rate among them).
Keys: routing bytes (``keys.block_bytes``); the agent keys its radix cache in them.
P/D: the OpenAI API's prefill leg (``kv_transfer_params``), as vLLM's.
"""

from __future__ import annotations

from radixfleet.engines.adapters.base import EngineAdapter
from radixfleet.engines.kinds import WorkerKind


class AgentAdapter(EngineAdapter):
    __slots__ = ()
    kind = WorkerKind.AGENT
    pushes = True
