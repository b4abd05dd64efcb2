"""``radixfleet bench script NAME [ARGS...]``: the live benchmarks that stay outside the
wheel, ``bench/NAME.py`` of a checkout, run as ``python3 bench/NAME.py ARGS`` would run
them (real vLLM servers, SGLang's gateway, CPU profiles of a live router: what needs
more than the package). The checkout is the working directory, or the first folder
above it, that holds ``bench/RESULTS.md``; ``radixfleet bench script --list`` names
the scripts. Their results are written down in ``bench/RESULTS.md`` like the others.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from radixfleet.wire.errors import ConfigError


def checkout(start: Path | None = None) -> Path | None:
    """The nearest folder at or above ``start`` (the working directory) holding
    ``bench/RESULTS.md``; None outside a checkout."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "bench" / "RESULTS.md").is_file():
            return folder
    return None


def scripts(root: Path) -> list[str]:
    """The names of ``bench/*.py`` in ``root``."""
    return sorted(p.stem for p in (root / "bench").glob("*.py") if not p.name.startswith("_"))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list", action="store_true", help="print the scripts of this checkout and exit")
    parser.add_argument("name", nargs="?", metavar="NAME", help="the script: bench/NAME.py of the checkout")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="its own arguments (NAME --help lists them)"
    )


def run(args: argparse.Namespace) -> int:
    root = checkout()
    if root is None:
        raise ConfigError("script", "no checkout here: run it from a clone of radixfleet (bench/RESULTS.md)")
    names = scripts(root)
    if args.list or not args.name:
        print("\n".join(names))
        return 0 if args.list else 2
    if args.name not in names:
        raise ConfigError("script", f"no bench/{args.name}.py; the scripts: {', '.join(names)}")
    path = root / "bench" / f"{args.name}.py"
    argv, sys.argv = sys.argv, [str(path), *args.args]
    sys.path.insert(0, str(root))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = argv
        sys.path.remove(str(root))
    return 0
