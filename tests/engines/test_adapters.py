"""Engine adapters (radixfleet.engines.adapters): each kind answers the interface, the
registry covers every kind, and the rules each one states hold (contract 7)."""

from __future__ import annotations

import asyncio
import json
import typing

import pytest

from radixfleet.config import WORKER_KINDS, DnsServiceSpec, K8sSelectorSpec, WorkerSpec
from radixfleet.engines.adapters import (
    ADAPTERS,
    KINDS,
    EngineAdapter,
    PdLeg,
    Truth,
    adapter_for,
    ask_until_answered,
)
from radixfleet.engines.engine_metrics import MetricsKind
from radixfleet.engines.event_sources import EventSource, SourcesCause, SourcesProblem
from radixfleet.engines.kinds import KindName, WorkerKind
from radixfleet.engines.tokenizer_source import EngineRoot, KeysCause, KeysProblem

#: the interface's answers, per kind: the table of radixfleet/engines/adapters/__init__.py
ANSWERS = {
    #        pushes lists  metrics              tokens  blocks  pd_leg
    "agent": (True, False, None, False, False, PdLeg.KV_TRANSFER),
    "vllm": (False, True, MetricsKind.VLLM, True, True, PdLeg.KV_TRANSFER),
    "sglang": (False, False, MetricsKind.SGLANG, True, True, PdLeg.BOOTSTRAP),
    "openai": (False, False, None, False, False, PdLeg.KV_TRANSFER),
}
ATTRS = ("pushes", "lists_event_sources", "metrics", "engine_tokens", "whole_block_hits", "pd_leg")


def test_every_kind_has_one_adapter_and_the_names_are_one_list():
    assert tuple(ADAPTERS) == tuple(WorkerKind)
    assert KINDS == ("agent", "vllm", "sglang", "openai") == tuple(k.value for k in WorkerKind)
    assert typing.get_args(KindName) == KINDS  # the names as a type, for the config's fields
    for kind, adapter in ADAPTERS.items():
        assert isinstance(adapter, EngineAdapter) and adapter.kind is kind
        assert adapter_for(kind) is adapter and adapter_for(kind.value) is adapter
        assert not hasattr(adapter, "__dict__"), f"{kind}: an adapter holds no state"
    assert len({type(a) for a in ADAPTERS.values()}) == len(ADAPTERS)  # one class per kind


def test_the_configs_kind_fields_list_the_registrys_kinds():
    # router/config.py still spells the names out (its Literal types); until it reads
    # them from KINDS this keeps its four copies equal to the registry
    assert WORKER_KINDS == KINDS
    assert typing.get_args(typing.get_type_hints(WorkerSpec)["kind"]) == ("auto", *KINDS)
    for cls in (K8sSelectorSpec, DnsServiceSpec):
        assert typing.get_args(typing.get_type_hints(cls)["kind"]) == KINDS, cls.__name__


def test_each_adapter_answers_every_question():
    got = {k.value: tuple(getattr(a, n) for n in ATTRS) for k, a in ADAPTERS.items()}
    assert got == ANSWERS
    for a in ADAPTERS.values():
        for name in ATTRS:
            assert name in type(a).__dict__ or name in EngineAdapter.__dict__, name
        assert isinstance(a.pd_leg, PdLeg) and (a.metrics is None or isinstance(a.metrics, MetricsKind))


def test_an_unprobed_or_unknown_kind():
    assert adapter_for(None) is ADAPTERS[WorkerKind.OPENAI]  # claims nothing until probed
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'; one of agent, vllm, sglang, openai"):
        adapter_for("tgi")


def test_truth_is_the_agents_pushes_else_the_events_sync():
    for kind, a in ADAPTERS.items():
        if kind is WorkerKind.AGENT:
            assert a.truth(True) is a.truth(False) is Truth.AGENT
        else:
            assert (a.truth(True), a.truth(False)) == (Truth.EXACT, Truth.APPROXIMATE), kind


