"""Arrival processes: bounded by count and duration, sessions sequential, rates honoured.

Every test runs ``drive`` on a virtual clock (``tests.vclock``): sleeps take no wall
time and every timestamp is exact, so the timing assertions are exact too and hold
on a loaded machine.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from radixfleet.wire.errors import WorkloadError
from radixfleet_tools.loadtest.arrivals import Bounds, Closed, Poisson, TraceTimes, drive
from radixfleet_tools.loadtest.workloads import RequestSpec, SingleShot, make_workload
from tests.vclock import run_virtual


def _now() -> float:
    return asyncio.get_running_loop().time()


def _recorder(delay=0.005, fail=()):
    log: list[tuple[str, float]] = []
    in_flight = [0, 0]  # now, max

    async def send(spec: RequestSpec):
        log.append((spec.id, _now()))
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            await asyncio.sleep(delay)
        finally:
            in_flight[0] -= 1
        return None if spec.id in fail else f"answer to {spec.id}"

    return send, log, in_flight


def test_closed_loop_bounded_by_count_and_concurrency():
    send, log, inf = _recorder()
    w = make_workload("zipf", {"requests": 500})
    stats = run_virtual(
        drive(w.sessions(), Closed(4), Bounds(max_requests=37, duration_s=10), send, clock=_now)
    )
    assert stats.dispatched == 37 == len(log) and stats.stopped_by == "requests"
    assert inf[1] == 4
    assert stats.completed == 37 and stats.cancelled == 0
    # 4 at a time, 5 ms each: request k leaves at (k // 4) x 5 ms
    assert [round(t, 9) for _, t in log] == [round(k // 4 * 0.005, 9) for k in range(37)]


def test_open_loop_bounded_by_duration_and_rate():
    send, log, _ = _recorder()
    w = make_workload("zipf", {"requests": 5000})

    async def run():
        t0 = _now()
        stats = await drive(
            w.sessions(), Poisson(100.0), Bounds(max_requests=5000, duration_s=0.6), send, seed=1, clock=_now
        )
        return stats, _now() - t0

    stats, took = run_virtual(run())
    assert stats.stopped_by == "duration"
    # dispatch stops at the deadline; the last request (5 ms) and nothing else follows
    assert 0.6 <= took <= 0.6 + 0.005 + 1e-9
    # exactly the Poisson(100/s) arrivals before 0.6 s, with the driver's seed
    rng = random.Random(1 ^ 0x5EED)
    due, want = [0.0], []
    while due[-1] < 0.6:
        want.append(due[-1])
        due.append(due[-1] + rng.expovariate(100.0))
    assert [t for _, t in log] == pytest.approx(want, abs=1e-9)
    assert stats.dispatched == len(want)


def test_drain_grace_cancels_stragglers():
    send, log, _ = _recorder(delay=5.0)
    w = make_workload("zipf", {"requests": 10})

    async def run():
        t0 = _now()
        stats = await drive(
            w.sessions(), Closed(3), Bounds(max_requests=3, duration_s=5, drain_s=0.1), send, clock=_now
        )
        return stats, _now() - t0

    stats, took = run_virtual(run())
    assert took == pytest.approx(0.1)  # the grace, not the 5 s the requests would take
    assert stats.dispatched == 3 and stats.cancelled == 3 and stats.completed == 0


def test_multiturn_turns_are_sequential_and_parallelism_bounded():
    send, log, inf = _recorder()
    w = make_workload("multiturn", {"clients": 6, "rounds": 3, "max_parallel": 2})
    stats = run_virtual(
        drive(
            w.sessions(),
            Closed(10),
            Bounds(max_requests=100, duration_s=10),
            send,
            max_active_sessions=w.max_active_sessions,
            clock=_now,
        )
    )
    assert stats.stopped_by == "exhausted" and stats.dispatched == 18
    assert inf[1] == 2  # only two sessions in progress, one turn each at a time
    order = [i for i, _ in log]
    for c in range(6):
        turns = [order.index(f"c{c}.{t}") for t in range(3)]
        assert turns == sorted(turns)


def test_failed_turn_ends_its_session():
    send, log, _ = _recorder(fail={"c0.1"})
    w = make_workload("multiturn", {"clients": 2, "rounds": 3})
    stats = run_virtual(drive(w.sessions(), Closed(2), Bounds(100, 10), send, clock=_now))
    ids = [i for i, _ in log]
    assert "c0.2" not in ids and "c1.2" in ids
    assert stats.dispatched == 5 and stats.sessions_finished == 2


def test_trace_times_are_honoured():
    send, log, _ = _recorder(delay=0.0)
    specs = [
        SingleShot(RequestSpec(f"t{i}.0", "completions", {"prompt": "x"}, 1, f"t{i}", 0, arrival_s=a))
        for i, a in enumerate((0.0, 0.2, 0.4))
    ]
    stats = run_virtual(drive(specs, TraceTimes(), Bounds(10, 5), send, clock=_now))
    assert stats.dispatched == 3
    assert [t for _, t in log] == [0.0, 0.2, 0.4]


def test_bad_bounds_and_rates():
    with pytest.raises(WorkloadError, match="--rate"):
        Poisson(0)
    with pytest.raises(WorkloadError, match="--concurrency"):
        Closed(0)
    with pytest.raises(WorkloadError, match="--requests"):
        Bounds(max_requests=0)
    with pytest.raises(WorkloadError, match="--duration"):
        Bounds(duration_s=0)


def _simulated_dispatches(sessions, arrivals, bounds, delay, seed, max_active_sessions=None):
    """The simulator's driver on a bare event loop: each request answered ``delay``
    after its dispatch (as ``_recorder``'s sender answers live)."""
    import heapq
    import itertools

    from radixfleet_tools.loadtest.simulator.driver import VirtualDriver

    log: list[tuple[str, float]] = []
    done: list = []
    now = [0.0]
    seq = itertools.count()
    peak = [0]

    def dispatch(session, spec):
        log.append((spec.id, now[0]))
        heapq.heappush(done, (now[0] + delay, next(seq), session, spec))
        peak[0] = max(peak[0], len(done))

    d = VirtualDriver(
        sessions, arrivals, bounds, dispatch, max_active_sessions=max_active_sessions, seed=seed
    )
    wake = d.pump(0.0)
    while not d.done:
        t = min(done[0][0] if done else math.inf, math.inf if wake is None else wake)
        if t == math.inf:
            break
        now[0] = t
        while done and done[0][0] <= t:
            _, _, session, spec = heapq.heappop(done)
            d.complete(session, f"answer to {spec.id}")
        wake = d.pump(t)
        d.check()
    return log, peak[0]


@pytest.mark.parametrize(
    "arrivals",
    [
        Poisson(40.0),
        Poisson(40.0, burstiness=0.25),
        Poisson(40.0, burstiness=4.0),
        Poisson(200.0, max_concurrency=3),
        Poisson(100.0, burstiness=0.3, max_concurrency=2),
        Closed(3),
    ],
    ids=repr,
)
def test_simulator_dispatches_at_the_live_drivers_times(arrivals):
    """``radixfleet simulate`` and ``radixfleet loadtest`` draw the same arrivals for
    the same workload and seed: burstiness shapes both, the concurrency cap holds in
    both, and every request leaves at the same moment."""
    delay = 0.05
    bounds = Bounds(max_requests=80, duration_s=30)

    def sessions():
        return make_workload("zipf", {"requests": 200}, seed=4).sessions()

    send, live, inf = _recorder(delay=delay)
    run_virtual(drive(sessions(), arrivals, bounds, send, seed=4, clock=_now))
    sim, sim_peak = _simulated_dispatches(sessions(), arrivals, bounds, delay, seed=4)
    assert len(live) == len(sim) == 80
    assert [i for i, _ in sim] == [i for i, _ in live]
    assert [t for _, t in sim] == pytest.approx([t for _, t in live], abs=1e-9)
    cap = getattr(arrivals, "max_concurrency", None) or getattr(arrivals, "concurrency", None)
    if cap is not None:
        assert inf[1] == sim_peak == cap


def test_a_rate_sweep_keeps_burstiness_and_the_concurrency_cap():
    from radixfleet_tools.loadtest.simulator.simulation import SimConfig
    from radixfleet_tools.loadtest.simulator.sweep import parse_sweep, plan_runs

    plans = plan_runs(
        SimConfig(workers=2), ["round_robin"], ["events"], Poisson(5.0, 0.5, 4), parse_sweep("rate=2,8")
    )
    assert [p.arrivals for p in plans] == [Poisson(2.0, 0.5, 4), Poisson(8.0, 0.5, 4)]


def test_the_overhead_benchmarks_schedule_is_the_drivers():
    """``bench loadgen`` offers its minimal client the arrivals ``radixfleet loadtest
    --rate R --seed S`` draws, and measures both clients' lag against them."""
    from radixfleet_tools.bench.loadgen import schedule

    send, log, _ = _recorder(delay=0.001)
    w = make_workload("zipf", {"requests": 100})
    run_virtual(
        drive(w.sessions(), Poisson(50.0), Bounds(max_requests=40, duration_s=60), send, seed=7, clock=_now)
    )
    assert [t for _, t in log] == pytest.approx(schedule(50.0, 40, 7), abs=1e-9)
