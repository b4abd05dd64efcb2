"""prefix_load: seeded scenarios with exact expected choices, against a real PrefixIndex."""

from __future__ import annotations

import random

import pytest

from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import Endpoint, request_key
from radixfleet.policies.base import MatchResult, Reason, RouteRequest, WorkerView
from radixfleet.policies.prefix_load import PrefixLoad
from radixfleet.policies.registry import build_policy
from radixfleet.policies.replication import HotRoots
from radixfleet_tools.loadtest.simulator.harness import PickLoop, counts

W4 = [f"w{i}" for i in range(4)]
W8 = [f"w{i}" for i in range(8)]
SYSTEM = "S" * 4096  # 1024 tokens = 32 blocks of 32 tokens


def completion(prompt: str, tenant: str = ""):
    return request_key(Endpoint.COMPLETIONS, {"model": "m", "prompt": prompt}, tenant=tenant)


def chat(messages, tenant: str = ""):
    return request_key(Endpoint.CHAT, {"model": "m", "messages": messages}, tenant=tenant)


def policy(seed=0, **params) -> PrefixLoad:
    return build_policy("prefix_load", params, random.Random(seed))


# ------------------------------------------------------------------ hand-built matches


def hand_req(prompt=3232, blocks=101):
    return RouteRequest(list(range(1, blocks + 1)), prompt, 32)


