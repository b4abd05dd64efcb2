"""``radixfleet loadtest``: one workload and seed against each target in turn (A/B).

::

    radixfleet loadtest --target ours=http://127.0.0.1:8000 --target smg=http://127.0.0.1:30000 \\
        --workload mixed -o sessions=64 --rate 8 --requests 400 --duration 120 \\
        --json report.json --plots plots/
    radixfleet loadtest --ab radix --workload multiturn     # radix cache on vs off
    radixfleet loadtest --ab policy --workload mixed        # prefix_load vs round_robin

``--ab`` starts a local fleet for the run (``radixfleet_tools.loadtest.ab``). A workload or trace runs
whole unless ``--requests`` / ``--duration`` bound it; a bound that cuts a run short
is starred in the table and said in the report (``cut``).

Before each target's run every agent's cache is flushed (``POST /flush_cache`` on the
``--flush`` URLs, or on the workers a radixfleet router lists at ``GET
/admin/workers`` on its admin listener, ``--admin NAME=URL``) so every run starts
cold. A failed flush stops the run with an error (a warm run must not be reported
as a cold one) unless ``--allow-warm`` is given; then the run goes on and its
report says ``"cold_start": false`` and which flush failed. With no agents to
flush the report says ``"cold_start": null``.
The pooled reference needs the fleet's KV capacity: ``--kv-capacity-tokens``, or
the sum the agents report.

Per-worker figures come from the router's ``x-radixfleet-worker`` header (sent where
the router has ``response_headers.worker_id`` on, ``radixfleet router --worker-header``;
``up`` and the local fleets turn it on); a target that names no worker (``smg``, or
a router with it off) gets them from the agents' ``/metrics`` counters,
read before and after its run.

Every target is probed first; an unreachable one is an error before any load is
sent. A target failing mid-run is counted per error kind and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from radixfleet.wire.errors import ConfigError, WorkloadError
from radixfleet.wire.settings import reference
from radixfleet_tools.loadtest.arrivals import Bounds, Closed, Poisson, TraceTimes
from radixfleet_tools.loadtest.report import (
    check_outputs,
    render_table,
    require_plots,
    write_json,
    write_plots,
)
from radixfleet_tools.loadtest.retry import RETRY_MODES, RetryPolicy
from radixfleet_tools.loadtest.runner import RunOutcome, run_ab
from radixfleet_tools.loadtest.workloads import (
    API_COMPLETIONS,
    APIS,
    WORKLOADS,
    Trace,
    Workload,
    make_workload,
    parse_options,
)

log = logging.getLogger(__name__)


def parse_target(text: str) -> tuple[str, str]:
    """``NAME=URL`` or ``NAME=URL,URL,...`` (router replicas, client-side round robin)."""
    name, sep, url = text.partition("=")
    if not sep or not name or not all(u.startswith(("http://", "https://")) for u in url.split(",")):
        raise ConfigError("--target", f"{text!r} must be NAME=http://HOST:PORT[,http://HOST:PORT...]")
    return name, url


def add_load_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_workload: str | None,
    model_flag: bool = True,
    load_shapes: bool = False,
    arrival_shapes: bool = False,
) -> None:
    """Workload, arrival and bound flags shared by ``loadtest``, ``demo`` and ``simulate``.

    ``arrival_shapes`` (``simulate``; implied by ``load_shapes``): ``--burstiness``
    exists and ``--rate`` combines with ``--concurrency`` (a cap on requests in
    flight), the arrivals ``loadtest`` draws. ``load_shapes`` (``loadtest``): besides,
    ``--rate`` takes a list (a sweep), ``--dataset`` exists, and neither
    ``--workload`` nor ``--dataset`` is required when ``--trace`` is given."""
    arrival_shapes = arrival_shapes or load_shapes
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--workload",
        default=default_workload,
        required=default_workload is None and not load_shapes,
        help=f"one of {', '.join(WORKLOADS)}"
        + ("; or --dataset, or --trace FILE alone" if load_shapes else ""),
    )
    g.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a workload parameter (repeatable), e.g. -o groups=8; each workload's options are listed below",
    )
    if parser.epilog is None:
        parser.epilog = workload_options_help()
    g.add_argument(
        "--trace",
        metavar="FILE",
        help="trace workload: the JSONL file "
        "(Mooncake or a radixfleet traffic log); alone, it implies --workload trace",
    )
    g.add_argument("--time-scale", type=float, help="trace workload: timestamp multiplier (default 1.0)")
    g.add_argument("--skip-bad-lines", action="store_true", help="trace workload: skip malformed lines")
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    if load_shapes:
        from radixfleet_tools.loadtest.datasets import DATASETS

        d = parser.add_argument_group("datasets (instead of --workload)")
        d.add_argument(
            "--dataset",
            choices=DATASETS,
            help="random: random lengths (vllm bench serve's); sharegpt: a "
            "ShareGPT-format JSON/JSONL file (--dataset-path)",
        )
        d.add_argument("--dataset-path", metavar="FILE", help="--dataset sharegpt: the file")
        d.add_argument("--input-len", type=int, default=1024, help="--dataset random: prompt tokens")
        d.add_argument(
            "--output-len",
            type=int,
            default=None,
            help="output tokens (default: random 128; sharegpt: each answer's)",
        )
        d.add_argument(
            "--range-ratio",
            type=float,
            default=0.0,
            help="--dataset random: lengths uniform in [L*(1-r), L*(1+r)]",
        )
        d.add_argument(
            "--prefix-len", type=int, default=0, help="--dataset random: tokens shared by every prompt"
        )
        d.add_argument(
            "--dataset-api", choices=APIS, default=API_COMPLETIONS, help="the endpoint datasets are sent to"
        )
    a = parser.add_argument_group("arrivals and bounds")
    m = a if arrival_shapes else a.add_mutually_exclusive_group()
    if load_shapes:
        m.add_argument(
            "--rate",
            type=parse_rates,
            metavar="R[,R...]",
            help="open loop: arrivals per second; a list runs each rate in turn (a sweep, one table)",
        )
    else:
        m.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    if arrival_shapes:
        m.add_argument(
            "--burstiness",
            type=float,
            default=1.0,
            help="--rate: gamma shape of the gaps (1: Poisson; < 1 burstier)",
        )
    m.add_argument(
        "--concurrency",
        type=int,
        help="closed loop: requests in flight (default: 8; trace: its own "
        "timestamps)" + ("; with --rate: the cap on requests in flight" if arrival_shapes else ""),
    )
    a.add_argument(
        "--requests",
        type=int,
        default=None,
        help="stop after N requests (default: the whole workload or trace)",
    )
    a.add_argument(
        "--duration", type=float, default=None, help="stop dispatching after S seconds (default: no limit)"
    )
    a.add_argument("--drain", type=float, default=30.0, help="grace for in-flight requests at the end")
    a.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    if model_flag:
        a.add_argument("--model", help="model name (default: the target's first /v1/models entry)")
    a.add_argument(
        "--send-session", action="store_true", help="send the session id as the OpenAI 'user' field"
    )
    o = parser.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the report {'runs': [...]} here")
    o.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")


def workload_options_help() -> str:
    """Every workload's ``-o`` options with their defaults, one workload a line
    (generated from each workload's ``Params`` schema)."""
    lines = ["workload options (-o NAME=VALUE; default in brackets):"]
    for name, cls in WORKLOADS.items():
        lines.append(f"  {name}: {_options_line(cls)}")
    return "\n".join(lines)


def list_workloads() -> str:
    """Each built-in workload: its name, the first line of what it sends, its -o
    options, then one line per option (default, allowed values, doc), all generated
    from the workload's ``Params`` schema."""
    lines = []
    for name, cls in WORKLOADS.items():
        doc = cls.__doc__ or cls.Params.__doc__ or ""
        para = " ".join(doc.strip().split("\n\n")[0].split())
        first = para.split(". ")[0].rstrip(".")
        lines += [name, f"  {first}".rstrip(), f"  -o options: {_options_line(cls) or '(none)'}"]
        rows = reference(cls.Params)
        width = max((len(key) for key, *_ in rows), default=0)
        for key, default, allowed, help_text in rows:
            lines.append(f"    {key:<{width}}  {allowed.replace('`', '')}; default {default}: {help_text}")
    return "\n".join(lines)


def _options_line(cls: type[Workload]) -> str:
    return ", ".join(f"{key} [{default}]" for key, default, *_ in reference(cls.Params))


def parse_rates(text: str) -> list[float]:
    """``"2,4,8"`` -> [2.0, 4.0, 8.0] (argparse type: a bad list exits 2)."""
    out = []
    for part in text.split(","):
        try:
            r = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} in {text!r} is not a number") from None
        if not r > 0 or r == float("inf"):
            raise argparse.ArgumentTypeError(f"{r:g} must be > 0")
        out.append(r)
    return out


