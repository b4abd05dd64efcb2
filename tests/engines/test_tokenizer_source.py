"""A worker's tokenizer found from its engine (``radixfleet.engines.tokenizer_source``): the
answers parsed, the root looked for here, ``tokenizers.download`` honoured (never
contacting a hub), and — against fake vLLM servers on loopback
(``tests.engines.fake_dp_vllm.FakeDpVllm``: /v1/models with a root, /tokenize,
/metrics, /kv_event_sources and a ZMQ publisher) — a worker given by its URL alone
keyed in its engine's tokens and following its events, every bad root leaving it on
routing bytes and serving, and a restart with another model re-probed. Real vLLM:
tests/engines/test_vllm.py (``test_quick_start_is_precise_with_nothing_configured``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time

import aiohttp
import pytest
from aiohttp import web

from radixfleet.config import parse_config
from radixfleet.engines.token_keys import TokenizerLoadError, TokenKeyer
from radixfleet.engines.tokenizer_source import (
    PROBE_TEXT,
    EngineRoot,
    KeysCause,
    KeysProblem,
    locate,
    parse_sglang_model_info,
    parse_vllm_models,
)
from radixfleet.keys import Endpoint
from radixfleet_tools.bench.tiny_tokenizer import build as build_tokenizer
from radixfleet_tools.harness.procs import free_port
from tests.engines.fake_dp_vllm import BS, MODEL, FakeDpVllm, prompt

# ------------------------------------------------------------------ the answers


def _models(*cards) -> bytes:
    return json.dumps({"object": "list", "data": list(cards)}).encode()


def test_a_vllm_answer_names_the_served_models_root():
    body = _models(
        {"id": "base", "root": "/models/base", "parent": None},
        {"id": "sql-lora", "root": "/adapters/sql", "parent": "base"},
        {"id": "alias", "root": "org/base-repo"},
    )
    want = EngineRoot("/models/base", "/v1/models root", ("base", "alias"))
    assert parse_vllm_models(200, body, "base") == want
    assert parse_vllm_models(200, body, "alias").source == "org/base-repo"
    assert parse_vllm_models(200, body, "").source == "/models/base"  # the first base model
    # an adapter is not a root: its base model's tokenizer is asked for by name
    assert parse_vllm_models(200, body, "sql-lora").cause is KeysCause.NO_ROOT


@pytest.mark.parametrize(
    "status, body, cause, says",
    [
        (200, _models({"id": "m"}), KeysCause.NO_ROOT, "has no root"),
        (200, _models({"id": "m", "root": ""}), KeysCause.NO_ROOT, "not a path"),
        (200, _models({"id": "m", "root": 7}), KeysCause.NO_ROOT, "not a path"),
        (200, _models({"id": "m", "root": "/x" * 3000}), KeysCause.NO_ROOT, "not a usable path"),
        (200, _models({"id": "other", "root": "/x"}), KeysCause.NO_ROOT, "lists no model 'm'"),
        (200, b'{"data": 5}', KeysCause.NO_ROOT, "no data list"),
        (200, b"[[[", KeysCause.NO_ROOT, "answer"),
        (404, b"", KeysCause.NO_ROOT, "answered 404"),
        (503, b"", KeysCause.UNREACHABLE, "answered 503"),
    ],
)
def test_a_vllm_answer_without_a_usable_root_says_why(status, body, cause, says):
    got = parse_vllm_models(status, body, "m")
    assert isinstance(got, KeysProblem) and got.cause is cause and says in got.detail, got


def test_an_sglang_answer_names_its_tokenizer_path_first():
    info = {"model_path": "/models/m", "tokenizer_path": "/models/m-tok", "is_generation": True}
    assert parse_sglang_model_info(200, json.dumps(info).encode()) == EngineRoot(
        "/models/m-tok", "/get_model_info tokenizer_path"
    )
    assert parse_sglang_model_info(200, b'{"model_path": "org/m", "tokenizer_path": null}').source == "org/m"
    for status, body in ((200, b"{}"), (200, b"[]"), (404, b"")):
        got = parse_sglang_model_info(status, body)
        assert isinstance(got, KeysProblem) and got.cause is KeysCause.NO_ROOT, got


# ------------------------------------------------------------ read here, or not


@pytest.fixture
def no_hub(monkeypatch):
    """The Hugging Face cache as the test says it is, and the hub unreachable: every
    call that would download raises (it must never be made)."""
    import huggingface_hub
    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached: set[str] = set()
    calls: list[dict] = []

    def try_to_load_from_cache(repo_id, filename, **kw):
        if "/" in repo_id and repo_id.count("/") > 1:
            raise ValueError("not a repo id")
        return f"/cache/{repo_id}/{filename}" if repo_id in cached else None

    def from_pretrained(where, **kw):
        calls.append({"where": where, **kw})
        raise OSError(f"no network in this test ({where})")

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", try_to_load_from_cache)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return cached, calls


def test_a_root_is_read_here_or_says_why(tmp_path, no_hub):
    cached, _ = no_hub
    (tmp_path / "tok").mkdir()
    (tmp_path / "file").write_text("x")
    assert locate(str(tmp_path / "tok"), False) is None
    for src, says in (
        ("/models/not-on-this-host", "no folder '/models/not-on-this-host' on the router's host"),
        (str(tmp_path / "file"), "is not a folder"),
        ("org/not-cached", "not in the local Hugging Face cache and tokenizers.download is off"),
    ):
        got = locate(src, False)
        assert isinstance(got, KeysProblem) and got.cause is KeysCause.UNREADABLE and says in got.detail, got
    cached.add("org/cached")
    assert locate("org/cached", False) is None
    assert locate("org/not-cached", True) is None  # download: the hub is asked at load


def test_an_unreadable_folder_is_unreadable(tmp_path):
    import os

    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0)
    try:
        if os.access(d, os.R_OK):
            pytest.skip("running as a user who reads any folder (root)")
        got = locate(str(d), False)
        assert isinstance(got, KeysProblem) and got.cause is KeysCause.UNREADABLE, got
        assert "not readable here" in got.detail
    finally:
        d.chmod(0o700)


def test_download_setting_is_honoured_and_off_by_default(no_hub):
    """tokenizers.download decides whether transformers may fetch a repo; off, nothing
    is asked of a hub at all. The hub is never contacted here (no_hub)."""
    cached, calls = no_hub
    assert parse_config({}).tokenizers.download is False
    assert parse_config({"tokenizers": {"download": True}}).tokenizers.download is True
    with pytest.raises(TokenizerLoadError, match="local Hugging Face cache"):
        TokenKeyer.load("org/cached-or-not")
    assert calls[-1]["local_files_only"] is True
    with pytest.raises(TokenizerLoadError, match="not loadable from the Hugging Face hub"):
        TokenKeyer.load("org/from-the-hub", download=True)
    assert calls[-1]["where"] == "org/from-the-hub" and calls[-1]["local_files_only"] is False


async def test_an_engine_named_repo_is_downloaded_only_when_the_setting_allows(no_hub):
    from prometheus_client import CollectorRegistry

    from radixfleet.engines.manager import Engines
    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex

    _, calls = no_hub
    cfg = parse_config({})
    index = PrefixIndex()
    eng = Engines(cfg, Pool(cfg, index), index, CollectorRegistry())
    off = await eng.discover_keyer("org/engine-model")
    assert isinstance(off, KeysProblem) and off.cause is KeysCause.UNREADABLE and not calls
    on = await eng.discover_keyer("org/engine-model", download=True)
    assert isinstance(on, KeysProblem) and on.cause is KeysCause.LOAD_FAILED, on
    assert [(c["where"], c["local_files_only"]) for c in calls] == [("org/engine-model", False)]
    # a failed load is not remembered: asked again (after a restart), it is tried again
    await eng.discover_keyer("org/engine-model", download=True)
    assert len(calls) == 2


# ------------------------------------------------------- fake engines on loopback


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return build_tokenizer(str(tmp_path_factory.mktemp("tiny-tokenizer")))


@pytest.fixture(scope="module")
def other_tokenizer_dir(tokenizer_dir, tmp_path_factory) -> str:
    """The tiny tokenizer with two of the probe prompt's token ids swapped: another
    model's tokenizer, loadable, disagreeing with the engine's."""
    d = tmp_path_factory.mktemp("other-tokenizer")
    shutil.copytree(tokenizer_dir, d, dirs_exist_ok=True)
    ids = TokenKeyer.load(tokenizer_dir).token_ids(Endpoint.COMPLETIONS, {"prompt": PROBE_TEXT})[0]
    a, b = sorted(set(ids))[-2:]
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    ka = next(k for k, v in vocab.items() if v == a)
    kb = next(k for k, v in vocab.items() if v == b)
    vocab[ka], vocab[kb] = b, a
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return str(d)


async def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


class QuickStart:
    """Fake engines and one router (in this process) configured as ``radixfleet router
    --worker URL ...`` configures it: each worker its URL alone (``extra``: more)."""

    def __init__(self, fakes: dict, extra: dict | None = None, worker: dict | None = None) -> None:
        self.fakes = fakes  # worker id -> FakeDpVllm (or an aiohttp app's owner)
        self.extra = extra or {}
        self.worker = worker or {}

    async def __aenter__(self):
        from radixfleet.server.app import Router, RouterServer

        self.runners, workers = [], []
        for wid, fake in self.fakes.items():
            runner = web.AppRunner(fake.app())
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)
            workers.append({"url": f"http://127.0.0.1:{port}", "id": wid, **self.worker})
        cfg = {"listen": {"port": 0}, "health": {"interval_s": 0.2}, "workers": workers}
        self.router = Router(parse_config({**cfg, **self.extra}))
        self.server = RouterServer(self.router, port=0, admin_port=0)
        self.base = f"http://127.0.0.1:{await self.server.start()}"
        self.admin = f"http://127.0.0.1:{self.server.admin_port}"  # /admin/*, /metrics
        self.session = aiohttp.ClientSession()
        await wait_for(
            lambda: all(w.routable(time.monotonic()) and w.engine.brought_up for w in self.router.pool),
            20,
            "every worker routable, its engine side up",
        )
        return self

    async def __aexit__(self, *exc):
        await self.session.close()
        await self.server.aclose()
        for r in self.runners:
            await r.cleanup()
        for f in self.fakes.values():
            if hasattr(f, "close"):
                f.close()

    async def workers(self) -> dict:
        async with self.session.get(self.admin + "/admin/workers") as r:
            assert r.status == 200
            return {w["id"]: w for w in (await r.json())["workers"]}

    async def send(self, text: str) -> tuple[int, dict]:
        async with self.session.post(
            self.base + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}
        ) as r:
            return r.status, await r.json()

    def metric(self, line: str) -> bool:
        return line in self.router.metrics.render().decode()


async def until_exact(q: QuickStart, wid: str, seed: int) -> None:
    """Sends fresh prompts until the worker's events are in sync and its entries are
    the events' (a subscriber that joined late has missed the first batches)."""
    link = q.router.pool.get(wid).engine
    deadline = time.monotonic() + 15
    while not (link.in_sync and q.router.index.entries(wid) > 0):
        assert time.monotonic() < deadline, f"{wid}: events never in sync: {link.describe()}"
        assert (await q.send(prompt(seed)))[0] == 200
        seed += 1
        await asyncio.sleep(0.1)


