"""The default shedding rule (radixfleet.route.shedding) over the live Pool: nothing is shed
below saturation, a learned batch limit keeps a closed loop of at most the fleet's
slots unshed, and a saturated fleet is shed with the drain time as Retry-After."""

from __future__ import annotations

import random

import pytest

from radixfleet.route.shedding import CALM_S, KV_FULL, QueueMark, Shedder
from radixfleet.wire.errors import Overloaded
from radixfleet.wire.events import Load
from tests.router.pools import make_pool

RATE = 1000.0  # prefill tokens/s of every worker here


def engine_report(pool, w, now, *, running=0, waiting=0, queued_tokens=0, kv=(0, 0)):
    pool.report_load(
        w,
        Load(
            queued_requests=waiting,
            queued_tokens=queued_tokens,
            queued_prefill_tokens=queued_tokens,  # an engine's one estimate
            running_requests=running,
            kv_used_tokens=kv[0],
            kv_capacity_tokens=kv[1],
            prefill_tokens_per_s=RATE,
        ),
        now,
        stale_s=5.0,
        engine=True,
    )
    w.mark.check()


def decoding(pool, w, n=1, tokens=100):
    """n requests picked for w and past their first token (their prefill done)."""
    for _ in range(n):
        pool.pick(w, tokens)
        pool.prefilled(w, tokens)


def saturated_at_8(pool, w, now):
    """Two reports in a row of a waiting queue at 8 running: w's batch limit is 8."""
    for _ in range(2):
        engine_report(pool, w, now, running=8, waiting=3, queued_tokens=300)


def check(shedder, pool, now, uncached=100):
    return shedder.check(pool.routable_workers(now), "m", None, uncached, now)


def learned(shedder, pool, now):
    """Teaches the shedder a typical request of 0.1 s (100 tokens at 1,000/s)."""
    for w in pool:
        engine_report(pool, w, now)
    assert check(shedder, pool, now) is None
    assert shedder.typical_s == pytest.approx(0.1)


def test_busy_unsaturated_workers_are_not_shed_between_scrapes():
    # Both engines reported an empty queue a second ago; since then the router sent
    # each 950 uncached tokens (0.95 s of prefill at its rate), which they prefilled
    # meanwhile. Counting those picks without what was prefilled since (the old rule)
    # put 0.95 s of queue on each and shed this request.
    pool, _, clock = make_pool()
    s = Shedder(0.5, 0.05)
    t0 = clock()
    learned(s, pool, t0)
    for w in pool:  # saturated once (a queue held at 8 running: the batch limit) ...
        for _ in range(8):
            pool.pick(w, 0)
        engine_report(pool, w, t0, running=8, waiting=2, queued_tokens=200)
        engine_report(pool, w, t0, running=8, waiting=2, queued_tokens=200)
        assert w.mark.limit == 8
        engine_report(pool, w, t0, running=8)  # ... now every slot busy, nothing waiting
    for w in pool:
        for _ in range(19):
            pool.pick(w, 50)
            pool.finish(w, 50, True)
    assert check(s, pool, t0 + 1.0) is None
    # the same picks within 0.1 s are a burst the workers cannot have prefilled: shed
    for w in pool:
        for _ in range(19):
            pool.pick(w, 50)
    exc = check(s, pool, t0 + 1.1)
    assert isinstance(exc, Overloaded)
    # the reports' age is subtracted (0.95 + 0.95 picked, 1.1 s gone: 0.8 s), but the
    # burst has not reached its first tokens: 0.95 s of prefill ahead, 0.05 bound
    assert exc.retry_after_s == pytest.approx(0.95 - 0.05)


def test_an_engine_that_never_held_a_queue_is_never_full():
    # a burst of new conversations on engines that never queued for two reports:
    # no evidence of saturation, whatever the router's count of picks says
    pool, _, clock = make_pool()
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    for w in pool:
        engine_report(pool, w, t, running=4)
        engine_report(pool, w, t, running=5, waiting=3, queued_tokens=1500)
        decoding(pool, w, 12, 500)
    assert check(s, pool, t) is None
    assert all(not w.mark.queue_held for w in pool)
    for w in pool:  # the queue holds: saturated, shed
        engine_report(pool, w, t, running=5, waiting=7, queued_tokens=3500)
    exc = check(s, pool, t)
    assert isinstance(exc, Overloaded) and exc.retry_after_s == pytest.approx(3.5 - 0.05)


