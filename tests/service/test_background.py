"""radixfleet.common.background: a loop's async with, stopping its task, the backoff between tries."""

from __future__ import annotations

import asyncio
import random

import pytest

from radixfleet.common.background import Backoff, stop


def test_backoff_doubles_to_its_cap_with_jitter_and_resets():
    b = Backoff(0.5, 3.0, random.Random(7))
    rand = random.Random(7)
    waits = [b.next_s() for _ in range(5)]
    nominal = [0.5, 1.0, 2.0, 3.0, 3.0]
    assert waits == [n * (0.75 + 0.5 * rand.random()) for n in nominal]
    assert all(0.75 * n <= w < 1.25 * n for w, n in zip(waits, nominal))
    assert b.delay_s == 3.0
    b.reset()
    assert b.delay_s == 0.5 and 0.375 <= b.next_s() < 0.625


def test_backoff_spreads_peers_that_start_together():
    waits = {round(Backoff(1.0, 1.0).next_s(), 9) for _ in range(20)}
    assert len(waits) > 1


async def test_stop_ends_the_task_and_absorbs_its_cancellation():
    ended = asyncio.Event()

    async def loop():
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    t = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await stop(t)
    assert t.cancelled() and ended.is_set()
    await stop(t)  # again: nothing
    await stop(None)


async def test_stop_keeps_the_callers_cancellation_and_the_tasks_error():
    async def stubborn():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # cleanup that takes a moment
            raise

    inner = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    outer = asyncio.create_task(stop(inner))
    await asyncio.sleep(0.01)
    outer.cancel()  # the caller is cancelled while it waits
    with pytest.raises(asyncio.CancelledError):
        await outer
    await asyncio.gather(inner, return_exceptions=True)

    async def broken():
        raise RuntimeError("the loop failed")

    t = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="the loop failed"):
        await stop(t)


async def test_lifecycle_starts_on_entry_and_closes_on_exit_even_after_an_error():
    from radixfleet.common.background import Lifecycle

    class Loop(Lifecycle):
        def __init__(self) -> None:
            self.calls: list[str] = []

        async def start(self) -> None:
            self.calls.append("start")

        async def aclose(self) -> None:
            self.calls.append("aclose")

    loop = Loop()
    with pytest.raises(ValueError):
        async with loop as entered:
            assert entered is loop and loop.calls == ["start"]
            raise ValueError("inside")
    assert loop.calls == ["start", "aclose"]
