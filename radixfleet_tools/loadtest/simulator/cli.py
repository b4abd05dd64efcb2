"""``radixfleet simulate``: policies on a simulated fleet, in virtual time.

::

    radixfleet simulate --workload gsp -o groups=16 --agents 8 \\
        --policies round_robin,cache_aware,prefix_load --json sim.json
    radixfleet simulate --trace radixfleet_tools/loadtest/data/mooncake_synthetic_trace.jsonl \\
        --agents 16 --policies prefix_load --kv-tokens 200000 --requests 4000
    radixfleet simulate --workload zipf --policies least_load,prefix_load \\
        --sweep kv_tokens=20000,50000,100000,400000 --plots plots/
    radixfleet simulate --workload mixed --feedback none,events --policies prefix_load
    radixfleet simulate --workload agent --dram-tokens 4x --index-tiers priced,ignore,as_gpu
    radixfleet simulate --workload zipf --policies round_robin,prefix_load \\
        --sweep kv_tokens=4000,8000,16000,32000 --jobs 0     # one process per CPU

Workload, arrival and bound flags are the load generator's (``radixfleet loadtest``):
the same workload, seed and arrivals (``--rate``, ``--burstiness``, ``--rate`` with a
``--concurrency`` cap) produce the same requests at the same times here and live.
Defaults are the demo's (``radixfleet_tools.loadtest.defaults``: workload, agents, per-agent KV,
rate, policies), so ``radixfleet simulate`` alone runs what ``radixfleet demo``
runs live; a trace keeps its own timestamps and the preset's KV pool.
``--trace FILE`` alone means ``--workload trace``; a trace runs at block level
(``--level auto``) unless ``--level text`` asks for synthesized text.

The report (``--json``) is the load generator's schema, one run per policy named
after it, latencies in simulated time (with ``--slo``, ``goodput`` as the load
generator's: ok requests per second within every bound), plus ``floor_ttft_ms`` (each request's TTFT
alone on an idle worker holding its oracle-cached prefix: the physical floor, see
``radixfleet_tools.loadtest.simulator.simulation``), ``wall_s``, ``sim_requests_per_s`` and
a ``sim`` object (level, fleet, feedback settings, decision reasons, counters).
Sweeps add ``sweep: {param, value}`` to each run and ``--plots`` draws them (the
knee: hit rate against KV tokens per policy, with the pooled and oracle lines).
Runs are independent and seeded: ``--jobs N`` runs them in N processes with the
same reports (but for the wall-clock figures).
``--router-config FILE`` runs the simulated router (the live ``radixfleet.fleet.pool``,
``radixfleet.index.feedback``, ``radixfleet.route.core`` and ``radixfleet.route.warmup`` objects) with that
file's settings.
A workload or trace runs whole unless ``--requests`` or ``--duration`` bounds it; a
run a bound cuts short is starred in the table, with a note saying which bound, and
its report says so (``stopped_by``, ``workload_requests``, ``cut``).
``--timeout`` (default 120 s, as live) fails a request with no complete answer
that long after dispatch (error kind ``timeout``) and cancels it at its worker.
``--shed`` runs the live router's shedding (``radixfleet.route.shedding``) on the simulated
agents' load reports: a refused request is answered 429 at once (error kind
``http_429``), nothing routed; the oracle and pooled caches see only the requests
that run. Off by default: the routing tables measure policies on the whole offered
load, and below saturation nothing is shed.
``--no-progress`` does nothing (there is no progress bar). Bad flags exit 2 with
one line on stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import sys
from typing import Any

import yaml

from radixfleet.config import TIER_MODES, Config, load_config
from radixfleet.index.prefix_index import tune_gc
from radixfleet.keys import DEFAULT_BLOCK_BYTES
from radixfleet.policies.registry import policy_names
from radixfleet.wire.cli_args import DeprecatedAlias, HelpFormatter
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import from_flags
from radixfleet_tools.agent.dram_tier import parse_dram_size
from radixfleet_tools.loadtest import defaults
from radixfleet_tools.loadtest.arrivals import Bounds
from radixfleet_tools.loadtest.cli import add_load_arguments, build_load, workload_options_help
from radixfleet_tools.loadtest.metrics import parse_slo
from radixfleet_tools.loadtest.report import (
    FLOOR_LEGEND,
    LEGEND,
    check_outputs,
    cut_notes,
    ok_cell,
    print_table,
    require_plots,
    write_json,
    write_plots,
)
from radixfleet_tools.loadtest.simulator import blocktrace
from radixfleet_tools.loadtest.simulator.engine import engine_help
from radixfleet_tools.loadtest.simulator.simulation import (
    FEEDBACK_MODES,
    FLAGS,
    LEVELS,
    SimConfig,
    SimOutcome,
    Simulation,
)
from radixfleet_tools.loadtest.simulator.sweep import parse_sweep, plan_runs, write_sweep_plots
from radixfleet_tools.loadtest.workloads import Trace

log = logging.getLogger(__name__)

_AUTO = "auto"  # --workload's default: 'trace' with --trace, else the demo's


DEFAULTS_HELP = (
    "Defaults are the demo's (radixfleet_tools.loadtest.defaults), so that both tell the same story: "
    f"--workload {defaults.WORKLOAD} "
    + "".join(f"-o {k}={v} " for k, v in defaults.WORKLOAD_OPTIONS.items())
    + "(the options without --workload, where -o does not set them), "
    f"--agents {defaults.AGENTS}, --kv-tokens {defaults.KV_TOKENS:,} "
    f"per agent, --rate {defaults.RATE:g} (open loop), --policies {','.join(defaults.POLICIES)}. "
    "With --trace: the trace's own timestamps and the preset's whole KV pool."
)


def configure(parser: argparse.ArgumentParser) -> None:
    f = parser.add_argument_group("fleet")
    f.add_argument(
        "--agents",
        dest="workers",
        type=int,
        default=defaults.AGENTS,
        help=f"simulated agents (workers) (default {defaults.AGENTS}, as the demo)",
    )
    f.add_argument("--workers", dest="workers", type=int, action=DeprecatedAlias, use="--agents")
    f.add_argument(
        "--policies",
        default=",".join(defaults.POLICIES),
        help=f"comma-separated policies, one run each; of {', '.join(policy_names())} "
        f"(default {','.join(defaults.POLICIES)}, as the demo)",
    )
    f.add_argument(
        "-P",
        "--policy-param",
        action="append",
        default=[],
        metavar="[POLICY.]NAME=VALUE",
        help="a policy parameter (repeatable), e.g. -P prefix_load.min_match_tokens=128; "
        "without POLICY. it applies to every one of --policies",
    )
    f.add_argument(
        "--kv-tokens",
        type=int,
        help=f"KV capacity per worker (default {defaults.KV_TOKENS:,}, as the demo; "
        "with --trace the preset's whole pool)",
    )
    f.add_argument(
        "--agent-model",
        dest="model",
        default="llama-3-8b",
        help="the agents' model preset (default llama-3-8b)",
    )
    f.add_argument("--model", dest="model", action=DeprecatedAlias, use="--agent-model")
    f.add_argument("--gpu", default="h100", help="GPU preset (default h100)")
    f.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per worker")
    f.add_argument("--chunk-tokens", type=int, help="chunked-prefill token budget per step")
    f.add_argument("--admission", help="agent cache admission mode (always, second_hit, ...)")
    f.add_argument(
        "--dram-tokens",
        metavar="TOKENS|Nx",
        help="a DRAM KV tier per worker: TOKENS, or Nx = N times the worker's KV pool "
        "(e.g. 4x); default: none",
    )
    f.add_argument(
        "--dram-admit-hits",
        type=int,
        default=1,
        help="requests that must reach a 256-token chunk before it is written to DRAM (default 1)",
    )
    f.add_argument(
        "--block-bytes",
        type=int,
        default=DEFAULT_BLOCK_BYTES,
        help=f"router block size, bytes (default {DEFAULT_BLOCK_BYTES})",
    )
    f.add_argument(
        "--level",
        choices=LEVELS,
        default="auto",
        help="prompt level: text (tokens) or block (trace hash ids); auto = block for traces",
    )
    f.add_argument(
        "--repeat", type=int, default=1, help="trace: replay N time- and id-shifted copies back to back"
    )
    f.add_argument(
        "--index-tiers",
        metavar="MODE[,MODE...]",
        help="the router's index.tiers: what a DRAM-tier prefix is worth to the policy, "
        f"one of {', '.join(TIER_MODES)} (default: the --router-config's, priced); "
        "a comma list runs each",
    )
    fb = parser.add_argument_group("feedback")
    fb.add_argument(
        "--feedback",
        default="events",
        help="none (router inserts only) | events (agent events) | plain "
        "(an engine that sends nothing: no events, no load reports; the "
        "index aged at the KV capacity, corrected by cached tokens); "
        "a comma list runs each (the ablation)",
    )
    fb.add_argument(
        "--feedback-delay-ms", type=float, default=5.0, help="agent -> router delivery delay (default 5)"
    )
    fb.add_argument(
        "--feedback-batch-ms", type=float, default=100.0, help="agent reporter batch interval (default 100)"
    )
    f.add_argument(
        "--router-config",
        metavar="FILE",
        help="a router YAML file: the simulated router runs with its load, index "
        "half-life, warm-up and breaker settings (its workers and policy are "
        "not used; default: the router's defaults)",
    )
    f.add_argument(
        "--shed",
        action="store_true",
        help="the live router's load shedding (its limits from --router-config or the "
        "defaults): a request every worker reports saturated for gets a 429 at once, as "
        "live (default off: every request is routed)",
    )
    f.add_argument(
        "--path-latency-ms",
        type=float,
        default=0.0,
        help="one-way client->router->agent latency added to every request (default 0)",
    )
    m = parser.add_argument_group("metrics")
    m.add_argument(
        "--slo",
        "--goodput",
        metavar="ttft_ms=MS,tpot_ms=MS,e2e_ms=MS",
        help="goodput: ok requests per second within every bound, as the load generator "
        "reports it (vLLM's ttft:MS,tpot:MS also read)",
    )
    s = parser.add_argument_group("sweep")
    s.add_argument(
        "--sweep",
        metavar="PARAM=V1,V2,...",
        help="kv_tokens=..., workers=... or rate=...: every policy at every value",
    )
    s.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run the independent runs (policies x feedback x sweep values) in N "
        "processes; 0 = one per CPU (default 1). Reports are identical but "
        "for wall_s and sim_requests_per_s; memory grows with N",
    )
    add_load_arguments(parser, default_workload=_AUTO, model_flag=False, arrival_shapes=True)
    parser.epilog = DEFAULTS_HELP + "\n\n" + engine_help() + "\n\n" + workload_options_help()
    parser.formatter_class = HelpFormatter


def _policy_params(pairs: list[str], policies: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {p: {} for p in policies}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        pol, dot, name = key.rpartition(".")
        if not sep or not name:
            raise ConfigError("--policy-param", f"{pair!r} must be [POLICY.]NAME=VALUE")
        if dot and pol not in out:
            raise ConfigError(
                "--policy-param", f"{pol!r} is not one of the --policies ({', '.join(policies)})"
            )
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        for p in [pol] if dot else policies:  # no POLICY.: every policy of the run
            out[p][name] = parsed
    return out


def build(args: argparse.Namespace):
    """(plans, workload, bounds, policy params) from flags; raises Config/WorkloadError."""
    if args.workload == _AUTO:
        args.workload = "trace" if args.trace is not None else defaults.WORKLOAD
        if args.workload == defaults.WORKLOAD:
            args.option = defaults.workload_options(args.option)
    if args.workload != "trace":  # the demo's fleet and load where no flag says otherwise
        if args.kv_tokens is None:
            args.kv_tokens = defaults.KV_TOKENS
        if args.rate is None and args.concurrency is None:
            args.rate = defaults.RATE
    workload, arrivals, bounds = build_load(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies", "name at least one policy")
    unknown = [p for p in policies if p not in policy_names()]
    if unknown:
        raise ConfigError("--policies", f"{unknown[0]!r} is not one of {', '.join(policy_names())}")
    if len(set(policies)) != len(policies):
        raise ConfigError("--policies", "each policy at most once")
    modes = [m.strip() for m in args.feedback.split(",") if m.strip()]
    if not modes or any(m not in FEEDBACK_MODES for m in modes):
        raise ConfigError(
            "--feedback", f"{args.feedback!r}: use {' or '.join(FEEDBACK_MODES)} (or a comma list of them)"
        )
    if args.repeat < 1:
        raise ConfigError("--repeat", f"must be >= 1, got {args.repeat}")
    if args.repeat > 1 and not isinstance(workload, Trace):
        raise ConfigError("--repeat", "applies to trace workloads only")
    if args.repeat > 1 and args.level == "text":
        raise ConfigError("--repeat", "repeated traces run at block level only (drop --level text)")
    engine: dict[str, Any] = {
        "model": args.model,
        "gpu": args.gpu,
        "tp": args.tp,
        "kv_tokens": args.kv_tokens,
        "chunk_tokens": args.chunk_tokens,
        "admission": args.admission,
        "dram_admit_hits": args.dram_admit_hits,
    }
    if args.dram_tokens is not None:
        try:
            engine["dram_tokens"], engine["dram_ratio"] = parse_dram_size(args.dram_tokens)
        except ValueError as e:
            raise ConfigError("--dram-tokens", str(e)) from None
    values = {
        "workers": args.workers,
        "engine": engine,
        "block_bytes": args.block_bytes,
        "feedback": modes[0],
        "feedback_delay_s": args.feedback_delay_ms / 1000.0,
        "feedback_batch_s": args.feedback_batch_ms / 1000.0,
        "level": args.level,
        "path_latency_s": args.path_latency_ms / 1000.0,
        "send_session": args.send_session,
        "timeout_s": args.timeout,
        "shed": args.shed,
        "router_config": (load_config(args.router_config) if args.router_config else Config()),
        "slo": parse_slo(args.slo) if args.slo else None,
    }
    # the millisecond flags' values as given (bounds at 0 read the same in seconds)
    shown = {
        "feedback_delay_s": args.feedback_delay_ms,
        "feedback_batch_s": args.feedback_batch_ms,
        "path_latency_s": args.path_latency_ms,
    }
    base: SimConfig = from_flags(SimConfig, values, FLAGS, shown)
    base.validate()
    sweep = parse_sweep(args.sweep) if args.sweep else None
    tier_modes = [m.strip() for m in (args.index_tiers or "").split(",") if m.strip()]
    if args.index_tiers is not None and (
        not tier_modes
        or any(m not in TIER_MODES for m in tier_modes)
        or len(set(tier_modes)) != len(tier_modes)
    ):
        raise ConfigError(
            "--index-tiers",
            f"{args.index_tiers!r}: use {', '.join(TIER_MODES)} (or a comma list of them, each once)",
        )
    plans = plan_runs(base, policies, modes, arrivals, sweep, tier_modes)
    params = _policy_params(args.policy_param, policies)
    return plans, workload, bounds, params


def simulate(
    plans, workload, bounds: Bounds, params: dict, *, seed: int, repeat: int = 1, progress=None, jobs: int = 1
) -> list:
    """Runs every plan; returns their ``SimOutcome``s in plan order.

    Each plan is an independent, seeded simulation, so with ``jobs > 1`` they run in
    that many worker processes (forked: the workload is shared, not pickled) and the
    reports are identical to a serial run but for ``wall_s`` and
    ``sim_requests_per_s``, which each process measures for its own run (on a
    machine with fewer free cores than ``jobs`` they measure the contention too).
    Outcomes from worker processes carry no ``jobs`` list (the per-request objects
    stay in the worker). ``progress`` is called with each report as it completes.
    """
    records = None
    if isinstance(workload, Trace) and repeat > 1:
        records = blocktrace.repeat(workload.records, repeat)
    jobs = min(jobs, len(plans))
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        outcomes = []
        for i in range(len(plans)):
            out = _run_plan(plans, workload, bounds, params, seed, records, i)
            outcomes.append(out)
            if progress is not None:
                progress(out.report)
        return outcomes
    global _SHARED
    _SHARED = (plans, workload, bounds, params, seed, records)
    try:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futs = {pool.submit(_run_shared, i): i for i in range(len(plans))}
            done: dict[int, SimOutcome] = {}
            for fut in concurrent.futures.as_completed(futs):
                report, ttft = fut.result()
                done[futs[fut]] = SimOutcome(report, ttft, [])
                if progress is not None:
                    progress(report)
    finally:
        _SHARED = None
    return [done[i] for i in range(len(plans))]


#: what forked worker processes read (set only while a parallel simulate() runs)
_SHARED: tuple[Any, Any, Bounds, dict, int, Any] | None = None


def _run_shared(i: int) -> tuple[dict, list[float]]:
    assert _SHARED is not None, "_run_shared runs in a process forked by simulate()"
    out = _run_plan(*_SHARED, i)
    return out.report, out.ttft_ms


def _run_plan(plans, workload, bounds: Bounds, params: dict, seed: int, records, i: int):
    plan = plans[i]
    cfg = dataclasses.replace(plan.cfg, policy_params=params.get(plan.cfg.policy) or None)
    sessions = blocktrace.sessions(workload, records) if records is not None else None
    sim = Simulation(cfg, workload, plan.arrivals, bounds, seed=seed, name=plan.name, sessions=sessions)
    out = sim.run()
    if plan.sweep is not None:
        out.report["sweep"] = plan.sweep
    return out


def _print_table(runs: list[dict]) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title="radixfleet simulate (simulated time)")
    slo = next((r["goodput"]["slo"] for r in runs if "goodput" in r), None)
    tiers = any(r.get("tiers", {}).get("dram_tokens_per_worker") for r in runs)
    cols = (
        "run",
        "sweep",
        "ok/req",
        "hit",
        *(["GPU hit", "DRAM hit"] if tiers else []),
        "oracle",
        "pooled",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "floor p50 ms",
        "floor p99 ms",
        "ITL p50 ms",
        "req/s",
        *(["goodput req/s"] if slo else []),
        "imbalance",
        "wall s",
        "sim req/s",
    )
    for c in cols:
        t.add_column(c, justify="left" if c in ("run", "sweep") else "right", no_wrap=c in ("run", "sweep"))

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in runs:
        sw = r.get("sweep")
        t.add_row(
            Text(r["name"]),
            f"{sw['param']}={sw['value']:g}" if sw else "",
            ok_cell(r),
            f(r["hit_rate"], ".3f"),
            *([f(r["tiers"]["gpu_hit_rate"], ".3f"), f(r["tiers"]["dram_hit_rate"], ".3f")] if tiers else []),
            f(r["oracle_hit_rate"], ".3f"),
            f(r["pooled_hit_rate"], ".3f"),
            f(r["ttft_ms"]["p50"], ".1f"),
            f(r["ttft_ms"]["p99"], ".1f"),
            f(r["floor_ttft_ms"]["p50"], ".1f"),
            f(r["floor_ttft_ms"]["p99"], ".1f"),
            f(r["itl_ms"]["p50"], ".2f"),
            f(r["throughput"]["requests_per_s"], ".2f"),
            *([f(r["goodput"]["requests_per_s"], ".2f")] if slo else []),
            f(r["load_imbalance"], ".2f"),
            f(r["wall_s"], ".2f"),
            f(r["sim_requests_per_s"], ".0f"),
        )
    legend = LEGEND + "  " + FLOOR_LEGEND
    if slo:
        legend += (
            "  goodput: ok requests per second within "
            + ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in slo.items())
            + "."
        )
    print_table(t, sys.stdout, cut_notes(runs), legend=legend)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    tune_gc()
    try:
        plans, workload, bounds, params = build(args)
    except ValueError as exc:  # a dataclass validator's message
        raise ConfigError("", str(exc)) from None
    if args.jobs < 0:
        raise ConfigError("--jobs", f"must be >= 0 (0: one per CPU), got {args.jobs}")
    jobs = args.jobs or (os.cpu_count() or 1)
    check_outputs(files=[("--json", args.json)], dirs=[("--plots", args.plots)])
    if args.plots:
        require_plots()
    outcomes = simulate(plans, workload, bounds, params, seed=args.seed, repeat=args.repeat, jobs=jobs)
    runs = [o.report for o in outcomes]
    _print_table(runs)
    if args.json:
        write_json(args.json, runs)
        print(f"report: {args.json}")
    if args.plots:
        if any(r.get("sweep") for r in runs):
            paths = write_sweep_plots(runs, args.plots)
        else:
            paths = write_plots(runs, args.plots, {o.report["name"]: o.ttft_ms for o in outcomes})
        print("plots: " + ", ".join(paths))
    return 0