def test_a_learned_batch_limit_keeps_a_closed_loop_of_the_fleets_slots_unshed():
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    # a queue seen once at the running ceiling may be a step's token budget: no limit
    engine_report(pool, a, t, running=8, waiting=1, queued_tokens=900)
    assert a.mark.limit == 0 and a.mark.running_max == 8
    # seen twice in a row at the same ceiling: the batch limit (vLLM's max_num_seqs)
    engine_report(pool, a, t, running=8, waiting=1, queued_tokens=900)
    assert a.mark.limit == 8
    engine_report(pool, b, t, running=7, waiting=2, queued_tokens=2000)
    engine_report(pool, b, t, running=8, waiting=2, queued_tokens=2000)
    engine_report(pool, b, t, running=8, waiting=2, queued_tokens=2000)
    assert b.mark.limit == 8
    # 16 clients in a closed loop: 9 on a (8 running, one waiting for a slot), 7 on b,
    # whose engine is prefilling a burst (5 running, 2 waiting for the step's token
    # budget). Both queues are past the bound; b has a slot: admitted.
    decoding(pool, a, 9)
    decoding(pool, b, 7)
    engine_report(pool, a, t, running=8, waiting=1, queued_tokens=900)
    engine_report(pool, b, t, running=5, waiting=2, queued_tokens=2000)
    assert b.mark.limit == 8
    assert check(s, pool, t) is None
    # a 17th client: b's last slot is taken, a is full: shed
    decoding(pool, b)
    exc = check(s, pool, t)
    assert isinstance(exc, Overloaded) and exc.retry_after_s == pytest.approx(0.9 - 0.05)
    # one of a's requests finishes: its waiting one takes the slot, still no room
    pool.finish(a, 0, True)
    assert isinstance(check(s, pool, t), Overloaded)
    pool.finish(a, 0, True)  # two gone: a slot on a
    assert check(s, pool, t) is None


def test_a_scrape_that_lags_the_routers_finishes_does_not_shed_the_fleets_slots():
    # Both engines at their limit (8) with 16 clients. b's gauge is read at 8 running;
    # before the reading reaches the router two of b's requests finish there: one
    # client's next turn goes back to b, the other starts a new conversation on a
    # (9 there: 8 running, 1 waiting). The reading then lands: 8 on b. Counting
    # what the router did since the moment the reading landed (7 on b then) read b
    # as 8 + 0 = full when it holds 7; one of a's requests finishes, its client's
    # next turn found both "full" with prefill ahead on each: a 429 at 15 in flight.
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    for w in (a, b):
        decoding(pool, w, 8)
        for _ in range(2):
            engine_report(pool, w, t, running=8, waiting=1, queued_tokens=100)
        assert w.mark.limit == 8
        engine_report(pool, w, t, running=8)
    pool.finish(b, 0, True)
    pool.finish(b, 0, True)
    pool.pick(b, 100)  # a turn on b, not yet at its first token
    pool.pick(a, 100)  # a new conversation on a
    engine_report(pool, b, t, running=8)  # read before the two finishes
    engine_report(pool, a, t, running=8, waiting=1, queued_tokens=100)
    pool.finish(a, 0, True)
    assert a.in_flight + b.in_flight == 15
    assert check(s, pool, t) is None  # b holds 7 of its 8
    # another router's requests still count: the engine reports more than this one
    # ever had there since its last reading
    engine_report(pool, b, t, running=8, waiting=1, queued_tokens=100)
    assert isinstance(check(s, pool, t), Overloaded)
    assert s.recent[-1]["bound_s"] == pytest.approx(0.05)
    assert {r["id"]: (r["running"], r["in_flight"], r["limit"]) for r in s.recent[-1]["workers"]} == {
        "a": (8, 8, 8),
        "b": (8, 7, 8),
    }