def parse_header(text: str) -> tuple[str, str]:
    """``"Name: value"`` (curl's syntax) -> (name, value); raises ``ConfigError``."""
    name, found, value = text.partition(":")
    name = name.strip()
    if not found or not name or any(c in name for c in ' \t()<>@,;\\"/[]?={}'):
        raise ConfigError("--header", f"{text!r} must be NAME:VALUE, e.g. 'x-tenant-id: a'")
    return name, value.strip()


def client_headers(args: argparse.Namespace) -> dict[str, str]:
    """Headers for every request: ``--header`` flags, and ``Authorization: Bearer`` from
    ``--api-key`` or ``$OPENAI_API_KEY`` unless a ``--header`` sets it."""
    headers: dict[str, str] = {}
    for h in args.header:
        name, value = parse_header(h)
        headers[name] = value
    key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    if key and not any(k.lower() == "authorization" for k in headers):
        headers["Authorization"] = f"Bearer {key}"
    return headers


def configure(parser: argparse.ArgumentParser) -> None:
    from radixfleet_tools.loadtest import ab

    parser.add_argument(
        "--list-workloads",
        action="store_true",
        help="print the built-in workloads, what each sends and its -o options, and exit",
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL[,URL...]",
        help="an OpenAI-compatible router (repeatable; run in the order given); "
        "several comma-separated URLs: replicas in client-side round "
        "robin; or --ab for a local fleet",
    )
    parser.add_argument(
        "--flush",
        action="append",
        default=[],
        metavar="URL",
        help="an agent to POST /flush_cache before each run (repeatable; "
        "default: the workers the router lists at /admin/workers, on its --admin listener)",
    )
    parser.add_argument(
        "--admin",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="the admin listener of target NAME's radixfleet router (admin.port): its "
        "/admin/workers names the agents to flush and the index's predictions (repeatable)",
    )
    parser.add_argument(
        "--allow-warm",
        action="store_true",
        help="run even when an agent's cache flush fails (the report then "
        "says cold_start: false) instead of stopping with an error",
    )
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="the fleet's KV capacity for pooled_hit_rate (default: from the agents)",
    )
    parser.add_argument(
        "--prefetch",
        choices=("on", "off"),
        default=None,
        help="a workload with a retriever lead (rag lead_ms): 'on' posts each request's known "
        "prefix to the router's /v1/prefetch at retrieval time and sends the request after "
        "the lead; 'off' only waits the lead (the baseline); absent: the lead is ignored",
    )
    c = parser.add_argument_group("client (as the OpenAI SDK behaves)")
    c.add_argument(
        "--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)"
    )
    c.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="a header sent with every request (repeatable)",
    )
    c.add_argument(
        "--retry",
        choices=RETRY_MODES,
        default="sdk",
        help="on 408/409/429/5xx: sdk retries as the OpenAI SDK does (Retry-After, "
        "else backoff 0.5-8 s); none: the refusal is the outcome",
    )
    c.add_argument("--max-retries", type=int, default=2, help="--retry sdk: retries per request")
    c.add_argument(
        "--max-failures",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="exit 1 when a run's failed share of requests exceeds this (0-1)",
    )
    r = parser.add_argument_group("metrics")
    r.add_argument(
        "--percentiles",
        default="50,90,99",
        metavar="P[,P...]",
        help="percentiles of TTFT, TPOT, ITL and E2E to report",
    )
    r.add_argument(
        "--slo",
        "--goodput",
        metavar="ttft_ms=MS,tpot_ms=MS,e2e_ms=MS",
        help="goodput: ok requests per second within every bound (vLLM's ttft:MS,tpot:MS also read)",
    )
    r.add_argument(
        "--requests-out",
        metavar="FILE",
        help="per-request export: JSONL, or CSV for a .csv name (send time, "
        "TTFT, TPOT, every inter-token gap, E2E, tokens, worker, status, retries; the "
        "router's available and predicted cached tokens where it sends them: --match-header)",
    )
    add_load_arguments(parser, default_workload=None, load_shapes=True)
    ab.add_arguments(parser)