def _keys_lines(caplog, wid: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("radixfleet") and r.getMessage().startswith(f"worker {wid}: keyed")
    ]


@pytest.mark.integration
async def test_a_worker_given_by_its_url_is_keyed_from_its_engine_root_and_precise(tokenizer_dir, caplog):
    """The quick start: nothing but the URL. The engine's /v1/models root is a folder
    here: its tokenizer is loaded, agrees with /tokenize, the events named by
    /kv_event_sources are followed, and each prompt's second request is predicted to
    the token. Before: keyed on routing bytes, events ignored (no_tokenizer)."""
    caplog.set_level(logging.INFO, logger="radixfleet")
    fake = FakeDpVllm(TokenKeyer.load(tokenizer_dir), ranks=1)
    fake.root = tokenizer_dir
    async with QuickStart({"v": fake}) as q:
        link = q.router.pool.get("v").engine
        keys = (await q.workers())["v"]["engine"]["keys"]
        assert keys["by"] == "tokens" and keys["from"] == "engine" and keys["tokenizer"] == tokenizer_dir
        assert keys["engine_root"] == {"source": tokenizer_dir, "field": "/v1/models root"}
        assert keys["probe"]["verdict"] == "agrees" and "probe prompt and chat" in keys["probe"]["detail"]
        assert keys["cause"] is None
        assert link.block_size == BS and link.events_source == "engine"
        await until_exact(q, "v", 900)
        before = link.stats.summary()
        for i in range(4):
            text = prompt(i)
            held = q.router.index.entries("v")
            status, first = await q.send(text)
            assert status == 200
            want = held + first["usage"]["prompt_tokens"] // BS
            await wait_for(lambda: q.router.index.entries("v") >= want, 5, "the events applied")
            status, second = await q.send(text)
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        after = link.stats.summary()
        assert after.samples - before.samples == 8
        assert after.sum_abs_tokens == before.sum_abs_tokens  # every prediction exact
        w = (await q.workers())["v"]["engine"]
        assert w["truth"] == "exact" and w["events"]["in_sync"] and w["events"]["source"] == "engine"
    said = _keys_lines(caplog, "v")
    assert len(said) == 1 and tokenizer_dir in said[0] and "/v1/models root" in said[0], said
    assert "agrees" in said[0]


