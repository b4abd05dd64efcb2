"""``radixfleet bench policy``: the cost of one policy decision with 16 workers.

Only ``policy.choose`` is timed — no HTTP, keying or index work (``bench routing``
measures those together). Inputs are prepared ahead: a seeded pool of requests
(96 blocks of 32 tokens), match results with 0-4 holders of random depth and
worker views with random loads and prefill rates, so the timed loop is the call
alone. Each row is the best of ``--repeats`` runs of ``--decisions`` calls
(per-call mean within a run); compare rows from one run, not across machines.

Rows: every registered policy, plus prefix_load on misses only and prefix_load
on a hot prefix: every request shares one fixed hot root (64 blocks, the same
chained hashes on every call, then a unique tail) held by 4 workers, at a decayed
rate of 30 requests/s — more than 4 holders absorb, so the record keeps a fifth
worker as a replica and the replication bookkeeping (record lookup, holder count,
needed holders, replica masking) runs on every call, as for a real hot system
prompt. Each row also gives the median and worst of its runs (the spread a target
is held against). Target: prefix_load <= 20 us per decision, in every row.

``--quality`` adds a second table: a seeded mixed workload (shared system prompts
with a heavy-tailed popularity, multi-turn chat sessions, unique prompts) routed
through ``radixfleet_tools.loadtest.simulator.harness.PickLoop`` — the route core, a real PrefixIndex
and 8 FIFO prefill servers at 10k tokens/s, load counted at pick time — reporting the
prefix hit rate (cached / prompt tokens) and the model's TTFT (queue + uncached
prefill). It is a sanity check of the policies' defaults, not a fleet simulation
(see ``simulate``); the ``full-prompt load`` row counts every request's whole prompt
as in-flight work, as a router that ignores ``Decision.matched_blocks`` would.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import Endpoint, WorkerId, request_key
from radixfleet.policies.base import MatchResult, RouteRequest, WorkerView
from radixfleet.policies.registry import build_policy, policy_names
from radixfleet_tools.loadtest.simulator.harness import PickLoop

TARGET_US = 20.0


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--workers", type=_positive, default=16, help="routable workers (default 16)")
    p.add_argument("--decisions", type=_positive, default=20_000, help="decisions per run (default 20000)")
    p.add_argument("--repeats", type=_positive, default=5, help="runs per row; best kept (default 5)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--quality", action="store_true", help="also route a mixed workload: hit rate and modelled TTFT"
    )
    p.add_argument(
        "--rate", type=_positive, default=200, help="--quality arrival rate, requests/s (default 200)"
    )
    p.add_argument(
        "--requests", type=_positive, default=6000, help="--quality requests per policy (default 6000)"
    )


#: the hot row: blocks of the fixed hot root, its holders and its request rate
HOT_ROOT_BLOCKS = 64
HOT_HOLDERS = 4
HOT_RATE = 30.0


def _inputs(
    workers: int, n: int, rng: random.Random, *, hot: bool = False, miss: bool = False
) -> list[tuple]:
    ids = [WorkerId(f"worker-{i}") for i in range(workers)]
    root = [rng.getrandbits(64) for _ in range(HOT_ROOT_BLOCKS)]  # the one hot root
    hot_holders = ids[:HOT_HOLDERS]
    out = []
    for k in range(n):
        if hot:
            hashes = root + [rng.getrandbits(64) for _ in range(96 - HOT_ROOT_BLOCKS)]
        else:
            hashes = [rng.getrandbits(64) for _ in range(96)]
        req = RouteRequest(
            hashes,
            96 * 32 + rng.randrange(32),
            32,
            session=f"user-{k % 500}" if k % 3 == 0 else None,
            model="m",
            text_len=96 * 128,
        )
        if miss:
            match = MatchResult({})
        elif hot:
            match = MatchResult({w: HOT_ROOT_BLOCKS for w in hot_holders}, HOT_ROOT_BLOCKS, HOT_RATE)
        else:
            holders = rng.sample(ids, rng.randrange(0, 5))
            blocks = {w: rng.randrange(1, 97) for w in holders}
            depth = max(blocks.values(), default=0)
            match = MatchResult(blocks, depth, rng.random() * 1.5)
        views = [
            WorkerView(
                w,
                in_flight=rng.randrange(0, 40),
                in_flight_tokens=rng.randrange(0, 40_000),
                queued_tokens=rng.randrange(0, 5_000),
                prefill_tokens_per_s=rng.choice((8_000.0, 10_000.0, 12_000.0)),
            )
            for w in ids
        ]
        out.append((req, match, views))
    return out


def _time(name: str, params: dict | None, inputs: list[tuple], repeats: int, seed: int) -> list[float]:
    """µs per decision of each of ``repeats`` runs (a fresh policy each), sorted."""
    runs = []
    clock = time.perf_counter
    for _ in range(repeats):
        pol = build_policy(name, params, random.Random(seed))
        choose = pol.choose
        now = 0.0
        t = clock()
        for req, match, views in inputs:
            choose(req, match, views, now)
        dt = clock() - t
        runs.append(dt / len(inputs) * 1e6)
    return sorted(runs)


def _hot_record(inputs: list[tuple], seed: int) -> dict:
    """The hot row's replication record after its decisions: proves the row runs
    the bookkeeping of one fixed hot root (one record, its 4 holders + a replica)."""
    pol = build_policy("prefix_load", None, random.Random(seed))
    for req, match, views in inputs:
        pol.choose(req, match, views, 0.0)
    recs = pol.describe()["hot_prefixes"]
    assert len(recs) == 1, f"the hot row should have one hot root, has {len(recs)}"
    rec = recs[0]
    assert rec["depth"] == HOT_ROOT_BLOCKS and len(rec["replicas"]) >= 1, rec
    return rec


def _row(policy: str, case: str, runs: list[float]) -> dict:
    return {
        "policy": policy,
        "case": case,
        "us_per_decision": round(runs[0], 2),
        "median_us": round(runs[len(runs) // 2], 2),
        "worst_us": round(runs[-1], 2),
    }


#: (label, policy, params, count the whole prompt as in-flight work)
QUALITY_ROWS = (
    ("round_robin", "round_robin", None, False),
    ("least_load", "least_load", None, False),
    ("cache_aware", "cache_aware", None, False),
    ("prefix_load", "prefix_load", None, False),
    ("prefix_load replicate=false", "prefix_load", {"replicate": False}, False),
    ("prefix_load prefill_weight=1", "prefix_load", {"prefill_weight": 1.0}, False),
    ("prefix_load full-prompt load", "prefix_load", None, True),
)


def _workload(n: int, rate: float, seed: int) -> list[tuple]:
    """``[(arrival time, PrefixKey)]``: the --quality workload (module docstring)."""
    wl = random.Random(seed)
    systems = [f"system {j} " + "s" * 8000 for j in range(5)]
    sessions: dict[int, list] = {}
    out = []
    t = 0.0
    for i in range(n):
        t += wl.expovariate(rate)
        r = wl.random()
        if r < 0.5:  # a shared system prompt, popularity heavy-tailed
            j = min(int(wl.paretovariate(1.2)) - 1, len(systems) - 1)
            k = request_key(Endpoint.COMPLETIONS, {"model": "m", "prompt": systems[j] + f"q{i} " + "x" * 800})
        elif r < 0.9:  # a turn of one of 100 chat sessions
            s = wl.randrange(100)
            hist = sessions.setdefault(s, [{"role": "system", "content": f"sess {s} " + "c" * 4000}])
            hist.append({"role": "user", "content": f"turn {i} " + "u" * 400})
            k = request_key(Endpoint.CHAT, {"model": "m", "messages": list(hist)})
            hist.append({"role": "assistant", "content": "a" * 400})
            if len(hist) > 30:
                sessions.pop(s)
        else:  # unique
            k = request_key(Endpoint.COMPLETIONS, {"model": "m", "prompt": f"u{i} " * 600})
        out.append((t, k))
    return out


def _quality(args: argparse.Namespace, labels: list[str] | None = None) -> list[dict]:
    """The --quality rows (all, or those of ``labels``), in ``QUALITY_ROWS`` order."""
    work = _workload(args.requests, float(args.rate), args.seed + 99)
    rows = []
    for label, name, params, full in QUALITY_ROWS:
        if labels is not None and label not in labels:
            continue
        loop = PickLoop(
            build_policy(name, params, random.Random(args.seed)),
            [f"w{i}" for i in range(8)],
            index=PrefixIndex(max_bytes=64 * 2**20, half_life_s=10.0),
            decode_s=1.0,
            count_cached=full,
        )
        ttfts = []
        cached = total = 0
        for t, k in work:
            d = loop.route(k.hashes, k.prompt_tokens, t, text_len=len(k.data))
            ttfts.append(loop.load[d.worker].busy_until - t)
            cached += d.matched_blocks * k.block_tokens
            total += k.prompt_tokens
        ttfts.sort()
        n = len(ttfts)
        rows.append(
            {
                "policy": label,
                "hit_rate": round(cached / total, 3),
                "ttft_mean_s": round(sum(ttfts) / n, 3),
                "ttft_p50_s": round(ttfts[n // 2], 3),
                "ttft_p99_s": round(ttfts[min(n - 1, int(n * 0.99))], 3),
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    base = _inputs(args.workers, args.decisions, rng)
    rows = []
    for name in policy_names():
        rows.append(_row(name, "mixed", _time(name, None, base, args.repeats, args.seed)))
    hot = _inputs(args.workers, args.decisions, rng, hot=True)
    hot_record = _hot_record(hot, args.seed)
    rows.append(_row("prefix_load", "hot root", _time("prefix_load", None, hot, args.repeats, args.seed)))
    miss = _inputs(args.workers, args.decisions, rng, miss=True)
    rows.append(_row("prefix_load", "misses", _time("prefix_load", None, miss, args.repeats, args.seed)))
    worst = max(r["worst_us"] for r in rows if r["policy"] == "prefix_load")
    summary = {
        "workers": args.workers,
        "decisions": args.decisions,
        "repeats": args.repeats,
        "target_us": TARGET_US,
        "prefix_load_worst_us": worst,
        "meets_target": worst <= TARGET_US,
        "rows": rows,
        "hot_record": hot_record,
    }
    if args.quality:
        summary["quality"] = {"rate": args.rate, "requests": args.requests, "rows": _quality(args)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"policy decision cost, {args.workers} workers "
            f"({args.repeats} runs x {args.decisions} decisions; best, median, worst run)"
        )
        print(f"{'policy':<18}{'case':<14}{'best us':>9}{'median':>9}{'worst':>9}")
        for r in rows:
            print(
                f"{r['policy']:<18}{r['case']:<14}{r['us_per_decision']:>9.2f}"
                f"{r['median_us']:>9.2f}{r['worst_us']:>9.2f}"
            )
        print(
            f"prefix_load worst run of any row {worst:.2f} us (target <= {TARGET_US:.0f} us): "
            f"{'met' if worst <= TARGET_US else 'NOT met'}"
        )
        if args.quality:
            q = summary["quality"]
            print(f"\nmixed workload, 8 workers, {q['rate']} req/s, {q['requests']} requests")
            print(f"{'policy':<32}{'hit':>7}{'ttft mean':>11}{'p50':>8}{'p99':>8}")
            for r in q["rows"]:
                print(
                    f"{r['policy']:<32}{r['hit_rate']:>7.3f}{r['ttft_mean_s']:>11.3f}"
                    f"{r['ttft_p50_s']:>8.3f}{r['ttft_p99_s']:>8.3f}"
                )
    return 0
