"""Imports run one way (ARCHITECTURE.md, "Layers").

    wire      radixfleet.wire, radixfleet.keys   prefix keys, event and bus wire formats,
                                                 identifier bounds, OpenAPI, errors: imports none of ours
    common    radixfleet.common -> wire          what both servers are built from (HTTP errors,
                                                 JSON bodies, tokens, tenant salts, metrics, the NATS link)
    policies  radixfleet.policies -> wire        pure decisions over views
    router    radixfleet.{index,route,fleet,engines,bus,config,server,gateway}
                                -> wire, common, policies
    agent     radixfleet_tools.agent -> wire, common, policies   (never the router: they are peers)
    loadtest  radixfleet_tools.loadtest -> wire, common, policies, router, agent
    top       radixfleet.cli, radixfleet.gateway.envoy, radixfleet_tools.bench,
              radixfleet_tools.harness (the tests' and benchmarks' process helpers) -> everything

An arrow the other way (the router importing the load generator to run a benchmark,
the agent's bus publisher living in the router) makes a lower layer carry an upper
one's code and dependencies: this walks every module's imports, lazy ones included,
with ``ast``; every module of ours belongs to a layer. Within the layers no module
imports itself back through others (a circle, ``TYPE_CHECKING`` and lazy imports
included): two modules that need each other are one module, or share a third below
them.

The tests follow one rule of their own (ARCHITECTURE.md, "Tests"): a test module sits
in its component's folder, not flat in ``tests/``, and imports no other test module
(what two test modules share is a helper module, so each runs and moves on its own).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: the two import roots of the distribution
ROOTS = ("radixfleet", "radixfleet_tools")
#: layer -> the module prefixes it holds (the longest prefix names a module's layer)
LAYERS: dict[str, tuple[str, ...]] = {
    "wire": ("radixfleet.wire", "radixfleet.keys"),
    "common": ("radixfleet.common",),
    "policies": ("radixfleet.policies",),
    "router": (
        "radixfleet.index",
        "radixfleet.route",
        "radixfleet.fleet",
        "radixfleet.engines",
        "radixfleet.bus",
        "radixfleet.config",
        "radixfleet.server",
        "radixfleet.gateway",
    ),
    "agent": ("radixfleet_tools.agent",),
    "loadtest": ("radixfleet_tools.loadtest",),
    # the commands that put everything together: the CLI's table, Envoy's launcher
    # (it runs Envoy as a child process of the load generator's fleet), the benchmarks
    "top": (
        "radixfleet",
        "radixfleet_tools",
        "radixfleet.cli",
        "radixfleet.gateway.envoy",
        "radixfleet_tools.bench",
        "radixfleet_tools.harness",
    ),
}
#: what each layer may import of ours (besides itself)
ALLOWED = {
    "wire": set(),
    "common": {"wire"},
    "policies": {"wire"},
    "router": {"wire", "common", "policies"},
    "agent": {"wire", "common", "policies"},
    "loadtest": {"wire", "common", "policies", "router", "agent"},
    "top": set(LAYERS),
}


def layer_of(module: str) -> str | None:
    """The layer of a dotted name of ours (a module, or a name inside one); None for
    a module not of ours. A package root alone (``radixfleet``) is the top."""
    if module.split(".")[0] not in ROOTS:
        return None
    best, found = -1, "unplaced"
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if (module == p or (module.startswith(p + ".") and p not in ROOTS)) and len(p) > best:
                best, found = len(p), layer
    return found


def _imports(path: pathlib.Path):
    """(line, dotted name) of each import of ours; ``from radixfleet import keys``
    imports ``radixfleet.keys``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS:
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in ROOTS:
                continue
            if node.module in ROOTS:
                for a in node.names:
                    yield node.lineno, f"{node.module}.{a.name}"
            else:
                yield node.lineno, node.module


def _our_files():
    for root in ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_module_has_a_layer():
    unplaced = [mod for _, mod in _our_files() if layer_of(mod) == "unplaced"]
    assert not unplaced, f"modules in no layer (add their package to LAYERS): {unplaced}"


def test_every_import_points_down_the_layers():
    wrong = []
    for path, mod in _our_files():
        rel = path.relative_to(ROOT).as_posix()
        here = layer_of(mod)
        for line, name in _imports(path):
            there = layer_of(name)
            if there in (None, here) or there in ALLOWED.get(here, set()):
                continue
            wrong.append(f"{rel}:{line} imports {name} ({here} -> {there})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_layer_check_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "def f():\n    from radixfleet_tools.loadtest.local_fleet import Fleet\n"
        "import radixfleet.server.app\nfrom radixfleet import keys\nimport json\n"
    )
    found = list(_imports(bad))
    assert found == [
        (2, "radixfleet_tools.loadtest.local_fleet"),
        (3, "radixfleet.server.app"),
        (4, "radixfleet.keys"),
    ] or sorted(found) == sorted(
        [(2, "radixfleet_tools.loadtest.local_fleet"), (3, "radixfleet.server.app"), (4, "radixfleet.keys")]
    )
    assert [layer_of(n) for _, n in sorted(found)] == ["loadtest", "router", "wire"]
    assert layer_of("radixfleet.gateway.envoy") == "top" and layer_of("radixfleet.gateway.server") == "router"
    assert layer_of("radixfleet.newpkg.x") == "unplaced" and layer_of("json") is None


