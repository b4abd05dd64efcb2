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

``launch_args(params)``: the ``smg launch`` settings an A/B arm may choose
(``smg[policy=round_robin]``: the same policy through both routers measures the
path, not the routing), checked here so a bad one fails before anything starts.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from radixfleet.wire.errors import ConfigError, RunError

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
                out.append(Path(str(dist.locate_file(f))).resolve())
    return list(dict.fromkeys(out))


def find_smg() -> str | None:
    """The path of an executable ``smg``, or None (see the module docstring)."""
    for p in candidates():
        if _executable(p):
            return str(p)
    return shutil.which(BINARY)


def missing_message() -> str:
    looked = ", ".join(str(p) for p in candidates())
    return (
        f"SGLang's router binary '{BINARY}' was not found (looked at {looked} and on "
        f"PATH); it ships in the {DISTRIBUTION} wheel of radixfleet's test extra: "
        f"{sys.executable} -m pip install -e '.[test]'"
    )


def require_smg() -> str:
    """``find_smg()``, or ``RunError`` with ``missing_message()``."""
    path = find_smg()
    if path is None:
        raise RunError(missing_message())
    return path


#: smg's policies an arm may name (its --policy; ``manual`` needs routing keys)
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
#: arm parameter -> (smg flag, the check it must pass, what the check says)
_SETTINGS = {
    "cache_threshold": ("--cache-threshold", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "balance_abs_threshold": ("--balance-abs-threshold", lambda v: v >= 0 and v == int(v), "an integer >= 0"),
    "balance_rel_threshold": ("--balance-rel-threshold", lambda v: v >= 1.0, "a number >= 1"),
}


def launch_args(params: dict, where: str = "smg") -> list[str]:
    """``smg launch`` flags for an arm's parameters (default: ``--policy cache_aware``,
    its other settings at smg's defaults). Raises ``ConfigError`` naming
    ``{where}.params.<name>`` for an unknown name or a bad value."""
    policy = params.get("policy", "cache_aware")
    if policy not in POLICIES:
        raise ConfigError(f"{where}.params.policy", f"expected one of {', '.join(POLICIES)}, got {policy!r}")
    out = ["--policy", policy]
    for name, value in params.items():
        if name == "policy":
            continue
        if name not in _SETTINGS:
            valid = ", ".join(["policy", *_SETTINGS])
            raise ConfigError(f"{where}.params.{name}", f"unknown smg setting; valid: {valid}")
        flag, ok, expected = _SETTINGS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ConfigError(f"{where}.params.{name}", f"expected {expected}, got {value!r}")
        out += [flag, str(int(value) if name == "balance_abs_threshold" else value)]
    return out