def test_priority_in_each_engines_own_order():
    order = {k.value: [a.priority(r, 3) for r in range(3)] for k, a in ADAPTERS.items()}
    assert order == {"agent": [0, 1, 2], "vllm": [0, 1, 2], "sglang": [2, 1, 0], "openai": [0, 1, 2]}


class _Resp:
    def __init__(self, status: int, body: bytes) -> None:
        self.status, self._body = status, body
        self.content = self

    async def read(self, n: int) -> bytes:
        return self._body[:n]

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None


class _Session:
    """Answers GETs from a path -> (status, JSON) table and records the URLs asked."""

    def __init__(self, pages: dict) -> None:
        self.pages, self.asked = pages, []

    def get(self, url: str, timeout=None) -> _Resp:
        self.asked.append(url)
        path = url.removeprefix("http://w")
        status, obj = self.pages.get(path, (404, {}))
        return _Resp(status, json.dumps(obj).encode())


MODELS = {"data": [{"id": "m", "root": "org/tok", "parent": None}]}
MODEL_INFO = {"model_path": "/models/m", "tokenizer_path": "/models/tok"}
SOURCES = {"0": {"endpoint": "tcp://*:5557", "topic": "kv"}}


def test_vllm_and_sglang_name_their_tokenizer_where_each_engine_says_it():
    s = _Session({"/v1/models": (200, MODELS), "/get_model_info": (200, MODEL_INFO)})
    vllm = asyncio.run(adapter_for("vllm").tokenizer_root(s, "http://w", "m"))
    sgl = asyncio.run(adapter_for("sglang").tokenizer_root(s, "http://w", ""))
    assert s.asked == ["http://w/v1/models", "http://w/get_model_info"]
    assert isinstance(vllm, EngineRoot) and vllm.source == "org/tok"
    assert isinstance(sgl, EngineRoot) and sgl.source == "/models/tok"


def test_only_vllm_lists_event_sources_and_the_others_say_so_without_asking():
    s = _Session({"/kv_event_sources": (200, SOURCES), "/v1/models": (200, MODELS)})
    got = asyncio.run(adapter_for("vllm").event_sources(s, "http://w"))
    assert got == (EventSource(0, "tcp://*:5557", "kv", None),)
    assert s.asked == ["http://w/kv_event_sources"]
    for kind in ("agent", "sglang", "openai"):
        no = asyncio.run(adapter_for(kind).event_sources(s, "http://w"))
        assert isinstance(no, SourcesProblem) and no.cause is SourcesCause.MISSING, kind
    for kind in ("agent", "openai"):
        no_root = asyncio.run(adapter_for(kind).tokenizer_root(s, "http://w", "m"))
        assert isinstance(no_root, KeysProblem) and no_root.cause is KeysCause.NO_ROOT, kind
    assert s.asked == ["http://w/kv_event_sources"]  # the defaults ask nothing


def test_an_unreachable_answer_is_asked_again_until_it_answers_or_the_asker_stops(monkeypatch):
    async def no_wait(self) -> None:
        return None

    monkeypatch.setattr("radixfleet.common.background.Backoff.sleep", no_wait)
    down = SourcesProblem(SourcesCause.UNREACHABLE, "down")
    answers = [down, KeysProblem(KeysCause.UNREACHABLE, "down"), ()]

    async def ask():
        return answers.pop(0)

    assert asyncio.run(ask_until_answered(ask, lambda: True, "w")) == ()
    missing = SourcesProblem(SourcesCause.MISSING, "404")
    assert asyncio.run(ask_until_answered(_const(missing), lambda: True, "w")) is missing  # not retried
    alive = iter([True, True, False])
    assert asyncio.run(ask_until_answered(_const(down), lambda: next(alive), "w")) is None


def _const(value):
    async def ask():
        return value

    return ask
