"""``radixfleet bench NAME``: benchmarks that print their figures (and ``--json``).

Each benchmark is a module here exposing ``configure(parser)`` and ``run(args)``,
like a CLI subcommand (``BENCHMARKS`` below names them: index, proxy, routing,
policy, agent, sim, fidelity, events, overload, priority, reproduce, replicas,
traffic_log, analyze, autoscale, loadgen, disagg, saturation, and ``script``:
``bench/NAME.py`` of a checkout, the live benchmarks kept outside the wheel). Two modules are helpers, not
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
    "index": ("radixfleet_tools.bench.index", "prefix index: inserts/s, matches/s, bytes per block"),
    "proxy": ("radixfleet_tools.bench.proxy", "proxy throughput and added latency vs direct and smg"),
    "routing": ("radixfleet_tools.bench.routing", "routing work per request: keys + match + policy"),
    "policy": ("radixfleet_tools.bench.policy", "policy decision cost with 16 workers"),
    "agent": ("radixfleet_tools.bench.agent", "agent: cached TTFT, cost model, bookkeeping req/s"),
    "sim": ("radixfleet_tools.bench.sim", "simulator: simulated requests per wall second"),
    "fidelity": ("radixfleet_tools.bench.fidelity", "simulator vs a live fleet: hit rate and TTFT"),
    "events": ("radixfleet_tools.bench.events", "KV events: decode + map + index blocks/s, bytes per block"),
    "overload": ("radixfleet_tools.bench.overload", "shedding at 4x capacity with default settings"),
    "priority": ("radixfleet_tools.bench.priority", "three priority classes at 2x capacity: who is shed"),
    "reproduce": (
        "radixfleet_tools.bench.reproduce",
        "re-run the seeded figures of bench/RESULTS.md; exit 1 if any differs",
    ),
    "replicas": (
        "radixfleet_tools.bench.replicas",
        "N router replicas on the NATS bus vs one router: hit rate and TTFT",
    ),
    "traffic_log": ("radixfleet_tools.bench.traffic_log", "routing p99 with the traffic log on vs off"),
    "analyze": ("radixfleet_tools.bench.analyze", "radixfleet analyze on a 100,000-request traffic log"),
    "autoscale": ("radixfleet_tools.bench.autoscale", "prefix-aware vs queue-depth autoscaling, flash crowd"),
    "loadgen": (
        "radixfleet_tools.bench.loadgen",
        "the load generator's own overhead: loadtest vs a minimal client on a fast stub",
    ),
    "disagg": (
        "radixfleet_tools.bench.disagg",
        "colocated vs disaggregated prefill/decode (simulated), same GPUs",
    ),
    "saturation": (
        "radixfleet_tools.bench.saturation",
        "goodput at 1.5x capacity, live: prefix_load (events, none) vs smg vs round robin",
    ),
    "script": (
        "radixfleet_tools.bench.script",
        "a live benchmark kept outside the wheel: bench/NAME.py of this checkout",
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
