"""A vLLM worker's KV-event endpoints learned from the server (``/kv_event_sources``),
its data-parallel ranks indexed and routed to separately, and every way that can go
wrong leaving the worker serving in the approximate mode — against fake vLLM-shaped
servers (aiohttp, one ZMQ PUB socket per rank, events in vLLM 0.32's map form from
``tests.engines.fake_engine.FakeEngine``, the tiny model's tokenizer built without
torch). The real server's side: tests/engines/test_vllm_dp.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from radixfleet.config import parse_config
from radixfleet.engines.event_sources import EventSource, SourcesCause, SourcesProblem, parse_event_sources
from radixfleet.engines.token_keys import TokenKeyer
from radixfleet.keys import Endpoint
from radixfleet_tools.bench.tiny_tokenizer import build as build_tokenizer
from radixfleet_tools.harness.procs import free_port
from tests.engines.fake_dp_vllm import BS, MODEL, FakeDpVllm, _src, prompt

# ------------------------------------------------------------------ the answer


def test_a_data_parallel_answer_is_every_rank_in_order():
    body = json.dumps({"1": _src(19902, "tcp://*:19912"), "0": _src(19901, "tcp://*:19911")})
    assert parse_event_sources(200, body.encode()) == (
        EventSource(0, "tcp://*:19901", "kv-events", "tcp://*:19911"),
        EventSource(1, "tcp://*:19902", "kv-events", "tcp://*:19912"),
    )


@pytest.mark.parametrize(
    "status,body,cause",
    [
        (404, b'{"detail":"Not Found"}', SourcesCause.MISSING),
        (200, b"{}", SourcesCause.EMPTY),
        (200, json.dumps({"0": _src(1, publisher="null")}).encode(), SourcesCause.DISABLED),
        (200, json.dumps({"0": _src(1, enable_kv_cache_events=False)}).encode(), SourcesCause.DISABLED),
        (503, b"", SourcesCause.UNREACHABLE),
        (200, b"not json", SourcesCause.MALFORMED),
        (200, b"[" * 100_000 + b"]" * 100_000, SourcesCause.MALFORMED),
        (200, b'{"0": {"endpoint": NaN}}', SourcesCause.MALFORMED),
        (200, b'{"0": {"endpoint": "tcp://*:1", "topic": "\xff"}}', SourcesCause.MALFORMED),
        (200, b"[]", SourcesCause.MALFORMED),
        (200, b'{"zero": {}}', SourcesCause.MALFORMED),
        (200, b'{"0": "tcp://*:1"}', SourcesCause.MALFORMED),
        (200, json.dumps({"0": {**_src(1), "endpoint": 5}}).encode(), SourcesCause.MALFORMED),
        (200, json.dumps({"0": {**_src(1), "endpoint": "http://x:1"}}).encode(), SourcesCause.MALFORMED),
        (200, json.dumps({"0": _src(1, replay_endpoint=7)}).encode(), SourcesCause.MALFORMED),
        (200, json.dumps({"0": _src(1), "2": _src(3)}).encode(), SourcesCause.MALFORMED),
        (200, json.dumps({"0": _src(1), "1": _src(2, publisher="null")}).encode(), SourcesCause.MALFORMED),
        (401, b"{}", SourcesCause.MALFORMED),
    ],
)
def test_an_unusable_answer_says_why(status, body, cause):
    got = parse_event_sources(status, body)
    assert isinstance(got, SourcesProblem) and got.cause is cause, got


# ------------------------------------------------------------ a fake DP vLLM


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(str(d))
    return str(d)


async def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


class Fleet:
    """Fake servers and one router (in this process) in front of them."""

    def __init__(self, fakes: dict, tokenizer_dir: str) -> None:
        self.fakes = fakes  # worker id -> FakeDpVllm
        self.tokenizer_dir = tokenizer_dir

    async def __aenter__(self):
        from radixfleet.server.app import Router, RouterServer

        self.runners, workers = [], []
        for wid, fake in self.fakes.items():
            runner = web.AppRunner(fake.app())
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)
            workers.append(
                {
                    "url": f"http://127.0.0.1:{port}",
                    "id": wid,
                    "kind": "vllm",
                    "tokenizer": self.tokenizer_dir,
                    "block_size": BS,
                    "metrics": {"path": ""},
                }
            )
        cfg = parse_config({"listen": {"port": 0}, "health": {"interval_s": 0.2}, "workers": workers})
        self.router = Router(cfg)
        self.server = RouterServer(self.router, port=0, admin_port=0)
        self.base = f"http://127.0.0.1:{await self.server.start()}"
        self.admin = f"http://127.0.0.1:{self.server.admin_port}"  # /admin/*, /metrics
        await wait_for(lambda: all(w.routable(time.monotonic()) for w in self.router.pool), 10, "routable")
        import aiohttp

        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.session.close()
        await self.server.aclose()
        for r in self.runners:
            await r.cleanup()
        for f in self.fakes.values():
            f.close()

    async def send(self, text: str) -> tuple[int, dict]:
        async with self.session.post(
            self.base + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}
        ) as r:
            body = await r.json()
            return r.status, body

    def metric(self, line: str) -> bool:
        return line in self.router.metrics.render().decode()


@pytest.mark.integration
async def test_each_rank_is_followed_from_the_engine_and_a_prompt_returns_to_its_rank(tokenizer_dir):
    """No events configured: both ranks' publishers come from /kv_event_sources; each
    prompt's second request carries the rank whose cache the first one filled (and
    is answered from it), and misses are spread over the ranks."""
    fake = FakeDpVllm(TokenKeyer.load(tokenizer_dir), ranks=2)
    async with Fleet({"dp": fake}, tokenizer_dir) as f:
        link = f.router.pool.get("dp").engine
        await wait_for(
            lambda: (
                link.ranks == 2
                and len(link.streams) == 2
                and all(s.connected for s, _ in link.streams.values())
            ),
            10,
            "both ranks subscribed",
        )
        assert link.events_source == "engine"
        for i in range(4):
            text = prompt(i)
            status, first = await f.send(text)
            assert status == 200
            rank = int(fake.headers[-1])
            holder = f"dp#{rank}"
            await wait_for(
                lambda: f.router.index.entries(holder) >= first["usage"]["prompt_tokens"] // BS,
                5,
                "the rank's events applied",
            )
            status, second = await f.send(text)
            assert status == 200 and fake.headers[-1] == str(rank), fake.headers
            assert (
                second["usage"]["prompt_tokens_details"]["cached_tokens"]
                == (first["usage"]["prompt_tokens"] - 1) // BS * BS
            )
        assert {fake.headers[i] for i in range(0, 8, 2)} == {"0", "1"}, fake.headers
        assert link.truth.value == "exact"
        assert set(f.router.index.workers()) == {"dp#0", "dp#1"}
        f.router.pool.check()  # a rank's entries are its worker's
        assert f.metric('radixfleet_worker_data_parallel_ranks{worker="dp"} 2.0')
        assert f.metric('radixfleet_engine_event_streams{source="engine",worker="dp"} 2.0')
        # the worker's unhealthiness drops every rank's entries (pool -> index parts)
        f.router.index.drop_worker("dp")
        assert f.router.index.workers() == set()
        f.router.index.check()


@pytest.mark.integration
async def test_readiness_waits_for_the_engines_history_and_the_next_turn_finds_its_holder(tokenizer_dir):
    """Two engines that served requests before this router started; each answers its
    replay late (a busy engine core). ``/readiness`` says 503 naming both until
    their KV events have joined — the history applied, the index exact — with no
    request sent; after it, a prompt the first engine already holds goes to it, and
    a new conversation's next turn stays on the worker of its first."""
    keyer = TokenKeyer.load(tokenizer_dir)
    fakes = {w: FakeDpVllm(keyer, ranks=1, replay_delay_s=1.0) for w in ("a", "b")}
    old = prompt(70)
    fakes["a"].publish(
        0,
        fakes["a"]
        .engines[0]
        .run(list(keyer.token_ids(Endpoint.COMPLETIONS, {"model": MODEL, "prompt": old})[0])),
    )
    for i in range(8):  # the rest of their history: other prompts (all in cache)
        for r, fake in enumerate(fakes.values()):
            fake.publish(
                0,
                fake.engines[0].run(
                    list(
                        keyer.token_ids(
                            Endpoint.COMPLETIONS, {"model": MODEL, "prompt": prompt(1000 + 2 * i + r)}
                        )[0]
                    )
                ),
            )
    for fake in fakes.values():
        fake.start_replay()
    async with Fleet(fakes, tokenizer_dir) as f:
        says = []
        deadline = time.monotonic() + 15
        while True:
            async with f.session.get(f.base + "/readiness") as r:
                body = await r.json()
            says.append((r.status, sorted(body["waiting"])))
            if r.status == 200:
                break
            assert time.monotonic() < deadline, says[-5:]
            await asyncio.sleep(0.05)
        assert (503, ["a", "b"]) in says, says[:5]
        links = [f.router.pool.get(w).engine for w in ("a", "b")]
        assert all(link.truth.value == "exact" for link in links)
        assert f.router.index.entries("a") > 0 and f.router.index.entries("b") > 0
        status, body = await f.send(old)
        assert status == 200 and fakes["a"].headers == [None] and not fakes["b"].headers
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for conv in range(4):
            text = prompt(200 + conv)
            n = {w: len(fk.headers) for w, fk in fakes.items()}
            assert (await f.send(text))[0] == 200
            first = next(w for w, fk in fakes.items() if len(fk.headers) > n[w])
            status, body = await f.send(text + " " + prompt(300 + conv, 30))
            assert status == 200 and len(fakes[first].headers) == n[first] + 2, conv
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.integration
async def test_a_rejected_rank_drops_the_rank_map_and_the_request_is_still_served(tokenizer_dir):
    """The server comes back with one rank: the request sent to rank 1 is refused
    (400, vLLM's message), retried on the same worker without a rank, answered 200;
    the sources are asked again and the worker is followed as one engine."""
    fake = FakeDpVllm(TokenKeyer.load(tokenizer_dir), ranks=2)
    async with Fleet({"dp": fake}, tokenizer_dir) as f:
        link = f.router.pool.get("dp").engine
        await wait_for(lambda: link.ranks == 2 and len(link.streams) == 2, 10, "two ranks")
        fake.ranks = 1
        fake.sources = (200, json.dumps({"0": _src(fake.ports[0])}))
        for i in range(3):
            status, body = await f.send(prompt(50 + i))
            assert status == 200, body
        assert "1" in fake.headers  # the stale rank was tried
        await wait_for(lambda: link.ranks == 0 and len(link.streams) == 1, 10, "one engine")
        assert f.metric('radixfleet_engine_events_unavailable_total{cause="rank_rejected",worker="dp"} 1.0')
        n = len(fake.headers)
        status, _ = await f.send(prompt(60))
        assert status == 200 and fake.headers[n:] == [None]


