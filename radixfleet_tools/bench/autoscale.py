"""``radixfleet bench autoscale``: prefix-aware vs queue-depth autoscaling on a flash crowd.

The simulator's closed loop (``radixfleet_tools.loadtest.simulator.scaling_loop``): llama-3-8b workers
on H100s behind prefix_load, starting from 2; steady traffic behind 4 system
prompts, then a crowd onto a new 16k-token document ramps to ``--flash-rate``
req/s over ``--ramp`` s, holds, ramps down. Every rule runs the same trace and seed
with the same controller (5 s ticks, ``--startup`` s before a new worker serves,
scale-up at most max(4, 100%) per 15 s, scale-down after a 60 s window, at most
``--max-workers``). Printed per rule: TTFT p50/p99 against ``--slo-ms``,
worker-seconds, peak workers; and a fixed fleet at the prefix-aware rule's peak
for reference. Target: the prefix-aware rule meets the SLO with fewer
worker-seconds than the queue-depth rule.
"""

from __future__ import annotations

import argparse
import json
import time

from radixfleet_tools.loadtest.simulator.scaling_loop import FlashCrowd, default_rules, run_flash_crowd


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--slo-ms", type=float, default=2000.0, help="TTFT p99 SLO (default 2000)")
    parser.add_argument("--startup", type=float, default=30.0, help="worker start-up delay, s")
    parser.add_argument("--flash-rate", type=float, default=150.0, help="crowd peak, req/s")
    parser.add_argument("--base-rate", type=float, default=12.0, help="baseline req/s")
    parser.add_argument("--ramp", type=float, default=120.0, help="crowd ramp, s")
    parser.add_argument("--hold", type=float, default=120.0, help="crowd at its peak, s")
    parser.add_argument("--max-workers", type=int, default=64, help="the autoscaler's ceiling")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--no-fixed", action="store_true", help="skip the fixed-fleet row")


def run(args: argparse.Namespace) -> int:
    duration = 90.0 + 2 * args.ramp + args.hold + 30.0
    crowd = FlashCrowd(
        seed=args.seed,
        base_rate=args.base_rate,
        flash_rate=args.flash_rate,
        ramp_s=args.ramp,
        hold_s=args.hold,
        duration_s=duration,
    )
    rows = []
    for sc in default_rules(startup_s=args.startup, max_workers=args.max_workers):
        t = time.perf_counter()
        r = run_flash_crowd(sc, crowd, workers=2, slo_ms=args.slo_ms, seed=args.seed)
        r["wall_s"] = time.perf_counter() - t
        rows.append(r)
    if not args.no_fixed:
        peak = rows[0]["peak_workers"]
        t = time.perf_counter()
        r = run_flash_crowd(None, crowd, workers=peak, slo_ms=args.slo_ms, seed=args.seed)
        r["wall_s"] = time.perf_counter() - t
        rows.append(r)
    if args.json:
        print(
            json.dumps(
                {
                    "crowd": rows[0]["crowd"],
                    "startup_s": args.startup,
                    "rows": [{k: v for k, v in r.items() if k not in ("sim", "crowd")} for r in rows],
                },
                indent=1,
            )
        )
        return 0
    print(
        f"flash crowd: {rows[0]['requests']:,} requests over {duration:.0f} s "
        f"(baseline {args.base_rate:g} req/s; a 16k-token prefix ramps to "
        f"{args.flash_rate:g} req/s in {args.ramp:g} s, holds {args.hold:g} s); "
        f"llama-3-8b on h100, prefix_load, start-up {args.startup:g} s, same seed"
    )
    print(
        f"{'rule':44s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'SLO':>5s} {'worker-s':>9s} "
        f"{'peak':>5s} {'joins':>6s} {'hit':>6s}"
    )
    for r in rows:
        print(
            f"{r['rule']:44s} {r['ttft_p50_ms']:7.0f}ms {r['ttft_p99_ms']:7.0f}ms "
            f"{'met' if r['slo_met'] else 'MISS':>5s} {r['worker_seconds']:9.0f} "
            f"{r['peak_workers']:5d} {r['joins']:6d} {r['hit_rate']:6.3f}"
        )
    print(f"SLO: TTFT p99 <= {args.slo_ms:g} ms over every request of the run")
    return 0
