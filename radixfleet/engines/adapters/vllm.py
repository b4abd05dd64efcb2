"""vLLM: its KV events over ZMQ, its /metrics, its tokenizer named by /v1/models.

Cache truth: KV events over ZMQ, from the configured ``events:`` or else from the
server's own ``GET /kv_event_sources`` (radixfleet.engines.event_sources), one stream per
data-parallel rank; the approximate mode while none are in sync.
Load: ``/metrics`` in the ``vllm:`` family (radixfleet.engines.engine_metrics).
Keys: token blocks with its tokenizer: configured, or named by ``/v1/models``' root
(radixfleet.engines.tokenizer_source), or through its ``POST /tokenize``; else routing
bytes. Its prefix hits are whole blocks below the last prompt token.
P/D: the prefill leg first with ``kv_transfer_params`` (its NIXL/P2P connectors);
lower ``priority`` values are served first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixfleet.engines.adapters.base import EngineAdapter
from radixfleet.engines.engine_metrics import MetricsKind
from radixfleet.engines.event_sources import EventSource, SourcesProblem, fetch_event_sources
from radixfleet.engines.kinds import WorkerKind
from radixfleet.engines.tokenizer_source import EngineRoot, KeysProblem, fetch_root, parse_vllm_models

if TYPE_CHECKING:
    import aiohttp


class VllmAdapter(EngineAdapter):
    __slots__ = ()
    kind = WorkerKind.VLLM
    lists_event_sources = True
    metrics = MetricsKind.VLLM
    engine_tokens = True
    whole_block_hits = True

    async def event_sources(
        self, session: aiohttp.ClientSession, url: str
    ) -> tuple[EventSource, ...] | SourcesProblem:
        """Its ``GET /kv_event_sources`` (vLLM 0.32 and later)."""
        return await fetch_event_sources(session, url)

    async def tokenizer_root(
        self, session: aiohttp.ClientSession, url: str, model: str
    ) -> EngineRoot | KeysProblem:
        """The ``root`` of ``model``'s entry in its ``GET /v1/models`` (its ``--model``)."""
        return await fetch_root(
            session, url, "/v1/models", lambda status, body: parse_vllm_models(status, body, model)
        )