@pytest.mark.integration
async def test_every_unusable_root_leaves_its_worker_on_bytes_serving_with_one_line_and_a_count(
    tokenizer_dir, other_tokenizer_dir, tmp_path, caplog
):
    """No root, a folder not on this host, one without a tokenizer, a tokenizer that
    is not the engine's (the probe), and keying through the engine's /tokenize off:
    keyed on routing bytes, its events not followed, one log line naming the cause,
    counted; every worker answers 200."""
    caplog.set_level(logging.INFO, logger="radixfleet")
    keyer = TokenKeyer.load(tokenizer_dir)
    (tmp_path / "empty").mkdir()
    roots = {
        "noroot": (None, "no_root"),
        "away": ("/models/on-the-engines-host", "unreadable"),
        "empty": (str(tmp_path / "empty"), "load_failed"),
        "other": (other_tokenizer_dir, "mismatch"),
    }
    fakes = {}
    for w, (root, _) in roots.items():
        fakes[w] = FakeDpVllm(keyer, ranks=1)
        fakes[w].root = root
    async with QuickStart(fakes, {"tokenizers": {"engine_tokenize": False}}) as q:
        ws = await q.workers()
        for w, (_, cause) in roots.items():
            keys = ws[w]["engine"]["keys"]
            assert keys["by"] == "bytes" and keys["cause"] == cause and keys["tokenizer"] is None, (w, keys)
            line = f'radixfleet_engine_tokenizer_unavailable_total{{cause="{cause}",worker="{w}"}} 1.0'
            assert q.metric(line), line
            assert not q.router.pool.get(w).engine.streams
        assert "first difference" in ws["other"]["engine"]["keys"]["detail"]
        assert ws["other"]["engine"]["keys"]["probe"]["verdict"] == "disagrees"
        for i in range(8):
            status, body = await q.send(prompt(300 + i))
            assert status == 200, body
    for w, (_, cause) in roots.items():
        said = _keys_lines(caplog, w)
        assert len(said) == 1 and f"({cause}: " in said[0] and "routing bytes" in said[0], (w, said)
    assert not any(r.exc_info for r in caplog.records if r.name.startswith("radixfleet"))