def test_before_the_limit_is_learned_what_an_engine_ran_at_once_is_room():
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    decoding(pool, a, 8)
    decoding(pool, b, 8)
    for r in (6, 7):  # a held a queue, but never long enough at one ceiling for a limit
        engine_report(pool, a, t, running=r, waiting=1, queued_tokens=100)
    engine_report(pool, a, t, running=8)  # ran 8 at once, no queue
    for _ in range(2):
        engine_report(pool, b, t, running=8, waiting=2, queued_tokens=2000)
    for _ in range(3):
        pool.finish(a, 0, True)
    engine_report(pool, a, t, running=5)  # 5 in flight: a has shown it runs 8
    for _ in range(20):  # a burst of picks since, more prefill than the bound allows
        decoding(pool, a)
        pool.finish(a, 0, True)
    decoding(pool, a, 2)
    assert a.mark.limit == 0 and check(s, pool, t) is None  # 7 < 8: a slot
    decoding(pool, a)  # 8: as many as it ever ran; its queue of picks decides
    exc = check(s, pool, t)
    assert isinstance(exc, Overloaded) and exc.retry_after_s == pytest.approx(2.0 - 0.05)
    # a queue at the most it ran: no slot until one of the router's requests finishes
    decoding(pool, a)
    engine_report(pool, a, t, running=8, waiting=1, queued_tokens=100)
    assert isinstance(check(s, pool, t), Overloaded)
    pool.finish(a, 0, True)
    assert isinstance(check(s, pool, t), Overloaded)  # 8: its waiting one takes the slot
    pool.finish(a, 0, True)
    assert check(s, pool, t) is None


def test_a_waiting_queue_below_the_most_an_engine_ran_leaves_its_slots_room():
    # 16 clients, conversations sticky: 9 on a (its limit 8 learned), 7 on b, whose
    # limit is not learned: it ran 8 at once (a conversation has moved since) and held
    # a queue twice while prefilling a burst (a step's token budget). b's reading shows
    # 5 running, 2 waiting. One of a's requests finishes and its client's next turn
    # arrives: 15 in flight. Reading b's waiting queue as "no slot at all" (a ceiling
    # of 0 while any queue showed) shed it.
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    decoding(pool, a, 9)
    decoding(pool, b, 8)
    engine_report(pool, b, t, running=8)
    pool.finish(b, 0, True)
    for _ in range(2):
        engine_report(pool, a, t, running=8, waiting=1, queued_tokens=100)
        engine_report(pool, b, t, running=5, waiting=2, queued_tokens=300)
    assert (a.mark.limit, b.mark.limit, b.mark.running_max, b.mark.queue_held) == (8, 0, 8, True)
    pool.finish(a, 0, True)
    assert check(s, pool, t) is None  # b: 7 on it, a slot short of what it ran
    decoding(pool, b)  # b at the most it ran, a full: shed
    assert isinstance(check(s, pool, t), Overloaded)


def test_a_saturated_engine_with_a_slot_but_prefill_ahead_is_full():
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    s.shed_at = t  # the fleet shed a moment ago: the plain bounds, not a calm fleet's
    for w in (a, b):
        decoding(pool, w, 4)
        saturated_at_8(pool, w, t)
        engine_report(pool, w, t, running=4)  # limit 8, four slots free
    pool.pick(a, 150)  # prefill ahead on a: 0.15 s, over one typical request (0.1 s)
    pool.pick(b, 80)
    assert check(s, pool, t) is None  # b: 0.08 s ahead, a slot
    pool.pick(b, 80)
    exc = check(s, pool, t)  # both: a slot, but a first token would wait too long
    assert isinstance(exc, Overloaded) and exc.retry_after_s == pytest.approx(0.15 - 0.05)
    pool.prefilled(a, 150)  # its first token: nothing ahead on a
    assert check(s, pool, t) is None


def test_one_ordinary_request_ahead_per_worker_is_room_after_the_rate_drops():
    """A light load after a saturated phase: the engines now read a slower prefill
    rate (unbatched prefill) than the one the typical request was learned at, and
    each has one ordinary request not yet at its first token. That is one request
    ahead, not a queue: nothing is shed. Two ahead on these quiet engines neither
    (a burst into idle slots); three ahead on both is."""
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)  # typical 0.1 s: 100 tokens at 1,000/s
    s.shed_at = t  # the fleet shed a moment ago: the plain bounds, not a calm fleet's
    for w in (a, b):
        saturated_at_8(pool, w, t)
        engine_report(pool, w, t, running=0)  # limit 8, idle now
        pool.report_load(
            w, Load(running_requests=1, prefill_tokens_per_s=RATE * 0.6), t, stale_s=5.0, engine=True
        )
        pool.pick(w, 100)  # one ordinary request each, prefilling: 0.17 s at 600/s
    assert check(s, pool, t) is None
    for w in (a, b):
        pool.pick(w, 100)
    assert check(s, pool, t) is None
    for w in (a, b):
        pool.pick(w, 100)
    assert isinstance(check(s, pool, t), Overloaded)


