"""radixfleet.engines.queue_estimate: an engine's waiting queue in prefill tokens."""

from __future__ import annotations

import math

import pytest

from radixfleet.engines.queue_estimate import QueueEstimate
from radixfleet.wire.events import MAX_LOAD_COUNT

RATE = 4000.0  # prefill tokens/s


def feed(q: QueueEstimate, rows) -> None:
    """rows: (now, waiting, prefilled, queries, hits)"""
    for r in rows:
        q.observe(*r)
        q.check()


def test_an_empty_queue_costs_nothing():
    q = QueueEstimate()
    assert q.queued_tokens(0, 500.0, RATE) == 0


def test_without_counters_the_fleet_mean_prices_each_waiting_request():
    q = QueueEstimate()
    feed(q, [(0.0, 5, None, None, None), (1.0, 5, None, None, None)])
    assert q.queued_tokens(5, 300.0, RATE) == 1500
    assert q.departures_per_s is None


def test_foreign_long_prompts_are_priced_at_the_engines_own_size():
    """Requests the router never saw (1,200 uncached tokens each) behind a fleet mean
    of 23: the engine's counters size the queue."""
    q = QueueEstimate()
    feed(q, [(0.0, 0, 0, 0, 0), (0.25, 16, 8, 8 * 1200, 0)])
    assert q.tokens_per_request == pytest.approx(1200)
    assert q.queued_tokens(16, 23.0, RATE) >= 16 * 1200


def test_cached_tokens_are_not_counted_as_work():
    q = QueueEstimate()
    feed(q, [(0.0, 0, 0, 0, 0), (1.0, 0, 10, 10 * 1000, 10 * 900)])
    assert q.tokens_per_request == pytest.approx(100)
    # a worker serving mostly cached requests is still priced at the fleet's mean
    assert q.queued_tokens(4, 500.0, RATE) == 2000


def test_a_queue_behind_long_decodes_is_priced_by_its_departure_rate():
    """Short prompts (100 tokens), 8 slots, each batch decodes for 2.5 s: 16 waiting
    requests wait ~5 s, far more than their 1,600 tokens of prefill."""
    q = QueueEstimate(tau_s=30.0)
    rows = [(0.0, 16, 0, 0, 0)]
    done = 0
    for step in range(1, 41):  # 10 s in 0.25 s scrapes; 8 depart every 2.5 s
        t = step * 0.25
        if step % 10 == 0:
            done += 8
        rows.append((t, 16, done, done * 100, 0))
    feed(q, rows)
    assert q.departures_per_s == pytest.approx(3.2, rel=0.2)
    wait_s = q.queued_tokens(16, 100.0, RATE) / RATE
    assert 4.0 <= wait_s <= 6.5, wait_s


def test_idle_intervals_do_not_count_as_departure_capacity():
    """An engine with no queue departs at the arrival rate: not a capacity."""
    q = QueueEstimate()
    feed(q, [(0.0, 0, 0, 0, 0), (1.0, 0, 1, 100, 0), (2.0, 0, 2, 200, 0)])
    assert q.departures_per_s is None
    assert q.queued_tokens(3, 100.0, RATE) == 300


def test_a_stuck_queue_grows_with_the_time_it_has_been_stuck():
    q = QueueEstimate()
    feed(q, [(0.0, 4, 10, 0, 0), (1.0, 4, 10, 0, 0), (2.0, 4, 10, 0, 0)])
    assert q.departures_per_s == 0
    assert q.queued_tokens(4, 10.0, RATE) >= 4 * 1.0 * RATE


def test_counters_going_backwards_restart_the_estimate():
    q = QueueEstimate()
    feed(q, [(0.0, 8, 0, 0, 0), (1.0, 8, 8, 8000, 0), (2.0, 8, 16, 16000, 0)])
    assert q.departures_per_s is not None and q.tokens_per_request > 0
    feed(q, [(3.0, 0, 0, 0, 0)])  # a new process
    assert q.departures_per_s is None and q.tokens_per_request == 0
    feed(q, [(4.0, 2, 1, 50, 0)])
    assert q.tokens_per_request == pytest.approx(50)


def test_repeated_or_backward_clock_readings_are_ignored():
    q = QueueEstimate()
    feed(q, [(1.0, 8, 0, 0, 0), (1.0, 8, 8, 800, 0), (0.5, 8, 16, 1600, 0)])
    assert q.departures_per_s is None and q.tokens_per_request == 0


def test_the_estimate_is_capped_at_the_load_bound():
    q = QueueEstimate()
    feed(q, [(0.0, 1, 0, 0, 0), (1.0, 1, 0, 0, 0)])
    assert q.queued_tokens(2**40, 1e9, 1e12) == MAX_LOAD_COUNT
    assert q.queued_tokens(10, math.inf, RATE) == MAX_LOAD_COUNT


@pytest.mark.parametrize("tau", [0.0, -1.0, math.nan, math.inf])
def test_a_bad_time_constant_is_refused(tau):
    with pytest.raises(ValueError):
        QueueEstimate(tau_s=tau)


def test_a_request_waiting_one_step_at_a_scrape_is_not_a_saturated_queue():
    """A lightly used engine (one arrival a second) caught with one request waiting
    at a scrape, empty at the next: not a measure of its capacity."""
    q = QueueEstimate()
    rows = []
    for k in range(20):
        rows.append((float(k), 1 if k % 2 == 0 else 0, k, 100 * k, 0))
    feed(q, rows)
    assert q.departures_per_s is None
    assert q.queued_tokens(1, 100.0, RATE) == 100
