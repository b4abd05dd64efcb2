"""Drives the synchronous ``Scheduler`` in real time on the asyncio loop.

::

    loop:  res = sched.step(now)  ->  sleep until now + res.duration_s  ->  deliver
                                                                            (wake waiters)

Lifecycle: ``NEW --start()--> RUNNING --aclose()--> CLOSED`` (aclose is idempotent;
requests still in flight are cancelled and their waiters woken). Only the loop task
calls ``step``; ``submit``/``cancel`` run on the same event loop between steps, so the
scheduler is never entered twice at once.
"""

from __future__ import annotations

import asyncio
import enum
import logging

from radixfleet.common import background
from radixfleet.common.background import Lifecycle
from radixfleet_tools.agent.scheduler import SchedRequest, Scheduler, State

log = logging.getLogger(__name__)


class EngineState(enum.Enum):
    NEW = "new"  # constructed, loop not started
    RUNNING = "running"  # loop task stepping the scheduler
    CLOSED = "closed"  # loop stopped; submit() refuses


class Waiter:
    """What a handler waits on: tokens made visible at the simulated time they exist."""

    __slots__ = ("event", "visible", "done")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        #: generated tokens delivered so far (set by the engine after each step's sleep)
        self.visible = 0
        #: finished or cancelled, as delivered
        self.done = False


class Engine(Lifecycle):
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.state = EngineState.NEW
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        if self.state is not EngineState.NEW:
            raise RuntimeError(f"engine is {self.state.value}; start() is called once")
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="sim-engine")
        self.state = EngineState.RUNNING

    def now(self) -> float:
        if self._loop is None:
            raise RuntimeError("call start() before now()")
        return self._loop.time()

    def submit(self, req: SchedRequest) -> Waiter:
        """Queues ``req`` (may raise ``PromptTooLarge``) and returns its waiter."""
        if self.state is not EngineState.RUNNING:
            raise RuntimeError("call start() before submit()")
        self.sched.submit(req, self.now())
        req.waiter = w = Waiter()
        self._wake.set()
        return w

    def cancel(self, req: SchedRequest) -> None:
        """Cancels a request that is not finished (client gone); frees its KV."""
        if req.state in (State.FINISHED, State.CANCELLED):
            return
        self.sched.cancel(req)
        if req.waiter is not None:
            req.waiter.done = True
            req.waiter.event.set()

    async def _run(self) -> None:
        sched, loop = self.sched, self._loop
        assert loop is not None, "start() sets the loop before it starts this task"
        while True:
            if not sched.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            start = loop.time()
            try:
                res = sched.step(start)
            except Exception:  # a bug: fail what is in flight rather than hang it
                log.exception("scheduler step failed; cancelling in-flight requests")
                for r in (*sched.waiting, *sched.prefilling, *sched.running):
                    try:
                        self.cancel(r)
                    except Exception:  # pragma: no cover - state already broken
                        log.exception("cancel failed for %r", r)
                sched.waiting.clear()
                sched.prefilling.clear()
                sched.running.clear()
                continue
            delay = start + res.duration_s - loop.time()
            # even a zero-length step yields, so handlers and the reporter run
            await asyncio.sleep(delay if delay > 0 else 0)
            for r in res.decoded:
                w = r.waiter
                if w is not None:
                    w.visible = r.generated
                    w.event.set()
            for r in res.finished:
                w = r.waiter
                if w is not None:
                    w.visible = r.generated
                    w.done = True
                    w.event.set()

    async def aclose(self) -> None:
        if self.state is EngineState.CLOSED:
            return
        self.state = EngineState.CLOSED
        await background.stop(self._task)
        s = self.sched
        for r in (*s.waiting, *s.prefilling, *s.running):
            self.cancel(r)
