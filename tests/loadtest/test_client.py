"""The streaming client and `radixfleet loadtest` against an in-process fake OpenAI server.

The fake is deliberately small: one LRU prefix cache (radixfleet_tools.loadtest.prefix_trie) decides
``cached_tokens``, tokens stream as SSE chunks, and chosen requests fail (HTTP 500,
or the connection dropped mid-stream) so the error accounting can be checked
exactly. The real agent + router path is tested in test_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest
from aiohttp import web

from radixfleet.keys import Endpoint, routing_bytes
from radixfleet_tools.loadtest.arrivals import Bounds, Closed
from radixfleet_tools.loadtest.client import Result, Target
from radixfleet_tools.loadtest.prefix_trie import PrefixTrie, as_tokens
from radixfleet_tools.loadtest.report import validate
from radixfleet_tools.loadtest.runner import run_ab
from radixfleet_tools.loadtest.workloads import make_workload

pytestmark = pytest.mark.integration


class FakeServer:
    """An OpenAI-compatible streaming server; ``fail(n)`` makes every n-th request fail."""

    def __init__(self, worker="fake0", capacity=100_000, fail_every=0, drop_every=0, flush_status=200):
        self.worker = worker  # the x-radixfleet-worker header, or None (like smg)
        self.totals = {"requests": 0, "prompt": 0, "cached": 0, "output": 0}
        self.cache = PrefixTrie(capacity)
        self.capacity = capacity
        self.fail_every = fail_every
        self.drop_every = drop_every
        self.count = 0
        self.flushes = 0
        self.flush_status = flush_status  # what POST /flush_cache answers (>= 300: failed)
        self.bodies: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/flush_cache", self.flush)
        app.router.add_get("/get_load", self.load)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request):
        t = self.totals
        lines = []
        for name, v in (
            ("radixfleet_agent_requests_finished", t["requests"]),
            ("sglang:prompt_tokens", t["prompt"]),
            ("sglang:cached_tokens", t["cached"]),
            ("sglang:generation_tokens", t["output"]),
        ):
            lines += [f"# TYPE {name} counter", f'{name}_total{{model_name="m"}} {v}.0']
        return web.Response(text="\n".join(lines) + "\n")

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def load(self, request):
        return web.json_response({"kv_capacity_tokens": self.capacity})

    async def flush(self, request):
        if self.flush_status >= 300:
            return web.json_response({"error": {"message": "no"}}, status=self.flush_status)
        self.cache = PrefixTrie(self.capacity)
        self.flushes += 1
        return web.json_response({"status": "ok"})

    async def generate(self, request):
        body = await request.json()
        self.count += 1
        nth = self.count  # this request's number (self.count moves on while it streams)
        self.bodies.append(body)
        if self.fail_every and nth % self.fail_every == 0:
            return web.json_response(
                {"error": {"message": "boom", "type": "server_error", "code": "x", "param": None}}, status=500
            )
        chat = request.path.endswith("chat/completions")
        data = as_tokens(routing_bytes(Endpoint.CHAT if chat else Endpoint.COMPLETIONS, body))
        cached = self.cache.serve(data)
        headers = {"Content-Type": "text/event-stream"}
        if self.worker:
            headers["x-radixfleet-worker"] = self.worker
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            if self.drop_every and nth % self.drop_every == 0 and i == 1:
                request.transport.close()
                return resp
            delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            await resp.write(f"data: {json.dumps({'choices': [{'index': 0, **delta}]})}\n\n".encode())
            await asyncio.sleep(0.001)
        usage = {
            "prompt_tokens": len(data) // 4,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        t = self.totals
        t["requests"] += 1
        t["prompt"] += len(data) // 4
        t["cached"] += cached
        t["output"] += n
        return resp


async def _serve(fake: FakeServer, port: int) -> web.AppRunner:
    runner = web.AppRunner(fake.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_client_measures_a_streaming_chat_request(port):
    fake = FakeServer()
    runner = await _serve(fake, port)
    try:
        async with Target("f", f"http://127.0.0.1:{port}/v1") as t:
            assert await t.probe() == "fake-model"
            session = make_workload("multiturn", {"clients": 1, "rounds": 2, "output_tokens": 5}).sessions()[
                0
            ]
            spec = session.first()
            r0 = Result(spec.id, spec.session, spec.turn)
            answer = await t.send(spec, r0)
            assert r0.ok and answer == "t0 t1 t2 t3 t4 "
            assert r0.output_tokens == 5 and len(r0.itl_s) == 4
            assert r0.ttft_s > 0 and r0.e2e_s >= r0.ttft_s
            assert r0.worker == "fake0" and r0.cached_tokens == 0 and r0.prompt_tokens > 128
            spec1 = session.follow(answer)
            r1 = Result(spec1.id, spec1.session, spec1.turn)
            await t.send(spec1, r1)
            assert r1.ok and 0 < r1.cached_tokens < r1.prompt_tokens
            sent = fake.bodies[-1]
            assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
            assert sent["model"] == "fake-model" and sent["max_tokens"] == 5
            assert sent["messages"][1] == {"role": "assistant", "content": answer}
    finally:
        await runner.cleanup()


async def test_errors_mid_run_are_counted_and_the_run_goes_on(port):
    fake = FakeServer(fail_every=5, drop_every=7)
    runner = await _serve(fake, port)
    try:
        w = make_workload("zipf", {"requests": 40, "output_tokens": 4})
        url = f"http://127.0.0.1:{port}"
        (out,) = await run_ab(
            [("f", url)], w, Closed(4), Bounds(40, 20), flush_urls=[url], progress=False, settle_s=0
        )
    finally:
        await runner.cleanup()
    r = out.report
    assert r["requests"] == 40
    fails = [i for i in range(1, 41) if i % 5 == 0]
    drops = [i for i in range(1, 41) if i % 7 == 0 and i % 5 != 0]
    assert r["errors_by_kind"] == {"http_500": len(fails), "stream": len(drops)}
    assert r["ok"] == 40 - len(fails) - len(drops)
    assert fake.flushes == 1
    assert r["kv_capacity_tokens"] == 100_000  # discovered from /get_load
    assert r["pooled_hit_rate"] == pytest.approx(r["oracle_hit_rate"])  # capacity never binds
    assert 0 < r["hit_rate"] <= r["oracle_hit_rate"] + 1e-9
    validate({"runs": [r]})


async def test_failed_flush_fails_the_run_unless_warm_runs_are_allowed(port):
    from radixfleet.wire.errors import RunError

    fake = FakeServer(flush_status=503)
    runner = await _serve(fake, port)
    url = f"http://127.0.0.1:{port}"
    w = make_workload("zipf", {"requests": 6, "output_tokens": 2})
    try:
        with pytest.raises(
            RunError,
            match=r"target f: cache flush failed on http://127.0.0.1:\d+ "
            r"\(HTTP 503\); the run would not start cold "
            r"\(pass --allow-warm",
        ):
            await run_ab(
                [("f", url)], w, Closed(2), Bounds(6, 20), flush_urls=[url], progress=False, settle_s=0
            )
        assert fake.count == 0  # no load was sent
        (out,) = await run_ab(
            [("f", url)],
            w,
            Closed(2),
            Bounds(6, 20),
            flush_urls=[url],
            progress=False,
            settle_s=0,
            allow_warm=True,
        )
        assert out.report["cold_start"] is False
        assert out.report["flush_failed"] == [f"{url} (HTTP 503)"]
        assert out.report["ok"] == 6
        fake.flush_status = 200
        (out,) = await run_ab(
            [("f", url)], w, Closed(2), Bounds(6, 20), flush_urls=[url], progress=False, settle_s=0
        )
        assert out.report["cold_start"] is True and "flush_failed" not in out.report
        validate({"runs": [out.report]})
    finally:
        await runner.cleanup()


async def test_unnamed_workers_are_counted_from_agent_metrics(port):
    fakes = [FakeServer(worker=None), FakeServer(worker=None)]
    from radixfleet_tools.harness.procs import free_port

    ports = [port, free_port()]  # port+1 was sometimes taken: both chosen free
    while ports[1] == port:
        ports[1] = free_port()
    runners = [await _serve(f, p) for f, p in zip(fakes, ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        # the "router" is the first fake itself; the second agent gets no traffic
        w = make_workload("zipf", {"requests": 12, "output_tokens": 3})
        (out,) = await run_ab(
            [("direct", urls[0])], w, Closed(2), Bounds(12, 20), flush_urls=urls, progress=False, settle_s=0
        )
    finally:
        for r in runners:
            await r.cleanup()
    r = out.report
    assert r["workers_source"] == "agent /metrics"
    a, b = (r["workers"][u.split("//")[1]] for u in urls)
    assert a["requests"] == 12 and a["output_tokens"] == 36 and b["requests"] == 0
    assert a["prompt_tokens"] == r["prompt_tokens"] and a["cached_tokens"] == r["cached_tokens"]
    assert r["load_imbalance"] == pytest.approx(2.0)
    validate({"runs": [r]})


async def test_unreachable_target_is_an_error_up_front(port):
    from radixfleet.wire.errors import ConfigError

    w = make_workload("zipf", {"requests": 5})
    with pytest.raises(ConfigError, match=r"--target down: http://127.0.0.1:\d+ is unreachable"):
        await run_ab([("down", f"http://127.0.0.1:{port}")], w, Closed(1), Bounds(5, 5), progress=False)


def test_cli_ab_run_writes_report_and_plots(tmp_path, port):
    """Two targets through the real CLI (a subprocess), one fake server in a thread."""
    fakes = [FakeServer(worker="a"), FakeServer(worker="b", fail_every=10)]
    loop = asyncio.new_event_loop()
    from radixfleet_tools.harness.procs import free_port

    ports = [port, free_port()]  # port+1 was sometimes taken: both chosen free
    while ports[1] == port:
        ports[1] = free_port()
    runners = []
    started = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        for f, p in zip(fakes, ports):
            runners.append(loop.run_until_complete(_serve(f, p)))
        started.set()
        loop.run_forever()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    assert started.wait(5)
    try:
        out = tmp_path / "report.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "radixfleet.cli",
                "loadtest",
                "--target",
                f"one=http://127.0.0.1:{ports[0]}",
                "--target",
                f"two=http://127.0.0.1:{ports[1]}",
                "--flush",
                f"http://127.0.0.1:{ports[0]}",
                "--flush",
                f"http://127.0.0.1:{ports[1]}",
                "--workload",
                "gsp",
                "-o",
                "groups=4",
                "-o",
                "prompts_per_group=5",
                "-o",
                "system_tokens=256",
                "-o",
                "output_tokens=4",
                "-o",
                "order=ordered",
                "--concurrency",
                "2",
                "--requests",
                "20",
                "--duration",
                "20",
                "--retry",
                "none",
                "--max-failures",
                "0.1",
                "--json",
                str(out),
                "--plots",
                str(tmp_path / "plots"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(out.read_text())
        validate(doc)
        one, two = doc["runs"]
        assert (one["name"], two["name"]) == ("one", "two")
        assert one["workload"]["params"]["groups"] == 4
        assert one["requests"] == two["requests"] == 20
        assert one["errors"] == 0 and two["errors_by_kind"] == {"http_500": 2}
        assert "2 of 20 requests failed" in proc.stdout
        # ordered gsp: 4 groups x 5 prompts, each group's system prompt cached after its first
        assert one["oracle_hit_rate"] == pytest.approx(one["hit_rate"], abs=0.01)
        # prompts are 1024 + 2 + 512 bytes = 385 tokens; 16 of 20 share 256 of them
        assert one["oracle_hit_rate"] == pytest.approx(16 * 256 / (20 * 385))
        assert fakes[0].flushes == 2 and fakes[1].flushes == 2  # cold before each run
        assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
            "hit_rate.png",
            "ttft_cdf.png",
            "worker_load.png",
        ]
    finally:
        for r in runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    cases = [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--workload", "gsp", "-o", "grups=3"], "gsp.grups: unknown option"),
        (["--workload", "trace", "--trace", str(bad_trace)], "line 2: not JSON"),
        (["--workload", "zipf", "--trace", str(bad_trace)], "apply to --workload trace only"),
        (["--workload", "zipf", "--rate", "0"], "argument --rate: 0 must be > 0"),
        (["--workload", "zipf", "--rate", "5,x"], "'x' in '5,x' is not a number"),
        (["--workload", "zipf", "--percentiles", "50,abc"], "--percentiles: 'abc'"),
        (["--workload", "zipf", "--slo", "ttfb=5"], "--slo: 'ttfb=5' must be KEY=MS"),
        (["--workload", "zipf", "--slo", "ttft:fast"], "is not a number of milliseconds"),
        (["--workload", "zipf", "--burstiness", "0.5"], "give --rate too"),
        (["--workload", "zipf", "--header", "no colon"], "--header: 'no colon' must be"),
        (["--workload", "zipf", "--max-failures", "2"], "--max-failures: must be a share"),
        (["--dataset", "sharegpt"], "needs --dataset-path"),
        (["--workload", "gsp", "--input-len", "100"], "--input-len applies to --dataset random only"),
        (
            ["--dataset", "sharegpt", "--dataset-path", "x", "--prefix-len", "5"],
            "--prefix-len applies to --dataset random only",
        ),
        (["--dataset", "sharegpt", "--dataset-path", str(bad_trace)], "line 2: not JSON"),
        ([], "give --workload NAME, --dataset random|sharegpt, or --trace FILE"),
    ]
    for extra, msg in cases:
        p = subprocess.run(
            [sys.executable, "-m", "radixfleet.cli", "loadtest", "--target", "x=http://127.0.0.1:9", *extra],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert p.returncode == 2, (extra, p.stderr)
        assert msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "radixfleet.cli", "loadtest", "--target", "bad", "--workload", "zipf"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "NAME=http://HOST:PORT" in p.stderr


def test_loadtest_and_demo_refuse_unwritable_outputs_before_sending(tmp_path, capsys):
    from radixfleet.cli import main as cli

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # port 1 on loopback: were anything sent, the run would fail differently
    argv = ["loadtest", "--target", "a=http://127.0.0.1:1", "--workload", "gsp", "--requests", "1"]
    assert cli([*argv, "--json", str(blocker / "r.json")]) == 2
    assert "--json: cannot write" in capsys.readouterr().err
    assert cli([*argv, "--plots", str(blocker / "plots")]) == 2
    assert "--plots: cannot write into" in capsys.readouterr().err
    assert cli(["demo", "--out", str(blocker / "demo")]) == 2
    assert "--out: cannot write into" in capsys.readouterr().err


def test_a_target_with_several_urls_round_robins_over_them():
    from radixfleet.wire.errors import ConfigError
    from radixfleet_tools.loadtest.cli import parse_target

    name, url = parse_target("four=http://a:1,http://b:2/v1,http://c:3")
    t = Target(name, url)
    assert t.base_url == "http://a:1" and t.base_urls == ["http://a:1", "http://b:2", "http://c:3"]
    urls = []
    for _ in range(6):
        t_url, _ = t._request(_Spec())
        urls.append(t_url.split("/v1")[0])
    assert urls == ["http://a:1", "http://b:2", "http://c:3"] * 2
    with pytest.raises(ConfigError):
        parse_target("x=http://a:1,ftp://b")


class _Spec:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    max_tokens = 1
    session = "s"
    api = "chat"


async def test_a_vllm_reset_is_followed_by_a_step_that_publishes_its_cleared_event(port):
    """vLLM publishes AllBlocksCleared only after its next scheduler step: the flush
    nudges it with a one-token request (sub-block prompt, nothing stored), so routers
    following its events drop their entries before the run, not after its first turns."""
    import aiohttp

    from radixfleet_tools.loadtest.runner import flush

    seen = []

    async def reset(request):
        seen.append(("reset", None))
        return web.json_response({})

    async def complete(request):
        body = await request.json()
        seen.append(("complete", body))
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application()
    app.router.add_post("/reset_prefix_cache", reset)  # no /flush_cache: a 404, as vLLM
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            assert await flush(s, [url], "tiny") == []
            assert seen == [
                ("reset", None),
                ("complete", {"model": "tiny", "prompt": "flush", "max_tokens": 1}),
            ]
            seen.clear()
            assert await flush(s, [url]) == []  # no model known: the reset alone
            assert seen == [("reset", None)]
    finally:
        await runner.cleanup()


async def test_each_token_is_timed_when_its_line_arrives_not_when_a_read_ends_on_a_line():
    """The stream is read a network read at a time: the whole lines of a read are
    timed at its arrival even when the read ends inside the next event."""
    from radixfleet_tools.loadtest.client import Result, _read_stream
    from radixfleet_tools.loadtest.workloads import API_COMPLETIONS

    def ev(text: str) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"

    a, b, c = ev("a"), ev("b"), ev("c")
    usage = b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 3}}).encode() + b"\n\n"
    reads = [(0.010, a + b[:9]), (0.020, b[9:] + c[:12]), (0.030, c[12:] + usage + b"data: [DONE]\n\n")]
    now = [0.0]

    class Content:
        async def iter_any(self):
            for t, piece in reads:
                now[0] = t
                yield piece

    class Resp:
        content = Content()

    r, parts = Result("x", "s", 0), []
    assert await _read_stream(Resp(), API_COMPLETIONS, r, parts, 0.0, lambda: now[0])
    assert parts == ["a", "b", "c"] and r.output_tokens == 3
    assert r.ttft_s == pytest.approx(0.010) and r.itl_s == pytest.approx([0.010, 0.010])
