"""``radixfleet bench proxy``: what the router costs on the wire, against SGLang's.

One upstream (``wire.LeanUpstream``, its own process: a few µs of CPU per request,
so it is not what limits a proxy; the run prints each process's CPU per request to
show it) is reached three ways, **in one run, in short interleaved rounds**::

    direct                     ->  upstream
    radixfleet (round_robin)   ->  upstream
    smg (SGLang's router, round_robin)  ->  upstream   (required; --no-smg to skip)
    envoy+radixfleet (--envoy: ``radixfleet gateway``, round_robin)  ->  upstream
                               Envoy carries the bytes, the router picks (ext_proc);
                               its CPU is the gateway's process plus Envoy's

Each of ``--rounds`` rounds measures every target, in an order rotated per round,
so that machine noise (the host is shared) falls on all of them alike:

1. **added latency**: ``--probes`` non-streaming requests per target, one at a
   time on one keep-alive connection (concurrency 1, no queueing), the targets
   interleaved request by request (direct, radixfleet, smg, direct, ...).
   Latency is timed at the client (``wire.LeanClient``); added latency is a
   proxied percentile minus the direct one over the same interleaved period.
2. **throughput**: wrk, ``--connections`` connections, ``--round-s`` seconds per
   target; requests/s and the CPU seconds each process used.
3. **streaming**: ``--streams`` concurrent streams for ``--round-s`` / 2 seconds;
   the upstream sends ``--chunks`` SSE events per stream, each a separate write,
   and the client **counts the events it receives** (a stream counts only if all
   of them and ``[DONE]`` arrived).

``--tracing`` adds a fourth target, ``rf+tracing``: the same router with tracing on
(``tracing.sample_ratio`` ``--trace-sample-ratio``, default 1: every request),
exporting over OTLP/HTTP to a sink in its own process (``otlp-sink``); both
radixfleet targets then start from a config file, identical but for ``tracing``,
and the ratio rf+tracing / radixfleet is reported per round.

Figures: per target the median over rounds, and the ratio radixfleet / smg per
round, reported as its median with the min..max spread over rounds. Added latency
p50/p99 over all interleaved probes (and its per-round spread); a figure at or
below zero means the difference is below what the run resolves and is printed as
such, never as a negative latency. ``--json`` prints every round.

The aiohttp upstream (``upstream_app``, ``python -m radixfleet_tools.bench.proxy
upstream --port P``) also serves the router tests: ``/v1/completions``,
``/v1/chat/completions``, ``/generate``, ``/v1/models``, ``/health``; headers it
received are echoed in the response (``x-upstream-tenant``), ``"delay_s"`` in a
body slows its answer, ``"fail"`` makes it answer 500, SSE chunk count and spacing
come from its flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from aiohttp import web

from radixfleet.wire.errors import RunError
from radixfleet_tools.bench.wire import LeanClient, LeanUpstream, post_request
from radixfleet_tools.loadtest.local_fleet import Child, free_port, stop_children
from radixfleet_tools.loadtest.report import percentile, spread
from radixfleet_tools.loadtest.smg import require_smg

# ---------------------------------------------------------------------- upstream


def upstream_app(
    name: str = "up", *, chunks: int = 8, chunk_delay_s: float = 0.0, model: str = "tiny"
) -> web.Application:
    """A minimal OpenAI-shaped worker. Per request it counts hits and remembers the
    last tenant header; ``GET /stats`` returns them. A request body's ``delay_s``
    delays the answer, ``fail`` makes it a 500, and ``chunks``, ``events_per_write``
    (default 1) and ``chunk_delay_s`` replace a stream's number of events, how many
    go in one write and the pause after each write (the chaos tests' endless or slow
    streams); a stream ends early when its client goes away."""
    stats: dict[str, Any] = {"requests": 0, "tenants": [], "paths": []}
    chunk_body = {
        "id": "c",
        "object": "text_completion",
        "model": model,
        "choices": [{"index": 0, "text": "x", "finish_reason": None}],
    }
    chat_chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": model,
        "created": 0,
        "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}],
    }
    comp = json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()
    chat = json.dumps(
        {
            "id": "chat-1",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()
    sse_comp = (
        b"".join(b"data: " + json.dumps(chunk_body).encode() + b"\n\n" for _ in range(chunks))
        + b"data: [DONE]\n\n"
    )

    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        stats["requests"] += 1
        stats["tenants"].append(request.headers.get("x-radixfleet-tenant"))
        stats["paths"].append(request.path)
        del stats["tenants"][:-1000], stats["paths"][:-1000]
        hdrs = {"x-upstream": name, "x-upstream-tenant": request.headers.get("x-radixfleet-tenant", "")}
        try:
            body = json.loads(raw)
        except ValueError:
            return web.Response(
                status=400, body=b'{"error":{"message":"bad json"}}', content_type="application/json"
            )
        if not isinstance(body, dict):
            body = {}
        if body.get("fail"):
            return web.Response(
                status=500,
                body=b'{"error":{"message":"fail"}}',
                content_type="application/json",
                headers=hdrs,
            )
        delay = body.get("delay_s")
        if isinstance(delay, (int, float)) and delay > 0:
            await asyncio.sleep(delay)
        is_chat = request.path == "/v1/chat/completions"
        if not body.get("stream"):
            return web.Response(body=chat if is_chat else comp, content_type="application/json", headers=hdrs)
        n, pause = body.get("chunks", chunks), body.get("chunk_delay_s", chunk_delay_s)
        per = body.get("events_per_write", 1)
        if (
            type(n) is not int
            or n < 0
            or type(per) is not int
            or per < 1
            or not isinstance(pause, (int, float))
            or not pause >= 0
        ):
            return web.Response(
                status=400,
                body=b'{"error":{"message":"chunks: an integer >= 0; events_per_write: an '
                b'integer >= 1; chunk_delay_s: a number >= 0"}}',
                content_type="application/json",
            )
        sr = web.StreamResponse(headers={"Content-Type": "text/event-stream", **hdrs})
        await sr.prepare(request)
        if n == chunks and pause == 0 and per == 1 and not is_chat:
            await sr.write(sse_comp)
        else:
            one = b"data: " + json.dumps(chat_chunk if is_chat else chunk_body).encode() + b"\n\n"
            batch = one * per
            for _ in range(n // per):
                await sr.write(batch)
                if pause:
                    await asyncio.sleep(pause)
            await sr.write(one * (n % per) + b"data: [DONE]\n\n")
        await sr.write_eof()
        return sr

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": name}]}
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application()
    for p in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(p, handle)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", get_stats)
    return app


def serve_upstream(args: argparse.Namespace) -> int:
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    app = upstream_app(args.name, chunks=args.chunks, chunk_delay_s=args.chunk_delay, model=args.model)
    with asyncio.Runner(loop_factory=loop_factory) as r:
        r.run(_serve_app(app, args.port))
    return 0


def otlp_sink_app() -> web.Application:
    """A collector that takes OTLP/HTTP trace exports and drops them: 200 to ``POST
    /v1/traces`` (an empty ``ExportTraceServiceResponse``), ``GET /stats`` the
    exports and bytes taken, ``GET /health``."""
    stats = {"exports": 0, "bytes": 0}

    async def traces(request: web.Request) -> web.Response:
        stats["exports"] += 1
        stats["bytes"] += len(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/stats", get_stats)
    app.router.add_get("/health", health)
    return app


def start_otlp_sink(log_dir: str) -> tuple[Child, str]:
    """The sink (``otlp_sink_app``) in its own process: (its child, its traces URL)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    c = Child(
        "otlp-sink",
        [sys.executable, "-m", "radixfleet_tools.bench.proxy", "otlp-sink", "--port", str(port)],
        os.path.join(log_dir, "otlp-sink.log"),
        base + "/health",
    )
    c.start()
    c.wait_ready(30.0)
    return c, base + "/v1/traces"


