"""What every long-lived loop of the servers shares: ``async with`` over its
``start()`` and ``aclose()`` (``Lifecycle``), stopping its task (``stop``) and
waiting between tries (``Backoff``).

``stop(task)`` cancels and awaits: the task's own cancellation is its normal end
and is absorbed, the caller's is not (``Task.cancelling``: an ``aclose`` that is
itself cancelled keeps propagating, STYLE 7); any other exception the task ended
with propagates.

``Backoff`` doubles a delay from ``base_s`` up to ``max_s`` and spreads each wait
over [0.75, 1.25) of it, so that peers that lost the same server together do not
come back in lockstep; ``reset()`` after a success.
"""

from __future__ import annotations

import asyncio
import random
from typing import TypeVar

_L = TypeVar("_L", bound="Lifecycle")


class Lifecycle:
    """``async with``: ``start()`` on entry, ``aclose()`` (idempotent) on exit."""

    __slots__ = ()

    async def start(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: _L) -> _L:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def stop(task: asyncio.Task[object] | None) -> None:
    """Cancels ``task`` (None: nothing) and waits for it to end (module docstring)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


class Backoff:
    """Exponential backoff with jitter (module docstring). ``delay_s`` is the nominal
    wait of the next try (for messages)."""

    __slots__ = ("base_s", "max_s", "delay_s", "_rand")

    def __init__(self, base_s: float, max_s: float, rand: random.Random | None = None) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.delay_s = base_s
        self._rand = rand or random.Random()

    def next_s(self) -> float:
        """The wait before the next try; the one after it doubles (up to ``max_s``)."""
        d = self.delay_s * (0.75 + 0.5 * self._rand.random())
        self.delay_s = min(self.delay_s * 2, self.max_s)
        return d

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_s())

    def reset(self) -> None:
        self.delay_s = self.base_s
