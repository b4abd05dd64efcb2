"""Test tiers, enforced: a test that starts a process or a server carries a marker.

Three tiers, chosen with ``-m``::

    (unmarked)     pure in-process tests: no child process, no listening socket.
                   ``pytest -m "not integration and not engine"`` runs only these
                   (the fast tier, for development).
    integration    starts real processes (Proc, RouterProcess, nats-server, ...) or
                   servers on loopback ports (aiohttp sites, fake engines).
    engine         against real vLLM servers the run provisions (tests/engines/).

A marker nobody checks drifts, so the run checks it. While a test's setup and body run,
``subprocess.Popen``, ``os.fork`` and ``socket.listen`` are watched; a test that used
one without ``integration`` or ``engine`` fails, naming what it started. A test that
asks for a vLLM fixture (it provisions a venv and a model) without ``engine`` is refused
at collection, before anything is provisioned, so ``-m "not engine"`` never builds vLLM.
Engine tests get a longer pytest-timeout limit (``ENGINE_TIMEOUT_S``) than the rest.

The watch is process-wide (one test runs at a time): a server started in a helper
thread counts for the test that is running. A fixture seen starting something counts
for every later test that uses it (a module-scoped server is started once). What runs
in teardown is not watched.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

#: fixtures that provision or start real vLLM (tests/conftest.py)
ENGINE_FIXTURES = frozenset({"vllm_pair", "vllm_model_dir"})
TIER_MARKS = ("integration", "engine")
#: pytest-timeout's limit for an engine test (the rest: ``timeout`` in pyproject.toml):
#: the first one provisions vLLM (radixfleet_tools/harness/vllm_env.py: an install bounded at
#: 1,500 s, then two servers started, 240 s each at most)
ENGINE_TIMEOUT_S = 2400


class _Watch:
    """What the running test started; ``None`` between tests (nothing is recorded)."""

    def __init__(self) -> None:
        self.started: list[str] | None = None
        #: fixture name -> what it started when it was set up: a later test that reuses
        #: a module- or session-scoped one starts nothing itself but needs it running
        self.fixtures: dict[str, str] = {}

    def note(self, what: str) -> None:
        if self.started is not None and len(self.started) < 64:
            self.started.append(what)


_watch = _Watch()
_installed = False


def _install() -> None:
    """Wrap the three calls that start processes and servers (once per interpreter)."""
    global _installed
    if _installed:
        return
    _installed = True
    popen_init = subprocess.Popen.__init__
    fork = os.fork
    listen = socket.socket.listen

    def watched_popen_init(self, args, *a, **kw):  # type: ignore[no-untyped-def]
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        _watch.note("starts a process: " + " ".join(str(x) for x in argv[:4]))
        popen_init(self, args, *a, **kw)

    def watched_fork() -> int:
        _watch.note("forks a process")
        return fork()

    def watched_listen(self: socket.socket, *a: int) -> None:
        try:
            where = self.getsockname()
        except OSError:
            where = "?"
        _watch.note(f"listens on {where}")
        listen(self, *a)

    subprocess.Popen.__init__ = watched_popen_init  # type: ignore[method-assign]
    os.fork = watched_fork
    socket.socket.listen = watched_listen  # type: ignore[method-assign]


def _marked(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) for m in TIER_MARKS)


def pytest_configure(config: pytest.Config) -> None:
    _warm_caches()
    _install()


def _warm_caches() -> None:
    """Builds, before the watch starts, the caches a library fills on first use by
    running a program: matplotlib's font cache runs ``fc-list`` once on a machine
    that has none (a fresh CI machine), which would read as the first plotting test
    starting a process."""
    try:
        import matplotlib.font_manager  # noqa: F401  (builds the cache on import)
    except ImportError:  # the plots extra is not installed: nothing to warm
        pass


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("engine") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(ENGINE_TIMEOUT_S))
    unmarked = [
        item.nodeid
        for item in items
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("engine")
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests use a real-vLLM fixture but are not marked engine "
            "(add pytestmark = pytest.mark.engine):\n  " + "\n  ".join(unmarked)
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _watch.started = []
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[object]:
    before = len(_watch.started) if _watch.started is not None else None
    result = yield
    if before is not None and _watch.started is not None and len(_watch.started) > before:
        _watch.fixtures.setdefault(fixturedef.argname, _watch.started[before])
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[object]:
    result = yield
    started, _watch.started = _watch.started, None
    started = started or []
    for name in getattr(item, "fixturenames", ()):
        if name in _watch.fixtures:
            started.append(f"uses fixture {name!r}, which {_watch.fixtures[name]}")
    if started and not _marked(item):
        pytest.fail(
            f"{item.nodeid} {'; '.join(started[:3])} but is not marked: add "
            "pytestmark = pytest.mark.integration (real vLLM: pytest.mark.engine); "
            "see tests/tiers.py",
            pytrace=False,
        )
    return result


def pytest_runtest_teardown(item: pytest.Item) -> None:
    _watch.started = None
