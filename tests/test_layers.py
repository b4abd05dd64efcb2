"""Imports run one way (ARCHITECTURE.md, "Layers").

    protocol                      prefix keys, event and bus wire formats, identifier
                                  bounds, OpenAPI documents, errors: imports none of ours
    service       -> protocol     what both servers are built from (HTTP errors, JSON
                                  bodies, tokens, tenant salts, metrics, the NATS link)
    policies      -> protocol     pure decisions over views
    router        -> protocol, service, policies
    worker_agent  -> protocol, service, policies   (never the router: they are peers)
    loadtest      -> protocol, service, router, policies, worker_agent
    radixfleet    -> everything   the ``radixfleet`` command and ``radixfleet bench``

An arrow the other way (the router importing the load generator to run a benchmark,
the agent's bus publisher living in the router) makes a lower layer carry an upper
one's code and dependencies: this walks every module's imports, lazy ones included,
with ``ast``.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("protocol", "service", "policies", "router", "worker_agent", "loadtest", "radixfleet")
#: what each package may import of ours (besides itself)
ALLOWED = {
    "protocol": set(),
    "service": {"protocol"},
    "policies": {"protocol"},
    "router": {"protocol", "service", "policies"},
    "worker_agent": {"protocol", "service", "policies"},
    "loadtest": {"protocol", "service", "policies", "router", "worker_agent"},
    "radixfleet": set(LAYERS),
}
# policies.harness replays the router's pick-time bookkeeping for scenario tests
# and benchmarks over the router's own index (the live data structure, not a copy)
EXCEPTIONS = {("policies/harness.py", "router")}


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def test_every_import_points_down_the_layers():
    wrong = []
    for pkg in LAYERS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, top in _imports(path):
                if top in LAYERS and top != pkg and top not in ALLOWED[pkg] \
                        and (rel, top) not in EXCEPTIONS:
                    wrong.append(f"{rel}:{line} imports {top}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_layer_check_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from loadtest.fleet import Fleet\n")
    assert list(_imports(bad)) == [(2, "loadtest")]
