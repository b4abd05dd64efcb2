"""argparse pieces that make every ``radixfleet`` subcommand read the same (contract 5).

- ``HelpFormatter``: descriptions and epilogs keep their line breaks, and every
  option's help ends with its default — unless the help already names one, or the
  default is empty (None, False, [], a sentinel meaning "from the config").
- ``log_level``: the ``--log-level`` type: DEBUG, INFO, WARNING, ERROR in any case,
  returned upper-case (``logging`` takes that).
- ``DeprecatedAlias``: an old flag spelling that still works, warning once on stderr
  that it is deprecated and naming the flag to use.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Raw description/epilog, and ``(default: X)`` after an option's help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if not text or text is argparse.SUPPRESS or not action.option_strings:
            return text
        d = action.default
        if "default" in text or d is argparse.SUPPRESS or isinstance(d, bool):
            return text
        if d is None or d == [] or not isinstance(d, (str, int, float)):
            return text
        return text + " (default: %(default)s)"


def log_level(text: str) -> str:
    """argparse type for ``--log-level``: a level name in any case -> upper-case."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(LOG_LEVELS)}, any case)"
        )
    return level


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores as the new one does and warns on stderr.

    ``parser.add_argument("--old", dest="new", action=DeprecatedAlias, use="--new",
    nargs=0)`` for a switch (stores True), or without ``nargs`` for a valued flag;
    with ``append=True`` the value is appended to the new flag's list. Hidden from
    ``--help`` (the new flag's help is the documentation)."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        use: str,
        append: bool = False,
        nargs: int | str | None = None,
        **kw: Any,
    ) -> None:
        kw["help"] = argparse.SUPPRESS
        kw.setdefault("default", argparse.SUPPRESS)  # never overwrite the new flag's default
        super().__init__(option_strings, dest, nargs=nargs, **kw)
        self.use = use
        self.append = append

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.use}", file=sys.stderr)
        if self.nargs == 0:
            values = True
        if self.append:
            values = list(getattr(namespace, self.dest, None) or []) + [values]
        setattr(namespace, self.dest, values)
