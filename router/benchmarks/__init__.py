"""``radixfleet bench NAME``: benchmarks that print their figures (and ``--json``).

Each benchmark is a module here exposing ``configure(parser)`` and ``run(args)``,
like a CLI subcommand. Results, with the command that produced them, are written
down in ``bench/RESULTS.md``. Benchmarks are never part of the test run; the seeded
figures are (``reproduce``, through ``tests/test_results_reproduce.py``).
"""

from __future__ import annotations

import argparse
import importlib

#: name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "index": ("router.benchmarks.index", "prefix index: inserts/s, matches/s, bytes per block"),
    "proxy": ("router.benchmarks.proxy", "proxy throughput and added latency vs direct and smg"),
    "routing": ("router.benchmarks.routing", "routing work per request: keys + match + policy"),
    "policy": ("router.benchmarks.policy", "policy decision cost with 16 workers"),
    "agent": ("router.benchmarks.agent", "agent: cached TTFT, cost model, bookkeeping req/s"),
    "sim": ("router.benchmarks.sim", "simulator: simulated requests per wall second"),
    "fidelity": ("router.benchmarks.fidelity", "simulator vs a live fleet: hit rate and TTFT"),
    "events": ("router.benchmarks.events", "KV events: decode + map + index blocks/s, bytes per block"),
    "overload": ("router.benchmarks.overload", "shedding at 4x capacity with default settings"),
    "reproduce": ("router.benchmarks.reproduce",
                  "re-run the seeded figures of bench/RESULTS.md; exit 1 if any differs"),
    "replicas": ("router.benchmarks.replicas", "N router replicas on the NATS bus vs one router: "
                 "hit rate and TTFT"),
    "traffic_log": ("router.benchmarks.traffic_log", "routing p99 with the traffic log on vs off"),
    "analyze": ("router.benchmarks.analyze", "radixfleet analyze on a 100,000-request traffic log"),
    "autoscale": ("router.benchmarks.autoscale", "prefix-aware vs queue-depth autoscaling, flash crowd"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True,
                                parser_class=type(parser))
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
