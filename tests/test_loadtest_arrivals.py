"""Arrival processes: bounded by count and duration, sessions sequential, rates honoured."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.errors import WorkloadError
from loadtest.arrivals import Bounds, Closed, Poisson, TraceTimes, drive
from loadtest.workloads import RequestSpec, SingleShot, make_workload


def _recorder(delay=0.005, fail=()):
    log: list[tuple[str, float]] = []
    in_flight = [0, 0]  # now, max

    async def send(spec: RequestSpec):
        log.append((spec.id, time.monotonic()))
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            await asyncio.sleep(delay)
        finally:
            in_flight[0] -= 1
        return None if spec.id in fail else f"answer to {spec.id}"

    return send, log, in_flight


async def test_closed_loop_bounded_by_count_and_concurrency():
    send, log, inf = _recorder()
    w = make_workload("zipf", {"requests": 500})
    stats = await drive(w.sessions(), Closed(4), Bounds(max_requests=37, duration_s=10), send)
    assert stats.dispatched == 37 == len(log) and stats.stopped_by == "requests"
    assert inf[1] == 4
    assert stats.completed == 37 and stats.cancelled == 0


async def test_open_loop_bounded_by_duration_and_rate():
    send, log, _ = _recorder()
    w = make_workload("zipf", {"requests": 5000})
    t0 = time.monotonic()
    stats = await drive(w.sessions(), Poisson(100.0), Bounds(max_requests=5000, duration_s=0.6),
                        send, seed=1)
    assert stats.stopped_by == "duration"
    assert time.monotonic() - t0 < 1.5
    assert 30 <= stats.dispatched <= 100  # ~60 expected at 100/s for 0.6 s


async def test_drain_grace_cancels_stragglers():
    send, log, _ = _recorder(delay=5.0)
    w = make_workload("zipf", {"requests": 10})
    t0 = time.monotonic()
    stats = await drive(w.sessions(), Closed(3), Bounds(max_requests=3, duration_s=5, drain_s=0.1),
                        send)
    assert time.monotonic() - t0 < 1.0
    assert stats.dispatched == 3 and stats.cancelled == 3 and stats.completed == 0


async def test_multiturn_turns_are_sequential_and_parallelism_bounded():
    send, log, inf = _recorder()
    w = make_workload("multiturn", {"clients": 6, "rounds": 3, "max_parallel": 2})
    stats = await drive(w.sessions(), Closed(10), Bounds(max_requests=100, duration_s=10), send,
                        max_active_sessions=w.max_active_sessions)
    assert stats.stopped_by == "exhausted" and stats.dispatched == 18
    assert inf[1] == 2  # only two sessions in progress, one turn each at a time
    order = [i for i, _ in log]
    for c in range(6):
        turns = [order.index(f"c{c}.{t}") for t in range(3)]
        assert turns == sorted(turns)


async def test_failed_turn_ends_its_session():
    send, log, _ = _recorder(fail={"c0.1"})
    w = make_workload("multiturn", {"clients": 2, "rounds": 3})
    stats = await drive(w.sessions(), Closed(2), Bounds(100, 10), send)
    ids = [i for i, _ in log]
    assert "c0.2" not in ids and "c1.2" in ids
    assert stats.dispatched == 5 and stats.sessions_finished == 2


async def test_trace_times_are_honoured():
    send, log, _ = _recorder(delay=0.0)
    specs = [SingleShot(RequestSpec(f"t{i}.0", "completions", {"prompt": "x"}, 1, f"t{i}", 0,
                                    arrival_s=a)) for i, a in enumerate((0.0, 0.2, 0.4))]
    t0 = time.monotonic()
    stats = await drive(specs, TraceTimes(), Bounds(10, 5), send)
    assert stats.dispatched == 3
    offsets = [t - t0 for _, t in log]
    for got, want in zip(offsets, (0.0, 0.2, 0.4)):
        assert want - 0.01 <= got <= want + 0.15


def test_bad_bounds_and_rates():
    with pytest.raises(WorkloadError, match="--rate"):
        Poisson(0)
    with pytest.raises(WorkloadError, match="--concurrency"):
        Closed(0)
    with pytest.raises(WorkloadError, match="--requests"):
        Bounds(max_requests=0)
    with pytest.raises(WorkloadError, match="--duration"):
        Bounds(duration_s=0)