@pytest.mark.integration
async def test_an_unusable_event_source_leaves_the_worker_approximate_and_serving(tokenizer_dir, caplog):
    """404 (older vLLM), {} and a malformed answer: approximate mode, one log line and
    a count per cause. A concrete endpoint the router must bind while something else
    holds it ("Address already in use"): no traceback, one line naming who binds and
    what to write, approximate mode. Every worker keeps answering."""
    keyer = TokenKeyer.load(tokenizer_dir)
    fakes = {w: FakeDpVllm(keyer, ranks=1) for w in ("old", "off", "bad", "busy")}
    fakes["old"].sources = (404, '{"detail": "Not Found"}')
    fakes["off"].sources = (200, "{}")
    fakes["bad"].sources = (200, '{"0": {"endpoint": 42}}')
    squatter = zmq.Context.instance().socket(zmq.PULL)
    busy_port = squatter.bind_to_random_port("tcp://127.0.0.1")
    fakes["busy"].sources = (200, json.dumps({"0": {**_src(0), "endpoint": f"tcp://127.0.0.1:{busy_port}"}}))
    caplog.set_level(logging.INFO, logger="radixfleet")
    try:
        async with Fleet(fakes, tokenizer_dir) as f:
            causes = {"old": "missing", "off": "empty", "bad": "malformed", "busy": "address_in_use"}
            await wait_for(
                lambda: all(
                    f.metric(f'radixfleet_engine_events_unavailable_total{{cause="{c}",worker="{w}"}} 1.0')
                    for w, c in causes.items()
                ),
                10,
                "every cause counted",
            )
            for w in causes:
                link = f.router.pool.get(w).engine
                assert link.truth.value == "approximate" and not link.streams and not link.ranks
            for i in range(8):
                status, body = await f.send(prompt(200 + i))
                assert status == 200, body
            assert all(fk.headers and set(fk.headers) == {None} for fk in fakes.values())
    finally:
        squatter.close(0)
    lines = [r for r in caplog.records if r.name.startswith("radixfleet")]
    assert not any(r.exc_info for r in lines), [r.getMessage() for r in lines if r.exc_info]
    busy = [
        r.getMessage() for r in lines if "worker busy" in r.getMessage() and "not followed" in r.getMessage()
    ]
    assert len(busy) == 1 and "router must bind" in busy[0] and "tcp://*:PORT" in busy[0], busy
    for w in ("old", "off", "bad"):
        said = [r.getMessage() for r in lines if f"worker {w}: no KV events" in r.getMessage()]
        assert len(said) == 1, (w, said)


