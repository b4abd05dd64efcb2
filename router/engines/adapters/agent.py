"""radixfleet's own worker agent (worker_agent/): it tells the router everything.

Cache truth: its exact KV events, pushed over HTTP (router.feedback, router/agent_api.py).
Load: its load reports, pushed beside them (its own prefill rate among them).
Keys: routing bytes (``keys.block_bytes``); the agent keys its radix cache in them.
P/D: the OpenAI API's prefill leg (``kv_transfer_params``), as vLLM's.
"""

from __future__ import annotations

from router.engines.adapters.base import EngineAdapter
from router.engines.kinds import WorkerKind


class AgentAdapter(EngineAdapter):
    __slots__ = ()
    kind = WorkerKind.AGENT
    pushes = True
