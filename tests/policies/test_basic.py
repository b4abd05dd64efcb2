"""round_robin, random, least_load, power_of_two and consistent_hash (bounded loads)."""

from __future__ import annotations

import math
import random

from radixfleet.policies.base import MatchResult, Reason, RouteRequest, WorkerView
from radixfleet.policies.consistent_hash import ConsistentHash
from radixfleet.policies.registry import build_policy

EMPTY = MatchResult({})


def req(hashes=(1, 2, 3), session=None, prompt=96):
    return RouteRequest(list(hashes), prompt, 32, session)


def views(loads, **kw):
    return [WorkerView(f"w{i}", in_flight_tokens=t, **kw) for i, t in enumerate(loads)]


def test_round_robin_cycles_in_view_order_and_survives_set_changes():
    pol = build_policy("round_robin", None, random.Random(0))
    vs = views([0, 0, 0])
    picks = [pol.choose(req(), EMPTY, vs, 0.0) for _ in range(7)]
    assert [d.worker for d in picks] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]
    assert {d.reason for d in picks} == {Reason.ROUND_ROBIN}
    two = vs[:2]
    assert [pol.choose(req(), EMPTY, two, 0.0).worker for _ in range(3)] == ["w1", "w0", "w1"]
    assert pol.choose(req(), MatchResult({"w0": 2}), two, 0.0).matched_blocks == 2


def test_random_is_seeded_and_covers_every_worker():
    vs = views([0] * 4)
    pol1 = build_policy("random", None, random.Random(3))
    pol2 = build_policy("random", None, random.Random(3))
    s1 = [pol1.choose(req(), EMPTY, vs, 0.0).worker for _ in range(400)]
    s2 = [pol2.choose(req(), EMPTY, vs, 0.0).worker for _ in range(400)]
    assert s1 == s2
    pol3 = build_policy("random", None, random.Random(4))
    assert [pol3.choose(req(), EMPTY, vs, 0.0).worker for _ in range(400)] != s1
    counts = {w: s1.count(w) for w in ("w0", "w1", "w2", "w3")}
    assert all(60 < c < 140 for c in counts.values()), counts


def test_least_load_counts_in_flight_tokens_plus_reported_queue():
    pol = build_policy("least_load", None, random.Random(0))
    vs = [
        WorkerView("a", in_flight_tokens=100, queued_tokens=500),
        WorkerView("b", in_flight_tokens=400, queued_tokens=100),
        WorkerView("c", in_flight_tokens=0, queued_tokens=700),
    ]
    d = pol.choose(req(), EMPTY, vs, 0.0)
    assert (d.worker, d.reason) == ("b", Reason.LEAST_LOAD)


def test_least_load_ties_break_at_random():
    pol = build_policy("least_load", None, random.Random(11))
    vs = views([5, 0, 0, 0, 9])
    seen = {pol.choose(req(), EMPTY, vs, 0.0).worker for _ in range(200)}
    assert seen == {"w1", "w2", "w3"}


def test_power_of_two_takes_the_less_loaded_of_two_distinct_candidates():
    pol = build_policy("power_of_two", None, random.Random(5))
    vs = views([0, 10, 20, 30])
    picks = [pol.choose(req(), EMPTY, vs, 0.0).worker for _ in range(600)]
    # the most loaded worker is never the less loaded of two distinct candidates
    assert "w3" not in picks
    # w0 wins whenever drawn: P = 1 - C(3,2)/C(4,2) = 1/2
    assert 240 < picks.count("w0") < 360
    assert (
        build_policy("power_of_two", None, random.Random(0)).choose(req(), EMPTY, views([7]), 0.0).worker
        == "w0"
    )


def _key_request(i: int) -> RouteRequest:
    return RouteRequest([random.Random(i).getrandbits(64)], 32, 32, None)


