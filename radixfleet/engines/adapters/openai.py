"""Any other OpenAI-compatible server (llama.cpp, TGI, ...): the router sees only its answers.

Cache truth: the router's own pick-time hints, aged at the KV capacity and corrected
by each answer's ``cached_tokens`` (the approximate mode), unless ``events:`` names
an endpoint publishing vLLM's event shapes.
Load: the router's own counts. Keys: routing bytes, unless a tokenizer is configured.
P/D: the OpenAI API's prefill leg (``kv_transfer_params``).

A worker whose kind is not yet probed (``kind: auto``) is answered for by this
adapter until its probe answers (``adapter_for(None)``): it claims nothing.
"""

from __future__ import annotations

from radixfleet.engines.adapters.base import EngineAdapter
from radixfleet.engines.kinds import WorkerKind


class OpenAIAdapter(EngineAdapter):
    __slots__ = ()
    kind = WorkerKind.OPENAI
