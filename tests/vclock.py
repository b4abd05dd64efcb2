"""An asyncio event loop on a virtual clock, for tests of code that sleeps.

``run_virtual(coro)`` runs ``coro`` on a ``VirtualClockLoop``: ``loop.time()``
starts at 0 and jumps straight to the next timer whenever nothing is ready, so
``asyncio.sleep``, ``wait_for`` timeouts and ``call_later`` take no wall time and
every timestamp read from ``loop.time()`` is exact — the same on an idle machine
and on a loaded one. Only timers move time: a test must do no real I/O (sockets,
subprocesses) on this loop; waiting with nothing scheduled raises instead of
hanging.

How: ``BaseEventLoop._run_once`` asks the selector to block for "time until the
next timer"; this selector polls the real one without blocking (the loop's own
self-pipe stays registered there) and advances the clock by that timeout.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any


class _VirtualSelector(selectors.BaseSelector):
    """Delegates registrations to a real selector; ``select(t)`` never blocks but
    advances the owning loop's clock by ``t``."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.loop: VirtualClockLoop | None = None

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def select(self, timeout=None):
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError(
                "virtual clock: the loop would wait forever (no timer, "
                "nothing ready) — a test awaiting real I/O on this loop?"
            )
        if timeout > 0:
            loop = self.loop
            # jump exactly to the next timer (its ``when``), so timestamps are exact
            nxt = loop._scheduled[0]._when if loop._scheduled else loop._now + timeout
            loop._now = max(loop._now, nxt)
        return []

    def close(self) -> None:
        self._real.close()

    def get_map(self):
        return self._real.get_map()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual (see the module docstring)."""

    def __init__(self) -> None:
        sel = _VirtualSelector()
        self._now = 0.0
        super().__init__(selector=sel)
        sel.loop = self

    def time(self) -> float:
        return self._now


def run_virtual(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs ``coro`` to completion on a fresh ``VirtualClockLoop``; returns its result."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
