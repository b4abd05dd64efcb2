"""Every policy decides on any view within the bounds the router keeps (hypothesis),
and the pool holds reported load within those bounds whatever a worker sent."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixfleet.config import parse_config
from radixfleet.policies.base import MatchResult, RouteRequest, WorkerView
from radixfleet.policies.registry import POLICIES, build_policy
from radixfleet.wire.errors import MalformedRequest
from radixfleet.wire.events import MAX_LOAD_COUNT, MAX_RATE, MIN_RATE, Load, parse_batch

_count = st.integers(0, MAX_LOAD_COUNT)
_views = st.lists(
    st.builds(
        WorkerView,
        st.sampled_from([f"w{i}" for i in range(6)]),
        st.integers(0, 10_000),
        _count,
        _count,
        _count,
        _count,
        _count,
        _count,
        st.floats(MIN_RATE, MAX_RATE, allow_nan=False),
        st.floats(0.01, 100.0),
    ),
    min_size=1,
    max_size=6,
    unique_by=lambda v: v.id,
)


@settings(max_examples=40, deadline=None)
@given(
    views=_views,
    blocks=st.dictionaries(st.sampled_from([f"w{i}" for i in range(6)]), st.integers(0, 64)),
    rate=st.floats(0, 1e9, allow_nan=False),
    prompt=st.integers(0, MAX_LOAD_COUNT),
    seed=st.integers(0, 2**32),
)
def test_every_policy_decides_on_any_valid_view(views, blocks, rate, prompt, seed):
    hashes = list(range(1, 65))
    depth = max(blocks.values(), default=0)
    match = MatchResult(blocks, depth, rate)
    req = RouteRequest(hashes, prompt, 32, None, "m", prompt * 4)
    ids = {v.id for v in views}
    for name in sorted(POLICIES):
        params = {"hot_min_rate": 0.001, "warm_ahead": seed % 2 == 0} if name == "prefix_load" else {}
        policy = build_policy(name, params, random.Random(seed))
        for now in (0.0, 1e6):
            d = policy.choose(req, match, views, now)
            assert d.worker in ids, (name, d)
            assert d.expected_ttft_s is None or not math.isnan(d.expected_ttft_s)


def test_views_stay_within_bounds_whatever_was_reported():
    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex

    cfg = parse_config({"workers": [{"url": "http://127.0.0.1:9", "id": "a"}]})
    pool = Pool(cfg, PrefixIndex(1 << 20, 30.0))
    w = pool.get("a")
    w.health = w.health.HEALTHY
    pool._changed(w)
    for rate in (1e-300, 0.5, 1e300):
        pool.report_load(w, Load(prefill_tokens_per_s=rate), 0.0)
        v = pool.views(0.0)[0]
        assert MIN_RATE <= v.prefill_tokens_per_s <= MAX_RATE
    with pytest.raises(MalformedRequest):
        parse_batch(
            {"worker_id": "a", "url": "u", "epoch": "e", "seq": 0, "load": {"queued_tokens": 10**400}}
        )