@pytest.mark.integration
async def test_an_engine_restarted_with_another_model_is_re_probed_and_its_entries_dropped(
    tokenizer_dir, other_tokenizer_dir, tmp_path
):
    """Restarted (a new start time on /metrics) with another model's folder: the root
    is asked again, the new tokenizer probed and keyed in, the worker's entries
    dropped, its events followed afresh; restarted again with a tokenizer that does
    not agree with its /tokenize: routing bytes (mismatch)."""
    second = str(tmp_path / "second-model")
    shutil.copytree(tokenizer_dir, second)
    fake = FakeDpVllm(TokenKeyer.load(tokenizer_dir), ranks=1)
    fake.root = tokenizer_dir
    off = {"tokenizers": {"engine_tokenize": False}}
    async with QuickStart({"v": fake}, off, worker={"metrics": {"interval_s": 0.1}}) as q:
        link = q.router.pool.get("v").engine
        index = q.router.index
        await until_exact(q, "v", 0)
        first_space = link.space.id
        fake.restart(second, TokenKeyer.load(second))
        await wait_for(lambda: link.keyer is not None and link.keyer.source == second, 10, "re-keyed")
        assert link.space.id != first_space and link.keys_describe()["probe"]["verdict"] == "agrees"
        assert q.metric('radixfleet_engine_resyncs_total{reason="restart",worker="v"} 1.0')
        await wait_for(lambda: bool(link.streams), 10, "its events followed again")
        await until_exact(q, "v", 50)
        # again, now serving with a tokenizer its root does not hold
        fake.restart(other_tokenizer_dir, TokenKeyer.load(tokenizer_dir))
        await wait_for(lambda: link.keys_problem is not None and not link.streams, 10, "re-probed")
        assert link.keys_describe()["cause"] == "mismatch" and link.keyer is None
        assert link.keys_describe()["by"] == "bytes" and index.entries("v") == 0
        assert (await q.send(prompt(99)))[0] == 200


