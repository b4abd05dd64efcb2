"""The router's engine side without a real engine: stream watching, load released at
the first content token, usage asked for and hidden, prediction accuracy, worker
kinds in the config and on the command line, engine load reaching the policy."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from radixfleet.config import parse_config
from radixfleet.engines.accuracy import PredictionStats, predicted_tokens
from radixfleet.engines.kinds import WorkerKind, kind_from_metrics, models_from
from radixfleet.server.cli import worker_entry
from radixfleet.server.sse import StreamWatch, usage_of
from radixfleet.wire.errors import ConfigError


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKEN = ev({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
USAGE = ev(
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    }
)
DONE = b"data: [DONE]\n\n"


# ------------------------------------------------------------------ StreamWatch


def test_role_chunk_is_not_the_first_token():
    w = StreamWatch()
    assert w.feed(ROLE) == ROLE and not w.first_token
    assert w.feed(TOKEN) == TOKEN and w.first_token


def test_completion_tokens_are_read_from_usage_or_meta_info():
    from radixfleet.server.sse import completion_tokens_of

    assert completion_tokens_of({"usage": {"completion_tokens": 7}}) == 7
    assert completion_tokens_of({"meta_info": {"completion_tokens": 3}}) == 3
    for bad in (
        {"usage": {"completion_tokens": -1}},
        {"usage": {"completion_tokens": "7"}},
        {"usage": {"completion_tokens": True}},
        {"usage": None},
        [],
        None,
    ):
        assert completion_tokens_of(bad) is None
    w = StreamWatch(strip_usage=True)
    w.feed(TOKEN + USAGE + DONE)
    assert w.output_tokens == 2 and w.usage == (100, 64)


def test_usage_read_and_hidden_only_when_asked():
    w = StreamWatch(strip_usage=True)
    out = w.feed(ROLE + TOKEN + USAGE + DONE)
    assert out == ROLE + TOKEN + DONE
    assert w.usage == (100, 64)
    keep = StreamWatch(strip_usage=False)
    assert keep.feed(TOKEN + USAGE + DONE) == TOKEN + USAGE + DONE and keep.usage == (100, 64)


def test_events_cut_across_reads_are_held_whole():
    w = StreamWatch(strip_usage=True)
    data = ROLE + TOKEN + USAGE + DONE
    out = b"".join(w.feed(data[i : i + 7]) for i in range(0, len(data), 7)) + w.flush()
    assert out == ROLE + TOKEN + DONE and w.usage == (100, 64) and w.first_token


def _with_sep(data: bytes, sep: bytes) -> bytes:
    """``data`` (events ending in LF LF) with every blank line written as ``sep`` and
    every other line end as ``sep``'s first line end."""
    nl = b"\r\n" if sep.startswith(b"\r\n") else sep[:1]
    return data.replace(b"\n\n", b"\0").replace(b"\n", nl).replace(b"\0", sep)


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n", b"\r\r", b"\r\n\n", b"\n\r\n", b"\r\r\n", b"\n\r"])
def test_every_sse_event_separator_ends_an_event_as_it_arrives(sep):
    # each event is passed on (and its facts read) as soon as its blank line arrives,
    # not at the end of the stream, whichever line ends the worker writes
    events = [_with_sep(e, sep) for e in (ROLE, TOKEN, USAGE, DONE)]
    w = StreamWatch(strip_usage=True)
    assert w.feed(events[0]) == events[0] and not w.first_token
    assert w.feed(events[1]) == events[1] and w.first_token
    assert w.feed(events[2]) == b"" and w.usage == (100, 64)
    assert w.feed(events[3]) == events[3] and w.pending == 0
    assert w.flush() == b""


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n", b"\r\r"])
def test_events_cut_anywhere_pass_byte_for_byte(sep):
    # a cut inside a CRLF (or after a lone CR) neither loses nor adds a byte, and a
    # multi-line event is read whole
    multi = b'data: {"choices": [{"delta":\ndata:  {"content": "Hi"}}]}\n\n'
    data = _with_sep(ROLE + multi + USAGE + DONE, sep)
    want = _with_sep(ROLE + multi + DONE, sep)
    for cut in range(1, len(data)):
        w = StreamWatch(strip_usage=True)
        out = w.feed(data[:cut]) + w.feed(data[cut:]) + w.flush()
        assert out == want, cut
        assert w.first_token and w.usage == (100, 64), cut
    w = StreamWatch(strip_usage=True)
    out = b"".join(w.feed(data[i : i + 1]) for i in range(len(data))) + w.flush()
    assert out == want


