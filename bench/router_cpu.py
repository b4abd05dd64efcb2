"""The router's CPU per request in front of vLLM-shaped servers, without vLLM.

    python3 bench/router_cpu.py [--requests 480] [--first-s 0.08] [--token-s 0.01]
                                [--no-tokenizer] [--sample] [--json FILE]

Starts two fake vLLM servers (this file's ``--fake-vllm PORT``: vLLM 0.32's
``/metrics`` page as recorded in tests/data/vllm_metrics.txt, its chat SSE events
with a role chunk, one event per token, the usage event when asked and ``[DONE]``),
one radixfleet router configured as ``bench/vllm_ab.py`` configures its precise
router (``prefix_load``, the engine's tokenizer, metrics scraped every 0.25 s,
health every 0.5 s; no KV events: the fakes publish none), and the load generator's
multiturn workload as ``bench/vllm_ab.py`` runs it. Prints the router's CPU (user +
system, from /proc) per request over the load generator's run. ``--first-s`` and
``--token-s`` pace the fakes (time to the first token, between tokens): the defaults
put the request rate near what two CPU vLLM servers serve, so that background work
(scrapes, health checks) weighs per request as it does in front of real engines.

Why: CPU per request in front of real engines is measured by ``bench/vllm_ab.py
--engine-phases``, which needs the vLLM lock and a quiet machine; this measures the
router's own share on the same request shapes in seconds, and compares two commits
by running it from each one's checkout (alternate the runs: the machine is shared).

``--sample`` runs the router under a CPU-time sampler (``ITIMER_PROF``, 1 ms: it
counts CPU time, not wall time, so preemption on a busy machine is not charged to
whatever ran last) and prints where the samples fell: the event loop's own C code
and the kernel (samples with no Python frame above the loop), the request path, the
upstream protocol, the metrics scrapes, the health checks.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.vllm_ab import cpu_s, router_config  # noqa: E402
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv  # noqa: E402
from radixfleet_tools.harness.vllm_env import tiny_model  # noqa: E402

PAGE = REPO / "tests" / "data" / "vllm_metrics.txt"
#: where a sample's stack falls (the first of these frames in it, outermost first)
_GROUPS = (
    ("front.py:_run", "request path (Python)"),
    ("upstream.py:data_received", "upstream protocol"),
    ("engine_metrics.py:_run", "metrics scrapes"),
    ("pool.py:_health_loop", "health checks"),
    ("pool.py:_check", "health checks"),
)


def fake_vllm(port: int, first_s: float, token_s: float, tokens: int) -> None:
    """Serves one fake vLLM on 127.0.0.1:``port`` until killed."""
    from aiohttp import web

    page = PAGE.read_text()

    def event(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(", ", ": ")).encode() + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(first_s)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        base = {
            "id": "chatcmpl-0",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": "tiny",
        }
        role = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        await resp.write(event({**base, "choices": [role], "prompt_token_ids": None}))
        for i in range(tokens):
            if i:
                await asyncio.sleep(token_s)
            done = "length" if i == tokens - 1 else None
            tok = {"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": done}
            await resp.write(event({**base, "choices": [{**tok, "token_ids": None}]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 4000, "total_tokens": 4000 + tokens, "completion_tokens": tokens}
            # every prompt token reported cached: the router's own hints are never
            # corrected, as with an engine whose cache holds what the router predicts
            usage["prompt_tokens_details"] = {"cached_tokens": 4000}
            await resp.write(event({**base, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/plain")

    async def empty(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", empty)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/reset_prefix_cache", empty)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def sampled(out: str, module: str, args: list[str]) -> None:
    """Runs ``module`` as __main__ with a 1 ms CPU-time sampler; writes the sampled
    stacks (outermost first, ``;``-joined) with their counts to ``out`` at exit."""
    import runpy

    stacks: collections.Counter = collections.Counter()

    def on_prof(sig, frame) -> None:
        names = []
        while frame is not None:
            code = frame.f_code
            names.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")
            frame = frame.f_back
        stacks[";".join(reversed(names))] += 1

    signal.signal(signal.SIGPROF, on_prof)
    signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        Path(out).write_text(json.dumps(stacks.most_common()))


def breakdown(stacks: list[tuple[str, int]]) -> dict[str, int]:
    """Samples taken while serving (not importing or starting), by where they fell."""
    out: collections.Counter = collections.Counter()
    for stack, n in stacks:
        frames = stack.split(";")
        if "cli.py:serve" in frames or not any(f.endswith(":run") for f in frames):
            continue  # start-up, shutdown
        if frames[-1].endswith("runners.py:run"):
            out["event loop C code and kernel"] += n
            continue
        out[next((g for f, g in _GROUPS if f in frames), "other")] += n
    return dict(out.most_common())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--requests", type=int, default=480, help="multiturn requests (32 clients' worth per 160)"
    )
    ap.add_argument("--first-s", type=float, default=0.08, help="the fakes' time to the first token")
    ap.add_argument("--token-s", type=float, default=0.01, help="the fakes' time between tokens")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per answer (one SSE event each)")
    ap.add_argument("--no-tokenizer", action="store_true", help="byte keys instead of the engine's tokenizer")
    ap.add_argument("--sample", action="store_true", help="sample the router's CPU time (module docstring)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--fake-vllm", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--sampled", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fake_vllm is not None:
        fake_vllm(args.fake_vllm, args.first_s, args.token_s, args.tokens)
        return 0
    if args.sampled:
        sampled(args.sampled[0], args.sampled[1], args.sampled[2:])
        return 0
    if args.requests < 5 or args.requests % 5:
        print("router_cpu: error: --requests must be a positive multiple of 5", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="radixfleet-router-cpu-"))
    ports = [free_port(), free_port()]
    pace = ["--first-s", str(args.first_s), "--token-s", str(args.token_s), "--tokens", str(args.tokens)]
    fakes = [
        Proc(
            [sys.executable, __file__, "--fake-vllm", str(p), *pace], ready_url=f"http://127.0.0.1:{p}/health"
        )
        for p in ports
    ]

    class _Server:  # what router_config reads of a server
        def __init__(self, port: int) -> None:
            self.url = f"http://127.0.0.1:{port}"

    port = free_port()
    cfg = router_config(
        port,
        [_Server(p) for p in ports],
        tiny_model(),
        policy="prefix_load",
        tokenizer=not args.no_tokenizer,
        events=False,
    )
    (tmp / "router.yaml").write_text(json.dumps(cfg))
    argv_router = radixfleet_argv("router", "--config", str(tmp / "router.yaml"))
    stacks_file = tmp / "stacks.json"
    if args.sample:
        argv_router = [sys.executable, __file__, "--sampled", str(stacks_file), *argv_router[2:]]
    try:
        for f in fakes:
            f.__enter__()
        router = Proc(argv_router, ready_url=f"http://127.0.0.1:{port}/readiness", timeout_s=120).__enter__()
        try:
            time.sleep(1.0)  # the first scrapes and health checks are in
            pid = router.proc.pid
            cpu0, t0 = cpu_s(pid), time.monotonic()
            clients = args.requests // 5
            lt = radixfleet_argv(
                "loadtest",
                "--target",
                f"router=http://127.0.0.1:{port}",
                "--workload",
                "multiturn",
                *("-o", f"clients={clients}", "-o", "rounds=5", "-o", "question_tokens=128"),
                *("-o", f"output_tokens={args.tokens}", "-o", "api=chat", "--concurrency", "8"),
                *("--requests", str(args.requests), "--duration", "900", "--model", "tiny"),
                *("--no-progress", "--json", str(tmp / "lt.json")),
            )
            res = subprocess.run(lt, stdout=subprocess.DEVNULL, timeout=900)
            cpu, wall = cpu_s(pid) - cpu0, time.monotonic() - t0
        finally:
            router.stop()
    finally:
        for f in fakes:
            f.stop()
    if res.returncode != 0:
        print(f"router_cpu: the load generator failed (exit {res.returncode})", file=sys.stderr)
        return 1
    ok = json.loads((tmp / "lt.json").read_text())["runs"][0]["requests"]
    doc: dict = {
        "requests": ok,
        "req_per_s": round(ok / wall, 1),
        "router_cpu_ms_per_request": round(1000 * cpu / max(1, ok), 3),
        "load_average": os.getloadavg()[0],
    }
    print(
        f"router CPU {doc['router_cpu_ms_per_request']:.2f} ms a request "
        f"({ok} requests, {doc['req_per_s']} req/s, load average {doc['load_average']:.2f})"
    )
    if args.sample and stacks_file.exists():
        parts = breakdown(json.loads(stacks_file.read_text()))
        total = sum(parts.values()) or 1
        doc["samples"] = parts
        for name, n in parts.items():
            print(f"  {n / total:6.1%}  {name}  ({n} samples)")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