def serve_lean_upstream(port: int, chunks: int) -> int:
    """Serves ``wire.LeanUpstream`` on 127.0.0.1:``port`` until SIGTERM/SIGINT."""
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None

    async def serve() -> None:
        up = LeanUpstream(chunks)
        await up.start(port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()
        await up.close()

    with asyncio.Runner(loop_factory=loop_factory) as r:
        r.run(serve())
    return 0


async def _serve_app(app: web.Application, port: int) -> None:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    await runner.cleanup()


# --------------------------------------------------------------------- benchmark


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON (every round)")
    parser.add_argument("--rounds", type=_positive_int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--round-s",
        type=_positive_float,
        default=2.0,
        help="seconds of wrk per target per round (default 2; streaming: half)",
    )
    parser.add_argument(
        "--probes", type=_positive_int, default=300, help="latency probes per target per round (default 300)"
    )
    parser.add_argument("--connections", type=_positive_int, default=64, help="wrk connections (default 64)")
    parser.add_argument("--threads", type=_positive_int, default=2, help="wrk threads")
    parser.add_argument(
        "--streams", type=_positive_int, default=16, help="concurrent SSE streams (default 16)"
    )
    parser.add_argument("--chunks", type=_positive_int, default=64, help="SSE events per stream (default 64)")
    parser.add_argument(
        "--no-smg",
        action="store_true",
        help="leave SGLang's router out (otherwise a missing smg is an error)",
    )
    parser.add_argument(
        "--envoy",
        action="store_true",
        help="also measure envoy+radixfleet: radixfleet gateway, Envoy with the router as its "
        "endpoint picker (the gateway extra)",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="add the router with tracing on (rf+tracing), exporting to a local OTLP sink",
    )
    parser.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=1.0,
        help="tracing.sample_ratio of rf+tracing (default 1: every request traced)",
    )


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {x}")
    return x


