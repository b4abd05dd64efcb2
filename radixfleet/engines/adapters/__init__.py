"""One adapter per engine kind (contract 7, docs/DESIGN.md): where a worker's cache
truth and load come from, how its requests are keyed, what its P/D leg looks like.

=========  ==================================  =========================  ===============
kind       cache truth                          load                       keys
=========  ==================================  =========================  ===============
agent      its event pushes (HTTP, exact)       its load reports           routing bytes
vllm       KV events over ZMQ (configured, or   /metrics (vllm:*)          token blocks with
           its /kv_event_sources, every data-                              a tokenizer (set, or
           parallel rank), else hints aged +                               its /v1/models root),
           cached_tokens                                                   else routing bytes
sglang     KV events if configured (vLLM's      /metrics (sglang:*)        as vllm (its
           shapes), else as vllm                                           /get_model_info)
openai     hints aged + cached_tokens           router counts only         routing bytes
=========  ==================================  =========================  ===============

Modules::

    base     EngineAdapter: the questions and their default rules; Truth, PdLeg
    agent    AgentAdapter     radixfleet's worker agent
    vllm     VllmAdapter      vLLM
    sglang   SglangAdapter    SGLang
    openai   OpenAIAdapter    any other OpenAI-compatible server

``ADAPTERS`` maps each kind to its one (stateless) adapter; ``KINDS`` is the kinds'
names in that order, the one list a worker's configured ``kind`` is checked against.
A new engine is one module here and one entry in ``ADAPTERS``.
"""

from __future__ import annotations

from radixfleet.engines.adapters.agent import AgentAdapter
from radixfleet.engines.adapters.base import EngineAdapter, PdLeg, Truth, ask_until_answered
from radixfleet.engines.adapters.openai import OpenAIAdapter
from radixfleet.engines.adapters.sglang import SglangAdapter
from radixfleet.engines.adapters.vllm import VllmAdapter
from radixfleet.engines.kinds import KindName, WorkerKind

ADAPTERS: dict[WorkerKind, EngineAdapter] = {
    a.kind: a for a in (AgentAdapter(), VllmAdapter(), SglangAdapter(), OpenAIAdapter())
}
#: the engine kinds' names, in ``ADAPTERS``' order (router/config.py's ``kind`` fields
#: list the same names: tests/engines/test_adapters.py keeps them equal)
KINDS: tuple[KindName, ...] = tuple(k.value for k in ADAPTERS)


def adapter_for(kind: WorkerKind | str | None) -> EngineAdapter:
    """The adapter of ``kind`` (a ``WorkerKind`` or its name: a ``WorkerKind`` is its
    name as a str, so one lookup serves both). None, a kind not yet probed: the
    plain OpenAI server's, which claims nothing of the worker. Raises
    ``ValueError`` naming the kinds for a name that is none of them."""
    if kind is None:
        return _UNPROBED
    adapter = _BY_NAME.get(kind)
    if adapter is None:
        raise ValueError(f"unknown engine kind {kind!r}; one of {', '.join(KINDS)}")
    return adapter


_BY_NAME: dict[str, EngineAdapter] = {k.value: a for k, a in ADAPTERS.items()}
_UNPROBED = ADAPTERS[WorkerKind.OPENAI]


__all__ = [
    "ADAPTERS",
    "KINDS",
    "KindName",
    "EngineAdapter",
    "PdLeg",
    "Truth",
    "adapter_for",
    "ask_until_answered",
]
