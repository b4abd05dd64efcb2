"""``radixfleet bench fidelity``: the simulator against a live fleet, same traffic.

The demo's setting (``radixfleet demo``): the ``mixed`` workload (chat sessions
behind a few shared system prompts), Poisson arrivals at 12 requests/s, 4 simulated
agents (Llama-3-8B on H100) with **12,000 KV tokens each** — where the fleet must
evict and the policies differ (the demo: round_robin hit ~0.50, prefix_load ~0.77).
A simulator that agrees with the live fleet only where every policy scores the same
(at 32,768 KV tokens they all hit ~0.92) would prove nothing, so the check leads
with the setting where a router's choices matter, and with more than one policy:
each of ``--policies`` (default prefix_load and round_robin) is run live and
simulated on each of ``--seeds`` (workload seeds, default 0, 1, 2), and the output
says whether the simulator puts the policies in the live order and how far apart.

1. live: ``radixfleet_tools.loadtest.local_fleet.Fleet`` starts the agents, and the router once per
   policy, as subprocesses on loopback; ``radixfleet_tools.loadtest.runner.run_ab`` flushes the
   agents (a failed flush fails the run) and drives the workload (the load
   generator's own client, report and references), ``--live-runs`` cold runs per
   policy and seed;
2. calibration: the one thing the simulator cannot know is this host's request
   path (client, router proxy, agent HTTP, on shared cores). Before the runs,
   ``--probes`` sequential one-token requests with fresh 64-token prompts go
   through the live router; the simulator serves the same requests on an idle
   simulated fleet; half the median TTFT difference is the one-way path latency
   (``SimConfig.path_latency_s``). **Both** simulated TTFTs are printed side by
   side, raw (GPU time only) and calibrated (plus the path), each with its
   difference from live — the calibration is measured, not fitted to the runs;
3. simulated: ``radixfleet_tools.loadtest.simulator`` runs the same workload, seed, arrivals and
   bounds on the same fleet in virtual time, ``--sim-seeds`` policy seeds per
   workload seed (tie-breaks, as timing varies them live).

Printed per policy: hit rate (live, simulated, difference in points) and TTFT p50
(live; simulated raw and calibrated, relative differences), means over seeds with
their spread, and whether they agree within 2 points and 15% (calibrated TTFT).
``--json`` prints one object with every run. Takes about policies x seeds x
live-runs x requests / rate seconds, plus ~10 s per router start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from typing import Any

from radixfleet.wire.cli_args import DeprecatedAlias
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.loadtest.arrivals import Bounds, Closed, Poisson
from radixfleet_tools.loadtest.client import Result, Target
from radixfleet_tools.loadtest.demo import DEFAULT_KV_TOKENS
from radixfleet_tools.loadtest.local_fleet import Fleet, FleetConfig
from radixfleet_tools.loadtest.runner import run_ab
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import (
    API_COMPLETIONS,
    RequestSpec,
    SingleShot,
    make_workload,
    parse_options,
    text_of,
)

HIT_POINTS = 0.02
TTFT_REL = 0.15


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--policies",
        default="prefix_load,round_robin",
        help="comma list, run live and simulated (default prefix_load,round_robin)",
    )
    p.add_argument("--agents", type=int, default=4, help="simulated agents")
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=DEFAULT_KV_TOKENS,
        help=f"per-agent KV tokens (default {DEFAULT_KV_TOKENS}, the demo's)",
    )
    p.add_argument("--agent-model", dest="model", default="llama-3-8b", help="the agents' model preset")
    p.add_argument("--model", dest="model", action=DeprecatedAlias, use="--agent-model")
    p.add_argument("--gpu", default="h100", help="the agents' GPU preset")
    p.add_argument("--workload", default="mixed", help="the workload (as loadtest --workload)")
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a workload parameter (repeatable)",
    )
    p.add_argument("--rate", type=float, default=12.0, help="Poisson arrivals/s (default 12)")
    p.add_argument("--requests", type=int, default=400, help="requests per run")
    p.add_argument("--duration", type=float, default=120.0, help="longest run, seconds")
    p.add_argument("--seeds", default="0,1,2", help="workload seeds, comma list (default 0,1,2)")
    p.add_argument("--probes", type=int, default=30, help="calibration requests (0: no calibration)")
    p.add_argument(
        "--live-runs", type=int, default=1, help="live runs (each cold) per policy and seed (default 1)"
    )
    p.add_argument(
        "--sim-seeds", type=int, default=4, help="simulated policy seeds per workload seed (default 4)"
    )


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000.0


def _pick(r: dict) -> dict:
    return {
        k: r[k]
        for k in (
            "requests",
            "ok",
            "errors",
            "hit_rate",
            "oracle_hit_rate",
            "pooled_hit_rate",
            "ttft_ms",
            "itl_ms",
            "e2e_ms",
            "load_imbalance",
            "duration_s",
            "workers",
        )
    }


def _probe_specs(n: int) -> list:
    return [
        SingleShot(
            RequestSpec(
                f"probe{i}.0",
                API_COMPLETIONS,
                {"prompt": text_of(64, f"fidelity-probe/{i}")},
                1,
                f"probe{i}",
                0,
                None,
                64,
            )
        )
        for i in range(n)
    ]


async def _live_probes(url: str, n: int) -> list[float]:
    out = []
    async with Target("probe", url) as t:
        await t.probe()
        for s in _probe_specs(n):
            r = Result(s.spec.id, s.spec.session, 0)
            await t.send(s.spec, r)
            if r.ok and r.ttft_s is not None:
                out.append(r.ttft_s)
    return out


def _sim_probe_ttft(sim_cfg: SimConfig, n: int) -> float:
    sim = Simulation(
        sim_cfg, make_workload("gsp", {}), Closed(1), Bounds(n, 1e6, 60.0), sessions=_probe_specs(n)
    )
    return sim.run().report["ttft_ms"]["p50"] / 1000.0


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.4g}..{max(xs):.4g}" if len(xs) > 1 else f"{xs[0]:.4g}"


def _seeds(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("--seeds", f"{text!r} is not a comma list of integers") from None
    if not out or len(set(out)) != len(out):
        raise ConfigError("--seeds", "give distinct integers, comma-separated")
    return out


def _policies(text: str) -> list[str]:
    from radixfleet.policies.registry import policy_class

    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or len(set(out)) != len(out):
        raise ConfigError("--policies", "give distinct policy names, comma-separated")
    for name in out:
        policy_class(name, path="--policies")
    return out


def _rel(a: float, b: float) -> float:
    """(a - b) / b."""
    return (a - b) / b if b else float("nan")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = parse_options(args.option)
    if args.live_runs < 1 or args.sim_seeds < 1:
        raise ConfigError("--live-runs", "--live-runs and --sim-seeds must be >= 1")
    seeds = _seeds(args.seeds)
    policies = _policies(args.policies)
    arrivals = Poisson(args.rate)
    bounds = Bounds(args.requests, args.duration, 30.0)
    cfg = FleetConfig(
        agents=args.agents,
        model=args.model,
        gpu=args.gpu,
        kv_tokens=args.kv_tokens,
        router_port=0,
        policy=policies[0],
    ).validate()
    engine = EngineSpec(model=args.model, gpu=args.gpu, kv_tokens=args.kv_tokens)
    t0 = time.perf_counter()
    probe_live = None
    lives: dict[str, dict[int, list[dict]]] = {p: {s: [] for s in seeds} for p in policies}
    with Fleet(cfg, log_dir=tempfile.mkdtemp(prefix="radixfleet-fidelity-"), start_router=False) as fleet:
        for i, policy in enumerate(policies):
            fleet.start_router(policy)  # waits until every agent is registered
            if i == 0 and args.probes > 0:
                ts = sorted(asyncio.run(_live_probes(fleet.router_url, args.probes)))
                probe_live = ts[len(ts) // 2] if ts else None
            for seed in seeds:
                for _ in range(args.live_runs):  # run_ab flushes every agent: each run is cold
                    outcomes = asyncio.run(
                        run_ab(
                            [(policy, fleet.router_url)],
                            make_workload(args.workload, options, seed),
                            arrivals,
                            bounds,
                            flush_urls=fleet.agent_urls,
                            kv_capacity_tokens=cfg.kv_tokens * cfg.agents,
                            progress=False,
                            settle_s=0.5,
                            admin_urls={fleet.router_url: fleet.admin_url},
                        )
                    )
                    lives[policy][seed].append(outcomes[0].report)
    live_wall = time.perf_counter() - t0
    path_s = 0.0
    probe_sim = None
    if probe_live is not None:
        probe_sim = _sim_probe_ttft(
            SimConfig(workers=args.agents, policy=policies[0], engine=engine), args.probes
        )
        path_s = max(0.0, (probe_live - probe_sim) / 2.0)

    def sims(policy: str, seed: int, path: float) -> list[dict]:
        c = SimConfig(workers=args.agents, policy=policy, engine=engine, path_latency_s=path)
        return [
            Simulation(c, make_workload(args.workload, options, seed), arrivals, bounds, seed=k).run().report
            for k in range(args.sim_seeds)
        ]

    rows: dict[str, dict[str, Any]] = {}
    for policy in policies:
        per_seed = []
        for seed in seeds:
            raw = sims(policy, seed, 0.0)
            cal = sims(policy, seed, path_s)
            live = lives[policy][seed]
            per_seed.append(
                {
                    "seed": seed,
                    "live_hit_rate": _mean([r["hit_rate"] for r in live]),
                    "sim_hit_rate": _mean([r["hit_rate"] for r in cal]),
                    "live_ttft_p50_ms": _mean([r["ttft_ms"]["p50"] for r in live]),
                    "sim_raw_ttft_p50_ms": _mean([r["ttft_ms"]["p50"] for r in raw]),
                    "sim_calibrated_ttft_p50_ms": _mean([r["ttft_ms"]["p50"] for r in cal]),
                    "live": [_pick(r) for r in live],
                    "sim": [_pick(r) for r in cal],
                    "sim_wall_s": sum(r["wall_s"] for r in raw + cal),
                }
            )
        col = {
            k: [x[k] for x in per_seed]
            for k in (
                "live_hit_rate",
                "sim_hit_rate",
                "live_ttft_p50_ms",
                "sim_raw_ttft_p50_ms",
                "sim_calibrated_ttft_p50_ms",
            )
        }
        m = {k: _mean(v) for k, v in col.items()}
        dh = m["sim_hit_rate"] - m["live_hit_rate"]
        raw_rel = _rel(m["sim_raw_ttft_p50_ms"], m["live_ttft_p50_ms"])
        cal_rel = _rel(m["sim_calibrated_ttft_p50_ms"], m["live_ttft_p50_ms"])
        rows[policy] = {
            "seeds": per_seed,
            "mean": m,
            "spread": {k: [min(v), max(v)] for k, v in col.items()},
            "hit_rate_diff_points": dh * 100,
            "ttft_p50_raw_rel_diff": raw_rel,
            "ttft_p50_calibrated_rel_diff": cal_rel,
            "agree_hit_rate_within_2_points": abs(dh) <= HIT_POINTS,
            "agree_calibrated_ttft_p50_within_15pct": abs(cal_rel) <= TTFT_REL,
        }
    order_live = sorted(policies, key=lambda p: -rows[p]["mean"]["live_hit_rate"])
    order_sim = sorted(policies, key=lambda p: -rows[p]["mean"]["sim_hit_rate"])
    doc = {
        "benchmark": "fidelity",
        "setting": {
            "agents": args.agents,
            "model": args.model,
            "gpu": args.gpu,
            "kv_tokens": args.kv_tokens,
            "policies": policies,
            "workload": args.workload,
            "options": options,
            "rate": args.rate,
            "requests": args.requests,
            "seeds": seeds,
            "live_runs": args.live_runs,
            "sim_seeds": args.sim_seeds,
        },
        "calibration": {
            "probes": args.probes,
            "live_probe_ttft_ms": _ms(probe_live),
            "sim_probe_ttft_ms": _ms(probe_sim),
            "path_latency_ms": path_s * 1000.0,
        },
        "policies": rows,
        "hit_rate_order_live": order_live,
        "hit_rate_order_sim": order_sim,
        "same_order": order_live == order_sim,
        "live_wall_s": live_wall,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"fidelity: {args.workload}, seeds {','.join(map(str, seeds))}, Poisson {args.rate:g}/s, "
        f"{args.requests} requests, {args.agents} x {args.model}@{args.gpu} ({args.kv_tokens} KV "
        f"tokens); per policy and seed {args.live_runs} live run(s), {args.sim_seeds} simulated"
    )
    if probe_live is not None and probe_sim is not None:  # measured together
        print(
            f"  path       {args.probes} probes: live TTFT p50 {probe_live * 1000:.2f} ms, simulated "
            f"{probe_sim * 1000:.2f} ms -> one-way path latency {path_s * 1000:.2f} ms"
        )
    for policy, r in rows.items():
        m, sp = r["mean"], r["spread"]
        print(f"  {policy}")
        print(
            f"    hit rate   live {m['live_hit_rate']:.4f} ({_spread(sp['live_hit_rate'])})   "
            f"sim {m['sim_hit_rate']:.4f} ({_spread(sp['sim_hit_rate'])})   "
            f"diff {r['hit_rate_diff_points']:+.2f} points   "
            f"[{'agree' if r['agree_hit_rate_within_2_points'] else 'DISAGREE'} within 2 points]"
        )
        print(
            f"    TTFT p50   live {m['live_ttft_p50_ms']:.2f} ms ({_spread(sp['live_ttft_p50_ms'])})   "
            f"sim raw {m['sim_raw_ttft_p50_ms']:.2f} ms ({r['ttft_p50_raw_rel_diff'] * 100:+.1f}%)   "
            f"sim calibrated {m['sim_calibrated_ttft_p50_ms']:.2f} ms "
            f"({r['ttft_p50_calibrated_rel_diff'] * 100:+.1f}%)   "
            f"[{'agree' if r['agree_calibrated_ttft_p50_within_15pct'] else 'DISAGREE'} "
            f"within 15%, calibrated]"
        )
    if len(policies) > 1:
        a, b = order_live[0], order_live[-1]
        gl = rows[a]["mean"]["live_hit_rate"] - rows[b]["mean"]["live_hit_rate"]
        gs = rows[a]["mean"]["sim_hit_rate"] - rows[b]["mean"]["sim_hit_rate"]
        print(
            f"  policies   live order {' > '.join(order_live)}, simulated "
            f"{' > '.join(order_sim)} [{'same' if doc['same_order'] else 'DIFFERENT'}]; "
            f"hit-rate gap {a} - {b}: live {gl * 100:+.1f} points, sim {gs * 100:+.1f}"
        )
    print(
        f"  wall       live {live_wall:.1f} s   "
        f"sim {sum(s['sim_wall_s'] for r in rows.values() for s in r['seeds']):.1f} s"
    )
    return 0