def _ensure_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk:
        return wrk
    for cmd in (
        ["apt-get", "install", "-y", "wrk"],
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "wrk"],
    ):
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        wrk = shutil.which("wrk")
        if wrk:
            return wrk
    raise RunError("wrk is not installed and apt-get install wrk failed")


_LUA = """
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  io.write(string.format("RESULT %%d %%d %%f\\n", summary.requests,
    summary.errors.status + summary.errors.connect + summary.errors.read +
    summary.errors.write + summary.errors.timeout, summary.duration / 1e6))
end
"""


def _wrk(wrk: str, url: str, body: dict, duration: float, conns: int, threads: int) -> dict:
    """One wrk run: requests, errors and requests/s (wrk's own duration)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_LUA % json.dumps(body))
        script = f.name
    try:
        out = subprocess.run(
            [
                wrk,
                "-t",
                str(min(threads, conns)),
                "-c",
                str(conns),
                "-d",
                f"{max(1, round(duration))}s",
                "-s",
                script,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=duration + 30,
        ).stdout
    finally:
        os.unlink(script)
    m = re.search(r"RESULT (\d+) (\d+) ([\d.]+)", out)
    if not m:
        raise RunError(f"wrk output not understood: {out.strip()[:200]!r}")
    n, errors, secs = m.groups()
    return {"requests": int(n), "errors": int(errors), "rps": int(n) / float(secs)}


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return float("nan")


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: _cpu_s(pid) for name, pid in pids.items()}


async def _latency_round(
    ports: dict[str, int], order: list[str], probes: int, body: dict
) -> dict[str, list[float]]:
    """``probes`` requests per target, one at a time, interleaved target by target."""
    clients = {n: await LeanClient.connect("127.0.0.1", ports[n]) for n in order}
    raws = {n: post_request("127.0.0.1", ports[n], "/v1/completions", body) for n in order}
    out: dict[str, list[float]] = {n: [] for n in order}
    try:
        for _ in range(probes):
            for n in order:
                a = await clients[n].request(raws[n])
                if a.status != 200:
                    raise RunError(f"{n} answered HTTP {a.status} to a latency probe")
                out[n].append(a.latency_s)
    finally:
        for c in clients.values():
            c.close()
    return out


async def _stream_round(port: int, streams: int, seconds: float, chunks: int, body: dict) -> dict:
    """``streams`` concurrent SSE streams for ``seconds``; events counted as received."""
    raw = post_request("127.0.0.1", port, "/v1/completions", body)
    tally = {"complete": 0, "incomplete": 0, "chunks": 0}
    end = time.perf_counter() + seconds

    async def one() -> None:
        c = await LeanClient.connect("127.0.0.1", port)
        try:
            while time.perf_counter() < end:
                a = await c.request(raw)
                got = a.events - (1 if a.done else 0)  # data events, [DONE] not counted
                tally["chunks"] += max(0, got)
                if a.status == 200 and a.done and got == chunks:
                    tally["complete"] += 1
                else:
                    tally["incomplete"] += 1
        finally:
            c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(streams)))
    dt = time.perf_counter() - t0
    return {
        **tally,
        "seconds": dt,
        "chunks_per_s": tally["chunks"] / dt,
        "streams_per_s": tally["complete"] / dt,
    }


def _spread(xs: list[float]) -> dict:
    return {**spread(xs), "rounds": xs}


class _Fleet:
    """The upstream, radixfleet and smg (``radixfleet_tools.loadtest.local_fleet.Child``), logging to a
    temporary folder its failures name; all stopped on ``stop()``."""

    def __init__(self) -> None:
        self.log_dir = tempfile.mkdtemp(prefix="radixfleet-bench-proxy-")
        self.children: list[Child] = []
        self.pids: dict[str, int] = {}

    def start(self, name: str, argv: list[str], ready_url: str, **kw: Any) -> None:
        c = Child(name, argv, os.path.join(self.log_dir, f"{name}.log"), ready_url, **kw)
        self.children.append(c)
        c.start()
        self.pids[name] = c.pid
        c.wait_ready(30.0)

    def stop(self) -> None:
        stop_children(self.children)


def run(args: argparse.Namespace) -> int:
    wrk = _ensure_wrk()
    smg_bin = None if args.no_smg else require_smg()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    plain = {"model": "tiny", "prompt": "hello world, a short benchmark prompt", "max_tokens": 1}
    streamed = dict(plain, stream=True)
    fleet = _Fleet()
    rounds = []
    try:
        up_port = free_port()
        up = f"http://127.0.0.1:{up_port}"
        fleet.start(
            "upstream",
            [
                sys.executable,
                "-m",
                "radixfleet_tools.bench.proxy",
                "lean-upstream",
                "--port",
                str(up_port),
                "--chunks",
                str(args.chunks),
            ],
            up + "/health",
        )
        rf_port = free_port()
        rf = f"http://127.0.0.1:{rf_port}"
        router_argv = [sys.executable, "-m", "radixfleet.cli", "router", "--log-level", "WARNING"]
        quick = ["--worker", up, "--policy", "round_robin"]
        if args.tracing:  # both from files, identical but for tracing
            quick = ["--config", _router_file(fleet.log_dir, "plain", up, None)]
        fleet.start("radixfleet", [*router_argv, *quick, "--port", str(rf_port)], rf + "/readiness")
        traced_port = 0
        if args.tracing:
            sink_port = free_port()
            sink = f"http://127.0.0.1:{sink_port}"
            sink_argv = [sys.executable, "-m", "radixfleet_tools.bench.proxy", "otlp-sink"]
            fleet.start("otlp-sink", [*sink_argv, "--port", str(sink_port)], sink + "/health")
            ratio = args.trace_sample_ratio
            tracing = {"enabled": True, "endpoint": sink + "/v1/traces", "sample_ratio": ratio}
            traced_port = free_port()
            fleet.start(
                "rf+tracing",
                [*router_argv, "--config", _router_file(fleet.log_dir, "traced", up, tracing)]
                + ["--port", str(traced_port)],
                f"http://127.0.0.1:{traced_port}/readiness",
            )
        ports = {"direct": up_port, "radixfleet": rf_port}
        if traced_port:
            ports["rf+tracing"] = traced_port
        if smg_bin is not None:
            smg_port = free_port()
            smg = f"http://127.0.0.1:{smg_port}"
            fleet.start(
                "smg",
                [
                    smg_bin,
                    "launch",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(smg_port),
                    "--worker-urls",
                    up,
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "error",
                ],
                smg + "/health",
            )
            _wait_smg(smg)
            ports["smg"] = smg_port
        if args.envoy:
            gw_port = free_port()
            state = os.path.join(fleet.log_dir, "gateway")
            fleet.start(
                "envoy+radixfleet",
                [
                    sys.executable,
                    "-m",
                    "radixfleet.cli",
                    "gateway",
                    "--worker",
                    up,
                    "--policy",
                    "round_robin",
                    "--port",
                    str(gw_port),
                    "--router-port",
                    str(free_port()),
                    "--picker-port",
                    str(free_port()),
                    "--state-dir",
                    state,
                    "--log-level",
                    "WARNING",
                ],
                # an unknown path: the picker's own 404 through Envoy, so both are up
                f"http://127.0.0.1:{gw_port}/ready",
                ready=lambda r: r.status_code == 404,
            )
            envoy_pid = _child_named(fleet.pids["envoy+radixfleet"], "envoy")
            if envoy_pid is None:
                raise RunError(f"radixfleet gateway started no Envoy (its log: {fleet.log_dir})")
            fleet.pids["envoy"] = envoy_pid
            ports["envoy+radixfleet"] = gw_port
        names = list(ports)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            for n in names:  # warm-up: connections, caches, JITs of every target
                _wrk(wrk, f"http://127.0.0.1:{ports[n]}/v1/completions", plain, 1.0, 8, 1)
                runner.run(_stream_round(ports[n], 2, 0.3, args.chunks, streamed))
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                rnd: dict = {
                    "order": order,
                    "latency_s": runner.run(_latency_round(ports, order, args.probes, plain)),
                    "throughput": {},
                    "stream": {},
                }
                for n in order:
                    c0 = _cpu(fleet.pids)
                    res = _wrk(
                        wrk,
                        f"http://127.0.0.1:{ports[n]}/v1/completions",
                        plain,
                        args.round_s,
                        args.connections,
                        args.threads,
                    )
                    c1 = _cpu(fleet.pids)
                    res["cpu_s"] = {k: c1[k] - c0[k] for k in c0}
                    rnd["throughput"][n] = res
                for n in order:
                    c0 = _cpu(fleet.pids)
                    res = runner.run(
                        _stream_round(ports[n], args.streams, args.round_s / 2, args.chunks, streamed)
                    )
                    c1 = _cpu(fleet.pids)
                    res["cpu_s"] = {k: c1[k] - c0[k] for k in c0}
                    rnd["stream"][n] = res
                rounds.append(rnd)
    finally:
        fleet.stop()
    summary = _summarize(names, rounds)
    doc = {
        "benchmark": "proxy",
        "config": {
            "rounds": args.rounds,
            "round_s": args.round_s,
            "probes": args.probes,
            "connections": args.connections,
            "threads": args.threads,
            "streams": args.streams,
            "chunks": args.chunks,
            "targets": names,
        },
        "summary": summary,
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    _print(doc)
    return 0


def _q(xs: list[float], q: float) -> float:
    """``percentile`` of a sample that is never empty here (each round loads each target)."""
    v = percentile(xs, q)
    assert v is not None, "an empty latency sample"
    return v


def _summarize(names: list[str], rounds: list[dict]) -> dict:
    out: dict = {"throughput": {}, "stream": {}, "latency": {}, "cpu_us_per_request": {}}
    for n in names:
        out["throughput"][n] = _spread([r["throughput"][n]["rps"] for r in rounds])
        out["throughput"][n]["errors"] = sum(r["throughput"][n]["errors"] for r in rounds)
        out["stream"][n] = _spread([r["stream"][n]["chunks_per_s"] for r in rounds])
        out["stream"][n]["incomplete"] = sum(r["stream"][n]["incomplete"] for r in rounds)
        # CPU per request of every process while this target was loaded (median over rounds)
        out["cpu_us_per_request"][n] = {
            proc: statistics.median(
                r["throughput"][n]["cpu_s"][proc] * 1e6 / max(1, r["throughput"][n]["requests"])
                for r in rounds
            )
            for proc in rounds[0]["throughput"][n]["cpu_s"]
        }
    pooled = {n: sorted(x for r in rounds for x in r["latency_s"][n]) for n in names}
    d50, d99 = _q(pooled["direct"], 0.50), _q(pooled["direct"], 0.99)
    out["latency"]["direct"] = {"p50_ms": d50 * 1e3, "p99_ms": d99 * 1e3, "samples": len(pooled["direct"])}
    for n in names[1:]:
        per50, per99 = [], []
        for r in rounds:
            a, b = sorted(r["latency_s"][n]), sorted(r["latency_s"]["direct"])
            per50.append((_q(a, 0.50) - _q(b, 0.50)) * 1e3)
            per99.append((_q(a, 0.99) - _q(b, 0.99)) * 1e3)
        p50, p99 = _q(pooled[n], 0.50), _q(pooled[n], 0.99)
        out["latency"][n] = {
            "p50_ms": p50 * 1e3,
            "p99_ms": p99 * 1e3,
            "added_p50_ms": (p50 - d50) * 1e3,
            "added_p99_ms": (p99 - d99) * 1e3,
            "added_p50_rounds_ms": per50,
            "added_p99_rounds_ms": per99,
        }
    if "rf+tracing" in names:
        for key in ("throughput", "stream"):
            rf = out[key]["radixfleet"]["rounds"]
            tr = out[key]["rf+tracing"]["rounds"]
            out[key]["ratio_tracing_over_off"] = _spread([a / b for a, b in zip(tr, rf)])
    pairs = [("radixfleet", "smg"), ("envoy+radixfleet", "smg"), ("envoy+radixfleet", "radixfleet")]
    for num, den in pairs:
        if num in names and den in names:
            for key in ("throughput", "stream"):
                ra, rb = out[key][num]["rounds"], out[key][den]["rounds"]
                out[key][f"ratio_{num}_over_{den}"] = _spread([x / y for x, y in zip(ra, rb)])
    # the upstream is not the bottleneck when direct is well above every proxy
    proxied = max(out["throughput"][n]["median"] for n in names[1:])
    out["direct_over_best_proxy"] = out["throughput"]["direct"]["median"] / proxied
    return out


def _child_named(pid: int, name: str) -> int | None:
    """The pid of ``pid``'s child process whose program is ``name``, or None."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for k in kids:
            try:
                with open(f"/proc/{k}/cmdline", "rb") as f:
                    prog = f.read().split(b"\0", 1)[0]
            except OSError:
                continue
            if os.path.basename(prog).decode(errors="replace") == name:
                return k
    return None