def test_a_broken_stream_drops_its_unfinished_event():
    w = StreamWatch()
    assert w.feed(TOKEN + b'data: {"choices":[{"delta":{"content":"hel') == TOKEN
    assert w.pending > 0
    assert w.flush(complete=False) == b"" and w.pending == 0
    w = StreamWatch()
    w.feed(TOKEN + b"data: [DONE]")
    assert w.flush() == b"data: [DONE]"  # a clean end passes what came, as it came


def test_completions_text_tool_calls_and_sglang_generate_count_as_tokens():
    for obj in (
        {"choices": [{"text": "x"}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]},
        {"choices": [{"delta": {"reasoning_content": "hmm"}}]},
        {"text": "x", "meta_info": {"prompt_tokens": 9, "cached_tokens": 3}},
    ):
        w = StreamWatch()
        w.feed(ev(obj))
        assert w.first_token, obj
    w = StreamWatch()
    w.feed(ev({"text": "x", "meta_info": {"prompt_tokens": 9, "cached_tokens": 3}}))
    assert w.usage == (9, 3)


def test_malformed_events_pass_through_untouched():
    junk = b"data: {not json\n\n: comment\n\nevent: x\ndata: 1\n\n"
    w = StreamWatch(strip_usage=True)
    assert w.feed(junk) == junk and not w.first_token and w.usage is None


