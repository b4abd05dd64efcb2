"""``radixfleet bench loadgen``: what the load generator itself adds to what it measures.

One fast OpenAI-compatible stub (``wire.LeanUpstream`` in its own process: a
streamed completion of ``--tokens`` events, the first ``--ttft-ms`` after the
request, the next ``--itl-ms`` apart, on timers) is driven at each of ``--rates``
by two clients in turn, each in its own process, with the same offered arrivals
(Poisson, seeded: the k-th request is due at the k-th event of
``radixfleet_tools.loadtest.arrivals.Poisson(rate).gap`` drawn from ``Random(seed ^ 0x5EED)``, the
schedule ``radixfleet loadtest --seed S`` draws):

    loadtest   ``radixfleet loadtest --dataset random --rate R --requests N``, the
               command as users run it; its figures read from ``--requests-out``
    lean       a minimal client (``python -m radixfleet_tools.bench.loadgen lean-client``):
               a keep-alive connection pool on ``wire.LeanClient`` (httptools, no
               aiohttp), a plain asyncio loop, a task per request; TTFT is the first
               SSE bytes, E2E the end of the response, both from before the send
               (a new connection's connect included, as loadtest's)

Each client runs ``--rounds`` times per rate (``--duration`` seconds of arrivals
each), the order alternating so that the machine's drift hits both alike; a
client's figures pool its rounds' requests. Per rate and client: TTFT and E2E
p50/p99 (ms), errors, **dispatch lag** (a request's
send time minus its scheduled time, ms, p50/p99, the schedule aligned so that the
earliest send is on time) and **client CPU** per request (the
process's user + system CPU, less what the same command spends on a one-request run:
its start-up and report), and the CPU share of one core over the run.

Verdicts per rate:

    sustains   every request answered, in every round the last request sent within
               5% of the schedule's span of its due time (the rate held), and TTFT
               p50 within 1.25x the stub's (answers read as fast as they come:
               beyond, the client, the stub or the host is saturated)
    agrees     loadtest's TTFT p50 and p99 each within ``--tolerance`` (default 5%)
               of the lean client's at that rate

Overhead: loadtest's TTFT and E2E p50/p99 minus the lean client's; the lean
client's own TTFT p50 minus ``--ttft-ms`` is what the wire and a client cost at all.
The summary names the highest rate loadtest sustains and agrees at, and the highest
the lean client sustains. The host is shared: run it on an idle machine for figures
to quote, and read a single disagreeing rate among agreeing ones as noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

from radixfleet.wire.errors import RunError
from radixfleet_tools.bench.wire import LeanClient, LeanUpstream, post_request
from radixfleet_tools.loadtest.arrivals import Poisson
from radixfleet_tools.loadtest.local_fleet import Child, cli_argv, free_port
from radixfleet_tools.loadtest.report import percentile


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON (every rate, both clients)")
    parser.add_argument(
        "--rates",
        default="25,50,100,200,400,800,1600",
        help="offered requests/s, comma-separated (default 25,50,...,1600: doubling)",
    )
    parser.add_argument(
        "--duration", type=float, default=6.0, help="seconds of arrivals per rate (default 6)"
    )
    parser.add_argument(
        "--ttft-ms", type=float, default=50.0, help="the stub's time to first token (default 50)"
    )
    parser.add_argument("--itl-ms", type=float, default=5.0, help="the stub's inter-token gap (default 5)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer (default 16)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument(
        "--tolerance", type=float, default=0.05, help="agreement bound on TTFT p50/p99 (default 0.05)"
    )
    parser.add_argument("--seed", type=int, default=0, help="arrival seed (default 0)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of each client per rate, order alternating (default 2)"
    )


# ---------------------------------------------------------------- the schedule


def schedule(rate: float, n: int, seed: int) -> list[float]:
    """The offered arrivals: seconds from the start of the k-th request, as the
    load generator's driver draws them for ``--rate rate --seed seed``."""
    rng = random.Random(seed ^ 0x5EED)
    p = Poisson(rate)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += p.gap(rng)
    return out


