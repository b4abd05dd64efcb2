"""The scripts under bench/ are files, not a package: ``load_script`` imports one for
its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_script(filename: str) -> ModuleType:
    """bench/``filename`` as a module (registered in ``sys.modules`` under a name of
    its own, so its dataclasses and pickling resolve)."""
    name = Path(filename).stem + "_under_test"
    spec = importlib.util.spec_from_file_location(name, _BENCH / filename)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
