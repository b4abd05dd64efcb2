"""``radixfleet bench NAME``: benchmarks that print their figures (and ``--json``).

Each benchmark is a module here exposing ``configure(parser)`` and ``run(args)``,
like a CLI subcommand (``BENCHMARKS`` below names them: index, proxy, routing,
policy, agent, sim, fidelity, events, overload, priority, reproduce, replicas,
traffic_log, analyze, autoscale, loadgen, disagg, saturation). Two modules are helpers, not
benchmarks: ``wire`` (the proxy benchmark's lean upstream and counting client) and
``tiny_tokenizer`` (the tiny test model's tokenizer). Results, with the command
that produced them, are written down in ``bench/RESULTS.md``. Benchmarks are never
part of the test run; the seeded figures are (``reproduce``, through
``tests/bench/test_results_reproduce.py``).
"""

from __future__ import annotations

import argparse
import importlib

#: name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "index": ("radixfleet.bench.index", "prefix index: inserts/s, matches/s, bytes per block"),
    "proxy": ("radixfleet.bench.proxy", "proxy throughput and added latency vs direct and smg"),
    "routing": ("radixfleet.bench.routing", "routing work per request: keys + match + policy"),
    "policy": ("radixfleet.bench.policy", "policy decision cost with 16 workers"),
    "agent": ("radixfleet.bench.agent", "agent: cached TTFT, cost model, bookkeeping req/s"),
    "sim": ("radixfleet.bench.sim", "simulator: simulated requests per wall second"),
    "fidelity": ("radixfleet.bench.fidelity", "simulator vs a live fleet: hit rate and TTFT"),
    "events": ("radixfleet.bench.events", "KV events: decode + map + index blocks/s, bytes per block"),
    "overload": ("radixfleet.bench.overload", "shedding at 4x capacity with default settings"),
    "priority": ("radixfleet.bench.priority", "three priority classes at 2x capacity: who is shed"),
    "reproduce": (
        "radixfleet.bench.reproduce",
        "re-run the seeded figures of bench/RESULTS.md; exit 1 if any differs",
    ),
    "replicas": (
        "radixfleet.bench.replicas",
        "N router replicas on the NATS bus vs one router: hit rate and TTFT",
    ),
    "traffic_log": ("radixfleet.bench.traffic_log", "routing p99 with the traffic log on vs off"),
    "analyze": ("radixfleet.bench.analyze", "radixfleet analyze on a 100,000-request traffic log"),
    "autoscale": ("radixfleet.bench.autoscale", "prefix-aware vs queue-depth autoscaling, flash crowd"),
    "loadgen": (
        "radixfleet.bench.loadgen",
        "the load generator's own overhead: loadtest vs a minimal client on a fast stub",
    ),
    "disagg": ("radixfleet.bench.disagg", "colocated vs disaggregated prefill/decode (simulated), same GPUs"),
    "saturation": (
        "radixfleet.bench.saturation",
        "goodput at 1.5x capacity, live: prefix_load (events, none) vs smg vs round robin",
    ),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True, parser_class=type(parser))
    rest = getattr(parser, "radixfleet_argv", [])
    chosen = next((a for a in rest if not a.startswith("-")), None)
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.configure(p)
            p.set_defaults(_bench_run=mod.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
