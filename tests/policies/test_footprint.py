"""radixfleet.policies.footprint: sessions found by their tips, counted from their second turn,
ended after their own gaps; and prefix_load moving sessions off a crowded worker."""

from __future__ import annotations

import random

import pytest

from radixfleet.policies.base import MatchResult, Reason, RouteRequest, WorkerView
from radixfleet.policies.footprint import Footprints
from radixfleet.policies.registry import build_policy

BT = 16
SHARED = list(range(1000, 1100))  # a 100-block shared prefix (1,600 tokens)


def turn(session: int, k: int, session_key: str | None = None) -> RouteRequest:
    """Session ``session``'s turn ``k``: the shared prefix, then 20 blocks per turn."""
    own = [session * 100_000 + i for i in range(20 * (k + 1))]
    hashes = SHARED + own
    return RouteRequest(hashes, len(hashes) * BT, BT, session=session_key)


def shared_match(req: RouteRequest, holders=("w0",)) -> MatchResult:
    return MatchResult({w: len(SHARED) for w in holders}, len(SHARED), 5.0, False)


def step(fp: Footprints, req: RouteRequest, worker: str, now: float, match=None):
    fp.expire(now)
    b = fp.find(req)
    fp.record(req, match if match is not None else shared_match(req), b, worker, now)
    fp.check()
    return b


def test_a_session_counts_from_its_second_turn_at_its_private_size():
    fp = Footprints(live_gaps=2.0, idle_s=100.0)
    assert step(fp, turn(1, 0), "w0", 0.0) is None
    assert fp.tokens("w0") == 0 and not fp.counted()  # one request is not a session
    b = step(fp, turn(1, 1), "w0", 3.0)
    assert b is not None and b.home == "w0"
    # private size: everything past the shared prefix it branched from
    assert fp.tokens("w0") == 40 * BT
    step(fp, turn(1, 2), "w0", 6.0)
    assert fp.tokens("w0") == 60 * BT  # replaced, not added
    # a second session, on another worker
    step(fp, turn(2, 0), "w1", 6.5)
    step(fp, turn(2, 1), "w1", 7.0)
    assert (fp.tokens("w0"), fp.tokens("w1")) == (60 * BT, 40 * BT)


def test_a_session_that_moves_takes_its_footprint_along():
    fp = Footprints(live_gaps=2.0)
    step(fp, turn(1, 0), "w0", 0.0)
    step(fp, turn(1, 1), "w0", 1.0)
    step(fp, turn(1, 2), "w1", 2.0)
    assert (fp.tokens("w0"), fp.tokens("w1")) == (0, 60 * BT)


def test_a_session_ends_after_its_own_gaps_and_its_record_after_idle_s():
    fp = Footprints(live_gaps=2.0, idle_s=30.0)
    step(fp, turn(1, 0), "w0", 0.0)
    step(fp, turn(1, 1), "w0", 3.0)  # gap 3 s: live until 3 + 2 * 3 = 9 s
    fp.expire(8.9)
    assert fp.tokens("w0") == 40 * BT
    fp.expire(9.0)
    fp.check()
    assert fp.tokens("w0") == 0
    # still found (a late turn continues it and counts again) until idle_s after it
    b = step(fp, turn(1, 2), "w0", 20.0)
    assert b is not None and fp.tokens("w0") == 60 * BT
    fp.expire(20.0 + 30.0)
    fp.check()
    assert fp.find(turn(1, 3)) is None and not fp._branches


def test_continuations_are_found_by_tip_within_a_turns_worth_of_blocks():
    fp = Footprints(scan_tokens=64 * BT)
    step(fp, turn(1, 0), "w0", 0.0)
    # a prompt that extends turn 0 by 20 blocks finds it; one that does not, does not
    assert fp.find(turn(1, 1)) is not None
    assert fp.find(turn(2, 1)) is None
    # an extension longer than the scan window is a new session
    long = turn(1, 0)
    far = RouteRequest(list(long.hashes) + list(range(7, 7 + 80)), (len(long.hashes) + 80) * BT, BT)
    assert fp.find(far) is None
    # a repeat of the same prompt (a retry) continues it
    assert fp.find(turn(1, 0)) is not None


def test_the_clients_session_key_wins_over_tips():
    fp = Footprints()
    step(fp, turn(1, 0, "alice"), "w0", 0.0)
    b = step(fp, turn(7, 3, "alice"), "w1", 1.0)  # unrelated text, same session key
    assert b is not None and b.key == "alice"
    assert fp.tokens("w1") == 80 * BT


def test_records_are_bounded_and_the_oldest_go_first():
    fp = Footprints(max_branches=5)
    for s in range(8):
        step(fp, turn(s, 0), "w0", float(s))
    assert len(fp._branches) == 5
    assert fp.find(turn(0, 1)) is None and fp.find(turn(7, 1)) is not None


def test_a_private_match_branches_from_nothing_shared():
    fp = Footprints()
    req = turn(1, 0)
    step(fp, req, "w0", 0.0, MatchResult({"w0": 50}, 50, 0.1, True))
    step(fp, turn(1, 1), "w0", 1.0)
    assert fp.tokens("w0") == len(turn(1, 1).hashes) * BT