def _ms(x: float) -> str:
    """An added latency for print: never shown negative (below resolution instead)."""
    return f"{x:.3f} ms" if x > 0 else "<= 0 (below this run's resolution)"


def _print(doc: dict) -> None:
    s, c = doc["summary"], doc["config"]
    names = c["targets"]
    print(
        f"proxy benchmark: {c['rounds']} interleaved rounds; per round and target wrk "
        f"{c['connections']} connections x {c['round_s']:g} s, {c['streams']} SSE streams x "
        f"{c['round_s'] / 2:g} s ({c['chunks']} events each, counted at the client), "
        f"{c['probes']} latency probes at concurrency 1"
    )
    for n in names:
        t, st = s["throughput"][n], s["stream"][n]
        line = (
            f"  {n:16s} {t['median']:9.0f} req/s ({t['min']:.0f}..{t['max']:.0f})  "
            f"stream {st['median']:9.0f} chunks/s ({st['min']:.0f}..{st['max']:.0f})"
        )
        if t["errors"] or st["incomplete"]:
            line += f"  [{t['errors']} wrk errors, {st['incomplete']} incomplete streams]"
        print(line)
    d = s["latency"]["direct"]
    print(
        f"  latency at concurrency 1: direct p50 {d['p50_ms']:.3f} ms p99 {d['p99_ms']:.3f} ms "
        f"({d['samples']} probes)"
    )
    for n in names[1:]:
        lt = s["latency"][n]
        r50, r99 = lt["added_p50_rounds_ms"], lt["added_p99_rounds_ms"]
        print(
            f"  {n:16s} added p50 {_ms(lt['added_p50_ms'])} (rounds {min(r50):.3f}..{max(r50):.3f}), "
            f"p99 {_ms(lt['added_p99_ms'])} (rounds {min(r99):.3f}..{max(r99):.3f})"
        )
    for key, label in (("throughput", "throughput"), ("stream", "streaming chunks/s")):
        r = s[key].get("ratio_tracing_over_off")
        if r:
            print(
                f"  radixfleet tracing on/off {label}: median {r['median']:.2f}x per round "
                f"(spread {r['min']:.2f}..{r['max']:.2f}x)"
            )
    for key, label in (("throughput", "throughput"), ("stream", "streaming chunks/s")):
        for ratio, r in s[key].items():
            if not ratio.startswith("ratio_") or ratio == "ratio_tracing_over_off":
                continue
            a, _, b = ratio[len("ratio_") :].partition("_over_")
            print(
                f"  {a}/{b} {label}: median {r['median']:.2f}x per round "
                f"(spread {r['min']:.2f}..{r['max']:.2f}x)"
            )
    cpu = s["cpu_us_per_request"]
    for n in names:
        print(
            f"  CPU µs per request while {n} was loaded: "
            + ", ".join(f"{p} {v:.1f}" for p, v in cpu[n].items())
        )
    print(
        f"  direct / best proxy throughput: {s['direct_over_best_proxy']:.2f}x "
        f"(the upstream is {'not ' if s['direct_over_best_proxy'] > 1.2 else ''}"
        f"the limit)"
    )


