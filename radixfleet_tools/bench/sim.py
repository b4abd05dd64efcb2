"""``radixfleet bench sim``: simulated requests per wall second, and where the time goes.

Rows (one simulation each, ``prefix_load``, Llama-3-8B on H100 workers, seed 0):

    gsp_8w         the gsp workload as SGLang benchmarks it (64 groups x 16 prompts,
                   2,048-token system prompts, 128-token questions, 256 output
                   tokens), 8 workers, Poisson 100 req/s
    gsp_light_8w   gsp with 256/32/16-token system/question/output, 4,096 requests,
                   8 workers, Poisson 400 req/s: the per-request floor
    trace_100k     the shared Mooncake trace, 25 time- and id-shifted copies
                   (99,825 requests, ~7 h of traffic), block level, 8 workers
    long_5k        5,000 requests of ~125k-token prompts (50 shared 100k-token
                   roots + 25k unique tokens each), block level, 8 workers
    gsp_500w       gsp light, 8,192 requests, 500 workers, Poisson 2,000 req/s
    gsp_floor      not a simulation: gsp_8w's 1,024 requests through only the library
                   calls every simulated request makes -- keying, the two reference
                   caches, the router's match / policy / optimistic insert, the
                   agent's radix-cache match, lock and two inserts, and its stored
                   events applied to the index -- back to back, with no event loop,
                   scheduler step or load report. The sum bounds what any simulator
                   that runs these same objects can reach: if it exceeds 50 us, 20,000
                   sim req/s is out of reach without compiling them.

``sim_requests_per_s`` = requests / wall seconds of the simulation itself (workload
generation excluded, reported apart as ``build_s``). With ``--profile`` (on for
the gsp rows by default) a second, cProfiled run splits the time by package —
``worker_agent`` is the agent's own scheduler and radix cache, ``router`` the
prefix index and keys, ``policies`` the policy, ``radixfleet_tools/loadtest/simulator`` this
simulator — so a shortfall is attributed, not guessed.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import random
import tempfile
import time
from array import array

from radixfleet.index.prefix_index import PrefixIndex, tune_gc
from radixfleet.keys import BYTES_PER_TOKEN, DEFAULT_BLOCK_BYTES, WorkerId, namespace_seed
from radixfleet.policies.base import RouteRequest, WorkerView
from radixfleet.policies.registry import build_policy
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.events import Removed, Stored
from radixfleet_tools.agent.radix_cache import KEY_TYPECODE
from radixfleet_tools.loadtest.arrivals import Bounds, Poisson, TraceTimes
from radixfleet_tools.loadtest.simulator import blocktrace
from radixfleet_tools.loadtest.simulator.engine import PRIVATE_BASE, EngineSpec, SimWorker
from radixfleet_tools.loadtest.simulator.prompts import text_prompt
from radixfleet_tools.loadtest.simulator.reference import TextReference
from radixfleet_tools.loadtest.simulator.simulation import UNREAD_ANSWER_BASE, SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import MOONCAKE_TRACE, Trace, make_workload

TARGET_GSP_REQ_PER_S = 20_000
TARGET_TRACE_100K_S = 60.0
SHARED_TRACE = MOONCAKE_TRACE
ROWS = ("gsp_8w", "gsp_light_8w", "trace_100k", "long_5k", "gsp_500w", "gsp_floor")
FLOOR_PARTS = ("keying", "references", "router_pick", "agent_cache", "feedback")
LIGHT = {"system_tokens": 256, "question_tokens": 32, "output_tokens": 16}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument(
        "--quick", action="store_true", help="smaller traces (trace_100k: 3 copies, long_5k: 500 requests)"
    )
    p.add_argument(
        "--profile",
        choices=("gsp", "all", "none"),
        default="gsp",
        help="which rows get a second, profiled run (time by package)",
    )
    p.add_argument("--policy", default="prefix_load", help="the simulated fleet's policy")


def _long_trace(path: str, n: int, seed: int = 0) -> None:
    """Mooncake-format lines: 50 roots of 200 blocks (102,400 tokens) shared, then
    45 unique blocks; ~125k-token prompts, 2 s apart, 32 output tokens."""
    rng = random.Random(seed)
    roots = [[r * 1000 + i for i in range(200)] for r in range(50)]
    nxt = 10_000_000
    with open(path, "w", encoding="utf-8") as f:
        for k in range(n):
            ids = list(rng.choice(roots)) + list(range(nxt, nxt + 45))
            nxt += 45
            n_in = len(ids) * 512 - rng.randrange(512)
            f.write(
                json.dumps(
                    {"timestamp": k * 2000, "input_length": n_in, "output_length": 32, "hash_ids": ids}
                )
                + "\n"
            )


def _breakdown(sim_factory) -> dict[str, float]:
    sim = sim_factory()
    pr = cProfile.Profile()
    pr.enable()
    sim.run()
    pr.disable()
    by: collections.Counter = collections.Counter()
    # Stats.stats: the raw per-function table, which typeshed leaves undeclared
    for (f, _, _), (_, _, tt, _, _) in pstats.Stats(pr).stats.items():  # type: ignore[attr-defined]
        if "/radixfleet_tools/loadtest/simulator/" in f:
            key = "radixfleet_tools/loadtest/simulator"
        elif "/radixfleet_tools/agent/" in f:
            key = "worker_agent"
        elif "/radixfleet/policies/" in f:
            key = "policies"
        elif "/radixfleet/" in f:
            key = "router"
        elif "/radixfleet_tools/loadtest/" in f:
            key = "loadtest"
        else:
            key = "python builtins/stdlib"
        by[key] += tt
    total = sum(by.values()) or 1.0
    return {k: round(v / total, 3) for k, v in by.most_common()}


def _floor_row(policy: str, engine: EngineSpec, workers: int = 8, requests: int = 1024) -> dict:
    """The ``gsp_floor`` row (module docstring): per-request microseconds of each
    part, timed around the same calls, in the same order, as the simulation makes
    them for a single-shot gsp request."""
    wl = make_workload("gsp", {}, seed=0)
    specs = [s.first() for s in wl.sessions()][:requests]
    block_bytes = DEFAULT_BLOCK_BYTES
    block_tokens = block_bytes // BYTES_PER_TOKEN
    ns_seed = namespace_seed(engine.model)
    sims = [SimWorker(f"w{i}", engine, block_level=False, hash_stride=block_tokens) for i in range(workers)]
    caches = [w.cache for w in sims]
    by_id = {w.id: i for i, w in enumerate(sims)}
    ns = sims[0].ns
    ref = TextReference(sum(w.capacity_tokens for w in sims))
    index = PrefixIndex()
    pol = build_policy(policy, {}, random.Random(0), path="policy")
    views = [WorkerView(WorkerId(w.id), kv_capacity_tokens=w.capacity_tokens) for w in sims]
    tokenize = SimWorker.tokenize
    spent = dict.fromkeys(FLOOR_PARTS, 0.0)
    clock = time.perf_counter
    for k, spec in enumerate(specs):
        now = k * 0.01
        n_out = spec.max_tokens
        t0 = clock()
        p = text_prompt(spec, ns_seed, block_bytes, tokenize)
        data, units = p.data, p.units
        assert data is not None and isinstance(units, array), "a text prompt has its bytes and key"
        t1 = clock()
        ref.observe_prompt(data, units)
        ref.observe_unread_answer(data, units, n_out, UNREAD_ANSWER_BASE + k)
        t2 = clock()
        match = index.match(p.hashes, now)
        d = pol.choose(
            RouteRequest(p.hashes, p.prompt_tokens, block_tokens, None, engine.model, p.text_len),
            match,
            views,
            now,
        )
        index.insert(d.worker, p.hashes, now)
        t3 = clock()
        cache = caches[by_id[d.worker]]
        _, node = cache.match_prefix(ns, units, len(units) - 1)
        cache.inc_lock_ref(node)
        _, prompt_node = cache.insert(ns, units, p.hashes, admit_from=0, below=node, lock=True)
        cache.dec_lock_ref(node)
        # the scheduler's finish: prompt + private output ids, all but the last token
        key = units + array(KEY_TYPECODE, (PRIVATE_BASE + k,)) * (n_out - 1)
        _, done = cache.insert(ns, key, p.hashes, admit_from=len(units), below=prompt_node, lock=True)
        cache.dec_lock_ref(prompt_node)
        cache.dec_lock_ref(done)
        over = cache.total_tokens - sims[0].capacity_tokens
        if over > 0:
            cache.evict(over)
        t4 = clock()
        wid = d.worker
        for e in cache.drain_events():
            if e.__class__ is Stored:
                index.insert(wid, e.hashes, now, e.parent)
            elif e.__class__ is Removed:
                index.remove(wid, e.hashes)
        t5 = clock()
        for part, dt in zip(FLOOR_PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            spent[part] += dt
    n = len(specs)
    parts = {k: round(v / n * 1e6, 2) for k, v in spent.items()}
    total = sum(spent.values()) / n * 1e6
    return {
        "row": "gsp_floor",
        "requests": n,
        "workers": workers,
        "floor_us_per_request": round(total, 1),
        "ceiling_sim_requests_per_s": round(1e6 / total) if total else None,
        "parts_us": parts,
    }


def row_factory(name: str, policy: str, engine: EngineSpec, tmp: str, quick: bool = False):
    """A function that builds the row's ``Simulation`` (``tmp``: a folder for the
    generated long trace). ``bench reproduce`` re-runs rows through it."""
    if name == "gsp_8w":
        wl = make_workload("gsp", {}, seed=0)

        def factory() -> Simulation:
            return Simulation(
                SimConfig(workers=8, policy=policy, engine=engine),
                wl,
                Poisson(100.0),
                Bounds(1024, 1e9, 1e6),
                sessions=wl.sessions(),
            )
    elif name == "gsp_light_8w":
        wl = make_workload("gsp", dict(LIGHT, groups=256), seed=0)

        def factory() -> Simulation:
            return Simulation(
                SimConfig(workers=8, policy=policy, engine=engine),
                wl,
                Poisson(400.0),
                Bounds(4096, 1e9, 1e6),
                sessions=wl.sessions(),
            )
    elif name == "gsp_500w":
        wl = make_workload("gsp", dict(LIGHT, groups=512), seed=0)

        def factory() -> Simulation:
            return Simulation(
                SimConfig(workers=500, policy=policy, engine=engine),
                wl,
                Poisson(2000.0),
                Bounds(8192, 1e9, 1e6),
                sessions=wl.sessions(),
            )
    elif name == "trace_100k":
        trace = make_workload("trace", {"path": SHARED_TRACE}, seed=0)
        assert isinstance(trace, Trace)
        recs = blocktrace.repeat(trace.records, 3 if quick else 25)

        def factory() -> Simulation:
            return Simulation(
                SimConfig(workers=8, policy=policy, engine=engine),
                trace,
                TraceTimes(),
                Bounds(len(recs), 1e9, 1e6),
                sessions=blocktrace.sessions(trace, recs),
            )
    else:  # long_5k
        path = os.path.join(tmp, "long.jsonl")
        n = 500 if quick else 5000
        _long_trace(path, n)
        wl = make_workload("trace", {"path": path}, seed=0)

        def factory() -> Simulation:
            return Simulation(
                SimConfig(workers=8, policy=policy, engine=engine), wl, TraceTimes(), Bounds(n, 1e9, 1e6)
            )

    return factory


def _row(name: str, factory, profile: bool) -> dict:
    t0 = time.perf_counter()
    sim = factory()
    build = time.perf_counter() - t0
    out = sim.run()
    r = out.report
    s = r["sim"]
    row = {
        "row": name,
        "requests": r["requests"],
        "ok": r["ok"],
        "workers": s["workers_n"],
        "level": s["level"],
        "wall_s": round(r["wall_s"], 3),
        "build_s": round(build, 3),
        "sim_requests_per_s": round(r["sim_requests_per_s"], 1),
        "wall_us_per_request": round(r["wall_s"] / max(1, r["requests"]) * 1e6, 1),
        "simulated_s": round(s["sim_duration_s"], 1),
        "hit_rate": round(r["hit_rate"], 4),
        "oracle_hit_rate": round(r["oracle_hit_rate"], 4),
        "ttft_p50_ms": r["ttft_ms"]["p50"],
        "engine_steps": s["engine_steps"],
        "fast_forwarded_steps": s["fast_forwarded_steps"],
        "mean_prompt_tokens": round(r["prompt_tokens"] / max(1, r["ok"])),
    }
    if profile:
        row["time_share"] = _breakdown(factory)
    return row


def run(args: argparse.Namespace) -> int:
    tune_gc()
    rows = [x.strip() for x in args.rows.split(",") if x.strip()]
    bad = [x for x in rows if x not in ROWS]
    if bad:
        raise ConfigError("--rows", f"unknown row {bad[0]!r}; rows: {', '.join(ROWS)}")
    engine = EngineSpec()
    out = []
    tmp = tempfile.mkdtemp(prefix="radixfleet-bench-sim-")

    def prof(name: str) -> bool:
        return args.profile == "all" or (args.profile == "gsp" and name.startswith("gsp"))

    for name in rows:
        if name == "gsp_floor":
            out.append(_floor_row(args.policy, engine))
            if not args.json:
                _print_floor(out[-1])
            continue
        factory = row_factory(name, args.policy, engine, tmp, args.quick)
        out.append(_row(name, factory, prof(name)))
        if not args.json:
            _print_row(out[-1])
    verdict = {}
    for r in out:
        if r["row"] == "gsp_8w":
            verdict["gsp_8w_reaches_20k_req_per_s"] = r["sim_requests_per_s"] >= TARGET_GSP_REQ_PER_S
        if r["row"] == "trace_100k" and not args.quick:
            verdict["trace_100k_under_60_s"] = r["wall_s"] < TARGET_TRACE_100K_S
    doc = {"benchmark": "sim", "rows": out, "targets": verdict}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for k, v in verdict.items():
            print(f"target {k}: {'yes' if v else 'NO'}")
    return 0


def _print_floor(r: dict) -> None:
    parts = ", ".join(f"{k} {v:.1f}" for k, v in r["parts_us"].items())
    print(
        f"{'gsp_floor':13s} {r['requests']:>7d} req  {r['workers']:>3d} workers  library calls only: "
        f"{r['floor_us_per_request']:.1f} us/req (ceiling {r['ceiling_sim_requests_per_s']} "
        f"sim req/s)  [{parts}]"
    )


def _print_row(r: dict) -> None:
    print(
        f"{r['row']:13s} {r['requests']:>7d} req  {r['workers']:>3d} workers  {r['level']:5s}  "
        f"wall {r['wall_s']:8.2f} s  ({r['wall_us_per_request']:.0f} us/req, "
        f"{r['sim_requests_per_s']:.0f} sim req/s)  build {r['build_s']:.2f} s  "
        f"simulated {r['simulated_s']:.0f} s  hit {r['hit_rate']:.3f} (oracle {r['oracle_hit_rate']:.3f})  "
        f"steps {r['engine_steps']} + {r['fast_forwarded_steps']} fast-forwarded"
    )
    if "time_share" in r:
        print("    time share: " + ", ".join(f"{k} {v:.0%}" for k, v in r["time_share"].items()))