@pytest.mark.integration
async def test_discovery_off_or_no_tokenize_endpoint(tokenizer_dir):
    """tokenizers.discover and engine_tokenize off: nothing asked, routing bytes, no
    cause. An engine without /tokenize: keyed from its root, the probe unchecked."""
    keyer = TokenKeyer.load(tokenizer_dir)
    fake = FakeDpVllm(keyer, ranks=1)
    fake.root = tokenizer_dir
    off = {"tokenizers": {"discover": False, "engine_tokenize": False}}
    async with QuickStart({"v": fake}, off) as q:
        keys = (await q.workers())["v"]["engine"]["keys"]
        assert keys == {
            "by": "bytes",
            "tokenizer": None,
            "from": None,
            "engine_root": None,
            "probe": None,
            "cause": None,
            "detail": None,
        }
    fake = FakeDpVllm(keyer, ranks=1)
    fake.root, fake.tokenize_keyer = tokenizer_dir, None
    async with QuickStart({"v": fake}) as q:
        keys = (await q.workers())["v"]["engine"]["keys"]
        assert keys["by"] == "tokens" and keys["probe"]["verdict"] == "unchecked", keys
        assert "answered 404" in keys["probe"]["detail"]


def _tokenize_count(q: QuickStart, outcome: str) -> float:
    return q.router.engines.prom.engine_tokenize.labels(outcome)._value.get()


@pytest.mark.integration
async def test_a_worker_whose_tokenizer_is_not_here_is_keyed_through_its_engine(tokenizer_dir, caplog):
    """The engine's root is a folder on its own host: each request's ids come from its
    POST /tokenize (the same body twice: fetched once), its events are followed, and
    predictions are exact. A /tokenize that stops answering: requests still served,
    routed by load (unkeyed), counted."""
    caplog.set_level(logging.INFO, logger="radixfleet")
    fake = FakeDpVllm(TokenKeyer.load(tokenizer_dir), ranks=1)
    fake.root = "/models/on-the-engines-host"
    async with QuickStart({"v": fake}) as q:
        link = q.router.pool.get("v").engine
        keys = (await q.workers())["v"]["engine"]["keys"]
        assert keys["by"] == "tokens" and keys["from"] == "engine_tokenize", keys
        assert keys["tokenizer"] == "engine:/models/on-the-engines-host" and keys["cause"] == "unreadable"
        assert not q.metric("radixfleet_engine_tokenizer_unavailable_total{")  # not on bytes
        await until_exact(q, "v", 700)
        before = link.stats.summary()
        fetched = _tokenize_count(q, "fetched")
        for i in range(3):
            text = prompt(i)
            held = q.router.index.entries("v")
            status, first = await q.send(text)
            assert status == 200
            want = held + first["usage"]["prompt_tokens"] // BS
            await wait_for(lambda: q.router.index.entries("v") >= want, 5, "the events applied")
            status, second = await q.send(text)
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        after = link.stats.summary()
        assert after.samples - before.samples == 6 and after.sum_abs_tokens == before.sum_abs_tokens
        assert _tokenize_count(q, "fetched") - fetched == 3  # each second request's ids were held
        assert _tokenize_count(q, "cached") >= 3
        fake.tokenize_keyer = None  # /tokenize now answers 404
        unkeyed = _tokenize_count(q, "unkeyed")
        for i in range(3):
            assert (await q.send(prompt(800 + i)))[0] == 200
        assert _tokenize_count(q, "failed") >= 3 and _tokenize_count(q, "unkeyed") - unkeyed >= 3
    said = [m for m in _keys_lines(caplog, "v")]
    assert len(said) == 1 and "through its POST /tokenize" in said[0] and "unreadable" in said[0], said


