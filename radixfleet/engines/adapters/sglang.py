"""SGLang: its /metrics, its tokenizer named by /get_model_info, its own P/D pairing.

Cache truth: KV events if ``events:`` is configured (vLLM's shapes); else the
approximate mode (it lists no event sources).
Load: ``/metrics`` in the ``sglang:`` family (radixfleet.engines.engine_metrics).
Keys: as vLLM's, its tokenizer named by ``/get_model_info``'s tokenizer_path or
model_path. Its prefix hits are whole blocks below the last prompt token.
P/D: both legs at once, paired by a ``bootstrap_room`` (radixfleet/route/pd.py); higher
``priority`` values are served first (its default order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixfleet.engines.adapters.base import EngineAdapter, PdLeg
from radixfleet.engines.engine_metrics import MetricsKind
from radixfleet.engines.kinds import WorkerKind
from radixfleet.engines.tokenizer_source import EngineRoot, KeysProblem, fetch_root, parse_sglang_model_info

if TYPE_CHECKING:
    import aiohttp


class SglangAdapter(EngineAdapter):
    __slots__ = ()
    kind = WorkerKind.SGLANG
    metrics = MetricsKind.SGLANG
    engine_tokens = True
    whole_block_hits = True
    pd_leg = PdLeg.BOOTSTRAP

    async def tokenizer_root(
        self, session: aiohttp.ClientSession, url: str, model: str
    ) -> EngineRoot | KeysProblem:
        """The tokenizer_path (else model_path) of its ``GET /get_model_info``."""
        return await fetch_root(session, url, "/get_model_info", parse_sglang_model_info)

    def priority(self, rank: int, classes: int) -> int:
        """Higher values are served first (SGLang's default; ``--schedule-low-priority-
        values-first`` reverses it, and is not followed here): the rank reversed."""
        return classes - 1 - rank