# ---------------------------------------------------------------- the lean client


class _TimedClient(LeanClient):
    """``LeanClient`` that notes when the first body bytes of an answer arrive."""

    first: float | None = None

    def on_body(self, body: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        super().on_body(body)


async def _lean_run(port: int, rate: float, n: int, seed: int, tokens: int, input_len: int) -> dict:
    raw = post_request(
        "127.0.0.1",
        port,
        "/v1/completions",
        {"model": "tiny", "prompt": "x " * input_len, "max_tokens": tokens, "stream": True},
    )
    due = schedule(rate, n, seed)
    idle: list[_TimedClient] = []
    rows: list[dict] = []

    async def one(send_s: float, t0: float) -> None:
        row: dict = {"send_s": send_s, "ok": False, "ttft_ms": None, "e2e_ms": None}
        rows.append(row)
        try:
            c = idle.pop() if idle else await _TimedClient.connect("127.0.0.1", port)
            c.first = None
            a = await c.request(raw)
        except (ConnectionError, OSError) as exc:
            row["error"] = str(exc)
            return
        end = time.perf_counter()
        idle.append(c)
        row["ok"] = a.status == 200 and a.done and a.events == tokens + 1
        row["ttft_ms"] = (c.first - t0) * 1000.0 if c.first is not None else None
        row["e2e_ms"] = (end - t0) * 1000.0

    tasks = []
    start = time.perf_counter()
    for d in due:
        wait = start + d - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        t0 = time.perf_counter()
        tasks.append(asyncio.create_task(one(t0 - start, t0)))
    await asyncio.gather(*tasks)
    for c in idle:
        c.close()
    return {"rows": rows}


def lean_client(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="radixfleet_tools.bench.loadgen lean-client")
    for flag, typ in (("--port", int), ("--rate", float), ("--requests", int), ("--seed", int)):
        p.add_argument(flag, type=typ, required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    a = p.parse_args(argv)
    res = asyncio.run(_lean_run(a.port, a.rate, a.requests, a.seed, a.tokens, a.input_len))
    json.dump(res, sys.stdout)
    return 0


def serve_stub(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="radixfleet_tools.bench.loadgen upstream")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    a = p.parse_args(argv)

    async def serve() -> None:
        up = LeanUpstream(a.tokens, first_s=a.ttft_ms / 1000.0, gap_s=a.itl_ms / 1000.0)
        await up.start(a.port)
        await asyncio.Event().wait()  # until SIGTERM (Child.stop)

    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as r:
        r.run(serve())
    return 0


# ---------------------------------------------------------------- the benchmark


def _child_cpu(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``argv`` to its end; (its result, the CPU seconds it used)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _lean_argv(port: int, rate: float, n: int, args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "radixfleet_tools.bench.loadgen",
        "lean-client",
        "--port",
        str(port),
        "--rate",
        repr(rate),
        "--requests",
        str(n),
        "--seed",
        str(args.seed),
        "--tokens",
        str(args.tokens),
        "--input-len",
        str(args.input_len),
    ]


def _loadtest_argv(url: str, rate: float, n: int, args, out: str) -> list[str]:
    return cli_argv(
        "loadtest",
        "--target",
        f"stub={url}",
        "--dataset",
        "random",
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.tokens),
        "--rate",
        repr(rate),
        "--requests",
        str(n),
        "--seed",
        str(args.seed),
        "--requests-out",
        out,
        "--no-progress",
        "--max-failures",
        "1",
        "--drain",
        "10",
    )


def _lean_rows(port: int, rate: float, n: int, args) -> tuple[list[dict], float]:
    proc, cpu = _child_cpu(_lean_argv(port, rate, n, args))
    if proc.returncode != 0:
        raise RunError(f"the lean client failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)["rows"], cpu


def _loadtest_rows(url: str, rate: float, n: int, args, tmp: str) -> tuple[list[dict], float]:
    out = os.path.join(tmp, f"requests-{rate:g}-{n}.jsonl")
    proc, cpu = _child_cpu(_loadtest_argv(url, rate, n, args, out))
    if proc.returncode not in (0, 1) or not os.path.exists(out):  # 1: failures (counted below)
        raise RunError(f"radixfleet loadtest failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    with open(out, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows, cpu


def _point(
    runs: list[tuple[list[dict], float]], startup_cpu_s: float, rate: float, seed: int, stub_ttft_ms: float
) -> dict:
    """One client's figures at one rate over its rounds ``(rows, cpu_s)``, pooled
    (module docstring)."""
    lags, ttft, e2e = [], [], []
    n = ok = 0
    run_cpu = wall_s = 0.0
    sustains = bool(runs)
    for rows, cpu_s in runs:
        rows = sorted(rows, key=lambda r: r["send_s"])
        due = schedule(rate, len(rows), seed)
        # the schedule placed where the client ran it: its earliest send relative to
        # its due time is lag 0 (a first request timed late must not hide the others')
        t0 = min((r["send_s"] - d for r, d in zip(rows, due, strict=True)), default=0.0)
        lag = [((r["send_s"] - t0) - d) * 1000.0 for r, d in zip(rows, due, strict=True)]
        good = [r for r in rows if r["ok"]]
        lags += lag
        ttft += [r["ttft_ms"] for r in good if r["ttft_ms"] is not None]
        e2e += [r["e2e_ms"] for r in good if r["e2e_ms"] is not None]
        n += len(rows)
        ok += len(good)
        run_cpu += max(0.0, cpu_s - startup_cpu_s)
        if rows:
            first = rows[0]["send_s"]
            wall_s += max(r["send_s"] - first + (r["e2e_ms"] or 0) / 1000.0 for r in rows)
        span_s = due[-1] if due else 0.0
        last_lag_s = lag[-1] / 1000.0 if lag else 0.0
        sustains = sustains and bool(rows) and len(good) == len(rows) and last_lag_s <= 0.05 * span_s

    def pct(xs, q):
        v = percentile(xs, q / 100.0)
        return None if v is None else round(v, 3)

    p50 = pct(ttft, 50)
    sustains = sustains and p50 is not None and p50 <= 1.25 * stub_ttft_ms

    return {
        "requests": n,
        "errors": n - ok,
        "ttft_ms": {"p50": p50, "p99": pct(ttft, 99)},
        "e2e_ms": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
        "lag_ms": {"p50": pct(lags, 50), "p99": pct(lags, 99)},
        "cpu_ms_per_request": round(run_cpu * 1000.0 / n, 3) if n else None,
        "cpu_share": round(run_cpu / wall_s, 3) if wall_s else None,
        "sustains": sustains,
    }


def _within(a: float | None, b: float | None, tol: float) -> bool:
    return a is not None and b is not None and abs(a - b) <= tol * b


def run(args: argparse.Namespace) -> int:
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        print(f"radixfleet bench loadgen: --rates {args.rates!r}: give numbers, e.g. 50,100", file=sys.stderr)
        return 2
    if not rates or any(not r > 0 for r in rates) or args.duration <= 0 or args.tokens < 1 or args.rounds < 1:
        print(
            "radixfleet bench loadgen: --rates, --duration, --tokens, --rounds must be > 0", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="rf-bench-loadgen-") as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        stub = Child(
            "stub",
            [
                sys.executable,
                "-m",
                "radixfleet_tools.bench.loadgen",
                "upstream",
                "--port",
                str(port),
                "--tokens",
                str(args.tokens),
                "--ttft-ms",
                repr(args.ttft_ms),
                "--itl-ms",
                repr(args.itl_ms),
            ],
            os.path.join(tmp, "stub.log"),
            url + "/health",
        )
        stub.start()
        try:
            stub.wait_ready(20.0)
            # what each command costs to start and report, on one request
            _, lean_startup = _lean_rows(port, rates[0], 1, args)
            _, lt_startup = _loadtest_rows(url, rates[0], 1, args, tmp)
            points: list[dict] = []
            for rate in rates:
                n = max(20, int(rate * args.duration))
                lean_runs, lt_runs = [], []
                for r in range(args.rounds):  # alternating order: drift hits both alike
                    if r % 2 == 0:
                        lean_runs.append(_lean_rows(port, rate, n, args))
                    lt_runs.append(_loadtest_rows(url, rate, n, args, tmp))
                    if r % 2 == 1:
                        lean_runs.append(_lean_rows(port, rate, n, args))
                lean = _point(lean_runs, lean_startup, rate, args.seed, args.ttft_ms)
                lt = _point(lt_runs, lt_startup, rate, args.seed, args.ttft_ms)
                lt["agrees"] = all(
                    _within(lt["ttft_ms"][q], lean["ttft_ms"][q], args.tolerance) for q in ("p50", "p99")
                )
                overhead = {
                    f"{m}_{q}": _diff(lt[m][q], lean[m][q])
                    for m in ("ttft_ms", "e2e_ms")
                    for q in ("p50", "p99")
                }
                points.append({"rate": rate, "lean": lean, "loadtest": lt, "overhead_ms": overhead})
                if not args.json:
                    _print_point(points[-1])
        finally:
            stub.stop()
    res = {
        "stub": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "tokens": args.tokens},
        "duration_s": args.duration,
        "rounds": args.rounds,
        "tolerance": args.tolerance,
        "startup_cpu_s": {"lean": round(lean_startup, 3), "loadtest": round(lt_startup, 3)},
        "points": points,
        "loadtest_max_rate": max(
            (p["rate"] for p in points if p["loadtest"]["sustains"] and p["loadtest"]["agrees"]), default=None
        ),
        "lean_max_rate": max((p["rate"] for p in points if p["lean"]["sustains"]), default=None),
    }
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(
            f"stub TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms, {args.tokens} tokens; "
            f"start-up CPU: loadtest {lt_startup:.2f} s, lean {lean_startup:.2f} s (left out of CPU/request)"
        )
        print(
            f"highest rate loadtest sustains with TTFT p50/p99 within {args.tolerance:.0%} of the lean "
            f"client's: {_rate(res['loadtest_max_rate'])}; highest the lean client sustains: "
            f"{_rate(res['lean_max_rate'])} (of {', '.join(f'{r:g}' for r in rates)} req/s)"
        )
    return 0


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _rate(r: float | None) -> str:
    return "none" if r is None else f"{r:g} req/s"


def _f(v: float | None, spec: str = "8.2f") -> str:
    return "-" if v is None else format(v, spec)


def _print_point(p: dict) -> None:
    for name in ("lean", "loadtest"):
        x = p[name]
        verdict = "sustains" if x["sustains"] else "FALLS BEHIND"
        if name == "loadtest":
            verdict += ", agrees" if x["agrees"] else ", DISAGREES"
        print(
            f"{p['rate']:>7g} req/s {name:<8}"
            f"  TTFT p50 {_f(x['ttft_ms']['p50'])} p99 {_f(x['ttft_ms']['p99'])}"
            f"  E2E p50 {_f(x['e2e_ms']['p50'])} p99 {_f(x['e2e_ms']['p99'])} ms"
            f"  lag p99 {_f(x['lag_ms']['p99'], '7.2f')} ms  CPU {_f(x['cpu_ms_per_request'], '.3f')} ms/req"
            f" ({_f(x['cpu_share'], '.0%')} of a core)  errors {x['errors']}  {verdict}"
        )
    o = p["overhead_ms"]
    print(
        f"{'':>13} overhead  TTFT p50 {_f(o['ttft_ms_p50'], '+.2f')} p99 {_f(o['ttft_ms_p99'], '+.2f')}"
        f"  E2E p50 {_f(o['e2e_ms_p50'], '+.2f')} p99 {_f(o['e2e_ms_p99'], '+.2f')} ms"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m radixfleet_tools.bench.loadgen upstream|lean-client ...``: the
    benchmark's stub server and its minimal client, each in its own process."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["upstream"]:
        return serve_stub(argv[1:])
    if argv[:1] == ["lean-client"]:
        return lean_client(argv[1:])
    print("usage: python -m radixfleet_tools.bench.loadgen upstream|lean-client ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
