"""``radixfleet config-reference``: deploy/README.md's key tables, made from the declared
schema (``radixfleet.config``'s sections and each policy's ``Params``), so the reference
cannot drift from what the router accepts. Prints the tables; ``--write FILE``
replaces the block between ``BEGIN`` and ``END`` in FILE (``tests/config/test_messages``
checks that deploy/README.md's block is current).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from radixfleet.config import Config, DiscoveryConfig
from radixfleet.policies.registry import describe_policies
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import keys_of, reference

BEGIN = (
    "<!-- BEGIN config-reference: made by `radixfleet config-reference --write "
    "deploy/README.md` from radixfleet/config/; do not edit by hand -->"
)
END = "<!-- END config-reference -->"


def _table(title: str, rows: list[tuple[str, str, str, str]]) -> list[str]:
    return (
        [f"#### {title}", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        + [f"| `{k}` | `{d}` | {a} | {m.replace('|', '/').replace('*', '&#42;')} |" for k, d, a, m in rows]
        + [""]
    )


def tables() -> str:
    """The generated block, markers included."""
    lines = [BEGIN, ""]
    rows = reference(Config)
    for name, f in keys_of(Config).items():
        lines += _table(
            f"`{name}` — {f.description}",
            [r for r in rows if r[0] == name or r[0].startswith((f"{name}.", f"{name}["))],
        )
        if name == "workers":
            lines += _table(
                "`workers.discovery` — workers found in Kubernetes or DNS",
                reference(DiscoveryConfig, "workers.discovery"),
            )
    for policy, params in describe_policies().items():
        lines += (
            _table(
                f"`policy.params` of `{policy}`",
                [(p["name"], str(p["default"]).lower(), p["expected"], p["doc"]) for p in params],
            )
            if params
            else []
        )
    return "\n".join(lines + [END])


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--write", metavar="FILE", help="replace the generated block of FILE (deploy/README.md)"
    )


def run(args: argparse.Namespace) -> int:
    if not args.write:
        print(tables())
        return 0
    text = Path(args.write).read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ConfigError("", f"{args.write}: no generated block ({BEGIN!r} ... {END!r})")
    Path(args.write).write_text(text[:start] + tables() + text[end + len(END) :], encoding="utf-8")
    return 0