def test_usage_of_refuses_impossible_figures():
    assert usage_of({"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 9}}}) is None
    assert usage_of({"usage": {"prompt_tokens": 5}}) is None
    assert usage_of({"usage": None}) is None
    assert usage_of([1]) is None


# --------------------------------------------------------------------- accuracy


def test_predicted_tokens_stops_below_the_last_prompt_token():
    # vLLM: a 64-token prompt fully cached reports 32 (the last token is recomputed)
    assert predicted_tokens(2, 32, 64, True) == 32
    assert predicted_tokens(37, 32, 1200, True) == 1184
    assert predicted_tokens(2, 32, 64, False) == 64
    assert predicted_tokens(0, 32, 64, True) == 0


def test_prediction_stats_exact_sums():
    s = PredictionStats(block_tokens=32)
    for pred, rep in ((64, 64), (96, 32), (0, 32)):
        s.record(pred, rep)
        s.check()
    sm = s.summary()
    assert (sm.samples, sm.sum_abs_tokens, sm.sum_signed_tokens, sm.over, sm.under) == (3, 96, 32, 1, 1)
    assert sm.mean_abs_blocks == pytest.approx(1.0)


# -------------------------------------------------------------------- kinds


def test_kind_from_metrics_and_models():
    assert kind_from_metrics(b"# HELP vllm:num_requests_running x\n") is WorkerKind.VLLM
    assert kind_from_metrics(b"sglang:num_queue_reqs 1\nradixfleet_agent_x 1\n") is WorkerKind.AGENT
    assert kind_from_metrics(b"sglang:num_queue_reqs 1\n") is WorkerKind.SGLANG
    assert kind_from_metrics(b"process_cpu_seconds_total 1\n") is None
    assert models_from(b'{"data":[{"id":"a"},{"id":""},{"x":1}]}') == ("a",)
    assert models_from(b"garbage") == ()


# ------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "worker,error",
    [
        (
            {"url": "http://h:1", "kind": "vllm", "events": {"endpoint": "tcp://h:5"}},
            "workers[0].tokenizer: required with events.endpoint",
        ),
        (
            {"url": "http://h:1", "kind": "vllm", "tokenizer": "/no/such/dir"},
            "workers[0].tokenizer: tokenizer folder '/no/such/dir' does not exist",
        ),
        (
            {"url": "http://h:1", "kind": "vllm", "tokenizer": "nobody/nothing-here"},
            "workers[0].tokenizer: 'nobody/nothing-here' is neither a folder nor a repo",
        ),
        (
            {"url": "http://h:1", "kind": "agent", "events": {"endpoint": "tcp://*:5"}},
            "workers[0].events.endpoint: agents push their events",
        ),
        (
            {"url": "http://h:1", "kind": "vllm", "events": {"endpoint": "udp://h:5"}},
            "workers[0].events.endpoint: expected tcp://HOST:PORT or ipc://PATH",
        ),
        ({"url": "http://h:1", "kind": "llamacpp"}, "workers[0].kind: 'llamacpp' is not one of"),
        (
            {"url": "http://h:1", "events": {"replay_endpoint": "tcp://*:6"}},
            "workers[0].events.replay_endpoint: needs events.endpoint",
        ),
    ],
)
def test_engine_fields_are_validated_with_their_path(worker, error):
    with pytest.raises(ConfigError) as e:
        # without discovery: a tokenizer is then the config's to give
        parse_config({"workers": [worker], "tokenizers": {"discover": False}})
    assert str(e.value).startswith(error), str(e.value)


def test_events_without_a_tokenizer_are_accepted_where_the_engine_can_name_one():
    """With tokenizers.discover (the default) the engine names its tokenizer; an
    openai worker's engine does not."""
    ev = {"endpoint": "tcp://*:5"}
    cfg = parse_config({"workers": [{"url": "http://h:1", "events": ev, "block_size": 32}]})
    assert cfg.tokenizers.discover and not cfg.tokenizers.download
    with pytest.raises(ConfigError, match=r"workers\[0\]\.tokenizer: required with events\.endpoint"):
        parse_config({"workers": [{"url": "http://h:1", "kind": "openai", "events": ev}]})
    with pytest.raises(ConfigError, match=r"tokenizers\.download: expected true or false"):
        parse_config({"tokenizers": {"download": "yes please"}})


def test_tokenizer_folder_without_tokenizer_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"workers\[0\]\.tokenizer: .* holds no tokenizer"):
        parse_config({"workers": [{"url": "http://h:1", "kind": "vllm", "tokenizer": str(tmp_path)}]})


