"""``radixfleet bench proxy``: what the router costs on the wire, against SGLang's.

One fast upstream (``upstream_app``: an OpenAI-shaped aiohttp server answering a
tiny completion, or an SSE stream of N chunks) is reached, in one run and with the
same load generator (wrk, installed from Debian's packages if absent):

    direct  ->  upstream
    radixfleet (round_robin)  ->  upstream
    smg (SGLang's router, round_robin)  ->  upstream

Figures: non-streaming requests/s of each and the ratio radixfleet/smg; added
latency p50/p99 (proxied minus direct) at half of the direct maximum rate
(wrk has no fixed-rate mode, so "half load" is a concurrency, not a rate
of the saturating run: the largest closed-loop concurrency at which radixfleet
runs at no more than about half its maximum rate, the same for every target); streamed
chunks/s of each and the ratio.

The upstream also serves the router tests (``python -m router.benchmarks.proxy
upstream --port P``): ``/v1/completions``, ``/v1/chat/completions``, ``/generate``,
``/v1/models``, ``/health``; headers it received are echoed in the response
(``x-upstream-tenant``), ``"delay_s"`` in a body slows its answer, ``"fail"`` makes
it answer 500, SSE chunk count and spacing come from its flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from aiohttp import web

# ---------------------------------------------------------------------- upstream


def upstream_app(name: str = "up", *, chunks: int = 8, chunk_delay_s: float = 0.0,
                 model: str = "tiny") -> web.Application:
    """A minimal OpenAI-shaped worker. Per request it counts hits and remembers the
    last tenant header; ``GET /stats`` returns them."""
    stats = {"requests": 0, "tenants": [], "paths": []}
    chunk_body = {"id": "c", "object": "text_completion", "model": model,
                  "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    chat_chunk = {"id": "c", "object": "chat.completion.chunk", "model": model, "created": 0,
                  "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    comp = json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": model,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }).encode()
    chat = json.dumps({
        "id": "chat-1", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }).encode()
    sse_comp = b"".join(b"data: " + json.dumps(chunk_body).encode() + b"\n\n"
                        for _ in range(chunks)) + b"data: [DONE]\n\n"

    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        stats["requests"] += 1
        stats["tenants"].append(request.headers.get("x-radixfleet-tenant"))
        stats["paths"].append(request.path)
        del stats["tenants"][:-1000], stats["paths"][:-1000]
        hdrs = {"x-upstream": name,
                "x-upstream-tenant": request.headers.get("x-radixfleet-tenant", "")}
        try:
            body = json.loads(raw)
        except ValueError:
            return web.Response(status=400, body=b'{"error":{"message":"bad json"}}',
                                content_type="application/json")
        if not isinstance(body, dict):
            body = {}
        if body.get("fail"):
            return web.Response(status=500, body=b'{"error":{"message":"fail"}}',
                                content_type="application/json", headers=hdrs)
        delay = body.get("delay_s")
        if isinstance(delay, (int, float)) and delay > 0:
            await asyncio.sleep(delay)
        is_chat = request.path == "/v1/chat/completions"
        if not body.get("stream"):
            return web.Response(body=chat if is_chat else comp,
                                content_type="application/json", headers=hdrs)
        sr = web.StreamResponse(headers={"Content-Type": "text/event-stream", **hdrs})
        await sr.prepare(request)
        if chunk_delay_s == 0 and not is_chat:
            await sr.write(sse_comp)
        else:
            one = b"data: " + json.dumps(chat_chunk if is_chat else chunk_body).encode() + b"\n\n"
            for _ in range(chunks):
                await sr.write(one)
                if chunk_delay_s:
                    await asyncio.sleep(chunk_delay_s)
            await sr.write(b"data: [DONE]\n\n")
        await sr.write_eof()
        return sr

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": name}]})

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
    app = upstream_app(args.name, chunks=args.chunks, chunk_delay_s=args.chunk_delay,
                       model=args.model)
    with asyncio.Runner(loop_factory=loop_factory) as r:
        r.run(_serve_app(app, args.port))
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
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=64, help="saturating connections")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--chunks", type=int, default=64, help="SSE chunks per stream")
    parser.add_argument("--no-smg", action="store_true", help="skip SGLang's router")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout_s: float = 20.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=0.5).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready")


def _ensure_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk:
        return wrk
    for cmd in (["apt-get", "install", "-y", "wrk"], ["apt-get", "update"],
                ["apt-get", "install", "-y", "wrk"]):
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        wrk = shutil.which("wrk")
        if wrk:
            return wrk
    raise RuntimeError("wrk is not installed and apt-get install wrk failed")


_LUA = """
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  io.write(string.format("RESULT %%d %%d %%f %%f %%f %%f\\n", summary.requests,
    summary.errors.status + summary.errors.connect + summary.errors.read +
    summary.errors.write + summary.errors.timeout, summary.duration / 1e6,
    latency:percentile(50) / 1e3, latency:percentile(99) / 1e3, latency.mean / 1e3))
