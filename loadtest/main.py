"""``radixfleet loadtest``: one workload and seed against each target in turn (A/B).

::

    radixfleet loadtest --target ours=http://127.0.0.1:8000 --target smg=http://127.0.0.1:30000 \\
        --workload mixed -o sessions=64 --rate 8 --requests 400 --duration 120 \\
        --json report.json --plots plots/
    radixfleet loadtest --ab radix --workload multiturn     # radix cache on vs off
    radixfleet loadtest --ab policy --workload mixed        # prefix_load vs round_robin

``--ab`` starts a local fleet for the run (``loadtest.ab``). A workload or trace runs
whole unless ``--requests`` / ``--duration`` bound it; a bound that cuts a run short
is starred in the table and said in the report (``cut``).

Before each target's run every agent's cache is flushed (``POST /flush_cache`` on the
``--flush`` URLs, or on the workers a radixfleet router lists at ``GET
/admin/workers``) so every run starts cold. A failed flush stops the run with an
error (a warm run must not be reported as a cold one) unless ``--allow-warm`` is
given; then the run goes on and its report says ``"cold_start": false`` and which
flush failed. With no agents to flush the report says ``"cold_start": null``.
The pooled reference needs the fleet's KV capacity: ``--kv-capacity-tokens``, or
the sum the agents report.

Per-worker figures come from the router's ``x-radixfleet-worker`` header; a target
that names no worker (``smg``) gets them from the agents' ``/metrics`` counters,
read before and after its run.

Every target is probed first; an unreachable one is an error before any load is
sent. A target failing mid-run is counted per error kind and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from protocol.errors import ConfigError, WorkloadError
from loadtest.arrivals import Bounds, Closed, Poisson, TraceTimes
from loadtest.report import check_outputs, render_table, write_json, write_plots
from loadtest.runner import RunOutcome, run_ab
from loadtest.workloads import WORKLOADS, Trace, Workload, make_workload, parse_options

log = logging.getLogger(__name__)


def parse_target(text: str) -> tuple[str, str]:
    """``NAME=URL`` or ``NAME=URL,URL,...`` (router replicas, client-side round robin)."""
    name, sep, url = text.partition("=")
    if not sep or not name or not all(u.startswith(("http://", "https://"))
                                       for u in url.split(",")):
        raise ConfigError("--target", f"{text!r} must be NAME=http://HOST:PORT"
                          "[,http://HOST:PORT...]")
    return name, url


def add_load_arguments(parser: argparse.ArgumentParser, *, default_workload: str | None,
                       model_flag: bool = True) -> None:
    """Workload, arrival and bound flags shared by ``loadtest`` and ``demo``."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", default=default_workload, required=default_workload is None,
                   help=f"one of {', '.join(WORKLOADS)}")
    g.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a workload parameter (repeatable), e.g. -o groups=8")
    g.add_argument("--trace", metavar="FILE", help="trace workload: the JSONL file")
    g.add_argument("--time-scale", type=float, help="trace workload: timestamp multiplier")
    g.add_argument("--skip-bad-lines", action="store_true", help="trace workload: skip malformed lines")
    g.add_argument("--seed", type=int, default=0)
    a = parser.add_argument_group("arrivals and bounds")
    m = a.add_mutually_exclusive_group()
    m.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    m.add_argument("--concurrency", type=int,
                   help="closed loop: requests in flight (default: 8; trace: its own timestamps)")
    a.add_argument("--requests", type=int, default=None,
                   help="stop after N requests (default: the whole workload or trace)")
    a.add_argument("--duration", type=float, default=None,
                   help="stop dispatching after S seconds (default: no limit)")
    a.add_argument("--drain", type=float, default=30.0, help="grace for in-flight requests at the end")
    a.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    if model_flag:
        a.add_argument("--model", help="model name (default: the target's first /v1/models entry)")
    a.add_argument("--send-session", action="store_true",
                   help="send the session id as the OpenAI 'user' field")
    o = parser.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the report {'runs': [...]} here")
    o.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")


