"""``radixfleet simulate`` at several seeds, its TTFTs pooled per arm.

A tail percentile of one short run is one or two requests (the p99 of the demo's 128
is its second slowest), so which arm has the lower p99 changes with the seed for
reasons that are not the arms'. This runs the same simulation at each seed and
reports, per arm (policy, feedback, index tiers), the percentiles of every request's
TTFT over all seeds together, the mean hit rate, and each seed's own p99:

    python3 bench/sim_seeds.py --seeds 0-9 [--json OUT] -- SIMULATE_FLAGS...

e.g. the agent workload with a DRAM tier, priced against ignored against as-GPU
(bench/RESULTS.md, "Routing on the DRAM tier"):

    python3 bench/sim_seeds.py --seeds 0-9 -- --agents 4 --workload agent \\
        --policies prefix_load --dram-tokens 4x --index-tiers priced,ignore,as_gpu

``--seed`` and ``--json`` among the simulate flags are this script's to set.
"""

from __future__ import annotations

import argparse
import json
import sys

from radixfleet.wire.errors import RadixfleetError
from radixfleet_tools.loadtest.report import percentile
from radixfleet_tools.loadtest.simulator import cli as sim_cli


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: use N, N-M or a comma list of them") from None
        if b < a:
            raise argparse.ArgumentTypeError(f"{part!r}: the range is empty")
        out.extend(range(a, b + 1))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=_seeds, default=list(range(10)), help="N, N-M or a list (default 0-9)")
    ap.add_argument("--json", help="write the pooled figures here")
    ap.add_argument("simulate", nargs=argparse.REMAINDER, help="-- then radixfleet simulate's flags")
    args = ap.parse_args(argv)
    flags = args.simulate[1:] if args.simulate[:1] == ["--"] else args.simulate
    if any(f in ("--seed", "--json") or f.startswith(("--seed=", "--json=")) for f in flags):
        ap.error("--seed and --json are set by this script; leave them out of the simulate flags")
    sp = argparse.ArgumentParser(prog="simulate")
    sim_cli.configure(sp)
    ttfts: dict[str, list[float]] = {}
    hits: dict[str, list[float]] = {}
    p99s: dict[str, list[float | None]] = {}
    for seed in args.seeds:
        sa = sp.parse_args([*flags, "--seed", str(seed)])
        try:
            plans, workload, bounds, params = sim_cli.build(sa)
        except (RadixfleetError, ValueError) as exc:  # a flag's value, named
            print(f"sim_seeds: {exc}", file=sys.stderr)
            return 2
        for out in sim_cli.simulate(plans, workload, bounds, params, seed=seed, jobs=1):
            name = out.report["name"]
            ttfts.setdefault(name, []).extend(out.ttft_ms)
            hits.setdefault(name, []).append(out.report["hit_rate"])
            p99s.setdefault(name, []).append(percentile(out.ttft_ms, 0.99))
    rows = []
    for name, xs in ttfts.items():
        xs.sort()
        rows.append(
            {
                "arm": name,
                "requests": len(xs),
                "hit_rate_mean": sum(hits[name]) / len(hits[name]),
                **{f"ttft_p{q:g}_ms": percentile(xs, q / 100, presorted=True) for q in (50, 90, 99, 99.9)},
                "ttft_max_ms": xs[-1] if xs else None,
                "ttft_mean_ms": sum(xs) / len(xs) if xs else None,
                "p99_per_seed_ms": p99s[name],
            }
        )
    print(f"seeds {args.seeds[0]}..{args.seeds[-1]} ({len(args.seeds)}), TTFT ms over all their requests")
    print(f"{'arm':<36} {'n':>6} {'hit':>6} {'p50':>7} {'p90':>7} {'p99':>7} {'p99.9':>7} {'max':>7}")
    cols = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_p99.9_ms", "ttft_max_ms")
    for r in rows:
        figures = " ".join(f"{r[k]:>7.1f}" for k in cols)
        print(f"{r['arm']:<36} {r['requests']:>6} {r['hit_rate_mean']:>6.3f} {figures}")
        print(f"{'':<36} p99 per seed: " + " ".join(f"{x:.0f}" for x in r["p99_per_seed_ms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": args.seeds, "simulate": flags, "arms": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