end
"""


def _wrk(wrk: str, url: str, body: dict, duration: float, conns: int, threads: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_LUA % json.dumps(body))
        script = f.name
    try:
        out = subprocess.run(
            [wrk, "-t", str(min(threads, conns)), "-c", str(conns), "-d", f"{max(1, round(duration))}s",
             "--latency", "-s", script, url],
            capture_output=True, text=True, timeout=duration + 30).stdout
    finally:
        os.unlink(script)
    m = re.search(r"RESULT (\d+) (\d+) ([\d.]+) ([\d.]+) ([\d.]+) ([\d.]+)", out)
    if not m:
        raise RuntimeError(f"wrk output not understood:\n{out}")
    n, errors, secs, p50, p99, mean = m.groups()
    return {"requests": int(n), "errors": int(errors), "rps": int(n) / float(secs),
            "p50_ms": float(p50), "p99_ms": float(p99), "mean_ms": float(mean)}


def run(args: argparse.Namespace) -> int:
    wrk = _ensure_wrk()
    procs: list[subprocess.Popen] = []

    def start(argv, ready_url, env=None):
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, **(env or {})})
        procs.append(p)
        _wait_http(ready_url)
        return p

    results: dict = {"config": {"duration_s": args.duration, "connections": args.connections,
                                "chunks": args.chunks}}
    try:
        up_port = _free_port()
        up = f"http://127.0.0.1:{up_port}"
        start([sys.executable, "-m", "router.benchmarks.proxy", "upstream", "--port",
               str(up_port), "--chunks", str(args.chunks)], up + "/health")
        rf_port = _free_port()
        rf = f"http://127.0.0.1:{rf_port}"
        start([sys.executable, "-m", "router.cli", "router", "--worker", up, "--policy",
               "round_robin", "--port", str(rf_port), "--log-level", "WARNING"], rf + "/readiness")
        _wait_ready(rf)
        targets = {"direct": up, "radixfleet": rf}
        if not args.no_smg and shutil.which("smg"):
            smg_port = _free_port()
            smg = f"http://127.0.0.1:{smg_port}"
            start(["smg", "launch", "--host", "127.0.0.1", "--port", str(smg_port),
                   "--worker-urls", up, "--policy", "round_robin", "--log-level", "error"],
                  smg + "/health")
            _wait_smg(smg)
            targets["smg"] = smg
        plain = {"model": "tiny", "prompt": "hello world, a short benchmark prompt",
                 "max_tokens": 1}
        streamed = dict(plain, stream=True)
        for name, base in targets.items():  # warm-up, all targets
            _wrk(wrk, base + "/v1/completions", plain, 1.0, 8, 1)
        for name, base in targets.items():
            url = base + "/v1/completions"
            results[name] = {"max": _wrk(wrk, url, plain, args.duration, args.connections,
                                         args.threads)}
        # Half load: the largest concurrency at which radixfleet runs at <= ~half its
        # maximum rate (closed loop); every target is measured at that concurrency.
        half_rps = results["radixfleet"]["max"]["rps"] / 2
        half = 1
        for c in (2, 4, 8, 16, 32):
            if c >= args.connections:
                break
            probe = _wrk(wrk, rf + "/v1/completions", plain, 2.0, c, 1)
            if probe["rps"] > half_rps * 1.1:
                break
            half = c
        for name, base in targets.items():
            url = base + "/v1/completions"
            r = results[name]
            r["light"] = _wrk(wrk, url, plain, args.duration / 2, half, 1)
            s = _wrk(wrk, url, streamed, args.duration / 2, max(1, args.connections // 4),
                     args.threads)
            s["chunks_per_s"] = s["rps"] * args.chunks
            r["stream"] = s
        results["config"]["half_load_connections"] = half
        d = results["direct"]
        summary = {}
        for name in targets:
            if name == "direct":
                continue
            r = results[name]
            summary[name] = {
                "rps": r["max"]["rps"],
                "added_p50_ms": r["light"]["p50_ms"] - d["light"]["p50_ms"],
                "added_p99_ms": r["light"]["p99_ms"] - d["light"]["p99_ms"],
                "light_rps": r["light"]["rps"],
                "chunks_per_s": r["stream"]["chunks_per_s"],
            }
        if "smg" in summary:
            a, b = summary["radixfleet"], summary["smg"]
            summary["ratio_rps_radixfleet_over_smg"] = a["rps"] / b["rps"]
            summary["ratio_chunks_radixfleet_over_smg"] = a["chunks_per_s"] / b["chunks_per_s"]
        summary["direct_rps"] = d["max"]["rps"]
        results["summary"] = summary
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    s = results["summary"]
    print(f"proxy benchmark: wrk {args.connections} connections x {args.duration:g}s, "
          f"light load {half} connections, SSE {args.chunks} chunks")
    print(f"  direct      {s['direct_rps']:9.0f} req/s  "
          f"light p50 {results['direct']['light']['p50_ms']:.3f} ms "
          f"p99 {results['direct']['light']['p99_ms']:.3f} ms  "
          f"stream {results['direct']['stream']['chunks_per_s']:.0f} chunks/s")
    for name in ("radixfleet", "smg"):
        if name in s:
            r = s[name]
            print(f"  {name:11s} {r['rps']:9.0f} req/s  added p50 {r['added_p50_ms']:.3f} ms "
                  f"p99 {r['added_p99_ms']:.3f} ms (at {r['light_rps']:.0f} req/s)  "
                  f"stream {r['chunks_per_s']:.0f} chunks/s")
    if "ratio_rps_radixfleet_over_smg" in s:
        print(f"  radixfleet/smg: throughput {s['ratio_rps_radixfleet_over_smg']:.2f}x, "
              f"streaming {s['ratio_chunks_radixfleet_over_smg']:.2f}x")
    return 0


def _wait_ready(base: str, timeout_s: float = 20.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/readiness", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base} never became ready")


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
    """``python -m router.benchmarks.proxy upstream --port P`` serves the upstream."""
    p = argparse.ArgumentParser(prog="router.benchmarks.proxy")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("upstream")
    u.add_argument("--port", type=int, required=True)
    u.add_argument("--name", default="up")
    u.add_argument("--model", default="tiny")
    u.add_argument("--chunks", type=int, default=8)
    u.add_argument("--chunk-delay", type=float, default=0.0)
    args = p.parse_args(argv)
    return serve_upstream(args)


if __name__ == "__main__":
    sys.exit(main())