def _router_file(log_dir: str, name: str, upstream: str, tracing: dict | None) -> str:
    """A router YAML: the one upstream, round_robin (the quick start's), and ``tracing``."""
    doc: dict[str, Any] = {"workers": [upstream], "policy": {"name": "round_robin"}}
    if tracing is not None:
        doc["tracing"] = tracing
    path = os.path.join(log_dir, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)  # JSON is YAML
    return path


def _wait_smg(base: str, timeout_s: float = 30.0) -> None:
    """smg answers /health before its worker is admitted; wait for a real answer."""
    import httpx

    deadline = time.monotonic() + timeout_s
    body = {"model": "tiny", "prompt": "warm", "max_tokens": 1}
    while time.monotonic() < deadline:
        try:
            if httpx.post(base + "/v1/completions", json=body, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"smg at {base} never routed a request")


def main(argv: list[str] | None = None) -> int:
    """``python -m radixfleet_tools.bench.proxy upstream --port P`` serves the upstream."""
    p = argparse.ArgumentParser(prog="radixfleet_tools.bench.proxy")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("upstream")
    u.add_argument("--port", type=int, required=True)
    u.add_argument("--name", default="up")
    u.add_argument("--model", default="tiny")
    u.add_argument("--chunks", type=int, default=8)
    u.add_argument("--chunk-delay", type=float, default=0.0)
    lean = sub.add_parser("lean-upstream")
    lean.add_argument("--port", type=int, required=True)
    lean.add_argument("--chunks", type=int, default=64)
    sink = sub.add_parser("otlp-sink")
    sink.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    if args.cmd == "otlp-sink":
        with asyncio.Runner() as r:
            r.run(_serve_app(otlp_sink_app(), args.port))
        return 0
    if args.cmd == "lean-upstream":
        return serve_lean_upstream(args.port, args.chunks)
    return serve_upstream(args)


if __name__ == "__main__":
    sys.exit(main())
