"""The package declares every third-party module it imports.

A dependency installed by hand on a developer's machine hides a missing
declaration until the quick start runs on a fresh one (``rich`` was imported by
the report tables and never declared: ``radixfleet demo`` and ``simulate`` then
crashed at their last step). This walks every module's imports with ``ast`` and
checks each non-stdlib, non-project top-level name against ``pyproject.toml``:
runtime packages against ``[project].dependencies`` and the feature extras
(engines, k8s, bus, plots, tracing: imported lazily, tests/repo/test_extras.py), test modules
against those plus the ``test`` extra.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import pathlib
import re
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[2]
OWN = {"radixfleet", "radixfleet_tools", "tests"}
#: scripts that run under another interpreter than the project's, with why
OTHER_ENV = {
    "tests/engines/make_tiny_llama.py": "runs in the vLLM venv (radixfleet_tools/harness/vllm_env.py), which "
    "has torch",
}


def _declared(reqs: list[str]) -> set[str]:
    names = set()
    for r in reqs:
        name = re.match(r"[A-Za-z0-9_.\-]+", r).group(0)
        names.add(re.sub(r"[-_.]+", "-", name).lower())
    return names


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _undeclared(dirs: list[str], allowed: set[str]) -> dict[str, set[str]]:
    dists = md.packages_distributions()  # top-level module -> distributions
    missing: dict[str, set[str]] = {}
    for d in dirs:
        for path in (ROOT / d).rglob("*.py"):
            if str(path.relative_to(ROOT)) in OTHER_ENV:
                continue
            for mod in _imports(path):
                if mod in OWN or mod in sys.stdlib_module_names or mod == "__future__":
                    continue
                provided = {re.sub(r"[-_.]+", "-", x).lower() for x in dists.get(mod, [mod])}
                if not provided & allowed:
                    missing.setdefault(mod, set()).add(str(path.relative_to(ROOT)))
    return missing


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


#: the extras a feature needs (radixfleet/wire/extras.py); ``test`` and ``dev`` pull them all
FEATURE_EXTRAS = ("engines", "k8s", "bus", "plots", "tracing", "gateway")


def _runtime(proj: dict) -> set[str]:
    extras = proj["optional-dependencies"]
    return _declared(proj["dependencies"]).union(*(_declared(extras[e]) for e in FEATURE_EXTRAS))


def test_runtime_imports_are_declared_dependencies():
    runtime = _runtime(_project())
    missing = _undeclared(["radixfleet", "radixfleet_tools"], runtime)
    assert not missing, f"imported but not in [project].dependencies or an extra: {missing}"


def test_the_test_extra_pulls_every_feature_extra():
    test = _project()["optional-dependencies"]["test"]
    assert f"radixfleet[{','.join(FEATURE_EXTRAS)}]" in test


def test_test_imports_are_declared_in_the_test_extra():
    proj = _project()
    allowed = _runtime(proj) | _declared(proj["optional-dependencies"]["test"])
    missing = _undeclared(["tests"], allowed)
    assert not missing, f"tests import modules missing from the test extra: {missing}"