def test_check_config_refuses_a_missing_tokenizer_exit_2(tmp_path, capsys):
    from radixfleet.cli import main

    p = tmp_path / "r.yaml"
    p.write_text(
        "workers:\n  - url: http://127.0.0.1:9\n    kind: vllm\n    tokenizer: ./missing-tokenizer\n"
    )
    assert main(["check-config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "workers[0].tokenizer" in err and len(err.strip().splitlines()) == 1


def test_command_line_worker_forms():
    assert worker_entry("http://a:1", "w") == {"url": "http://a:1"}
    assert worker_entry("sglang=http://a:1", "w") == {"url": "http://a:1", "kind": "sglang"}
    e = worker_entry(
        "url=http://a:1,kind=vllm,events=tcp://*:5557,block_size=32,replay_endpoint=tcp://*:5558", "w"
    )
    assert e == {
        "url": "http://a:1",
        "kind": "vllm",
        "block_size": 32,
        "events": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
    }
    with pytest.raises(ConfigError, match=r"w\.colour: unknown key"):
        worker_entry("url=http://a:1,colour=red", "w")
    with pytest.raises(ConfigError, match=r"w\.block_size: expected an integer"):
        worker_entry("url=http://a:1,block_size=x", "w")


# ------------------------------------------------- the data plane on the wire


class FakeEngine:
    """An OpenAI streaming server that sends the role chunk before a slow 'prefill'."""

    def __init__(self, prefill_s: float = 0.4) -> None:
        self.prefill_s = prefill_s
        self.bodies: list[dict] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if not body.get("stream"):
            return web.json_response(
                {
                    "choices": [{"message": {"content": "Hi"}}],
                    "usage": {
                        "prompt_tokens": 100,
                        "completion_tokens": 1,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                }
            )
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(ROLE)
        await asyncio.sleep(self.prefill_s)
        await r.write(TOKEN)
        if (body.get("stream_options") or {}).get("include_usage"):
            await r.write(USAGE)
        await r.write(DONE)
        await r.write_eof()
        return r

    async def health(self, request):
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        return app


async def _serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.integration
async def test_stream_load_held_until_first_content_token_and_usage_hidden():
    import aiohttp

    from radixfleet.server.app import Router, RouterServer

    fake = FakeEngine(prefill_s=0.4)
    runner, url = await _serve(fake.app())
    cfg = parse_config(
        {"workers": [{"url": url, "kind": "openai"}], "health": {"interval_s": 0.2}, "listen": {"port": 0}}
    )
    router = Router(cfg)
    server = RouterServer(router, port=0, admin_port=0)
    port = await server.start()
    try:
        w = router.pool.get(cfg.workers[0].id)
        for _ in range(100):
            if w.routable(0.0 + __import__("time").monotonic()):
                break
            await asyncio.sleep(0.05)
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x" * 4000}]}
        seen: list[tuple[int, int]] = []
        received = b""
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                first = await r.content.readany()
                assert b'"role"' in first
                # the role chunk is through; prefill is not: the prompt stays counted
                for _ in range(5):
                    seen.append((w.in_flight, w.in_flight_tokens))
                    await asyncio.sleep(0.03)
                received = first + await r.read()
        assert all(f == 1 and t >= 900 for f, t in seen), seen
        assert (w.in_flight, w.in_flight_tokens) == (0, 0)
        # the router asked for usage; the client, who did not, never sees it
        assert fake.bodies[-1]["stream_options"] == {"include_usage": True}
        assert b'"usage"' not in received and received.endswith(DONE)
        p = w.engine.stats.summary()
        # the fake reports 64 cached tokens of a cold prompt: an under-prediction of 64
        assert p.samples == 1 and p.sum_signed_tokens == -64 and p.under == 1
    finally:
        await server.aclose()
        await runner.cleanup()


@pytest.mark.integration
async def test_traffic_log_and_autoscale_signal_are_wired_into_the_router(tmp_path):
    import aiohttp

    from radixfleet.server.app import Router, RouterServer

    fake = FakeEngine(prefill_s=0.0)
    runner, url = await _serve(fake.app())
    cfg = parse_config(
        {
            "workers": [{"url": url, "id": "f", "kind": "openai"}],
            "health": {"interval_s": 0.2},
            "listen": {"port": 0},
            "traffic_log": {"enabled": True, "dir": str(tmp_path / "log")},
        }
    )
    router = Router(cfg)
    server = RouterServer(router, port=0, admin_port=0)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    try:
        w = router.pool.get("f")
        for _ in range(100):
            if w.routable(__import__("time").monotonic()):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            for _i in range(3):
                async with s.post(
                    base + "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "y" * 600}]},
                ) as r:
                    assert r.status == 200
            admin = f"http://127.0.0.1:{server.admin_port}"
            async with s.get(admin + "/metrics") as r:
                text = await r.text()
            async with s.get(admin + "/admin/index") as r:
                index = await r.json()
        assert "radixfleet_autoscale_desired_workers 1.0" in text
        assert index["autoscale"]["desired"] == 1
    finally:
        await server.aclose()  # flushes and closes the log
        await runner.cleanup()
    lines = [json.loads(x) for f in sorted((tmp_path / "log").iterdir()) for x in f.read_text().splitlines()]
    assert len(lines) == 3 and all(x["worker"] == "f" and x["hash_ids"] for x in lines)
    assert lines[0]["cached_tokens"] == 0 and lines[0]["input_length"] == 100
    assert all(x["output_length"] == 1 for x in lines)  # the worker's completion_tokens


@pytest.mark.integration
async def test_shed_requests_are_logged_as_offered_load(tmp_path):
    """A request the router sheds (429) gets a traffic-log line with its status and
    no worker; analyze replays it as offered load and keeps it out of the observed
    (served) figures."""
    import aiohttp

    from radixfleet.server.app import Router, RouterServer
    from radixfleet.wire.errors import Overloaded
    from radixfleet_tools.loadtest.analyze import Options, analyze

    fake = FakeEngine(prefill_s=0.0)
    runner, url = await _serve(fake.app())
    cfg = parse_config(
        {
            "workers": [{"url": url, "id": "f", "kind": "openai"}],
            "health": {"interval_s": 0.2},
            "listen": {"port": 0},
            "traffic_log": {"enabled": True, "dir": str(tmp_path / "log")},
        }
    )
    router = Router(cfg)
    server = RouterServer(router, port=0, admin_port=0)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    dp = router.dataplane
    real = dp.shedder

    class Saturated:  # every worker saturated: the shedder's verdict
        def check(self, *args):
            return Overloaded("every worker is saturated")

    try:
        w = router.pool.get("f")
        for _ in range(100):
            if w.routable(__import__("time").monotonic()):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            statuses = []
            for i in range(4):
                # the last two arrive with every worker saturated
                dp.route.use_shedder(real if i < 2 else Saturated())
                async with s.post(
                    base + "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": f"{i} " + "y" * 600}]},
                ) as r:
                    statuses.append(r.status)
        assert statuses == [200, 200, 429, 429]
    finally:
        dp.route.use_shedder(real)
        await server.aclose()  # flushes and closes the log
        await runner.cleanup()
    files = sorted(str(f) for f in (tmp_path / "log").iterdir())
    lines = [json.loads(x) for f in files for x in open(f).read().splitlines()]
    shed = [x for x in lines if x["status"] == 429]
    assert len(lines) == 4 and len(shed) == 2
    assert all(x["worker"] == "" and x["hash_ids"] and x["matched_tokens"] == 0 for x in shed)
    assert all(x["cached_tokens"] is None and x["ttft_ms"] is None for x in shed)
    res = analyze(files, Options())
    assert res["inputs"]["requests"] == 4  # offered load: shed lines are replayed
    obs = res["observed"]
    assert obs["shed_requests"] == 2 and obs["requests_reporting_cached"] == 2


