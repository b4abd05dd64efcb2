"""An engine kind's facts live in its adapter (radixfleet/engines/adapters/, ARCHITECTURE.md
"engines"): no other module of the router branches on a kind.

A branch on a kind is a comparison (``==``, ``!=``, ``is``, ``is not``, ``in``, ``not
in``) of something named ``kind`` with a ``WorkerKind`` member, a kind's name or a
list of kinds (a name ending in ``KINDS``), or any use of a ``WorkerKind`` member
(``WorkerKind.VLLM``). Comparing a kind with ``None`` (not yet probed) is no branch.
Walked with ``ast``, lazy code included.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = {"agent", "vllm", "sglang", "openai"}
#: where kinds are spelled out: the kinds themselves, their adapters, and the config
#: schema's cross-field checks (a kind's keys: radixfleet/config/)
ALLOWED = {"radixfleet/engines/kinds.py"}
ALLOWED_DIRS = ("radixfleet/engines/adapters/", "radixfleet/config/")


def _mentions_kind(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and "kind" in n.id) or (isinstance(n, ast.Attribute) and "kind" in n.attr)
        for n in ast.walk(node)
    )


def _is_kind_value(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_kind_value(e) for e in node.elts)
    if isinstance(node, ast.Name) and node.id.endswith("KINDS"):
        return True  # a list of kinds (ENGINE_KINDS)
    return _member(node)


def _member(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "WorkerKind"
    )


def kind_branches(source: str, name: str = "<src>") -> list[int]:
    """The lines of ``source`` that branch on a kind (module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if _member(node):
            found.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_mentions_kind(s) for s in sides) and any(_is_kind_value(s) for s in sides):
                found.append(node.lineno)
    return sorted(set(found))


def test_no_module_but_the_adapters_branches_on_an_engine_kind():
    wrong = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED or rel.startswith(ALLOWED_DIRS):
            continue
        wrong += [f"{rel}:{line}" for line in kind_branches(path.read_text(), rel)]
    assert not wrong, "ask the worker's adapter (link.adapter) instead:\n" + "\n".join(wrong)


def test_the_kind_check_sees_each_shape_of_branch():
    src = (
        "if link.kind is WorkerKind.AGENT: pass\n"
        "x = self.kind in ENGINE_KINDS\n"
        'y = spec.kind != "sglang"\n'
        "z = w.kind in ('openai', 'agent')\n"
        "ok = self.kind is None or part == 'tool_reference' or src.value == 'agent'\n"
        "k = WorkerKind.VLLM\n"
    )
    assert kind_branches(src) == [1, 2, 3, 4, 6]
