"""``radixfleet bench disagg``: colocated against disaggregated prefill/decode, same GPUs.

Per workload, three simulated fleets of ``--gpus`` workers (one GPU each, the
agent's presets: ``--agent-model`` on ``--gpu``, each worker's KV pool the
preset's unless ``--kv-tokens``), seeded, virtual time:

    colocated        N workers doing both, prefix_load (the router's default)
    disagg_rr        P prefill + D decode (``--disagg P:D``), round_robin prefill pick
    disagg_prefix    the same fleet, prefix_load prefill pick (prefix match against
                     the prefill queue, the index of the prefill side)

The decode worker is picked by free KV, then running load
(``radixfleet.policies.disagg.choose_decode``); the prompt's KV moves over ``--link``
(``radixfleet_tools.agent.cost_model.LINKS``); the decode side emits the first token
(``radixfleet_tools.loadtest.simulator.disagg``). Workloads:

    mooncake   the shared Mooncake conversation trace (block level, its own
               timestamps times ``--time-scale``), the first ``--requests``
    chat       short-prompt chat: SGLang's multiturn (``--chat-clients`` clients x
               6 rounds of 128-token questions and 128-token answers), Poisson
               ``--chat-rate`` req/s. Its clients take turns nearly in lockstep (a
               client's next turn comes about ``--chat-clients`` requests after its
               last), so when that count is a multiple of the prefill workers round
               robin sends every turn of a client to the same worker and its hit
               rate is an artefact; ``--chat-clients 127`` breaks the lockstep

Printed per row: TTFT p50/p99, ITL p99 (the decode steps' durations), hit rate
(prompt tokens served from the prefill side's cache), KV bytes transferred; the
check the figures are held to: prefix-aware prefill's hit >= 1.5 x round robin's
and its bytes no higher. ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import from_flags
from radixfleet_tools.agent.cost_model import LINKS
from radixfleet_tools.loadtest.arrivals import Bounds, Poisson, TraceTimes
from radixfleet_tools.loadtest.simulator.disagg import DisaggSimulation, DisaggSpec
from radixfleet_tools.loadtest.simulator.engine import FLAGS as ENGINE_FLAGS
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import make_workload

SHARED_TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
WORKLOADS = ("mooncake", "chat")
#: prefix-aware prefill's hit rate against round robin's, at least (the target)
HIT_RATIO_TARGET = 1.5


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, default=8, help="GPUs (workers) in every fleet (default 8)")
    parser.add_argument(
        "--disagg", default=None, help="P:D prefill:decode split of the GPUs (default half:half)"
    )
    parser.add_argument("--link", default="rdma", help=f"KV link preset: {', '.join(LINKS)} (default rdma)")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma list of {', '.join(WORKLOADS)} (default both)",
    )
    parser.add_argument("--trace", default=SHARED_TRACE, help="the Mooncake trace (default the shared one)")
    parser.add_argument(
        "--requests", type=int, default=2000, help="mooncake: first N requests (default 2000)"
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="mooncake: timestamps x this (default 1)"
    )
    parser.add_argument("--chat-clients", type=int, default=128, help="chat: clients (default 128)")
    parser.add_argument("--chat-rate", type=float, default=40.0, help="chat: Poisson req/s (default 40)")
    parser.add_argument("--agent-model", dest="model", default="llama-3-8b", help="model preset")
    parser.add_argument("--gpu", default="h100", help="GPU preset (default h100)")
    parser.add_argument(
        "--kv-tokens", type=int, default=None, help="KV tokens per worker (default: the preset's)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _split(args: argparse.Namespace) -> DisaggSpec:
    if type(args.gpus) is not int or args.gpus < 2:
        raise ConfigError("--gpus", f"a disaggregated fleet needs at least 2 GPUs, got {args.gpus}")
    text = args.disagg or f"{args.gpus // 2}:{args.gpus - args.gpus // 2}"
    spec = DisaggSpec.split(text, args.link)
    if spec.prefill + spec.decode != args.gpus:
        raise ConfigError("--disagg", f"{text} is {spec.prefill + spec.decode} GPUs, --gpus is {args.gpus}")
    return spec


def _load(name: str, args: argparse.Namespace):
    """(workload, arrivals factory, bounds) of one workload."""
    if name == "mooncake":
        if not os.path.exists(args.trace):
            raise ConfigError("--trace", f"no such file: {args.trace}")
        opts = {"path": args.trace}
        if args.time_scale != 1.0:
            opts["time_scale"] = args.time_scale
        return (
            lambda: make_workload("trace", opts, seed=args.seed),
            TraceTimes,
            Bounds(args.requests, 1e9, 1e6),
        )
    if name == "chat":
        opts = {"clients": args.chat_clients, "rounds": 6, "question_tokens": 128, "output_tokens": 128}
        n = args.chat_clients * 6
        return (
            lambda: make_workload("multiturn", opts, seed=args.seed),
            lambda: Poisson(args.chat_rate),
            Bounds(n, 1e9, 1e6),
        )
    raise ConfigError("--workloads", f"{name!r} is not one of {', '.join(WORKLOADS)}")


def _row(workload: str, fleet: str, report: dict, wall_s: float) -> dict:
    d = report.get("disagg") or {}
    return {
        "workload": workload,
        "fleet": fleet,
        "requests": report["requests"],
        "ok": report["ok"],
        "ttft_p50_ms": report["ttft_ms"]["p50"],
        "ttft_p99_ms": report["ttft_ms"]["p99"],
        "itl_p99_ms": report["itl_ms"]["p99"],
        "hit_rate": report["hit_rate"],
        "oracle_hit_rate": report.get("oracle_hit_rate"),
        "kv_bytes_transferred": d.get("kv_bytes_transferred", 0.0),
        "transfer_p99_ms": (d.get("transfer_ms") or {}).get("p99"),
        "decode_wait_p99_ms": (d.get("decode_admission_wait_ms") or {}).get("p99"),
        "wall_s": wall_s,
    }


def run_workload(name: str, args: argparse.Namespace, spec: DisaggSpec) -> list[dict]:
    make, arrivals, bounds = _load(name, args)
    values = {"model": args.model, "gpu": args.gpu, "kv_tokens": args.kv_tokens}
    engine: EngineSpec = from_flags(EngineSpec, values, ENGINE_FLAGS)
    rows = []
    t = time.perf_counter()
    sim = Simulation(
        SimConfig(workers=args.gpus, policy="prefix_load", engine=engine), make(), arrivals(), bounds
    )
    rows.append(_row(name, f"colocated {args.gpus}x prefix_load", sim.run().report, time.perf_counter() - t))
    for policy, label in (("round_robin", "disagg_rr"), ("prefix_load", "disagg_prefix")):
        t = time.perf_counter()
        cfg = SimConfig(workers=spec.prefill, policy=policy, engine=engine)
        sim = DisaggSimulation(cfg, spec, make(), arrivals(), bounds, seed=args.seed)
        fleet = f"{label} {spec.prefill}P:{spec.decode}D {spec.link} {policy}"
        rows.append(_row(name, fleet, sim.run().report, time.perf_counter() - t))
    rr, pa = rows[1], rows[2]
    ratio = pa["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    pa["hit_vs_rr"] = ratio
    pa["meets_target"] = (
        ratio >= HIT_RATIO_TARGET and pa["kv_bytes_transferred"] <= rr["kv_bytes_transferred"]
    )
    return rows


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.1f}"


def run(args: argparse.Namespace) -> int:
    try:
        spec = _split(args)
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        bad = [w for w in names if w not in WORKLOADS]
        if bad or not names:
            raise ConfigError("--workloads", f"{(bad or [''])[0]!r} is not one of {', '.join(WORKLOADS)}")
        rows = []
        for name in names:
            rows += run_workload(name, args, spec)
    except ConfigError as exc:
        print(f"radixfleet bench disagg: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"gpus": args.gpus, "link": spec.link, "rows": rows}, indent=2))
        return 0
    print(
        f"{args.gpus} x {args.gpu}, {args.model}; disaggregated {spec.prefill}P:{spec.decode}D over "
        f"{spec.link} ({LINKS[spec.link].bytes_per_s / 1e9:g} GB/s); first token from the decode side"
    )
    print("| workload | fleet | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | hit rate | KV GB moved | ok |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['fleet']} | {_ms(r['ttft_p50_ms'])} | {_ms(r['ttft_p99_ms'])} | "
            f"{_ms(r['itl_p99_ms'])} | {r['hit_rate']:.3f} | {r['kv_bytes_transferred'] / 1e9:,.1f} | "
            f"{r['ok']}/{r['requests']} |"
        )
    for i, r in enumerate(rows):
        if "hit_vs_rr" in r:
            rr = rows[i - 1]
            more = r["kv_bytes_transferred"] - rr["kv_bytes_transferred"]
            print(
                f"{r['workload']}: prefix-aware prefill hit = {r['hit_vs_rr']:.2f} x round robin's, "
                f"KV bytes moved {'no higher' if more <= 0 else f'{more / 1e9:,.1f} GB higher'} "
                f"-> {'meets' if r['meets_target'] else 'MISSES'} the >= {HIT_RATIO_TARGET}x target"
            )
    return 0
