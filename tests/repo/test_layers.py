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
with ``ast``. Within the layers no module imports itself back through others (a
circle, ``TYPE_CHECKING`` and lazy imports included): two modules that need each
other are one module, or share a third below them.

The tests follow one rule of their own (ARCHITECTURE.md, "Tests"): a test module sits
in its component's folder, not flat in ``tests/``, and imports no other test module
(what two test modules share is a helper module, so each runs and moves on its own).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
                if top in LAYERS and top != pkg and top not in ALLOWED[pkg]:
                    wrong.append(f"{rel}:{line} imports {top}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_layer_check_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from loadtest.local_fleet import Fleet\n")
    assert list(_imports(bad)) == [(2, "loadtest")]


def _module_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (``from p import m`` of a module ``m``
    is an import of ``p.m``; of a name, of ``p``)."""
    mods = {}
    for pkg in LAYERS:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            out.update(t for t in map(ours, names) if t is not None and t != mod)
        graph[mod] = out
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_module_imports_itself_back():
    circles = _circles(_module_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_sees_a_circle(tmp_path):
    for pkg in LAYERS:
        (tmp_path / pkg).mkdir()
    (tmp_path / "loadtest" / "__init__.py").write_text("")
    (tmp_path / "loadtest" / "a.py").write_text("from loadtest.b import run\n")
    (tmp_path / "loadtest" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
    )
    (tmp_path / "loadtest" / "c.py").write_text("def f():\n    from loadtest import a\n")
    (tmp_path / "loadtest" / "d.py").write_text("import loadtest.a\n")
    graph = _module_graph(tmp_path)
    assert graph["loadtest.c"] == {"loadtest", "loadtest.a"}
    assert _circles(graph) == [["loadtest.a", "loadtest.b", "loadtest.c"]]


def _test_module_imports(path: pathlib.Path):
    """(line, module) of each import of a test module (``tests.<...>.test_*``)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:]):
                yield node.lineno, name
                break


def test_no_module_imports_a_test_module():
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{line} imports {name}"
        for path in sorted(ROOT.rglob("*.py"))
        if ".cache" not in path.parts and ".git" not in path.parts
        for line, name in _test_module_imports(path)
    ]
    assert not found, "move what is shared into a helper module (tests/router/fleet.py):\n" + "\n".join(found)


def test_the_test_import_check_sees_one(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "from tests.procs import Proc\nfrom tests.router.test_front import BODY\n"
        "import tests.test_x\nfrom tests.router import test_units\n"
    )
    assert list(_test_module_imports(bad)) == [
        (2, "tests.router.test_front"),
        (3, "tests.test_x"),
        (4, "tests.router.test_units"),
    ]


def test_test_modules_live_in_component_folders():
    flat = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert not flat, f"test modules flat in tests/ (ARCHITECTURE.md, Tests, names their folder): {flat}"


# ------------------------------------------------------------- the route core

#: what the route core (router/route.py) may import at run time: pure decisions and
#: data, never I/O (sockets, the event loop, HTTP, the bus, the engines' links)
ROUTE_CORE = "router/route.py"
IO_MODULES = ("asyncio", "socket", "aiohttp", "httpx", "zmq", "nats", "selectors", "ssl", "subprocess")
#: modules of ours that do I/O: the route core sees their objects through duck types
IO_OURS = (
    "router.dataplane",
    "router.front",
    "router.upstream",
    "router.app",
    "router.pool",
    "router.engines.link",
    "router.engines.manager",
    "router.bus",
    "router.admission_queue",
)
#: the route core's callers: none keeps a copy of the path, and none but the router's
#: own shell imports the data plane
CALLERS = (
    "router/attempts.py",
    "router/warm.py",
    "router/pd.py",
    "router/prefetch.py",
    "loadtest/simulator/simulation.py",
    "loadtest/simulator/disagg.py",
    "loadtest/simulator/harness.py",
    "radixfleet/bench/routing.py",
)
#: the request path's own calls, which only the route core makes
PATH_CALLS = (".policy.choose(", "pool.pick(", "index.insert(", "shedder.check(")
#: (caller, call) -> how often it may appear, and why it is not the path's
NOT_THE_PATH = {
    # a warm-up's blocks entering the index when its prefill ends: the agent's stored
    # event (feedback truth), not the pick's hint
    ("loadtest/simulator/harness.py", "index.insert("): 1,
}


def _runtime_imports(path: pathlib.Path):
    """(line, module) of every import outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                typing_only.update(id(n) for n in ast.walk(inner))
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_the_route_core_does_no_io():
    wrong = [
        f"{ROUTE_CORE}:{line} imports {mod}"
        for line, mod in _runtime_imports(ROOT / ROUTE_CORE)
        if mod.split(".")[0] in IO_MODULES or any(mod == m or mod.startswith(m + ".") for m in IO_OURS)
    ]
    assert not wrong, "the route core is sans-I/O:\n" + "\n".join(wrong)


def test_no_caller_of_the_route_core_imports_the_data_plane():
    wrong = [
        f"{rel}:{line} imports {mod}"
        for rel in CALLERS
        for line, mod in _runtime_imports(ROOT / rel)
        if mod == "router.dataplane" or mod.startswith("router.dataplane.")
    ]
    assert not wrong, "the data plane is one caller of the route core, not a library:\n" + "\n".join(wrong)


def test_the_request_path_is_decided_in_one_place():
    """Outside the route core, no module of the request path chooses with the policy
    or places a hint and a load count itself (index.insert + pool.pick)."""
    wrong = []
    for rel in ("router/dataplane.py", *CALLERS):
        src = (ROOT / rel).read_text()
        for needle in PATH_CALLS:
            n = src.count(needle)
            if n > NOT_THE_PATH.get((rel, needle), 0):
                wrong.append(f"{rel} calls {needle} ({n}x)")
    assert not wrong, "route through router.route.RouteCore:\n" + "\n".join(wrong)


def test_policies_import_nothing_of_the_router():
    """Policies are pure decisions over views: what drives them with the router's
    index and route core (the pick loop of scenario tests) lives above the router."""
    wrong = [
        f"{path.relative_to(ROOT).as_posix()}:{line} imports {top}"
        for path in sorted((ROOT / "policies").rglob("*.py"))
        for line, top in _imports(path)
        if top != "policies" and top != "protocol" and top in LAYERS
    ]
    assert not wrong, "\n".join(wrong)


#: the router's modules that carry a routed request's bytes after its pick (router.epp
#: is the gateway's carrier)
CARRIERS = (
    "router/dataplane.py",
    "router/attempts.py",
    "router/warm.py",
    "router/pd.py",
    "router/epp/server.py",
)
#: what settling a pick takes (router.ledger's end and first_token)
SETTLING = ("pool.finish(", "pool.prefilled(", "rank_finished(", "link.observe(", "tenancy.charge(")


def test_what_a_pick_counted_is_settled_only_by_the_ledger():
    """After the pick, no carrier releases the load, teaches the engine link or
    charges the tenant itself: each attempt and leg tells its ``RequestLedger``
    (router/ledger.py), which keeps the release exactly-once."""
    wrong = []
    for rel in CARRIERS:
        src = (ROOT / rel).read_text()
        for needle in SETTLING:
            if needle in src:
                wrong.append(f"{rel} calls {needle}")
    assert not wrong, "settle through router.ledger.RequestLedger:\n" + "\n".join(wrong)


def test_the_route_core_check_sees_io(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\nimport asyncio\n"
        "if TYPE_CHECKING:\n    from router.pool import Pool\n"
    )
    assert list(_runtime_imports(bad)) == [(1, "typing"), (2, "asyncio")]