def test_a_burst_into_quiet_engines_is_admitted_up_to_two_requests_ahead():
    """At light load after a saturated phase, five requests arrive within
    milliseconds: each engine reports nothing waiting and one running, and has two
    requests picked and not yet at their first token (0.2 s of prefill ahead, the
    bound 0.05 s). A burst into idle slots, not a queue: admitted. A third ahead on
    both is shed; so is the second ahead where the reports show over half the limit
    running (the one-request rule that keeps a saturated engine's steps short)."""
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)  # typical 0.1 s, largest 100 tokens: bound 0.05 s
    s.shed_at = t  # the fleet shed a moment ago: the plain bounds, not a calm fleet's
    for w in (a, b):
        saturated_at_8(pool, w, t)
        engine_report(pool, w, t, running=1)  # limit 8, quiet now
        pool.pick(w, 100)
        pool.pick(w, 100)
    assert check(s, pool, t) is None
    for w in (a, b):
        pool.pick(w, 100)
    assert isinstance(check(s, pool, t), Overloaded)
    assert s.recent[-1]["workers"][0]["quiet"]
    for w in (a, b):
        pool.prefilled(w, 100)  # two ahead each again, but now the engines are busy
        engine_report(pool, w, t, running=5)
    assert isinstance(check(s, pool, t), Overloaded)
    assert not s.recent[-1]["workers"][0]["quiet"]
    # reports gone stale (a saturated engine answering /metrics late) read as no
    # evidence of quiet: one request ahead, as before
    for w in (a, b):
        engine_report(pool, w, t, running=1)
    assert check(s, pool, t) is None
    assert isinstance(check(s, pool, t + 6.0), Overloaded)


def test_limit_is_relearned_above_a_new_ceiling_and_forgotten_on_restart():
    pool, _, clock = make_pool()
    a = pool.get("a")
    t = clock()
    for _ in range(2):
        engine_report(pool, a, t, running=4, waiting=3, queued_tokens=300)
    assert a.mark.limit == 4
    engine_report(pool, a, t, running=6, waiting=0)  # more ran than "the limit"
    assert (a.mark.limit, a.mark.running_max) == (0, 6)
    engine_report(pool, a, t, running=6, waiting=1, queued_tokens=100)
    engine_report(pool, a, t, running=5, waiting=1, queued_tokens=100)  # not at the max
    engine_report(pool, a, t, running=6, waiting=1, queued_tokens=100)
    assert a.mark.limit == 0  # never two in a row at the ceiling
    engine_report(pool, a, t, running=6, waiting=4, queued_tokens=100)
    assert a.mark.limit == 6
    pool.engine_restarted(a)
    assert (a.mark.limit, a.mark.running_max) == (0, 0)
    a.mark.check()


def test_full_kv_means_no_room_and_agents_learn_no_limit():
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    cap = 10_000
    for _ in range(2):
        engine_report(pool, a, t, running=8, waiting=1, queued_tokens=900)
    # a has a free slot by count, but its KV is full: the queue decides
    engine_report(pool, a, t, running=3, waiting=5, queued_tokens=900, kv=(int(KV_FULL * cap), cap))
    pool.report_load(
        b,
        Load(
            queued_requests=5,
            queued_tokens=900,
            queued_prefill_tokens=900,
            running_requests=3,
            prefill_tokens_per_s=RATE,
        ),
        t,
    )  # an agent
    assert b.mark.limit == 0 and b.mark.running_max == 0
    exc = check(s, pool, t)
    assert isinstance(exc, Overloaded) and exc.retry_after_s == pytest.approx(0.9 - 0.05)
    engine_report(pool, a, t, running=3, waiting=4, queued_tokens=900, kv=(int(KV_FULL * cap) - 1, cap))
    assert check(s, pool, t) is None  # a slot and KV: room


