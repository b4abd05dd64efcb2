"""The schema's layout (radixfleet/config/): a section per module, each section and key
documented where it is declared, the engine kinds and roles declared once, every
name callers import still importable from ``radixfleet.config``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Literal, get_args, get_origin

import radixfleet.config as config
from radixfleet.config import (
    WORKER_KINDS,
    Config,
    DnsServiceSpec,
    K8sSelectorSpec,
    WorkerSpec,
)
from radixfleet.config.kinds import EngineKind, Role
from radixfleet.wire.settings import keys_of, optional_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "router" / "config"
#: the most lines a product module may have
MAX_LINES = 800


def _sections(cls: type, seen: dict[type, str], path: str = "") -> dict[type, str]:
    """Every settings class reachable from ``cls``: {class: the path of its first use}."""
    seen.setdefault(cls, path or "(the document)")
    for name, f in keys_of(cls).items():
        tp = optional_of(f.annotation)
        for inner in (tp, *get_args(tp)):
            if hasattr(inner, "__pydantic_fields__") and inner not in seen:
                _sections(inner, seen, f"{path}.{name}".lstrip("."))
    return seen


ALL = _sections(Config, {})
ALL = _sections(config.DiscoveryConfig, ALL, "workers.discovery")


def test_every_section_and_key_is_documented_where_it_is_declared():
    undocumented = [
        f"{path} ({cls.__name__})"
        for cls, path in ALL.items()
        if cls.__module__.startswith("radixfleet.config.") and not (cls.__doc__ or "").strip()
    ]
    assert not undocumented, f"sections without a docstring: {undocumented}"
    bare = [
        f"{path}.{name}" for cls, path in ALL.items() for name, f in keys_of(cls).items() if not f.description
    ]
    assert not bare, f"keys without a doc: {bare}"


def test_each_section_lives_in_the_package_and_no_module_is_too_long():
    # tenancy: declared with its rules in radixfleet.route.tenancy (and its queue's module)
    outside = [
        f"{path} ({c.__module__})"
        for c, path in ALL.items()
        if not c.__module__.startswith("radixfleet.config.") and not path.startswith("tenancy")
    ]
    assert not outside, f"sections declared outside radixfleet/config/: {outside}"
    long = {p.name: n for p in PACKAGE.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _choices(cls: type, key: str) -> tuple:
    tp = cls.__pydantic_fields__[key].annotation
    assert get_origin(tp) is Literal, tp
    return get_args(tp)


def test_the_engine_kinds_and_roles_are_declared_once():
    assert WORKER_KINDS == get_args(EngineKind) == ("agent", "vllm", "sglang", "openai")
    assert _choices(WorkerSpec, "kind") == ("auto", *WORKER_KINDS)
    for cls in (K8sSelectorSpec, DnsServiceSpec):
        assert _choices(cls, "kind") == WORKER_KINDS
    for cls in (WorkerSpec, K8sSelectorSpec, DnsServiceSpec):
        assert _choices(cls, "role") == get_args(Role)
    literals = []
    for p in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and node.value == "sglang" and p.name != "kinds.py":
                literals.append(f"{p.name}:{node.lineno}")
    assert not literals, f"an engine kind written outside radixfleet/config/kinds.py: {literals}"


def test_what_callers_import_is_still_importable_from_router_config():
    """Every ``from radixfleet.config import X`` of the tree resolves (callers need not
    know which module declares a section)."""
    missing = []
    for path in ROOT.rglob("*.py"):
        if {".git", ".cache", "__pycache__"} & set(path.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(errors="replace"))):
            if isinstance(node, ast.ImportFrom) and node.module == "radixfleet.config":
                missing += [
                    f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if not hasattr(config, a.name)
                ]
    assert not missing, missing
    assert sorted(config.__all__) == sorted(set(config.__all__))