def _make_workload(args: argparse.Namespace) -> Workload:
    """The workload the flags name: ``--dataset``, ``--workload``, or ``--trace`` alone."""
    dataset = getattr(args, "dataset", None)
    if hasattr(args, "dataset"):
        _check_dataset_flags(args)
    if dataset is not None:
        from radixfleet_tools.loadtest.datasets import make_dataset

        if args.workload is not None or args.trace is not None or args.option:
            raise WorkloadError("--dataset replaces --workload, --trace and -o: give one")
        params: dict = {"api": args.dataset_api}
        if dataset == "random":
            params.update(
                input_len=args.input_len,
                range_ratio=args.range_ratio,
                prefix_len=args.prefix_len,
                output_len=128 if args.output_len is None else args.output_len,
            )
            if args.requests is not None:
                params["requests"] = args.requests
        else:
            params.update(
                path=args.dataset_path or "", output_len=0 if args.output_len is None else args.output_len
            )
        return make_dataset(dataset, params, args.seed)
    if args.workload is None:
        if args.trace is None:
            raise WorkloadError("give --workload NAME, --dataset random|sharegpt, or --trace FILE")
        args.workload = "trace"
    options: dict = parse_options(args.option)
    if args.trace is not None:
        options["path"] = args.trace
    if args.time_scale is not None:
        options["time_scale"] = args.time_scale
    if args.skip_bad_lines:
        options["skip_bad_lines"] = True
    if args.workload != "trace" and (
        args.trace is not None or args.time_scale is not None or args.skip_bad_lines
    ):
        raise WorkloadError("--trace, --time-scale and --skip-bad-lines apply to --workload trace only")
    return make_workload(args.workload, options, args.seed)


