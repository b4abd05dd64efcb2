"""``radixfleet bench traffic_log``: routing p99 with the traffic log on vs off.

Per request, the router's whole routing work (as ``bench routing``): ``request_key``
(canonical bytes, hashes), ``index.match``, ``pool.views``, ``policy.choose``,
``index.insert``, ``pool.pick`` — and, with the log on, ``TrafficLog.record`` of the
request as it finishes. The log's writer thread runs meanwhile in the same process,
encoding and writing to a real directory, so its share of the GIL is in the figure.
Requests arrive paced (``--rate``, default 2,000/s: the process sleeps between them
as a router's event loop waits on its sockets) or back to back (``--rate 0``: the
writer never finds the process idle, the CPU-saturated worst case), in alternating
rounds of off and on so that the machine's drift hits both alike; figures are the
median over rounds of each round's mean, p50, p99.

Target: routing p99 with the log on <= 1.1 x off. Also printed: records
written and dropped, bytes per line, and the writer's lag at the end of a round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from radixfleet.config import TrafficLogConfig, build_policy_from, parse_config
from radixfleet.fleet.pool import HealthState, Pool
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import Endpoint, request_key
from radixfleet.policies.base import RouteRequest
from radixfleet.server.traffic_log import TrafficLog
from radixfleet_tools.bench.routing import _bodies


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--requests", type=int, default=5_000, help="per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each (off, on)")
    parser.add_argument("--workers", type=int, default=16, help="routable workers")
    parser.add_argument("--prompt-bytes", type=int, default=8192, help="bytes per prompt")
    parser.add_argument("--policy", default="prefix_load", help="the routing policy")
    parser.add_argument(
        "--rate",
        type=float,
        default=2000.0,
        help="requests/s offered (0: back to back, the CPU-saturated worst case; default 2000)",
    )
    parser.add_argument("--dir", help="log directory (default: a temporary one)")


def _round(bodies, policy_name: str, workers: int, tl: TrafficLog | None, rate: float) -> list[float]:
    cfg = parse_config(
        {
            "workers": [{"url": f"http://10.0.0.{i}:1", "id": f"w{i}"} for i in range(workers)],
            "policy": {"name": policy_name},
        }
    )
    policy = build_policy_from(cfg.policy)
    index = PrefixIndex()
    pool = Pool(cfg, index)
    for w in pool:
        pool._set_health(w, HealthState.HEALTHY)
    bb = cfg.keys.block_bytes
    perf = time.perf_counter
    now0 = time.monotonic()
    wall0 = time.time()
    lat = []
    in_flight = []
    gap = 1.0 / rate if rate > 0 else 0.0
    due = perf()
    for i, body in enumerate(bodies):
        if gap:
            # paced arrivals: the process waits between requests as a router's event
            # loop waits on its sockets (sleeping releases the GIL)
            due += gap
            pause = due - perf()
            if pause > 0:
                time.sleep(pause)
        t0 = perf()
        now = now0 + i * 1e-3
        key = request_key(Endpoint.CHAT, body, tenant="tenant-a", block_bytes=bb)
        match = index.match(key.hashes, now)
        views = pool.views(now)
        d = policy.choose(
            RouteRequest(key.hashes, key.prompt_tokens, key.block_tokens, None, key.model, len(key.data)),
            match,
            views,
            now,
        )
        w = pool.get(d.worker)
        assert w is not None, "the policy picks from the pool's views"
        index.insert(w.id, key.hashes, now)
        tokens = max(0, key.prompt_tokens - d.matched_blocks * key.block_tokens)
        pool.pick(w, tokens)
        if tl is not None:
            tl.record(
                key,
                arrival_s=wall0 + i * 1e-3,
                worker=w.id,
                matched_tokens=d.matched_blocks * key.block_tokens,
                prompt_tokens=key.prompt_tokens,
                output_tokens=64,
                cached_tokens=d.matched_blocks * key.block_tokens,
                ttft_s=0.05,
                session=None,
            )
        lat.append(perf() - t0)
        in_flight.append((w, tokens))
        if len(in_flight) > 32:
            fw, ft = in_flight.pop(0)
            pool.finish(fw, ft, True, ft)
    return lat


def _stats(lat: list[float]) -> dict:
    s = sorted(lat)
    n = len(s)
    return {
        "mean_us": sum(s) / n * 1e6,
        "p50_us": s[n // 2] * 1e6,
        "p99_us": s[min(n - 1, int(n * 0.99))] * 1e6,
    }


def run(args: argparse.Namespace) -> int:
    bodies = _bodies(args.requests, args.prompt_bytes, random.Random(0))
    d = args.dir or tempfile.mkdtemp(prefix="radixfleet-traffic-")
    cfg = TrafficLogConfig(enabled=True, dir=d, flush_interval_s=0.1)
    tl = TrafficLog(cfg, key=b"bench")
    tl.start()
    off, on, lag = [], [], []
    try:
        for _ in range(args.rounds):
            off.append(_stats(_round(bodies, args.policy, args.workers, None, args.rate)))
            on.append(_stats(_round(bodies, args.policy, args.workers, tl, args.rate)))
            lag.append(tl.stats().queued)
    finally:
        tl.close()
    st = tl.stats()

    def med(rows, k):
        return statistics.median(r[k] for r in rows)

    res = {
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "prompt_bytes": args.prompt_bytes,
        "workers": args.workers,
        "policy": args.policy,
        "rate": args.rate,
        "off": {k: med(off, k) for k in ("mean_us", "p50_us", "p99_us")},
        "on": {k: med(on, k) for k in ("mean_us", "p50_us", "p99_us")},
        "written": st.written,
        "dropped_full": st.dropped_full,
        "dropped_error": st.dropped_error,
        "bytes_per_line": st.bytes_written / max(1, st.written),
        "max_queue_at_round_end": max(lag),
        "dir": d,
    }
    res["p99_ratio"] = res["on"]["p99_us"] / res["off"]["p99_us"]
    res["mean_ratio"] = res["on"]["mean_us"] / res["off"]["mean_us"]
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    pace = f"{args.rate:g} req/s" if args.rate > 0 else "back to back"
    print(
        f"routing with the traffic log off vs on: {args.prompt_bytes} B chat prompts, "
        f"{args.workers} workers, {args.policy}, {pace}, {args.rounds} x {args.requests} "
        "requests each"
    )
    for name in ("off", "on"):
        r = res[name]
        print(
            f"  log {name:3s}  mean {r['mean_us']:6.1f} us  p50 {r['p50_us']:6.1f} us  "
            f"p99 {r['p99_us']:6.1f} us"
        )
    print(
        f"  p99 on/off {res['p99_ratio']:.3f} (target <= 1.1), mean on/off "
        f"{res['mean_ratio']:.3f}; {st.written} lines written ({res['bytes_per_line']:.0f} B "
        f"each), {st.dropped_full} dropped, writer queue at round ends <= "
        f"{res['max_queue_at_round_end']}"
    )
    return 0