# ------------------------------------------------------------ choosing a rank


def test_a_rank_is_chosen_by_its_blocks_then_its_requests_then_in_turn():
    from prometheus_client import CollectorRegistry

    from radixfleet.config import WorkerSpec
    from radixfleet.engines.link import EngineLink
    from radixfleet.engines.manager import Engines, _fold_ranks
    from radixfleet.fleet.pool import Pool, Source
    from radixfleet.index.prefix_index import PrefixIndex
    from radixfleet.policies.base import MatchResult

    cfg = parse_config({})
    index = PrefixIndex()
    pool = Pool(cfg, index)
    eng = Engines(cfg, pool, index, CollectorRegistry())
    w = pool.add("w", "http://127.0.0.1:9", Source.ADMIN)
    link = EngineLink(w, WorkerSpec(url=w.url, id="w", kind="vllm"), eng)
    assert link.pick_rank({1: 3}) is None  # no rank map: the worker as one engine
    link._set_ranks(3)
    assert link.holders() == ["w#0", "w#1", "w#2"]
    assert link.pick_rank({0: 2, 2: 5}) == 2  # most blocks
    assert link.pick_rank({0: 5, 2: 5}) == 0  # a tie: fewer in flight (2 has one)
    # misses: the idle rank first, then in turn among equals
    assert link.pick_rank(None) == 1
    link.rank_finished(0)
    link.rank_finished(1)
    link.rank_finished(2)
    assert [link.pick_rank(None) for _ in range(3)] == [2, 0, 1]
    # the policy sees the worker at its best rank's match; the ranks' own are kept
    ranks: dict = {}
    m = _fold_ranks(MatchResult({"w#0": 2, "w#2": 5, "x": 1}, 6, 0.5, True), ranks)
    assert m == MatchResult({"w": 5, "x": 1}, 6, 0.5, True)
    assert ranks == {"w": {0: 2, 2: 5}}
    # the rank map changes: the worker's entries under the old holders go
    index.insert("w#1", [11, 12], 0.0)
    link._set_ranks(2)
    assert index.workers() == set() and link.holders() == ["w#0", "w#1"]
    index.check()