#: flags of one dataset only -> the datasets they apply to (given elsewhere: an error)
_DATASET_FLAGS = {
    "input_len": ("random",),
    "range_ratio": ("random",),
    "prefix_len": ("random",),
    "dataset_path": ("sharegpt",),
    "output_len": ("random", "sharegpt"),
    "dataset_api": ("random", "sharegpt"),
}


def _check_dataset_flags(args: argparse.Namespace) -> None:
    """Raises ``WorkloadError`` for a dataset flag that the chosen traffic would ignore."""
    defaults = {
        "input_len": 1024,
        "range_ratio": 0.0,
        "prefix_len": 0,
        "dataset_path": None,
        "output_len": None,
        "dataset_api": API_COMPLETIONS,
    }
    for dest, datasets in _DATASET_FLAGS.items():
        if getattr(args, dest) != defaults[dest] and args.dataset not in datasets:
            flag = "--" + dest.replace("_", "-")
            raise WorkloadError(f"{flag} applies to --dataset {' or '.join(datasets)} only")


def build_load(args: argparse.Namespace) -> tuple[Workload, object, Bounds]:
    """Workload, arrivals and bounds from parsed flags; raises ``WorkloadError``.
    ``args.rate`` is one rate (a sweep calls this once per rate)."""
    workload = _make_workload(args)
    burstiness = getattr(args, "burstiness", 1.0)
    arrivals: Poisson | Closed | TraceTimes
    if args.rate is not None:
        arrivals = Poisson(args.rate, burstiness=burstiness, max_concurrency=args.concurrency)
    elif burstiness != 1.0:
        raise WorkloadError("--burstiness shapes --rate arrivals: give --rate too")
    elif args.concurrency is not None:
        arrivals = Closed(args.concurrency)
    elif isinstance(workload, Trace):
        arrivals = TraceTimes()
    else:
        arrivals = Closed(8)
    if isinstance(workload, Trace) and getattr(workload, "skipped", None):
        log.warning(
            "trace: skipped %d bad lines (first: line %d)", len(workload.skipped), workload.skipped[0]
        )
    return workload, arrivals, Bounds(args.requests, args.duration, args.drain)


def emit(outcomes: list[RunOutcome], args: argparse.Namespace) -> None:
    from radixfleet_tools.loadtest import metrics

    runs = [o.report for o in outcomes]
    render_table(runs)
    if all("percentiles" in r for r in runs):
        metrics.render_latency(runs)
    sweep = any("offered_rate" in r for r in runs)
    if sweep:
        metrics.render_sweep(runs)
    if args.json:
        write_json(args.json, runs)
        print(f"report: {args.json}")
    if getattr(args, "requests_out", None):
        n = metrics.write_requests(args.requests_out, [(o.report["name"], o.results) for o in outcomes])
        print(f"requests: {args.requests_out} ({n} records)")
    if args.plots:
        paths = write_plots(runs, args.plots, {o.report["name"]: o.ttft_ms for o in outcomes})
        if sweep:
            paths.append(metrics.write_sweep_plot(runs, args.plots))
        print("plots: " + ", ".join(paths))


