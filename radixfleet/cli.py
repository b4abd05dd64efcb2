"""The one command line, ``radixfleet`` (contract 5, docs/DESIGN.md).

Each subcommand lives in the module that owns the work; this file only knows the
table below. A subcommand module exposes::

    configure(parser: argparse.ArgumentParser) -> None   # adds its arguments
    run(args: argparse.Namespace) -> int                  # the exit status

Modules are imported only when their subcommand is chosen, so ``radixfleet --help``
stays fast. Bad input exits 2 with one line on stderr; ``RadixfleetError`` raised by
a subcommand is reported the same way.

SIGTERM leaves every subcommand but the servers as Ctrl-C does (exit 130, ``up``: 0):
the interrupt unwinds the ``with`` blocks that stop what the command started (a
bench's fleet, the demo's agents), which a process killed by the default action
would leave running in their own process groups. The servers (``router``,
``agent``) drain on SIGTERM themselves.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from radixfleet.wire.cli_args import HelpFormatter
from radixfleet.wire.errors import RadixfleetError
from radixfleet_tools.bench import BENCHMARKS

#: name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "router": ("radixfleet.server.cli", "run the cache-aware router (reverse proxy)"),
    "agent": ("radixfleet_tools.agent.cli", "run a worker agent (simulated GPU engine or sidecar)"),
    "gateway": (
        "radixfleet.gateway.envoy",
        "run Envoy with radixfleet as its endpoint picker (Gateway API inference)",
    ),
    "up": ("radixfleet_tools.loadtest.local_fleet", "run a local fleet: N simulated agents and a router"),
    "demo": ("radixfleet_tools.loadtest.demo", "start a local fleet, load-test three policies, compare"),
    "loadtest": ("radixfleet_tools.loadtest.cli", "drive a workload against one or more routers (A/B)"),
    "simulate": (
        "radixfleet_tools.loadtest.simulator.cli",
        "simulate a fleet and its policies in virtual time",
    ),
    "analyze": (
        "radixfleet_tools.loadtest.analyze",
        "the cache-size knee, Zipf head and policy replay of a traffic log",
    ),
    "bench": ("radixfleet_tools.bench", "run a benchmark: " + ", ".join(BENCHMARKS)),
    "check-config": ("radixfleet.config", "validate a router YAML file (exit 0 or 2)"),
    "config-reference": (
        "radixfleet.config.reference",
        "print the router YAML key tables (deploy/README.md), made from the schema",
    ),
}


#: subcommands that handle SIGTERM themselves (a graceful drain)
SERVERS = frozenset({"router", "agent", "gateway"})


def interrupt_on_sigterm() -> None:
    """From now on the first SIGTERM raises ``KeyboardInterrupt`` in the main thread;
    later ones (a supervisor and the wrapper it signals both) are ignored, so they
    cannot interrupt the stopping itself."""
    received = False

    def on_term(signum, frame):
        nonlocal received
        if received:
            return
        received = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``radixfleet X: error: ...`` and exit 2."""

    #: set on the chosen subcommand's parser: the arguments after its name (read by
    #: nested dispatchers such as ``bench``)
    radixfleet_argv: list[str]

    def error(self, message: str):  # noqa: D401 - argparse's signature
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="radixfleet",
        description="A fleet-level, cache-aware router for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"radixfleet {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name == chosen:
            # nested dispatchers (``bench``) read the arguments after their name
            p.radixfleet_argv = argv[argv.index(name) + 1 :]
            mod = importlib.import_module(module)
            mod.configure(p)
            p.set_defaults(_run=mod.run)
    return parser


def version() -> str:
    """The installed distribution's version, else the source tree's (pyproject.toml)."""
    from importlib import metadata

    try:
        return metadata.version("radixfleet")
    except metadata.PackageNotFoundError:
        import pathlib

        import tomllib

        path = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            return tomllib.loads(path.read_text())["project"]["version"]
        except (OSError, KeyError, ValueError):
            return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(argv)  # imports the chosen subcommand's module
    except RadixfleetError as exc:  # MissingExtra: a module of an extra not installed
        print(f"radixfleet: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if not argv else 2
    if args.command not in SERVERS:
        interrupt_on_sigterm()
    try:
        return int(args._run(args) or 0)
    except RadixfleetError as exc:
        print(f"radixfleet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
