"""Finding SGLang's router binary, ``smg``, for the comparisons that run it.

``smg`` ships in the ``sglang-router`` wheel, pinned in radixfleet's ``test`` extra
(``pip install -e '.[test]'``). Its console script lands in the ``bin`` folder of
the environment that installed it, which need not be on ``PATH`` (a venv used
through its interpreter, a pyenv shim that is not set up). So it is looked for, in
order:

1. next to ``sys.executable`` (a venv's ``bin``, the interpreter's own folder);
2. in this interpreter's scripts folder (``sysconfig``);
3. among the files the ``sglang-router`` distribution installed (its ``RECORD``);
4. on ``PATH``.

Missing is never silent: ``require_smg()`` raises ``RunError`` with
``missing_message()``, which says where it looked and how to install it; the
benchmark stops with that message (unless ``--no-smg``) and the integration test
fails with it.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from protocol.errors import RunError

#: the distribution that ships the binary (pinned in pyproject's test extra)
DISTRIBUTION = "sglang-router"
BINARY = "smg"


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def candidates() -> list[Path]:
    """Where ``find_smg`` looks, in order (PATH last, not listed here)."""
    out = [Path(sys.executable).parent / BINARY]
    scripts = sysconfig.get_path("scripts")
    if scripts:
        out.append(Path(scripts) / BINARY)
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if f.name == BINARY:
                out.append(Path(dist.locate_file(f)).resolve())
    return list(dict.fromkeys(out))


def find_smg() -> str | None:
    """The path of an executable ``smg``, or None (see the module docstring)."""
    for p in candidates():
        if _executable(p):
            return str(p)
    return shutil.which(BINARY)


def missing_message() -> str:
    looked = ", ".join(str(p) for p in candidates())
    return (f"SGLang's router binary '{BINARY}' was not found (looked at {looked} and on "
            f"PATH); it ships in the {DISTRIBUTION} wheel of radixfleet's test extra: "
            f"{sys.executable} -m pip install -e '.[test]'")


def require_smg() -> str:
    """``find_smg()``, or ``RunError`` with ``missing_message()``."""
    path = find_smg()
    if path is None:
        raise RunError(missing_message())
    return path