def _metric_options(args: argparse.Namespace):
    from radixfleet_tools.loadtest.metrics import MetricOptions, parse_percentiles, parse_slo

    return MetricOptions(parse_percentiles(args.percentiles), parse_slo(args.slo) if args.slo else {})


def _finish(outcomes: list[RunOutcome], args: argparse.Namespace) -> int:
    """Prints and writes the results; the exit status: 1 when a run failed more than
    ``--max-failures`` allows (said on stderr), else 0."""
    from radixfleet_tools.loadtest.metrics import over_failure_limit

    emit(outcomes, args)
    over = over_failure_limit([o.report for o in outcomes], args.max_failures)
    for line in over:
        print(f"radixfleet loadtest: {line}", file=sys.stderr)
    return 1 if over else 0


def run(args: argparse.Namespace) -> int:
    from radixfleet_tools.loadtest.metrics import enrich

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.list_workloads:
        print(list_workloads())
        return 0
    if not 0.0 <= args.max_failures <= 1.0:
        raise ConfigError("--max-failures", f"must be a share in [0, 1], got {args.max_failures:g}")
    mopts = _metric_options(args)
    if args.ab:
        return _run_local_ab(args, mopts)
    if not args.target:
        raise ConfigError(
            "--target", "give at least one --target NAME=URL, or --ab radix|policy for a local fleet"
        )
    targets = [parse_target(t) for t in args.target]
    admin_urls = {}
    for item in args.admin:
        name, sep, url = item.partition("=")
        urls = [u for n, u in targets if n == name]
        if not sep or not url or not urls:
            raise ConfigError("--admin", f"expected NAME=URL for a --target NAME, got {item!r}")
        admin_urls[urls[0]] = url.rstrip("/")
    names = [n for n, _ in targets]
    if len(set(names)) != len(names):
        raise ConfigError("--target", "target names must be unique")
    headers = client_headers(args)
    retry = RetryPolicy(args.retry, args.max_retries)
    rates = args.rate or [None]
    # every rate's load is built (and checked) before the first request goes out
    loads = [build_load(argparse.Namespace(**{**vars(args), "rate": rate})) for rate in rates]
    if args.kv_capacity_tokens is not None and args.kv_capacity_tokens <= 0:
        raise ConfigError("--kv-capacity-tokens", "must be > 0")
    check_outputs(
        files=[("--json", args.json), ("--requests-out", args.requests_out)], dirs=[("--plots", args.plots)]
    )
    if args.plots:
        require_plots()
    outcomes: list[RunOutcome] = []
    for rate, (workload, arrivals, bounds) in zip(rates, loads):
        outs = asyncio.run(
            run_ab(
                targets,
                workload,
                arrivals,
                bounds,
                flush_urls=[u.rstrip("/") for u in args.flush],
                kv_capacity_tokens=args.kv_capacity_tokens,
                model=args.model,
                timeout_s=args.timeout,
                send_session=args.send_session,
                progress=False if args.no_progress else None,
                allow_warm=args.allow_warm,
                headers=headers,
                retry=retry,
                prefetch=None if args.prefetch is None else args.prefetch == "on",
                admin_urls=admin_urls,
            )
        )
        for o in outs:
            enrich(o.report, o.results, mopts)
            if len(rates) > 1:
                o.report["target_name"] = o.report["name"]
                o.report["name"] = f"{o.report['name']}@{rate:g}/s"
                o.report["offered_rate"] = rate
        outcomes += outs
    return _finish(outcomes, args)


def _run_local_ab(args: argparse.Namespace, mopts) -> int:
    from radixfleet_tools.loadtest import ab
    from radixfleet_tools.loadtest.metrics import enrich

    if args.target or args.flush or args.admin:
        raise ConfigError("--ab", "starts its own fleet: drop --target, --flush and --admin")
    if args.rate and len(args.rate) > 1:
        raise ConfigError("--rate", "--ab runs one rate; sweep with --target")
    args.rate = args.rate[0] if args.rate else None
    ab.arms(args)  # flag errors before anything starts
    workload, arrivals, bounds = build_load(args)
    check_outputs(
        files=[("--json", args.json), ("--requests-out", args.requests_out)], dirs=[("--plots", args.plots)]
    )
    if args.plots:
        require_plots()
    outcomes = ab.run_local(args, workload, arrivals, bounds)
    for o in outcomes:
        enrich(o.report, o.results, mopts)
    status = _finish(outcomes, args)
    for line in ab.worth([o.report for o in outcomes], args.ab):
        print(line)
    return status