def test_miss_goes_to_the_least_loaded_worker():
    pol = policy()
    vs = [
        WorkerView("w0", in_flight_tokens=300),
        WorkerView("w1", in_flight_tokens=100),
        WorkerView("w2", in_flight_tokens=0, queued_tokens=200),
    ]
    d = pol.choose(hand_req(), MatchResult({}), vs, 0.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w1", Reason.MISS, 0)
    assert d.expected_ttft_s == pytest.approx((100 + 3232) / 10_000)
    # a match shorter than min_match_tokens (64) is a miss: 1 block = 32 tokens
    d = pol.choose(hand_req(), MatchResult({"w2": 1}, depth=1), vs, 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.MISS)
    # 2 blocks = 64 tokens is a match (and w2 wins on score)
    d = pol.choose(hand_req(), MatchResult({"w2": 2, "w0": 2}, depth=2), vs, 0.0)
    assert d.reason is Reason.AFFINITY and d.matched_blocks == 2
    # equally least-loaded workers tie at random (new prefixes: none has a home yet)
    eq = [WorkerView("a", in_flight_tokens=50), WorkerView("b"), WorkerView("c")]
    fresh = [RouteRequest(list(range(1000 * k, 1000 * k + 101)), 3232, 32) for k in range(1, 61)]
    assert {pol.choose(r, MatchResult({}), eq, 0.0).worker for r in fresh} == {"b", "c"}


def test_a_miss_on_an_evicted_prefix_goes_back_to_its_last_worker_when_saturated():
    pol = policy()
    base = 20_000  # 2 s of queue on every worker: the fleet is saturated
    vs = [
        WorkerView("w0", in_flight_tokens=base + 3000),
        WorkerView("w1", in_flight_tokens=base + 3000),
        WorkerView("w2", in_flight_tokens=base),
    ]
    req = hand_req()
    # first seen: the least-loaded worker
    assert pol.choose(req, MatchResult({}), vs, 0.0).worker == "w2"
    # evicted everywhere (the index shows no holder); w2 is now the busier one but not
    # overloaded relative to the others (under twice the least-loaded queue)
    vs = [
        WorkerView("w0", in_flight_tokens=base),
        WorkerView("w1", in_flight_tokens=base),
        WorkerView("w2", in_flight_tokens=base + 15_000),
    ]
    sibling = RouteRequest(req.hashes[:50] + [10_000 + i for i in range(51)], 3232, 32)
    d = pol.choose(sibling, MatchResult({}), vs, 1.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w2", Reason.MISS, 0)
    # overloaded relative to the least-loaded worker: the home yields
    vs[2] = WorkerView("w2", in_flight_tokens=3 * base)
    assert pol.choose(sibling, MatchResult({}), vs, 2.0).worker in ("w0", "w1")
    # below saturation a miss goes to the least-loaded worker, home or not
    light = [WorkerView("w0"), WorkerView("w1"), WorkerView("w2", in_flight_tokens=3000)]
    assert pol.choose(sibling, MatchResult({}), light, 3.0).worker in ("w0", "w1")
    # with home_records 0 nothing is remembered
    off = policy(home_records=0)
    off.choose(req, MatchResult({}), vs, 0.0)
    vs = [
        WorkerView("w0", in_flight_tokens=base),
        WorkerView("w1", in_flight_tokens=base),
        WorkerView("w2", in_flight_tokens=base + 15_000),
    ]
    assert off.choose(sibling, MatchResult({}), vs, 1.0).worker in ("w0", "w1")
    pol.check()


def test_a_fleet_the_router_is_shedding_for_is_saturated_though_its_queues_are_short():
    """Shedding holds each queue near its bound (a fraction of a prefill), so no queue
    reaches saturated_s; the views' ``saturated`` (the router refused what these
    workers could serve) turns the saturated rules on: a miss goes home."""
    pol = policy()
    base = 1_000  # 0.1 s of queue on every worker, far below saturated_s (1 s)

    def views(sat: bool, w2: int):
        return [
            WorkerView("w0", in_flight_tokens=base, saturated=sat),
            WorkerView("w1", in_flight_tokens=base, saturated=sat),
            WorkerView("w2", in_flight_tokens=w2, saturated=sat),
        ]

    req = hand_req()
    first = [
        WorkerView(v.id, in_flight_tokens=v.in_flight_tokens + 300, saturated=True) for v in views(True, 0)
    ]
    assert pol.choose(req, MatchResult({}), first, 0.0).worker == "w2"
    sibling = RouteRequest(req.hashes[:50] + [10_000 + i for i in range(51)], 3232, 32)
    d = pol.choose(sibling, MatchResult({}), views(True, base + 800), 1.0)
    assert (d.worker, d.reason) == ("w2", Reason.MISS)
    # one worker not refused for: not the whole fleet, the least-loaded worker
    mixed = views(True, base + 800)
    mixed[0] = WorkerView("w0", in_flight_tokens=base)
    assert pol.choose(sibling, MatchResult({}), mixed, 2.0).worker in ("w0", "w1")
    # nothing refused: below saturation, the least-loaded worker
    assert pol.choose(sibling, MatchResult({}), views(False, base + 800), 3.0).worker in ("w0", "w1")
    # saturated_s 0 turns the saturated rules off whatever the views say
    off = policy(saturated_s=0)
    off.choose(req, MatchResult({}), first, 0.0)
    assert off.choose(sibling, MatchResult({}), views(True, base + 800), 1.0).worker in ("w0", "w1")
    pol.check()


def test_a_saturated_fleet_trusts_a_fresh_home_over_the_index_and_a_stale_one_not_at_all():
    """Past saturation the queue ahead of a request writes more than a cache holds:
    the prefix's last worker holds it when the request's turn comes while less than
    its KV capacity was routed there since (fresh), whatever the index shows now;
    after that (stale) the copy the index shows there is gone by then."""
    pol = policy()
    base = 20_000  # 2 s of queue on every worker: saturated

    def fleet(w2_extra: int) -> list[WorkerView]:
        return [
            WorkerView("w0", in_flight_tokens=base, kv_capacity_tokens=32_000),
            WorkerView("w1", in_flight_tokens=base, kv_capacity_tokens=32_000),
            WorkerView("w2", in_flight_tokens=base + w2_extra, kv_capacity_tokens=32_000),
        ]

    req = hand_req()
    assert pol.choose(req, MatchResult({}), fleet(-3000), 0.0).worker == "w2"  # its home now
    sibling = RouteRequest(req.hashes[:64] + [10_000 + i for i in range(37)], 3232, 32)
    # the index shows an older copy on w0 and none on w2, busier: the fresh home keeps it
    d = pol.choose(sibling, MatchResult({"w0": 64}, depth=64), fleet(3000), 1.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w2", Reason.MISS, 0)
    # 40k uncached tokens routed to w2 since: stale. The index still shows w2 holding the
    # prefix, but the copy will be gone when the request's turn comes: a miss, to the
    # least-loaded worker (not home)
    pol.observe_pick("w2", 40_000, 2.0)
    d = pol.choose(sibling, MatchResult({"w2": 64}, depth=64), fleet(3000), 3.0)
    assert d.worker in ("w0", "w1") and d.reason is Reason.MISS, d
    pol.check()


def test_a_saturated_holders_reported_queue_counts_only_the_prompts_it_must_prefill():
    """A worker's report counts whole prompts waiting; past saturation a good holder's
    queue is mostly prompts it holds. Counted whole, it looks overloaded and its
    prefix moves; counted at the share of its prompts it prefills, it keeps it."""
    pol = policy()
    req = hand_req()
    idle = [WorkerView("w0"), WorkerView("w1")]
    for t in range(5):  # w0 holds 100 of 101 blocks: ~1% of its prompts is prefill
        assert pol.choose(req, MatchResult({"w0": 100}, depth=100), idle, float(t)).worker == "w0"
    vs = [
        WorkerView("w0", in_flight_tokens=20_000, queued_tokens=80_000),  # 8 s counted whole
        WorkerView("w1", in_flight_tokens=20_000),
    ]
    d = pol.choose(req, MatchResult({"w0": 100}, depth=100), vs, 5.0)
    assert (d.worker, d.reason) == ("w0", Reason.AFFINITY)
    assert d.expected_ttft_s == pytest.approx((20_000 + 32) / 10_000)
    # nothing routed to w1 yet: its report counts whole
    vs = [
        WorkerView("w0", in_flight_tokens=20_000),
        WorkerView("w1", in_flight_tokens=20_000, queued_tokens=80_000),
    ]
    assert pol.choose(hand_req(blocks=101), MatchResult({"w1": 100}, depth=100), vs, 6.0).worker == "w0"
    pol.check()


def test_a_saturated_fleet_keeps_a_holder_within_the_affinity_bound():
    # every worker queues 2 s or more: a holder 0.9 s busier than the least-loaded
    # worker keeps its 8-block match (the score alone would move it)
    vs = [WorkerView("w0", in_flight_tokens=29_000), WorkerView("w1", in_flight_tokens=20_000)]
    m = MatchResult({"w0": 8}, depth=8)
    req = hand_req(prompt=512, blocks=16)
    assert policy(saturated_s=0).choose(req, m, vs, 0.0).worker == "w1"
    d = policy().choose(req, m, vs, 0.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w0", Reason.AFFINITY, 8)
    # past the bound (over twice the least-loaded queue and 1 s + the saved prefill): it yields
    vs = [WorkerView("w0", in_flight_tokens=60_000), WorkerView("w1", in_flight_tokens=20_000)]
    assert policy().choose(req, m, vs, 0.0).worker == "w1"


def test_queue_delay_is_in_seconds_of_each_workers_prefill_rate():
    pol = policy()
    # w0 has fewer queued tokens but prefills 4x slower: w1 is less loaded in time
    vs = [
        WorkerView("w0", in_flight_tokens=1000, prefill_tokens_per_s=2_500.0),
        WorkerView("w1", in_flight_tokens=3000, prefill_tokens_per_s=10_000.0),
    ]
    assert pol.choose(hand_req(), MatchResult({}), vs, 0.0).worker == "w1"


def test_affinity_bound_exact_edges():
    # the bound: queue excess over the least-loaded > affinity_abs_s + prefill_weight x
    # the prefill the match saves, and queue > affinity_rel x the least-loaded's
    pol = policy()  # affinity_abs_s 1.0, affinity_rel 2.0, prefill_weight 2.0
    assert (pol.params.affinity_abs_s, pol.params.affinity_rel) == (1.0, 2.0)
    r = hand_req(prompt=6432, blocks=201)
    m = MatchResult({"w0": 200}, depth=200)  # 6400 of 6432 tokens cached on w0: saves 0.64 s
    lo = WorkerView("w1", in_flight_tokens=1000)  # 0.1 s
    at = WorkerView("w0", in_flight_tokens=23800)  # 2.38 s: exceeds by exactly 1.0 + 2 x 0.64
    d = pol.choose(r, m, [at, lo], 0.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w0", Reason.AFFINITY, 200)
    assert d.expected_ttft_s == pytest.approx(2.38 + 32 / 10_000)
    over = WorkerView("w0", in_flight_tokens=23801)
    d = pol.choose(r, m, [over, lo], 0.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w1", Reason.SPILL_LOAD, 0)
    assert d.expected_ttft_s == pytest.approx(0.1 + 6432 / 10_000)
    # both margins must be exceeded: 3.5 s vs 2.0 s is 1.5 s more but < 2x -> affinity
    r = hand_req(prompt=12832, blocks=401)
    m = MatchResult({"w0": 400}, depth=400)  # saves 1.28 s
    busy = WorkerView("w1", in_flight_tokens=20000)
    d = pol.choose(r, m, [WorkerView("w0", in_flight_tokens=35000), busy], 0.0)
    assert (d.worker, d.reason) == ("w0", Reason.AFFINITY)
    # 5.56 s: > 2x, and exactly 1.0 + 2 x 1.28 more: still affinity
    d = pol.choose(r, m, [WorkerView("w0", in_flight_tokens=55600), busy], 0.0)
    assert (d.worker, d.reason) == ("w0", Reason.AFFINITY)
    # 5.5601 s: past both margins, the bound overrides the score, whose reuse credit
    # 2 x 1.28 x (1 + 1.28 / 0.25) = 15.6 s would have kept w0
    d = pol.choose(r, m, [WorkerView("w0", in_flight_tokens=55601), busy], 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.SPILL_LOAD)


def test_reuse_credit_grows_with_the_saved_prefill():
    # 1600 of 3232 tokens cached on w0 saves 0.16 s: credit 2 x 0.16 x (1 + 0.16 / 0.25)
    # = 0.5248 s; linear (long_match_s 0) it is 0.32 s
    r = hand_req()
    m = MatchResult({"w0": 50}, depth=50)
    vs = [WorkerView("w0", in_flight_tokens=5000), WorkerView("w1")]  # 0.5 s busier
    d = policy().choose(r, m, vs, 0.0)
    assert (d.worker, d.reason) == ("w0", Reason.AFFINITY)
    d = policy(long_match_s=0.0).choose(r, m, vs, 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.SPILL_LOAD)
    vs = [WorkerView("w0", in_flight_tokens=5300), WorkerView("w1")]  # 0.53 s: not worth it
    d = policy().choose(r, m, vs, 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.SPILL_LOAD)


def test_scoring_trades_reuse_against_queueing():
    pol = policy()
    m = MatchResult({"w0": 10}, depth=10)  # 320 of 3232 tokens cached on w0
    # w0 0.1 s busier: saves 2 x 320 / 10k = 0.064 s of weighted prefill -> not worth it
    d = pol.choose(hand_req(), m, [WorkerView("w0", in_flight_tokens=1000), WorkerView("w1")], 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.SPILL_LOAD)
    # 0.05 s busier: worth it
    d = pol.choose(hand_req(), m, [WorkerView("w0", in_flight_tokens=500), WorkerView("w1")], 0.0)
    assert (d.worker, d.reason) == ("w0", Reason.AFFINITY)


def test_a_private_match_is_worth_private_weight_a_shared_one_prefill_weight():
    # 1,600 of 2,000 tokens held by w0, which has 0.5 s more queue than w1
    req = RouteRequest(list(range(1, 64)), 2000, 32)
    vs = [
        WorkerView("w0", in_flight_tokens=5000, prefill_tokens_per_s=10_000),
        WorkerView("w1", prefill_tokens_per_s=10_000),
    ]
    # shared: 0.5 + 2 x 0.04 - 8 x 0.16^2 = 0.375 s against 2 x 0.2 = 0.4 s: stays;
    # with 0.6 s of queue (0.475 s) it spills
    shared = MatchResult({"w0": 50}, 50)
    private = MatchResult({"w0": 50}, 50, private=True)
    assert policy().choose(req, shared, vs, 0.0).worker == "w0"
    vs[0] = WorkerView("w0", in_flight_tokens=6000, prefill_tokens_per_s=10_000)
    d = policy().choose(req, shared, vs, 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.SPILL_LOAD)
    # private: 0.6 + 4 x 0.04 - 16 x 0.16^2 = 0.35 s against 4 x 0.2 = 0.8 s: stays
    d = policy().choose(req, private, vs, 0.0)
    assert (d.worker, d.reason) == ("w0", Reason.AFFINITY)
    assert policy(private_weight=2.0).choose(req, private, vs, 0.0).worker == "w1"
    # the affinity bound stays at prefill_weight: 3,584 of 4,000 tokens held, 2.0 s of
    # queue; the private score would keep it (2.0 + 4 x 0.0416 - 16 x 0.3584^2 = 0.11 s
    # against 1.6 s), the bound (1.0 + 2 x 0.3584 = 1.72 s) does not
    req = RouteRequest(list(range(1, 126)), 4000, 32)
    private = MatchResult({"w0": 112}, 112, private=True)
    vs[0] = WorkerView("w0", in_flight_tokens=20_000, prefill_tokens_per_s=10_000)
    d = policy().choose(req, private, vs, 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.SPILL_LOAD)
    assert policy(affinity_abs_s=1.3).choose(req, private, vs, 0.0).worker == "w0"


def test_a_holder_whose_cache_churns_keeps_its_private_matches_but_not_new_sessions():
    # every request shares a 2,304-token prefix (72 blocks) that only w0 holds, and
    # brings 696 tokens of its own: w0 takes them all, writing 696 tokens each
    req = RouteRequest(list(range(1, 95)), 3000, 32)
    shared = MatchResult({"w0": 72}, 72)
    vs = [WorkerView(f"w{i}", kv_capacity_tokens=12_000, prefill_tokens_per_s=10_000) for i in range(4)]
    pol = policy()
    got = [pol.choose(req, shared, vs, i * 0.1).worker for i in range(6)]
    # w0's cache (12k tokens) is rewritten in under kv_turnover_s (30 s) once it takes
    # 400 tokens/s over kv_window_s (10 s) — 4,000 tokens: after the 6th request — and
    # nobody else writes (its rate > kv_rel x the fleet's mean)
    assert got == ["w0"] * 6
    assert pol._write_rate("w0", 0.6) == pytest.approx(6 * 696 / 10, rel=0.05)  # decayed
    d = pol.choose(req, shared, vs, 0.6)
    assert d.reason is Reason.MISS and d.worker != "w0"
    # a private match (a session's own history) still stays where it is
    d = pol.choose(req, MatchResult({"w0": 80}, 80, private=True), vs, 0.7)
    assert (d.worker, d.reason) == ("w0", Reason.AFFINITY)
    # the churn ends as the rate decays
    assert pol.choose(req, shared, vs, 60.0).worker == "w0"
    pol.check()
    # workers that left are forgotten once the record outgrows the fleet
    for i in range(40):
        pol.choose(req, MatchResult({}), [WorkerView(f"gone{i}")], 100.0 + i)
    assert len(pol._written) <= 2 + 16 + 1 and "gone39" in pol._written
    # a worker whose KV capacity is unknown is never judged
    pol = policy()
    vs = [WorkerView(f"w{i}", prefill_tokens_per_s=10_000) for i in range(4)]
    assert {pol.choose(req, shared, vs, i * 0.1).worker for i in range(20)} == {"w0"}


def test_a_miss_avoids_a_churning_worker_only_while_the_other_is_not_overloaded():
    # two workers; w0 takes six misses and churns (its write rate over kv_rel x the
    # mean, its 12k-token cache rewritten in under kv_turnover_s): misses avoid it
    pol = policy()
    vs = [WorkerView(f"w{i}", kv_capacity_tokens=12_000, prefill_tokens_per_s=10_000) for i in (0, 1)]
    fresh = iter(RouteRequest(list(range(1000 * k, 1000 * k + 94)), 3000, 32) for k in range(1, 100))
    for i in range(6):
        pol.choose(next(fresh), MatchResult({}), vs[:1], i * 0.1)
    assert pol._kv_churning(vs, 0.6) == {"w0"}
    # w1 0.29 s busier than idle w0, less than the request's own prefill (0.3 s): w1
    vs[1] = WorkerView("w1", in_flight_tokens=2_900, kv_capacity_tokens=12_000, prefill_tokens_per_s=10_000)
    assert pol.choose(next(fresh), MatchResult({}), vs, 0.6).worker == "w1"
    # 0.31 s busier: the miss would pay its prefill twice to spare w0's cache; unbounded,
    # every miss went to w1 while the shedder, seeing w0's room, admitted them all
    vs[1] = WorkerView("w1", in_flight_tokens=3_100, kv_capacity_tokens=12_000, prefill_tokens_per_s=10_000)
    d = pol.choose(next(fresh), MatchResult({}), vs, 0.6)
    assert (d.worker, d.reason) == ("w0", Reason.MISS)
    pol.check()


def test_ties_go_to_the_worker_written_the_least_kv_lately():
    """After the longer match and fewer in-flight requests, a tie goes to the worker
    that took the fewest uncached tokens lately (tie_written), before chance: a
    conversation placed there evicts the least that is still wanted."""
    req = RouteRequest(list(range(1, 95)), 3000, 32)
    vs = [WorkerView(f"w{i}", prefill_tokens_per_s=10_000) for i in range(3)]
    pol = policy()
    # w0 took 3,000 uncached tokens, w1 1,000, w2 nothing (one miss each, placed by hand)
    pol._written = {"w0": [3000.0, 0.0], "w1": [1000.0, 0.0]}
    # a miss among equally idle workers
    d = pol.choose(req, MatchResult({}), vs, 1.0)
    assert (d.worker, d.reason) == ("w2", Reason.MISS)
    # a shared match every worker holds equally: the scores tie
    pol._written = {"w0": [3000.0, 0.0], "w1": [1000.0, 0.0], "w2": [5000.0, 0.0]}
    d = pol.choose(req, MatchResult({"w0": 72, "w1": 72, "w2": 72}, 72), vs, 1.0)
    assert (d.worker, d.reason) == ("w1", Reason.AFFINITY)
    # fewer in-flight requests still come first
    busy = [
        WorkerView("w0", prefill_tokens_per_s=10_000),
        WorkerView("w1", in_flight=1, prefill_tokens_per_s=10_000),
    ]
    pol._written = {"w0": [9000.0, 0.0]}
    assert pol.choose(req, MatchResult({}), busy, 1.0).worker == "w0"
    # the placements spread a run of new sessions evenly, where chance did not
    for flag, expect in ((True, {"w0": 4, "w1": 4, "w2": 4}), (False, None)):
        pol = policy(seed=3, tie_written=flag)
        got = [pol.choose(req, MatchResult({}), vs, 0.01 * i).worker for i in range(12)]
        if expect:
            assert counts(got) == expect
        else:
            assert counts(got) != {"w0": 4, "w1": 4, "w2": 4}  # seed 3 draws unevenly


def test_unroutable_holders_do_not_count():
    d = policy().choose(
        hand_req(),
        MatchResult({"gone": 100}, depth=100),
        [WorkerView("w0", in_flight_tokens=5), WorkerView("w1")],
        0.0,
    )
    assert (d.worker, d.reason) == ("w1", Reason.MISS)


# ------------------------------------------------------------------ scenarios (real index)


def test_conversation_follow_ups_stay_while_load_allows():
    loop = PickLoop(policy(seed=1), W4, check=True)
    for w, bg in zip(W4, (0, 1000, 2000, 3000)):  # background prefill tokens (persistent)
        loop.load[w].in_flight_tokens = bg
    messages = [
        {"role": "system", "content": "You are terse. " + "R" * 8000},
        {"role": "user", "content": "question 0"},
    ]
    t = 0.0
    for turn in range(8):
        if turn == 5:
            loop.load["w0"].in_flight_tokens = 4000  # busier, but reuse still wins
        if turn == 6:
            # 1.1 s vs 0.1 s: a turn's match is private (no other request went
            # through its deepest block), so it earns private_weight: 2304 cached
            # tokens, credit 4 x 0.2304 x (1 + 0.2304 / 0.25) = 1.77 s; at
            # prefill_weight (2: 0.885 s) it would have spilled
            loop.load["w0"].in_flight_tokens = 11000
        if turn == 7:
            # 2.0 s: past the affinity bound (0.1 + 1.0 + 2 x the 0.2624 s its 2624
            # cached tokens save = 1.62 s), which holds at prefill_weight for any match
            loop.load["w0"].in_flight_tokens = 20000
        k = chat(messages)
        # the previous turn's blocks: matched by no request yet
        assert loop.index.match(k.hashes, t, count=False).private is (turn > 0)
        loop.route(k.hashes, k.prompt_tokens, t)
        messages += [
            {"role": "assistant", "content": f"answer {turn} " * 20},
            {"role": "user", "content": f"question {turn + 1}"},
        ]
        t += 5.0  # earlier prefills have finished
    got = [(d.worker, d.reason) for d in loop.decisions]
    assert got == [("w0", Reason.MISS)] + [("w0", Reason.AFFINITY)] * 6 + [("w1", Reason.SPILL_LOAD)]
    assert all(d.matched_blocks > 0 for d in loop.decisions[1:7])


def test_burst_of_64_spreads_as_the_affinity_bound_dictates():
    # the bound, not the score, is what binds: a holder takes requests while its
    # queue is <= affinity_abs_s + prefill_weight x the prefill its 1024 cached
    # tokens save = 0.048 + 1.5 x 0.1024 = 0.2016 s: the first costs 1088 tokens
    # (0.1088 s), each later one its 64 uncached tokens (0.0064 s), so
    # 0.1088 + 15 x 0.0064 = 0.2048 > 0.2016 stops it after 16; then the next idle
    # worker. (The score alone would keep it up to 1.5 x 0.1024 + 6 x 0.1024^2 = 0.2165 s.)
    loop = PickLoop(policy(seed=4, affinity_abs_s=0.048, prefill_weight=1.5), W8, check=True)
    for i in range(64):
        k = completion(SYSTEM + f"question {i:03d} ".ljust(256, "q"))
        assert k.prompt_tokens == 1088
        loop.route(k.hashes, k.prompt_tokens, 0.0)  # simultaneous: nothing finishes
    chosen = loop.chosen()
    runs = [chosen[i * 16 : (i + 1) * 16] for i in range(4)]
    assert all(len(set(r)) == 1 for r in runs), chosen
    assert len({r[0] for r in runs}) == 4
    reasons = [d.reason for d in loop.decisions]
    expected = []
    for r in range(4):
        expected += [Reason.MISS if r == 0 else Reason.SPILL_LOAD] + [Reason.AFFINITY] * 15
    assert reasons == expected
    assert [d.matched_blocks for d in loop.decisions[:3]] == [0, 32, 32]
    assert sorted(l.in_flight_tokens for l in loop.load.values()) == [0] * 4 + [2048] * 4


def test_burst_with_defaults_never_herds():
    loop = PickLoop(policy(seed=9), W8, check=True)
    pol = loop.policy
    for i in range(64):
        k = completion(SYSTEM + f"question {i:03d} ".ljust(256, "q"))
        vs = loop.views()
        qs = {v.id: v.in_flight_tokens / v.prefill_tokens_per_s for v in vs}
        d = loop.route(k.hashes, k.prompt_tokens, 0.0, views=vs)
        lo = min(qs.values())
        if d.reason is Reason.AFFINITY:  # never past the bound at pick time
            assert not (
                qs[d.worker] - lo > pol.params.affinity_abs_s and qs[d.worker] > lo * pol.params.affinity_rel
            )
    c = counts(loop.chosen())
    # the score binds: the shared 1024 tokens earn a holder a reuse credit of
    # 2 x 0.1024 x (1 + 0.1024 / 0.25) = 0.2887 s, so its 30th request (queue
    # 0.1088 + 28 x 0.0064 = 0.288 s) still ties (within tie_s) with an idle
    # worker's 2 x 1088 / 10k and its 31st (0.2944 s) spills: runs of 30, 30, 4
    assert sorted(c.values()) == [4, 30, 30], c


def test_tenants_never_match_each_others_prefixes():
    loop = PickLoop(policy(seed=2), W4, check=True)
    body = SYSTEM + "the same question"
    a, b = completion(body, tenant="acme"), completion(body, tenant="globex")
    assert a.data == b.data and not set(a.hashes) & set(b.hashes)
    d1 = loop.route(a.hashes, a.prompt_tokens, 0.0)
    d2 = loop.route(a.hashes, a.prompt_tokens, 1.0)
    assert d1.worker == d2.worker and d2.reason is Reason.AFFINITY
    assert loop.index.match(b.hashes, 1.5, count=False).blocks == {}
    d3 = loop.route(b.hashes, b.prompt_tokens, 2.0)
    assert d3.reason is Reason.MISS and d3.matched_blocks == 0
    assert d3.worker != d1.worker  # acme's holder still has acme's work queued
    d4 = loop.route(b.hashes, b.prompt_tokens, 9.0)
    assert (d4.worker, d4.reason) == (d3.worker, Reason.AFFINITY)


def _mixed_run(seed: int):
    loop = PickLoop(policy(seed=seed), W8, index=PrefixIndex(half_life_s=2.0), decode_s=0.2)
    wl = random.Random(1234)  # the workload is fixed; only the policy's seed varies
    t = 0.0
    for i in range(400):
        t += wl.expovariate(30.0)
        kind = wl.random()
        if kind < 0.5:
            k = completion(SYSTEM + f"q{i} ".ljust(300, "x"))
        elif kind < 0.8:
            s = wl.randrange(10)
            k = chat(
                [
                    {"role": "system", "content": f"session {s} " + "c" * 1500},
                    {"role": "user", "content": "turn " * wl.randrange(1, 40)},
                ]
            )
        else:
            k = completion(f"unique {i} " * 50)
        loop.route(k.hashes, k.prompt_tokens, t)
    return [
        (d.worker, d.reason, d.matched_blocks, d.expected_ttft_s, d.warm) for d in loop.decisions
    ], loop.policy.describe()


def test_same_seed_same_decisions():
    a, da = _mixed_run(7)
    b, db = _mixed_run(7)
    assert a == b and da == db
    c, _ = _mixed_run(8)
    assert c != a
    reasons = {r for _, r, _, _, _ in a}
    assert {Reason.MISS, Reason.AFFINITY, Reason.REPLICA} <= reasons


def _hot_phase(loop, rate, seconds, t, n):
    out = []
    end = t + seconds
    while t < end:
        k = completion(SYSTEM + f"question {n:05d} ".ljust(1000, "q"))
        out.append(loop.route(k.hashes, k.prompt_tokens, t))
        t += 1.0 / rate
        n += 1
    return out, t, n


def test_hot_prefix_gains_replicas_and_loses_them_after_its_rate_decays():
    loop = PickLoop(policy(seed=5), W8, index=PrefixIndex(half_life_s=2.0), decode_s=0.5, check=True)
    pol = loop.policy
    cold, t, n = _hot_phase(loop, 5, 4.0, 0.0, 0)
    origin = cold[0].worker
    assert [d.reason for d in cold] == [Reason.MISS] + [Reason.AFFINITY] * 19
    assert {d.worker for d in cold} == {origin}
    assert [r["replicas"] for r in pol.describe()["hot_prefixes"]] == [[]]

    hot, t, n = _hot_phase(loop, 40, 6.0, t, n)
    (rec,) = pol.describe()["hot_prefixes"]
    # 40 req/s, one holder absorbs holder_max_rate = 10 req/s: 4 holders
    assert rec["needed"] == 4 and len(rec["replicas"]) == 3 and origin not in rec["replicas"]
    first_use = [d for d in hot if d.reason is Reason.REPLICA and d.matched_blocks == 0]
    assert [d.worker for d in first_use] == [
        w for w in dict.fromkeys(d.worker for d in first_use)
    ]  # each replica made once
    assert sorted(d.worker for d in first_use) == rec["replicas"]
    spread = counts(d.worker for d in hot[-80:])
    assert set(spread) == {origin, *rec["replicas"]}
    assert all(c >= 10 for c in spread.values()), spread  # spread over its holders
    assert pol.hot.replicas_added == 3

    cool, t, n = _hot_phase(loop, 1, 20.0, t, n)
    (rec,) = pol.describe()["hot_prefixes"]
    assert rec["replicas"] == [] and len(rec["retired"]) == 3
    # once retired, the replicas are no longer preferred: back on the original holder
    assert [(d.worker, d.reason) for d in cool[-10:]] == [(origin, Reason.AFFINITY)] * 10
    # the engines evict the cold copies: the record ages out with them
    first = completion(SYSTEM).hashes[0]
    for w in rec["retired"]:
        loop.index.remove(w, [first])
    _hot_phase(loop, 1, 1.0, t, n)
    assert pol.describe()["hot_prefixes"] == []
    assert pol.hot.replicas_retired == 3


def test_warm_ahead_names_the_new_replica_instead_of_sending_it_the_request():
    loop = PickLoop(
        policy(seed=5, warm_ahead=True), W8, index=PrefixIndex(half_life_s=2.0), decode_s=0.5, check=True
    )
    _, t, n = _hot_phase(loop, 5, 4.0, 0.0, 0)
    # the hot phase: a warm-up is not an index hint (neither the router nor the
    # simulator inserts one); the warmed worker enters the index only once its
    # warm-up prefill has ended, as its agent's report would say
    root = completion(SYSTEM).hashes[:32]
    pending: list[tuple[str, float]] = []  # (warmed worker, its warm-up prefill end)
    seen_before = seen_after = 0
    hot = []
    end = t + 6.0
    while t < end:
        k = completion(SYSTEM + f"question {n:05d} ".ljust(1000, "q"))
        d = loop.route(k.hashes, k.prompt_tokens, t)
        hot.append(d)
        for w, busy in pending:
            held = loop.index.match(root, t, count=False).blocks.get(w, 0)
            if t < busy:
                assert held == 0, (w, t, busy)
                seen_before += 1
            else:
                assert held == 32, (w, t, busy)
                seen_after += 1
        pending += [(w, loop.load[w].busy_until) for w in d.warm]
        t += 1.0 / 40
        n += 1
    assert seen_before and seen_after
    warmed = [d for d in hot if d.warm]
    assert len(warmed) == 3
    for d in warmed:
        assert d.warm[0] != d.worker  # the request itself went to a current holder
        assert d.matched_blocks >= 32
    assert [w for w, _ in loop.warmups] == [d.warm[0] for d in warmed]
    # the warmed replicas then take traffic, as replicas, with the prefix cached
    later = [d for d in hot if d.reason is Reason.REPLICA]
    assert later and all(d.matched_blocks >= 32 for d in later)
    assert {d.worker for d in later} <= {d.warm[0] for d in warmed}


def test_replication_off_keeps_one_holder_until_the_bound():
    loop = PickLoop(
        policy(seed=5, replicate=False), W8, index=PrefixIndex(half_life_s=2.0), decode_s=0.5, check=True
    )
    _, t, n = _hot_phase(loop, 5, 4.0, 0.0, 0)
    hot, t, n = _hot_phase(loop, 40, 6.0, t, n)
    assert Reason.REPLICA not in {d.reason for d in hot}
    assert loop.policy.describe()["hot_prefixes"] == []


def test_hot_record_is_bounded_lru():
    hot = HotRoots(capacity=2, max_replicas=1)
    a = hot.see(1, 3, 5.0, 0.0)
    hot.see(2, 3, 5.0, 1.0)
    hot.see(1, 3, 6.0, 2.0)  # refreshes 1
    hot.see(3, 4, 7.0, 3.0)  # evicts 2, the least recently seen
    hot.check()
    assert [r.key for r in hot.records()] == [3, 1] and hot.get(2) is None
    hot.add_replica(a, "w1", 2.0)
    hot.check()
    assert hot.retire_newest(a, {"w1"}, 4.0) == "w1"
    assert a.replicas == {} and a.retired == {"w1": 4.0}
    hot.check()
    with pytest.raises(AssertionError):
        a.replicas["w1"] = 0.0  # replica and retired at once
        hot.check()


def test_burst_with_full_prompt_accounting_still_spreads():
    # A router that counts every request's full prompt tokens (not just the uncached
    # part) overstates a warm worker's queue: affinity yields sooner, never herds.
    loop = PickLoop(policy(seed=9), W8, count_cached=True, check=True)
    for i in range(64):
        k = completion(SYSTEM + f"question {i:03d} ".ljust(256, "q"))
        loop.route(k.hashes, k.prompt_tokens, 0.0)
    c = counts(loop.chosen())
    assert sorted(c.values()) == [8] * 8, c
    assert sum(d.reason is Reason.MISS for d in loop.decisions) == 1