def test_check_catches_a_wrong_sum():
    fp = Footprints()
    step(fp, turn(1, 0), "w0", 0.0)
    step(fp, turn(1, 1), "w0", 1.0)
    fp._tokens["w0"] += 500
    with pytest.raises(AssertionError):
        fp.check()


# ------------------------------------------------------------------ prefix_load


def pl(**params):
    return build_policy("prefix_load", params, random.Random(0))


def views(cap=6000):
    return [WorkerView(w, prefill_tokens_per_s=10_000, kv_capacity_tokens=cap) for w in ("w0", "w1", "w2")]


def crowd_w0(pol, sessions=5, turns=3):
    """``sessions`` sessions off the shared prefix, all homed on w0 (its only holder),
    each continued ``turns - 1`` times; returns the time reached."""
    t = 0.0
    for k in range(turns):
        for s in range(sessions):
            req = turn(s, k)
            m = (
                MatchResult({"w0": len(req.hashes) - 20}, len(req.hashes) - 20, 0.1, True)
                if k
                else shared_match(req)
            )
            pol.footprints.expire(t)
            b = pol.footprints.find(req)
            pol.footprints.record(req, m, b, "w0", t)
            t += 0.2
    pol.check()
    return t


def test_a_session_on_a_crowded_worker_moves_where_it_fits():
    """Five sessions of 960 private tokens each live on w0 (6,000 KV): the next turn
    of one of them (1,600 shared + 1,280 private = 2,880 tokens) plus the other
    four's 3,840 is past 80% of w0's cache, while w1 and w2 hold nothing live (2,880
    fits in 70% of theirs). With footprints it moves; without, its private match
    keeps it home."""
    vs = views()
    for room, expect in ((0.7, {"w1", "w2"}), (0.0, {"w0"})):
        pol = pl(footprint_room=room)
        t = crowd_w0(pol) if room else 3.0
        req = turn(0, 3)
        held = len(req.hashes) - 20
        m = MatchResult({"w0": held}, held, 0.1, True)
        d = pol.choose(req, m, vs, t)
        assert d.worker in expect, (room, d)
        if room:
            assert d.reason is Reason.MISS and d.matched_blocks == 0
            pol.check()
            # it took its footprint along: w0 lost a session, the new home has it
            assert pol.footprints.tokens(d.worker) == (len(req.hashes) - len(SHARED)) * BT
            assert pol.footprints.tokens("w0") == 4 * 60 * BT


def test_new_sessions_avoid_a_crowded_holder_but_an_even_fleet_is_left_alone():
    vs = views()
    pol = pl()
    t = crowd_w0(pol)
    req = turn(9, 0)  # a new session off the shared prefix w0 holds
    d = pol.choose(req, shared_match(req), vs, t)
    assert d.worker in ("w1", "w2") and d.reason is Reason.MISS
    # every worker equally crowded: nobody is over the fleet's mean, nothing moves
    pol = pl()
    t = 0.0
    for k in range(3):
        for s in range(6):
            req = turn(s, k)
            w = f"w{s % 3}"
            m = (
                MatchResult({w: len(req.hashes) - 20}, len(req.hashes) - 20, 0.1, True)
                if k
                else shared_match(req, ("w0", "w1", "w2"))
            )
            pol.footprints.expire(t)
            pol.footprints.record(req, m, pol.footprints.find(req), w, t)
            t += 0.2
    req = turn(0, 3)
    held = len(req.hashes) - 20
    assert pol.choose(req, MatchResult({"w0": held}, held, 0.1, True), vs, t).worker == "w0"


def test_unknown_capacity_is_never_judged():
    pol = pl()
    t = crowd_w0(pol)
    req = turn(0, 3)
    held = len(req.hashes) - 20
    d = pol.choose(req, MatchResult({"w0": held}, held, 0.1, True), views(cap=0), t)
    assert d.worker == "w0" and d.reason is Reason.AFFINITY


def settle(pol, homes: dict[str, int], turns=3) -> float:
    """Sessions homed by hand: ``homes[w]`` sessions on worker w, each continued
    ``turns - 1`` times (960 private tokens each at 3 turns)."""
    placed = [w for w, n in homes.items() for _ in range(n)]
    t = 0.0
    for k in range(turns):  # turn k of every session, then k + 1: regular gaps
        for sid, w in enumerate(placed):
            req = turn(sid, k)
            pol.footprints.expire(t)
            pol.footprints.record(req, shared_match(req), pol.footprints.find(req), w, t)
            t += 0.01
    pol.check()
    return t


def test_nothing_moves_while_the_fleet_cannot_hold_its_live_sessions():
    """w0 is crowded (9 sessions, 8,640 tokens) and w1 empty. With 16,320 live tokens
    on 4 x 6,000 the fleet holds them (under 70%): the next session avoids w0. One
    more session on w3 (17,280, over 70%): every cache thrashes, a move would only
    re-prefill a history elsewhere, and the holder keeps its match."""
    vs = views() + [WorkerView("w3", prefill_tokens_per_s=10_000, kv_capacity_tokens=6000)]
    for extra, expect in ((0, {"w1", "w2", "w3"}), (1, {"w0"})):
        pol = pl()
        t = settle(pol, {"w0": 9, "w2": 4, "w3": 4 + extra})
        req = turn(99, 0)
        d = pol.choose(req, shared_match(req), vs, t)
        assert d.worker in expect, (extra, d)