def test_no_report_or_a_stale_one_is_never_full_and_zero_turns_it_off():
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    for _ in range(2):
        engine_report(pool, a, t, waiting=100, queued_tokens=10**6)
    assert check(s, pool, t) is None  # b never reported: no evidence
    engine_report(pool, b, t, waiting=100, queued_tokens=10**6)
    assert check(s, pool, t) is None  # b's queue not seen twice: maybe one step's
    engine_report(pool, b, t, waiting=100, queued_tokens=10**6)
    assert isinstance(check(s, pool, t), Overloaded)
    assert check(s, pool, t + 5.0) is None  # both reports stale
    assert check(Shedder(0.0, 0.05), pool, t) is None


def test_a_saturated_engine_whose_scrapes_stop_is_judged_on_the_routers_counts():
    # Both engines learned their limit (8); the router holds 8 decoding requests on
    # each and 2 more sent since, waiting for a slot (no first token yet). Then their
    # /metrics stop answering in time (an engine at full batch on shared cores): the
    # reports go stale. Reading that silence as room admitted the whole overload into
    # the engines' queues; the router's own counts say they are full with prefill ahead.
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    for w in (a, b):
        decoding(pool, w, 8)
        saturated_at_8(pool, w, t)
        assert w.mark.limit == 8
        pool.pick(w, 300)
        pool.pick(w, 300)
    later = t + 6.0  # the reports (trusted 5 s) are stale
    assert a.load_until <= later
    exc = check(s, pool, later)
    assert isinstance(exc, Overloaded) and exc.retry_after_s == pytest.approx(0.6 - 0.05)
    for _ in range(2):  # a's waiting requests started and two others finished
        pool.prefilled(a, 300)
        pool.finish(a, 0, True)
    assert check(s, pool, later) is None
    # an engine that never held a queue keeps "no evidence, room" when it goes quiet
    pool2, _, clock2 = make_pool()
    t2 = clock2()
    learned(s, pool2, t2)
    for w in pool2:
        decoding(pool2, w, 8)
        engine_report(pool2, w, t2, running=8)
        pool2.pick(w, 300)
        pool2.pick(w, 300)
    assert check(s, pool2, t2 + 6.0) is None


def test_random_reports_and_picks_keep_the_mark_consistent():
    rng = random.Random(7)
    pool, _, clock = make_pool()
    s = Shedder(0.5, 0.05)
    ws = list(pool)
    held = {w.id: 0 for w in ws}
    for _step in range(3000):
        w = rng.choice(ws)
        op = rng.random()
        clock.t += rng.random() * 0.05
        if op < 0.3:
            engine_report(
                pool,
                w,
                clock(),
                running=rng.randrange(10),
                waiting=rng.randrange(4),
                queued_tokens=rng.randrange(3000),
                kv=(rng.randrange(1000), 1000),
            )
        elif op < 0.6:
            pool.pick(w, rng.randrange(500))
            held[w.id] += 1
        elif op < 0.9 and held[w.id]:
            pool.finish(w, 0, True)
            held[w.id] -= 1
        elif op < 0.92:
            pool.engine_restarted(w)
        res = check(s, pool, clock())
        assert res is None or (isinstance(res, Overloaded) and res.retry_after_s > 0)
        for x in ws:
            x.mark.check()
    pool.check()


def test_queue_mark_starts_empty():
    m = QueueMark()
    m.check()
    assert (m.limit, m.running_max, m.since_tokens) == (0, 0, 0)


def test_a_prefetch_is_not_counted_in_the_typical_request():
    # A prefetch is a max_tokens 1 warm-up of a later request: its whole prompt is
    # uncached, the real request after it hits. Counted, 5,000-token prefetches would
    # teach a typical request of seconds and widen the bound for every other request.
    pool, _, clock = make_pool()
    s = Shedder(0.5, 0.05)
    t0 = clock()
    learned(s, pool, t0)
    largest = s.largest_tokens
    for _ in range(20):
        assert s.check(pool.routable_workers(t0), "m", None, 5000, t0, prefetch=True) is None
    assert s.typical_s == pytest.approx(0.1)
    assert s.largest_tokens == 5000 > largest  # its prefill sits ahead like a request's
    assert check(s, pool, t0, uncached=300) is None
    assert s.typical_s > 0.1  # a real request still counts


