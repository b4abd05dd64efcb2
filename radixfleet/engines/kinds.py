"""What a worker is (contract 7, docs/DESIGN.md), and finding out by asking it.

The kinds are ``WorkerKind``'s; what each one means for cache truth, load, keys and
P/D is its adapter's to say (radixfleet.engines.adapters).

``probe`` tells the kind of a worker configured as ``auto`` from what it serves, in
this order: our agent's ``/server_info`` (``"version": "radixfleet-..."``), the
metric families of ``/metrics`` (``vllm:`` or ``sglang:``), SGLang's
``/server_info``; anything else that answers is ``openai``. It also reads the
models the worker serves from ``/v1/models``. Every request is bounded by
``timeout_s``; a worker that answers nothing probes as ``None`` (retried later).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import re
from dataclasses import dataclass
from typing import Literal

import aiohttp

log = logging.getLogger("radixfleet.engines")


#: the kinds' names as a type (``Literal["auto", KindName]``: a worker entry's kind);
#: ``WorkerKind``'s values, in its order (tests/engines/test_adapters.py)
KindName = Literal["agent", "vllm", "sglang", "openai"]


class WorkerKind(str, enum.Enum):
    AGENT = "agent"  # radixfleet's worker agent
    VLLM = "vllm"
    SGLANG = "sglang"
    OPENAI = "openai"  # any other OpenAI-compatible server (llama.cpp, TGI, ...)


def configured_kind(name: str) -> WorkerKind | None:
    """The kind a worker entry names; None for ``auto`` (``probe`` tells it)."""
    return None if name == "auto" else WorkerKind(name)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    kind: WorkerKind
    models: tuple[str, ...]  # from /v1/models ((): unknown)


async def _get(
    session: aiohttp.ClientSession, url: str, timeout_s: float, limit: int = 4 << 20
) -> tuple[int, bytes] | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            body = await r.content.read(limit)
            return r.status, body
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


def _json(body: bytes):
    try:
        return json.loads(body)
    except ValueError:
        return None


def _family(prefix: bytes) -> re.Pattern:
    return re.compile(rb"(?m)^(?:# (?:HELP|TYPE) )?" + re.escape(prefix))


_VLLM, _SGLANG, _AGENT = _family(b"vllm:"), _family(b"sglang:"), _family(b"radixfleet_agent_")


def kind_from_metrics(text: bytes) -> WorkerKind | None:
    """The engine a Prometheus page belongs to, from its metric family names (our
    agent exports sglang:* gauges too, beside its own radixfleet_agent_* ones)."""
    if _VLLM.search(text):
        return WorkerKind.VLLM
    if _AGENT.search(text):
        return WorkerKind.AGENT
    if _SGLANG.search(text):
        return WorkerKind.SGLANG
    return None


def models_from(body: bytes | None) -> tuple[str, ...]:
    """Model ids from a ``/v1/models`` answer; () when it is not one."""
    data = _json(body) if body else None
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return ()
    return tuple(m["id"] for m in items if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"])[
        :64
    ]


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> ProbeResult | None:
    """Asks the worker at ``url`` what it is (module docstring). None: no answer."""
    info, metrics, models = await asyncio.gather(
        _get(session, url + "/server_info", timeout_s),
        _get(session, url + "/metrics", timeout_s),
        _get(session, url + "/v1/models", timeout_s),
    )
    if info is None and metrics is None and models is None:
        return None
    mods = models_from(models[1]) if models and models[0] == 200 else ()
    si = _json(info[1]) if info and info[0] == 200 else None
    if isinstance(si, dict) and str(si.get("version", "")).startswith("radixfleet"):
        return ProbeResult(WorkerKind.AGENT, mods)
    if metrics and metrics[0] == 200:
        k = kind_from_metrics(metrics[1])
        if k is not None:
            return ProbeResult(k, mods)
    if isinstance(si, dict) and ("max_total_num_tokens" in si or "tp_size" in si):
        return ProbeResult(WorkerKind.SGLANG, mods)
    return ProbeResult(WorkerKind.OPENAI, mods)
