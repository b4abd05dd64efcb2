"""The hit rate a partitioned fleet can reach on a trace, against one pooled cache.

    python3 bench/partition_bound.py TRACE [TRACE ...] --workers 8 --kv-tokens 32000 [--json OUT]

``pooled_hit_rate`` (the simulator's and the load generator's reference) is one LRU
cache of the whole fleet's KV: it packs every prefix into one space. A fleet of W
workers holds W caches of ``kv_tokens`` each, and a prefix lives in one of them, so
each worker holds whole prefixes plus a fragment of one, and the hottest prefixes are
spread over the workers by however they were placed. This replays the trace (a
Mooncake-format JSONL: ``hash_ids`` of ``--block-tokens`` blocks, ``input_length``)
through W per-worker LRU caches with every tenant — the requests sharing a first
block — always on the same worker, no copies and no load balancing, placed two ways:

    lpt     the tenants by request count, each onto the worker with the fewest
            requests so far (longest-processing-time-first: balanced popularity)
    modulo  tenant number (order of first appearance) modulo W

and prints each one's hit rate against the pooled cache's. No router does better
than the best placement without copying prefixes, so where these fall short of a
target fraction of pooled, the target is the trace's, not the routing's
(bench/RESULTS.md, "Past saturation"). Every request is replayed (none shed).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from radixfleet_tools.loadtest.simulator.reference import BlockReference


def _replay(recs: list[tuple[list[int], int]], caps: list[int], worker_of: list[int], bt: int) -> float:
    refs = [BlockReference(c, bt, oracle=False) for c in caps]
    cached = total = 0
    for (ids, n), w in zip(recs, worker_of):
        p, _, c = refs[w].observe(ids, n, n - bt * (len(ids) - 1))
        cached += c
        total += p
    return cached / total if total else 0.0


def bound(path: str, workers: int, kv_tokens: int, block_tokens: int) -> dict:
    """Pooled, lpt and modulo hit rates of one trace file (module docstring)."""
    recs: list[tuple[list[int], int]] = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ids, n = [int(x) for x in r["hash_ids"]], int(r["input_length"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{i}: not a trace line with hash_ids and input_length ({exc})"
                ) from None
            if not ids or n <= 0:
                raise ValueError(f"{path}:{i}: empty hash_ids or input_length <= 0")
            recs.append((ids, n))
    if not recs:
        raise ValueError(f"{path}: no requests")
    tenant: dict[int, int] = {}
    of = [tenant.setdefault(ids[0], len(tenant)) for ids, _ in recs]
    counts = collections.Counter(of)
    load = [0] * workers
    lpt: dict[int, int] = {}
    for t, c in sorted(counts.items(), key=lambda x: (-x[1], x[0])):
        w = min(range(workers), key=lambda i: (load[i], i))
        lpt[t] = w
        load[w] += c
    pooled = _replay(recs, [workers * kv_tokens], [0] * len(recs), block_tokens)
    out = {"trace": path, "requests": len(recs), "tenants": len(tenant), "pooled_hit_rate": pooled}
    for name, place in (("lpt", [lpt[t] for t in of]), ("modulo", [t % workers for t in of])):
        hit = _replay(recs, [kv_tokens] * workers, place, block_tokens)
        out[f"{name}_hit_rate"] = hit
        out[f"{name}_x_pooled"] = hit / pooled if pooled else 0.0
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", metavar="TRACE")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=32000, help="KV tokens per worker")
    ap.add_argument("--block-tokens", type=int, default=512, help="tokens per hash_ids block (Mooncake: 512)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    for name in ("workers", "kv_tokens", "block_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    rows = []
    for path in args.traces:
        try:
            rows.append(bound(path, args.workers, args.kv_tokens, args.block_tokens))
        except (OSError, ValueError) as exc:
            print(f"partition_bound: {exc}", file=sys.stderr)
            return 2
    for r in rows:
        print(
            f"{r['trace']}: {r['requests']} requests, {r['tenants']} tenants; "
            f"pooled {r['pooled_hit_rate']:.3f}, lpt {r['lpt_hit_rate']:.3f} ({r['lpt_x_pooled']:.3f}x), "
            f"modulo {r['modulo_hit_rate']:.3f} ({r['modulo_x_pooled']:.3f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": args.workers, "kv_tokens": args.kv_tokens, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