def configure(parser: argparse.ArgumentParser) -> None:
    from loadtest import ab

    parser.add_argument("--target", action="append", default=[], metavar="NAME=URL[,URL...]",
                        help="an OpenAI-compatible router (repeatable; run in the order given); "
                             "several comma-separated URLs: replicas in client-side round "
                             "robin; or --ab for a local fleet")
    parser.add_argument("--flush", action="append", default=[], metavar="URL",
                        help="an agent to POST /flush_cache before each run (repeatable; "
                             "default: the workers the router lists at /admin/workers)")
    parser.add_argument("--allow-warm", action="store_true",
                        help="run even when an agent's cache flush fails (the report then "
                             "says cold_start: false) instead of stopping with an error")
    parser.add_argument("--kv-capacity-tokens", type=int,
                        help="the fleet's KV capacity for pooled_hit_rate (default: from the agents)")
    add_load_arguments(parser, default_workload=None)
    ab.add_arguments(parser)


def build_load(args: argparse.Namespace) -> tuple[Workload, object, Bounds]:
    """Workload, arrivals and bounds from parsed flags; raises ``WorkloadError``."""
    options: dict = parse_options(args.option)
    if args.trace is not None:
        options["path"] = args.trace
    if args.time_scale is not None:
        options["time_scale"] = args.time_scale
    if args.skip_bad_lines:
        options["skip_bad_lines"] = True
    if args.workload != "trace" and (args.trace is not None or args.time_scale is not None
                                     or args.skip_bad_lines):
        raise WorkloadError("--trace, --time-scale and --skip-bad-lines apply to --workload trace only")
    workload = make_workload(args.workload, options, args.seed)
    if args.rate is not None:
        arrivals = Poisson(args.rate)
    elif args.concurrency is not None:
        arrivals = Closed(args.concurrency)
    elif isinstance(workload, Trace):
        arrivals = TraceTimes()
    else:
        arrivals = Closed(8)
    if isinstance(workload, Trace) and getattr(workload, "skipped", None):
        log.warning("trace: skipped %d bad lines (first: line %d)", len(workload.skipped),
                    workload.skipped[0])
    return workload, arrivals, Bounds(args.requests, args.duration, args.drain)


def emit(outcomes: list[RunOutcome], args: argparse.Namespace) -> None:
    runs = [o.report for o in outcomes]
    render_table(runs)
    if args.json:
        write_json(args.json, runs)
        print(f"report: {args.json}")
    if args.plots:
        paths = write_plots(runs, args.plots, {o.report["name"]: o.ttft_ms for o in outcomes})
        print("plots: " + ", ".join(paths))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.ab:
        return _run_local_ab(args)
    if not args.target:
        raise ConfigError("--target", "give at least one --target NAME=URL, or --ab radix|policy "
                                      "for a local fleet")
    targets = [parse_target(t) for t in args.target]
    names = [n for n, _ in targets]
    if len(set(names)) != len(names):
        raise ConfigError("--target", "target names must be unique")
    workload, arrivals, bounds = build_load(args)
    if args.kv_capacity_tokens is not None and args.kv_capacity_tokens <= 0:
        raise ConfigError("--kv-capacity-tokens", "must be > 0")
    check_outputs(files=[("--json", args.json)], dirs=[("--plots", args.plots)])
    outcomes = asyncio.run(run_ab(
        targets, workload, arrivals, bounds, flush_urls=[u.rstrip("/") for u in args.flush],
        kv_capacity_tokens=args.kv_capacity_tokens, model=args.model, timeout_s=args.timeout,
        send_session=args.send_session, progress=False if args.no_progress else None,
        allow_warm=args.allow_warm))
    emit(outcomes, args)
    return 0


def _run_local_ab(args: argparse.Namespace) -> int:
    from loadtest import ab

    if args.target or args.flush:
        raise ConfigError("--ab", "starts its own fleet: drop --target and --flush")
    ab.arms(args)  # flag errors before anything starts
    workload, arrivals, bounds = build_load(args)
    check_outputs(files=[("--json", args.json)], dirs=[("--plots", args.plots)])
    outcomes = ab.run_local(args, workload, arrivals, bounds)
    emit(outcomes, args)
    for line in ab.worth([o.report for o in outcomes], args.ab):
        print(line)
    return 0