def _module_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (``from p import m`` of a module ``m``
    is an import of ``p.m``; of a name, of ``p``)."""
    mods = {}
    for top in ROOTS:
        for path in (root / top).rglob("*.py"):
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
            # a package's own __init__ is not an edge (importing radixfleet.x runs it)
            out.update(t for t in map(ours, names) if t is not None and t != mod and t not in ROOTS)
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
    for top in ROOTS:
        (tmp_path / top).mkdir()
    lt = tmp_path / "radixfleet_tools" / "loadtest"
    lt.mkdir()
    (lt / "__init__.py").write_text("")
    (lt / "a.py").write_text("from radixfleet_tools.loadtest.b import run\n")
    (lt / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (lt / "c.py").write_text("def f():\n    from radixfleet_tools.loadtest import a\n")
    (lt / "d.py").write_text("import radixfleet_tools.loadtest.a\n")
    graph = _module_graph(tmp_path)
    assert graph["radixfleet_tools.loadtest.c"] == {
        "radixfleet_tools.loadtest",
        "radixfleet_tools.loadtest.a",
    }
    assert _circles(graph) == [
        ["radixfleet_tools.loadtest.a", "radixfleet_tools.loadtest.b", "radixfleet_tools.loadtest.c"]
    ]


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
        "from radixfleet_tools.harness.procs import Proc\nfrom tests.router.test_front import BODY\n"
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

#: what the route core (radixfleet/route/core.py) may import at run time: pure decisions and
#: data, never I/O (sockets, the event loop, HTTP, the bus, the engines' links)
ROUTE_CORE = "radixfleet/route/core.py"
IO_MODULES = ("asyncio", "socket", "aiohttp", "httpx", "zmq", "nats", "selectors", "ssl", "subprocess")
#: modules of ours that do I/O: the route core sees their objects through duck types
IO_OURS = (
    "radixfleet.server.dataplane",
    "radixfleet.server.front",
    "radixfleet.server.upstream",
    "radixfleet.server.app",
    "radixfleet.fleet.pool",
    "radixfleet.engines.link",
    "radixfleet.engines.manager",
    "radixfleet.bus",
    "radixfleet.route.admission_queue",
)
#: the route core's callers: none keeps a copy of the path, and none but the router's
#: own shell imports the data plane
CALLERS = (
    "radixfleet/server/attempts.py",
    "radixfleet/server/warm.py",
    "radixfleet/route/pd.py",
    "radixfleet/server/prefetch.py",
    "radixfleet_tools/loadtest/simulator/simulation.py",
    "radixfleet_tools/loadtest/simulator/disagg.py",
    "radixfleet_tools/loadtest/simulator/harness.py",
    "radixfleet_tools/bench/routing.py",
)
#: the request path's own calls, which only the route core makes
PATH_CALLS = (".policy.choose(", "pool.pick(", "index.insert(", "shedder.check(")
#: (caller, call) -> how often it may appear, and why it is not the path's
NOT_THE_PATH = {
    # a warm-up's blocks entering the index when its prefill ends: the agent's stored
    # event (feedback truth), not the pick's hint
    ("radixfleet_tools/loadtest/simulator/harness.py", "index.insert("): 1,
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
        if mod == "radixfleet.server.dataplane" or mod.startswith("radixfleet.server.dataplane.")
    ]
    assert not wrong, "the data plane is one caller of the route core, not a library:\n" + "\n".join(wrong)


def test_the_request_path_is_decided_in_one_place():
    """Outside the route core, no module of the request path chooses with the policy
    or places a hint and a load count itself (index.insert + pool.pick)."""
    wrong = []
    for rel in ("radixfleet/server/dataplane.py", *CALLERS):
        src = (ROOT / rel).read_text()
        for needle in PATH_CALLS:
            n = src.count(needle)
            if n > NOT_THE_PATH.get((rel, needle), 0):
                wrong.append(f"{rel} calls {needle} ({n}x)")
    assert not wrong, "route through radixfleet.route.core.RouteCore:\n" + "\n".join(wrong)


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


#: the router's modules that carry a routed request's bytes after its pick (radixfleet.gateway
#: is the gateway's carrier)
CARRIERS = (
    "radixfleet/server/dataplane.py",
    "radixfleet/server/attempts.py",
    "radixfleet/server/warm.py",
    "radixfleet/route/pd.py",
    "radixfleet/gateway/server.py",
)
#: what settling a pick takes (radixfleet.server.ledger's end and first_token)
SETTLING = ("pool.finish(", "pool.prefilled(", "rank_finished(", "link.observe(", "tenancy.charge(")


def test_what_a_pick_counted_is_settled_only_by_the_ledger():
    """After the pick, no carrier releases the load, teaches the engine link or
    charges the tenant itself: each attempt and leg tells its ``RequestLedger``
    (radixfleet/server/ledger.py), which keeps the release exactly-once."""
    wrong = []
    for rel in CARRIERS:
        src = (ROOT / rel).read_text()
        for needle in SETTLING:
            if needle in src:
                wrong.append(f"{rel} calls {needle}")
    assert not wrong, "settle through radixfleet.server.ledger.RequestLedger:\n" + "\n".join(wrong)


def test_the_route_core_check_sees_io(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\nimport asyncio\n"
        "if TYPE_CHECKING:\n    from radixfleet.fleet.pool import Pool\n"
    )
    assert list(_runtime_imports(bad)) == [(1, "typing"), (2, "asyncio")]