def test_consistent_hash_load_bound_holds_over_10000_keys():
    n, c = 16, 1.25
    pol = build_policy("consistent_hash", {"load_factor": c}, random.Random(0))
    rng = random.Random(42)
    load = {f"w{i}": 0 for i in range(n)}
    live: list[str] = []
    hash_picks = 0
    for k in range(10_000):
        vs = [WorkerView(w, in_flight=f) for w, f in load.items()]
        d = pol.choose(_key_request(k), EMPTY, vs, 0.0)
        assert d.reason is Reason.HASH
        load[d.worker] += 1
        live.append(d.worker)
        hash_picks += 1
        m = sum(load.values())
        assert max(load.values()) <= math.ceil(c * m / n), (k, load)
        # churn: requests finish at random, keeping ~400 in flight
        while len(live) > 400:
            load[live.pop(rng.randrange(len(live)))] -= 1
    assert hash_picks == 10_000
    assert pol.rebuilds == 1
    pol.check()


def test_consistent_hash_same_key_same_worker_until_full():
    pol = build_policy("consistent_hash", None, random.Random(0))
    vs = views([0] * 8)
    first = pol.choose(req(session="alice"), EMPTY, vs, 0.0).worker
    assert all(pol.choose(req(session="alice"), EMPTY, vs, 0.0).worker == first for _ in range(20))
    # the session key wins over the prefix: a different prompt, same worker
    assert pol.choose(req(hashes=(9, 9, 9), session="alice"), EMPTY, vs, 0.0).worker == first
    # one session flooding: its worker fills to ceil(1.25 * m / 8), then the ring spills
    load = {v.id: 0 for v in vs}
    for _ in range(80):
        cur = [WorkerView(w, in_flight=f) for w, f in load.items()]
        load[pol.choose(req(session="alice"), EMPTY, cur, 0.0).worker] += 1
    assert load[first] == math.ceil(1.25 * 80 / 8) == 13
    assert max(load.values()) == 13
    assert sum(1 for f in load.values() if f) >= 7


def test_consistent_hash_key_is_first_n_blocks():
    pol = build_policy("consistent_hash", {"key_blocks": 2}, random.Random(0))
    assert pol.key_of(req(hashes=(5, 6, 7, 8))) == 6
    assert pol.key_of(req(hashes=(5,))) == 5
    assert pol.key_of(req(hashes=())) is None
    # no key at all: the least-loaded worker, as a miss
    vs = [WorkerView(f"w{i}", in_flight=f) for i, f in enumerate([3, 1, 2])]
    d = pol.choose(req(hashes=()), EMPTY, vs, 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.MISS)


def test_consistent_hash_rebuilds_only_when_the_set_changes_and_moves_few_keys():
    pol = build_policy("consistent_hash", None, random.Random(0))
    vs = views([0] * 10)
    before = [pol.choose(_key_request(k), EMPTY, vs, 0.0).worker for k in range(2000)]
    shuffled = list(reversed(vs))
    same = [pol.choose(_key_request(k), EMPTY, shuffled, 0.0).worker for k in range(2000)]
    assert same == before and pol.rebuilds == 1  # order alone: no rebuild
    fewer = [v for v in vs if v.id != "w3"]
    after = [pol.choose(_key_request(k), EMPTY, fewer, 0.0).worker for k in range(2000)]
    assert pol.rebuilds == 2
    moved = [k for k in range(2000) if before[k] != after[k]]
    assert all(before[k] == "w3" for k in moved)  # only the departed worker's keys move
    assert len(moved) == before.count("w3")
    pol.check()


def test_consistent_hash_weights_scale_capacity():
    pol = ConsistentHash(ConsistentHash.Params(), random.Random(0))
    load = {"big": 0, "small": 0}
    weight = {"big": 3.0, "small": 1.0}
    for k in range(400):
        vs = [WorkerView(w, in_flight=f, weight=weight[w]) for w, f in load.items()]
        load[pol.choose(_key_request(k), EMPTY, vs, 0.0).worker] += 1
        m = sum(load.values())
        assert load["small"] <= math.ceil(1.25 * m * 1 / 4)
        assert load["big"] <= math.ceil(1.25 * m * 3 / 4)
    assert load["big"] > load["small"]
