"""The router's concurrency limit: ``Admission``, a slot per request in flight and a
bounded FIFO queue for the rest (``limits.max_concurrency``, ``limits.max_queue``,
``limits.queue_timeout_s``); a request that finds the queue full, or waits past the
timeout, is refused 429 + Retry-After (``limits.retry_after_s``)."""

from __future__ import annotations

import asyncio
import collections

from radixfleet.wire.errors import Overloaded


class Admission:
    """A concurrency limit with a bounded FIFO queue.

    ``active`` counts requests holding a slot (<= limit, except briefly after a
    reload lowers the limit); ``_waiters`` holds futures of queued requests. A
    released slot passes directly to the oldest live waiter, so ``active`` is
    unchanged by the hand-over.
    """

    __slots__ = ("limit", "max_queue", "timeout_s", "retry_after_s", "active", "_waiters")

    def __init__(self, limit: int, max_queue: int, timeout_s: float, retry_after_s: int) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def try_enter(self) -> bool:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        return False

    async def enter(self) -> None:
        """Waits for a slot. Raises ``Overloaded`` if the queue is full or the wait
        times out; on cancellation nothing is held and the cancellation propagates
        (a slot handed over as it came is passed on: no ``asyncio.wait_for``, which
        before Python 3.12 may swallow a cancellation that races its result)."""
        if self.try_enter():
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(
                f"router at capacity ({self.limit} in flight, {len(self._waiters)} queued)",
                retry_after_s=self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(self.timeout_s, _expire, fut)
        try:
            got = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.leave()  # the slot arrived as we gave up: pass it on
            else:
                self._forget(fut)
            raise
        finally:
            timer.cancel()
        if not got:
            self._forget(fut)
            raise Overloaded(f"no slot within {self.timeout_s:g}s", retry_after_s=self.retry_after_s)

    def _forget(self, fut: asyncio.Future) -> None:
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    def configure(self, limit: int, max_queue: int, timeout_s: float, retry_after_s: int) -> None:
        """Takes reloaded limits: waiters already queued keep their place."""
        self.limit, self.max_queue = limit, max_queue
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s

    def leave(self) -> None:
        w = self._waiters
        while w:
            f = w.popleft()
            if not f.done():
                if self.active <= self.limit:
                    f.set_result(True)
                    return
                w.appendleft(f)
                break
        self.active -= 1

    def busy(self) -> bool:
        """Whether a request arriving now would wait (or be refused) for a slot."""
        return self.active >= self.limit or bool(self._waiters)

    def check(self) -> None:
        assert self.active >= 0, f"{self.active=}"


def _expire(fut: asyncio.Future) -> None:
    """An admission wait's timeout: the waiter gets False (no slot) unless served."""
    if not fut.done():
        fut.set_result(False)
