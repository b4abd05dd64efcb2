"""``radixfleet bench fidelity``: the simulator against a live fleet, same traffic.

The demo's traffic (``radixfleet demo``): the ``mixed`` workload (chat sessions
behind a few shared system prompts), seed 0, Poisson arrivals at 12 requests/s,
on 4 simulated agents (Llama-3-8B on H100) behind the router with ``prefix_load``.
KV per agent defaults to 32,768 tokens: the fleet holds the working set but a
misrouted request still misses. At the demo's own 12,000 the fleet thrashes and a
single run's hit rate swings with tie-breaks and timing (simulated seeds alone
span ~10 points, live runs more), so one run against one run means little there;
``--kv-tokens 12000 --live-runs 3`` shows it. Every figure is a mean over
``--live-runs`` cold live runs and ``--sim-seeds`` simulated policy seeds.

1. live: ``loadtest.fleet.Fleet`` starts the agents and the router as subprocesses
   on loopback; ``loadtest.main.run_ab`` flushes the agents and drives the workload
   (the load generator's own client, report and references);
2. calibration: the one thing the simulator cannot know is this host's request
   path (client, router proxy, agent HTTP, on shared cores). Before the run,
   ``--probes`` sequential one-token requests with fresh 64-token prompts go
   through the live router; the simulator serves the same requests on an idle
   simulated fleet; half the median TTFT difference is the one-way path latency
   (``SimConfig.path_latency_s``) of the simulated run. Both simulated figures,
   with and without it, are printed;
3. simulated: ``loadtest.simulator`` runs the same workload, seed, arrivals and
   bounds on the same fleet in virtual time.

Printed: hit rate (live, simulated, difference in points) and TTFT p50 (live,
simulated, relative difference), and whether they agree within 2 points and 15%
(the issue's bar). Other figures are printed for context. ``--json`` prints one
object. Takes about requests / rate seconds plus ~10 s of start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import tempfile
import time

from loadtest.arrivals import Bounds, Closed, Poisson
from loadtest.client import Result, Target
from loadtest.demo import DEFAULT_KV_TOKENS
from loadtest.fleet import Fleet, FleetConfig
from loadtest.main import run_ab
from loadtest.simulator.engine import EngineSpec
from loadtest.simulator.fleet import SimConfig, Simulation
from loadtest.workloads import (API_COMPLETIONS, RequestSpec, SingleShot, make_workload,
                                parse_options, text_of)
from router.errors import ConfigError

HIT_POINTS = 0.02
TTFT_REL = 0.15


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--policy", default="prefix_load")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--kv-tokens", type=int, default=32_768,
                   help=f"per-agent KV tokens (default 32768; the demo uses {DEFAULT_KV_TOKENS})")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--workload", default="mixed")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--rate", type=float, default=12.0, help="Poisson arrivals/s (default 12)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probes", type=int, default=30, help="calibration requests (0: no calibration)")
    p.add_argument("--live-runs", type=int, default=2, help="live runs (each cold), averaged")
    p.add_argument("--sim-seeds", type=int, default=8, help="simulated runs (policy seeds), averaged")


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000.0


def _pick(r: dict) -> dict:
    return {k: r[k] for k in ("requests", "ok", "errors", "hit_rate", "oracle_hit_rate",
                              "pooled_hit_rate", "ttft_ms", "itl_ms", "e2e_ms", "load_imbalance",
                              "duration_s", "workers")}


def _probe_specs(n: int) -> list:
    return [SingleShot(RequestSpec(f"probe{i}.0", API_COMPLETIONS,
                                   {"prompt": text_of(64, f"fidelity-probe/{i}")}, 1,
                                   f"probe{i}", 0, None, 64)) for i in range(n)]


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
    sim = Simulation(sim_cfg, make_workload("gsp", {}), Closed(1), Bounds(n, 1e6, 60.0),
                     sessions=_probe_specs(n))
    return sim.run().report["ttft_ms"]["p50"] / 1000.0


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.4g}..{max(xs):.4g}" if len(xs) > 1 else f"{xs[0]:.4g}"


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = parse_options(args.option)
    if args.live_runs < 1 or args.sim_seeds < 1:
        raise ConfigError("--live-runs", "--live-runs and --sim-seeds must be >= 1")
    arrivals = Poisson(args.rate)
    bounds = Bounds(args.requests, args.duration, 30.0)
    cfg = FleetConfig(agents=args.agents, model=args.model, gpu=args.gpu,
                      kv_tokens=args.kv_tokens, router_port=0, policy=args.policy).validate()
    sim_cfg = SimConfig(workers=args.agents, policy=args.policy,
                        engine=EngineSpec(model=args.model, gpu=args.gpu, kv_tokens=args.kv_tokens))
    t0 = time.perf_counter()
    probe_live = None
    lives = []
    # Fleet waits until the router lists every agent as registered (feedback flows)
    with Fleet(cfg, log_dir=tempfile.mkdtemp(prefix="radixfleet-fidelity-")) as fleet:
        if args.probes > 0:
            ts = sorted(asyncio.run(_live_probes(fleet.router_url, args.probes)))
            probe_live = ts[len(ts) // 2] if ts else None
        for _ in range(args.live_runs):  # run_ab flushes every agent first: each run is cold
            outcomes = asyncio.run(run_ab(
                [(args.policy, fleet.router_url)], make_workload(args.workload, options, args.seed),
                arrivals, bounds, flush_urls=fleet.agent_urls,
                kv_capacity_tokens=cfg.kv_tokens * cfg.agents, progress=False, settle_s=0.5))
            lives.append(outcomes[0].report)
    live_wall = time.perf_counter() - t0
    path_s = 0.0
    probe_sim = None
    if probe_live is not None:
        probe_sim = _sim_probe_ttft(sim_cfg, args.probes)
        path_s = max(0.0, (probe_live - probe_sim) / 2.0)

    def sims(c: SimConfig) -> list[dict]:
        # seeds vary the policy's tie-breaks, as timing varies them live
        return [Simulation(c, make_workload(args.workload, options, args.seed), arrivals, bounds,
                           seed=k).run().report for k in range(args.sim_seeds)]

    raws = sims(sim_cfg)
    simr = sims(dataclasses.replace(sim_cfg, path_latency_s=path_s))
    lh, sh = [r["hit_rate"] for r in lives], [r["hit_rate"] for r in simr]
    lt, st = [r["ttft_ms"]["p50"] for r in lives], [r["ttft_ms"]["p50"] for r in simr]
    dh = _mean(sh) - _mean(lh)
    rel = (_mean(st) - _mean(lt)) / _mean(lt)
    doc = {
        "benchmark": "fidelity",
        "setting": {"agents": args.agents, "model": args.model, "gpu": args.gpu,
                    "kv_tokens": args.kv_tokens, "policy": args.policy, "workload": args.workload,
                    "options": options, "rate": args.rate, "requests": args.requests,
                    "seed": args.seed, "live_runs": args.live_runs, "sim_seeds": args.sim_seeds},
        "calibration": {"probes": args.probes, "live_probe_ttft_ms": _ms(probe_live),
                        "sim_probe_ttft_ms": _ms(probe_sim), "path_latency_ms": path_s * 1000.0},
        "live_hit_rate": lh, "sim_hit_rate": sh, "live_ttft_p50_ms": lt, "sim_ttft_p50_ms": st,
        "sim_without_path_latency_ttft_p50_ms": [r["ttft_ms"]["p50"] for r in raws],
        "hit_rate_diff_points": dh * 100, "ttft_p50_rel_diff": rel,
        "agree_hit_rate_within_2_points": abs(dh) <= HIT_POINTS,
        "agree_ttft_p50_within_15pct": abs(rel) <= TTFT_REL,
        "live": [_pick(r) for r in lives], "sim": [_pick(r) for r in simr],
        "live_wall_s": live_wall, "sim_wall_s": sum(r["wall_s"] for r in simr),
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"fidelity: {args.workload} seed {args.seed}, Poisson {args.rate}/s, {args.requests} requests, "
          f"{args.agents} x {args.model}@{args.gpu} ({args.kv_tokens} KV tokens), {args.policy}; "
          f"{args.live_runs} live run(s), {args.sim_seeds} simulated seeds")
    if probe_live is not None:
        print(f"  path       {args.probes} probes: live TTFT p50 {probe_live * 1000:.2f} ms, simulated "
              f"{probe_sim * 1000:.2f} ms -> one-way path latency {path_s * 1000:.2f} ms")
    print(f"  hit rate   live {_mean(lh):.4f} ({_spread(lh)})   sim {_mean(sh):.4f} ({_spread(sh)})   "
          f"diff {dh * 100:+.2f} points   [{'agree' if abs(dh) <= HIT_POINTS else 'DISAGREE'} within 2 points]")
    print(f"  TTFT p50   live {_mean(lt):.2f} ms ({_spread(lt)})   sim {_mean(st):.2f} ms ({_spread(st)})   "
          f"diff {rel * 100:+.1f}%   [{'agree' if abs(rel) <= TTFT_REL else 'DISAGREE'} within 15%]   "
          f"(sim without path latency {_mean([r['ttft_ms']['p50'] for r in raws]):.2f} ms)")
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        for q in ("p50", "p90", "p99") if key == "ttft_ms" else ("p50",):
            if key == "ttft_ms" and q == "p50":
                continue
            a = _mean([r[key][q] for r in lives])
            b = _mean([r[key][q] for r in simr])
            print(f"  {label} {q:4s}   live {a:.2f} ms   sim {b:.2f} ms")
    print(f"  ok         live {sum(r['ok'] for r in lives)}/{sum(r['requests'] for r in lives)}   "
          f"sim {sum(r['ok'] for r in simr)}/{sum(r['requests'] for r in simr)}")
    print(f"  oracle     live {_mean([r['oracle_hit_rate'] for r in lives]):.4f}   "
          f"sim {_mean([r['oracle_hit_rate'] for r in simr]):.4f}")
    print(f"  wall       live {live_wall:.1f} s   sim {doc['sim_wall_s']:.2f} s")
    return 0