class FaultyEngine(FakeEngine):
    """``FakeEngine`` whose prompt picks a fault: "bad" a 400, "down" a 500, "break"
    a stream cut off after its first token."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = body["messages"][0]["content"]
        if text.startswith("bad"):
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        if text.startswith("down"):
            return web.json_response({"error": {"message": "engine error"}}, status=500)
        if text.startswith("break"):
            r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await r.prepare(request)
            await r.write(ROLE + TOKEN)
            await asyncio.sleep(0.05)
            request.transport.abort()  # the engine dies mid-answer
            return r
        self.bodies.append(body)
        return await FakeEngine.chat(self, _Replay(request, body))


class _Replay:
    """A request whose JSON body was read already (``FakeEngine.chat`` reads it again)."""

    def __init__(self, request: web.Request, body: dict) -> None:
        self._request, self._body = request, body

    async def json(self) -> dict:
        return self._body

    def __getattr__(self, name):
        return getattr(self._request, name)


@pytest.mark.integration
async def test_traffic_log_records_the_status_the_client_got(tmp_path):
    """An upstream error and a stream the worker broke off are logged as the client
    saw them (the error status; a 200 marked ``broken``), never as a plain 200, and
    analyze counts them apart from the served requests."""
    import aiohttp

    from radixfleet.server.app import Router, RouterServer
    from radixfleet_tools.loadtest.analyze import Options, analyze

    fake = FaultyEngine(prefill_s=0.0)
    runner, url = await _serve(fake.app())
    cfg = parse_config(
        {
            "workers": [{"url": url, "id": "f", "kind": "openai"}],
            "health": {"interval_s": 0.2},
            "listen": {"port": 0},
            "traffic_log": {"enabled": True, "dir": str(tmp_path / "log")},
        }
    )
    router = Router(cfg)
    server = RouterServer(router, port=0, admin_port=0)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    seen = {}
    try:
        w = router.pool.get("f")
        for _ in range(100):
            if w.routable(__import__("time").monotonic()):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            for kind, stream in (("ok", True), ("bad", False), ("break", True), ("down", False)):
                body = {
                    "model": "m",
                    "stream": stream,
                    "messages": [{"role": "user", "content": f"{kind} " + "y" * 600}],
                }
                async with s.post(base + "/v1/chat/completions", json=body) as r:
                    seen[kind] = (r.status, await r.read())
                for _ in range(100):  # the next fault on a routable worker
                    if w.routable(__import__("time").monotonic()):
                        break
                    await asyncio.sleep(0.05)
    finally:
        await server.aclose()  # flushes and closes the log
        await runner.cleanup()
    assert {k: v[0] for k, v in seen.items()} == {"ok": 200, "bad": 400, "break": 200, "down": 502}
    assert b"incomplete" in seen["break"][1]
    files = sorted(str(f) for f in (tmp_path / "log").iterdir())
    lines = [json.loads(x) for f in files for x in open(f).read().splitlines()]
    assert len(lines) == 4 and all(x["worker"] == "f" and x["hash_ids"] for x in lines)
    got = sorted((x["status"], x["broken"]) for x in lines)
    assert got == [(200, False), (200, True), (400, False), (502, False)]
    failed = next(x for x in lines if x["status"] == 502)
    assert failed["matched_tokens"] == 0 and failed["cached_tokens"] is None and failed["ttft_ms"] is None
    res = analyze(files, Options())
    assert res["inputs"]["requests"] == 4  # offered load: every line is replayed
    obs = res["observed"]
    assert (obs["shed_requests"], obs["failed_requests"], obs["broken_requests"]) == (0, 2, 1)


async def test_links_of_one_tokenizer_share_a_single_load(tmp_path):
    """Two engines served by the same tokenizer folder start together: one load,
    both links keyed (concurrent loads of one folder left one worker on bytes)."""
    from prometheus_client import CollectorRegistry

    from radixfleet.engines.manager import Engines
    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex
    from radixfleet_tools.bench.tiny_tokenizer import build

    src = build(str(tmp_path / "tok"))
    cfg = parse_config({})
    index = PrefixIndex()
    eng = Engines(cfg, Pool(cfg, index), index, CollectorRegistry())
    a, b, c = await asyncio.gather(
        eng.load_keyer(src, "a"), eng.load_keyer(src, "b"), eng.load_keyer(src, "c")
    )
    assert a is not None and a is b is c
    assert await eng.load_keyer(str(tmp_path / "missing"), "d") is None


class FakeVllm:
    """A vLLM-shaped worker: /v1/completions with usage, /v1/models, /health, and a
    /metrics page (vLLM 0.32's, tests/data/vllm_metrics.txt) whose queue and
    counters the test sets."""

    PAGE = (__import__("pathlib").Path(__file__).parents[1] / "data" / "vllm_metrics.txt").read_text()

    def __init__(self) -> None:
        self.series: dict[str, float] = {}
        self.drop: set[str] = set()  # series left off the page

    def page(self) -> str:
        out = []
        for line in self.PAGE.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in self.drop:
                continue
            if name in self.series and not line.startswith("#"):
                line = line.rsplit(" ", 1)[0] + f" {self.series[name]}"
            out.append(line)
        return "\n".join(out) + "\n"

    async def metrics(self, request):
        return web.Response(text=self.page(), content_type="text/plain")

    async def completions(self, request):
        body = await request.json()
        n = len(body["prompt"]) // 4
        return web.json_response(
            {
                "choices": [{"text": "ok"}],
                "usage": {
                    "prompt_tokens": n,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            }
        )

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def health(self, request):
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        return app


@pytest.mark.integration
async def test_an_engine_queue_the_router_did_not_send_is_priced_and_avoided():
    """A holder whose vLLM queue holds 40 requests other clients sent: priced from the
    engine's own counters (1,200 uncached tokens per prefilled request), the next
    turn spills to the idle worker. Without the counters (the fleet's mean of the
    router's own requests only) the same queue looked cheap and the holder kept it."""
    import time

    import aiohttp

    from radixfleet.server.app import Router, RouterServer

    fakes = [FakeVllm(), FakeVllm()]
    served = [await _serve(f.app()) for f in fakes]
    cfg = parse_config(
        {
            "workers": [
                {"url": u, "id": f"v{i}", "kind": "vllm", "metrics": {"interval_s": 0.05, "timeout_s": 1.0}}
                for i, (_, u) in enumerate(served)
            ],
            "health": {"interval_s": 0.2},
            "listen": {"port": 0},
            "limits": {"worker_queue_requests": 0},
            "response_headers": {"worker_id": True},
        }
    )
    router = Router(cfg)
    server = RouterServer(router, port=0, admin_port=0)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    prompt = "the shared context of a long conversation " * 200  # ~8.6 KB

    async def send(s, text: str) -> str:
        async with s.post(
            base + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 1}
        ) as r:
            assert r.status == 200, await r.text()
            return r.headers["x-radixfleet-worker"]

    async def queued(wid: str, at_least: int) -> None:
        for _ in range(200):
            ld = router.pool.get(wid).load
            if ld is not None and ld.queued_requests == 40 and ld.queued_tokens >= at_least:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{wid}: {router.pool.get(wid).load}")

    try:
        for _ in range(200):
            if all(w.routable(time.monotonic()) for w in router.pool):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            holder = await send(s, prompt)
            other = "v1" if holder == "v0" else "v0"
            fake = fakes[int(holder[1])]
            # 40 waiting, the page without the prefilled-requests counter
            fake.drop = {"vllm:time_to_first_token_seconds_count"}
            fake.series = {"vllm:num_requests_waiting": 40.0, "vllm:num_requests_running": 8.0}
            await queued(holder, 1)
            assert await send(s, prompt + " first question") == holder
            # the engine's counters: 8 requests prefilled, 9,600 uncached tokens
            fake.drop = set()
            fake.series.update(
                {"vllm:time_to_first_token_seconds_count": 0.0, "vllm:prefix_cache_queries_total": 0.0}
            )
            await asyncio.sleep(0.2)
            fake.series.update(
                {"vllm:time_to_first_token_seconds_count": 8.0, "vllm:prefix_cache_queries_total": 9600.0}
            )
            await queued(holder, 40 * 1200)
            before = router.metrics.requests.labels(other, "200", "spill_load")._value.get()
            assert await send(s, prompt + " second question") == other
            assert router.metrics.requests.labels(other, "200", "spill_load")._value.get() == before + 1
            q = router.pool.get(holder).engine.describe()["engine_queue"]
            assert q["tokens_per_request"] == 1200.0
    finally:
        await server.aclose()
        for runner, _ in served:
            await runner.cleanup()


@pytest.mark.integration
async def test_a_plain_engines_configured_kv_capacity_reaches_the_policy_view():
    """No load report ever comes from a plain engine, yet its KV capacity is known
    (YAML): prefix_load's KV-turnover rule reads it from the view."""
    from radixfleet.server.app import Router, RouterServer

    fake = FakeEngine(prefill_s=0.0)
    runner, url = await _serve(fake.app())
    cfg = parse_config(
        {
            "workers": [{"url": url, "id": "p", "kind": "openai", "kv_capacity_tokens": 12_345}],
            "health": {"interval_s": 0.2},
            "listen": {"port": 0},
        }
    )
    router = Router(cfg)
    server = RouterServer(router, port=0, admin_port=0)
    await server.start()
    try:
        w = router.pool.get("p")
        now = __import__("time").monotonic()
        assert w.engine is not None and w.load is None
        v = w.build_view(now)
        assert v.kv_capacity_tokens == 12_345 and v.kv_used_tokens == 0
    finally:
        await server.aclose()
        await runner.cleanup()


@pytest.mark.integration
async def test_a_byte_keyed_engines_configured_kv_capacity_caps_its_index_entries():
    """A plain engine keyed on routing bytes (no tokenizer) with its KV capacity in
    the YAML: the index ages its guesses at that capacity. It was never capped (the
    cap was applied only on moving to a token space or on a scraped capacity), so on
    the agent workload its entries grew past what the engine held and the router
    predicted ~1,000 cached tokens a response too many."""
    import time

    import aiohttp

    from radixfleet.server.app import Router, RouterServer

    fake = FakeEngine(prefill_s=0.0)
    runner, url = await _serve(fake.app())
    cap_tokens = 3_200  # 100 blocks of 128 routing bytes (32 tokens of 4 bytes)
    cfg = parse_config(
        {
            "workers": [{"url": url, "id": "p", "kind": "openai", "kv_capacity_tokens": cap_tokens}],
            "health": {"interval_s": 0.2},
            "listen": {"port": 0},
        }
    )
    router = Router(cfg)
    server = RouterServer(router, port=0, admin_port=0)
    port = await server.start()
    index = router.engines.index
    try:
        deadline = time.monotonic() + 5
        while index.capacity("p") is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert index.capacity("p") == cap_tokens // (cfg.keys.block_bytes // 4) == 100
        while not router.pool.get("p").routable(time.monotonic()):
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            for i in range(4):  # 4 x ~62 blocks of distinct prompts into 100 blocks
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"{i} " + "abcdefgh"[i] * 8000}],
                }
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
        assert 0 < index.entries("p") <= 100
        index.check()
    finally:
        await server.aclose()
        await runner.cleanup()


# ------------------------------------------------------- the link's owner boundary


def test_a_link_uses_of_its_owner_only_what_link_host_declares():
    """``EngineLink`` reaches ``self.engines.<name>`` only for ``LinkHost``'s members,
    and ``Engines`` provides every one of them."""
    import ast
    import inspect

    from radixfleet.engines import link as link_mod
    from radixfleet.engines.link import LinkHost
    from radixfleet.engines.manager import Engines

    declared = {n for n in vars(LinkHost) if not n.startswith("_")} | set(LinkHost.__annotations__)
    tree = ast.parse(inspect.getsource(link_mod))
    used = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "engines"
        ):
            aliases = {t.id for t in node.targets if isinstance(t, ast.Name)}
            assert aliases <= {"eng"}, aliases  # the one local alias checked below
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "engines"
        ):
            used.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "eng":
            used.add(node.attr)
    assert used and used <= declared, used - declared
    from prometheus_client import CollectorRegistry

    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex

    cfg = parse_config({})
    index = PrefixIndex()
    eng = Engines(cfg, Pool(cfg, index), index, CollectorRegistry())
    assert all(hasattr(eng, n) for n in declared)