def test_an_agents_whole_queue_is_judged_and_its_prefill_kept_in_the_record():
    # Each agent has two 4,116-token prompts waiting whose 4,096-token prefixes its
    # cache holds: 8.2 s counted whole, 0.04 s of prefill. Shedding judges the whole
    # count (past saturation such prefixes are often evicted before their turn) and
    # keeps the prefill beside it for whoever traces the decision.
    pool, _, clock = make_pool()
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)
    for w in pool:
        pool.report_load(
            w,
            Load(
                queued_requests=2,
                queued_tokens=2 * 4116,
                queued_prefill_tokens=2 * 20,
                running_requests=1,
                prefill_tokens_per_s=RATE,
            ),
            t,
        )
    assert isinstance(check(s, pool, t), Overloaded)
    rows = s.recent[-1]["workers"]
    assert [(r["pending_s"], r["prefill_s"]) for r in rows] == [(8.232, 0.04)] * 2


def burst(shedder, pool, now, n):
    """n requests of 100 uncached tokens at ``now``, each admitted one picked on the
    worker with the least prefill ahead; how many were admitted."""
    admitted = 0
    for _ in range(n):
        if check(shedder, pool, now) is not None:
            continue
        pool.pick(min(pool, key=lambda w: w.in_flight_tokens), 100)
        admitted += 1
    return admitted


def test_a_burst_while_nothing_was_shed_takes_a_saturated_engines_free_slots_only():
    """An engine that has held a queue takes a calm burst's requests only into free
    slots and only on a fresh report: a burst of seven on two quiet engines (over
    QUIET_AHEAD's two ahead) is admitted; on engines with every slot taken, or whose
    reports went stale, the plain rules hold."""
    pool, _, clock = make_pool()
    a, b = pool.get("a"), pool.get("b")
    s = Shedder(0.5, 0.05)
    t = clock()
    learned(s, pool, t)  # typical 0.1 s, largest 100 tokens: bound 0.05 s
    for w in (a, b):
        saturated_at_8(pool, w, t)
        engine_report(pool, w, t, running=1)  # limit 8, quiet now
    assert burst(s, pool, t, 7) == 7
    for w in (a, b):  # every slot taken, the burst still ahead: no room, whatever the calm
        engine_report(pool, w, t, running=8)
    assert isinstance(check(s, pool, t + 0.1), Overloaded)
    for w in (a, b):
        pool.prefilled(w, 100 * w.in_flight)
        engine_report(pool, w, t + 10.0, running=1)
    assert burst(s, pool, t + 10.0, 6) == 6  # calm again (10 s since the shed): 3 ahead each
    # the same burst against stale reports: one request ahead each, as before
    assert isinstance(check(s, pool, t + 16.0), Overloaded)


def test_a_refusal_shows_the_workers_saturated_to_the_policy_for_calm_s():
    """The shedder tells the pool of each refusal (``on_refuse``); the views of the
    workers serving the model read ``saturated`` for CALM_S seconds (the cached view
    is rebuilt at the refusal and when it ends), then not."""
    pool, _, clock = make_pool()
    s = Shedder(0.5, 0.05, pool.refused)
    t = clock()
    learned(s, pool, t)
    assert not any(v.saturated for v in pool.views(t))
    for w in pool:  # every worker's queue past the bound: shed
        engine_report(pool, w, t, running=5, waiting=7, queued_tokens=3500)
        engine_report(pool, w, t, running=5, waiting=7, queued_tokens=3500)
    assert isinstance(check(s, pool, t), Overloaded)
    assert all(v.saturated for v in pool.views(t + 0.1))
    assert all(v.saturated for v in pool.views(t + CALM_S - 0.01))
    assert not any(v.saturated for v in pool.views(t + CALM_S))
    # a refusal for a model only some workers serve marks those only
    a, b = pool.get("a"), pool.get("b")
    a.models, b.models = ("m",), ("other",)
    pool.refused("m", None, t + 10.0)
    assert {v.id: v.saturated for v in pool.views(t + 10.0)} == {"a": True, "b": False}