def test_a_request_is_asked_of_tokenize_as_the_engine_renders_it():
    from array import array

    from radixfleet.engines.engine_keys import tokenize_request

    msgs = [{"role": "user", "content": "hi"}]
    chat = {"model": "x", "messages": msgs, "tools": [{"type": "function"}], "max_tokens": 3, "stream": True}
    assert tokenize_request(Endpoint.CHAT, chat, "m") == {
        "model": "m",
        "messages": msgs,
        "tools": chat["tools"],
    }
    assert tokenize_request(Endpoint.COMPLETIONS, {"prompt": "a", "add_special_tokens": False}, "m") == {
        "model": "m",
        "prompt": "a",
        "add_special_tokens": False,
    }
    assert tokenize_request(Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}, "") == {"prompt": "a"}
    assert tokenize_request(Endpoint.COMPLETIONS, {"prompt": [1, 2, 3]}, "m") == array("I", [1, 2, 3])
    assert tokenize_request(Endpoint.COMPLETIONS, {"prompt": [[4, 5], [6]]}, "m") == array("I", [4, 5])
    assert tokenize_request(Endpoint.GENERATE, {"input_ids": [7]}, "m") == array("I", [7])
    assert tokenize_request(Endpoint.GENERATE, {"text": "t"}, "m") == {"model": "m", "prompt": "t"}
    kv = {"messages": msgs, "kv_transfer_params": {"prompt_token_ids": [9, 8]}}
    assert tokenize_request(Endpoint.CHAT, kv, "m") == array("I", [9, 8])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for endpoint, body, why in (
        (Endpoint.CHAT, {"messages": image}, "media"),
        (Endpoint.CHAT, {"messages": msgs, "reasoning_effort": "low"}, "reasoning_effort"),
        (Endpoint.CHAT, {"messages": "no"}, "no messages"),
        (Endpoint.COMPLETIONS, {"prompt": "a", "suffix": "b"}, "suffix"),
        (Endpoint.COMPLETIONS, {"prompt": 5}, "no prompt string"),
        (Endpoint.COMPLETIONS, {"prompt": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ):
        got = tokenize_request(endpoint, body, "m")
        assert isinstance(got, str) and why in got, (body, got)


class FakeSglang:
    """An SGLang-shaped server: /get_model_info naming its tokenizer, /tokenize of
    prompts only (a 400 for messages), /generate, /health."""

    def __init__(self, keyer: TokenKeyer, tokenizer_path: str) -> None:
        self.keyer = keyer
        self.tokenizer_path = tokenizer_path

    async def model_info(self, request):
        return web.json_response(
            {"model_path": "/elsewhere/weights", "tokenizer_path": self.tokenizer_path, "is_generation": True}
        )

    async def tokenize(self, request):
        body = await request.json()
        if "prompt" not in body:
            return web.json_response({"object": "error", "message": "prompt is required"}, status=400)
        ids = self.keyer.token_ids(Endpoint.COMPLETIONS, body)[0]
        return web.json_response({"tokens": list(ids), "count": len(ids), "max_model_len": 4096})

    async def generate(self, request):
        body = await request.json()
        n = len(self.keyer.token_ids(Endpoint.GENERATE, body)[0])
        return web.json_response({"text": "ok", "meta_info": {"prompt_tokens": n, "cached_tokens": 0}})

    async def health(self, request):
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        return app


@pytest.mark.integration
async def test_an_sglang_worker_is_keyed_from_its_tokenizer_path(tokenizer_dir):
    fake = FakeSglang(TokenKeyer.load(tokenizer_dir), tokenizer_dir)
    worker = {"kind": "sglang", "block_size": BS, "metrics": {"path": ""}}
    async with QuickStart({"s": fake}, worker=worker) as q:
        keys = (await q.workers())["s"]["engine"]["keys"]
        assert keys["by"] == "tokens" and keys["tokenizer"] == tokenizer_dir, keys
        assert keys["engine_root"]["field"] == "/get_model_info tokenizer_path"
        assert keys["probe"]["verdict"] == "agrees" and "chat not checked (400)" in keys["probe"]["detail"]
        async with q.session.post(q.base + "/generate", json={"text": prompt(1)}) as r:
            assert r.status == 200
