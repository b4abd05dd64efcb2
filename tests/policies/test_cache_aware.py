"""cache_aware: SGLang's decision rule with its defaults (0.3, 64, 1.5), block-level."""

from __future__ import annotations

import random

import pytest

from radixfleet.keys import Endpoint, request_key
from radixfleet.policies.base import MatchResult, Reason, RouteRequest, WorkerView
from radixfleet.policies.registry import build_policy
from radixfleet_tools.loadtest.simulator.harness import PickLoop


def vs(*in_flight):
    return [WorkerView(f"w{i}", in_flight=f) for i, f in enumerate(in_flight)]


def req(text_len=320, blocks=10):
    # 10 blocks of 32 tokens = 1280 bytes keyed; text_len bytes of routing text
    return RouteRequest(list(range(1, blocks + 1)), text_len // 4, 32, text_len=text_len)


@pytest.fixture
def pol():
    return build_policy("cache_aware", None, random.Random(0))


def test_defaults_are_sglangs(pol):
    p = pol.params
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold) == (0.3, 64, 1.5)


def test_match_rate_above_threshold_takes_the_matched_worker(pol):
    r = req(text_len=1280)
    # 4 blocks x 128 bytes / 1280 = 0.4 > 0.3, even though w2 is busier
    d = pol.choose(r, MatchResult({"w2": 4}), vs(0, 1, 30), 0.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w2", Reason.AFFINITY, 4)


def test_match_rate_at_threshold_is_a_miss_to_the_least_loaded(pol):
    r = req(text_len=1280)
    # exactly 3 blocks: 384/1280 = 0.3, not > 0.3
    d = pol.choose(r, MatchResult({"w2": 3}), vs(5, 1, 0, 9), 0.0)
    assert (d.worker, d.reason) == ("w2", Reason.MISS)
    d = pol.choose(r, MatchResult({"w3": 3}), vs(5, 1, 2, 0), 0.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w3", Reason.MISS, 3)
    d = pol.choose(r, MatchResult({"w3": 3}), vs(5, 1, 2, 9), 0.0)
    assert (d.worker, d.reason, d.matched_blocks) == ("w1", Reason.MISS, 0)


def test_imbalance_needs_both_thresholds(pol):
    r = req(text_len=1280)
    m = MatchResult({"w0": 10})
    # abs 70 > 64 and 100 > 30 x 1.5: imbalanced -> least loaded, whatever the match
    d = pol.choose(r, m, vs(100, 30, 50), 0.0)
    assert (d.worker, d.reason) == ("w1", Reason.BALANCE)
    # abs 64 is not > 64: balanced -> the match
    assert pol.choose(r, m, vs(94, 30, 50), 0.0).reason is Reason.AFFINITY
    # abs 100 > 64 but 300 > 200 x 1.5 is false: balanced
    assert pol.choose(r, m, vs(300, 200, 250), 0.0).reason is Reason.AFFINITY


def test_only_routable_workers_count(pol):
    # the best match is on a worker that is not in the views
    d = pol.choose(req(text_len=1280), MatchResult({"gone": 10, "w1": 1}), vs(3, 2, 0), 0.0)
    assert (d.worker, d.reason) == ("w2", Reason.MISS)


def test_equal_matches_and_equal_loads_tie_at_random(pol):
    seen = {
        pol.choose(req(text_len=1280), MatchResult({"w0": 8, "w1": 8}), vs(0, 5, 0), 0.0).worker
        for _ in range(100)
    }
    assert seen == {"w0", "w1"}
    seen = {pol.choose(req(text_len=1280), MatchResult({}), vs(1, 0, 0), 0.0).worker for _ in range(100)}
    assert seen == {"w1", "w2"}


def test_herds_below_the_absolute_threshold():
    # SGLang's known weakness, kept on purpose: 64 requests sharing one prefix all go
    # to its first holder while the in-flight difference stays <= 64.
    loop = PickLoop(
        build_policy("cache_aware", None, random.Random(3)), [f"w{i}" for i in range(8)], check=True
    )
    system = "S" * 4096
    for i in range(64):
        k = request_key(Endpoint.COMPLETIONS, {"model": "m", "prompt": system + f"{i:04d}" * 8})
        loop.route(k.hashes, k.prompt_tokens, 0.0, text_len=len(k.data))
    chosen = loop.chosen()
    assert chosen.count(chosen[0]) == 64
    assert [d.reason for d in loop.decisions][:2] == [Reason.MISS, Reason.AFFINITY]
