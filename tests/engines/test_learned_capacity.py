"""radixfleet.engines.capacity: a plain engine's index cap learned from its answers."""

from __future__ import annotations

import pytest

from radixfleet.engines.capacity import LearnedCapacity, correct
from radixfleet.index.prefix_index import PrefixIndex


def chain(tag: int, n: int) -> list[int]:
    return [tag * 1_000_000 + i for i in range(n)]


def test_decrease_by_the_blocks_lost_grow_by_one_percent_of_the_match():
    lc = LearnedCapacity(1000)
    assert lc.observe(200, 30) == 970  # the engine held 30 blocks fewer
    assert lc.observe(500, 0) == 975  # held: +1% of the 500 matched
    assert lc.observe(3, 0) == 976  # at least one block
    lc.check()


def test_bounded_by_a_quarter_and_by_the_configured_capacity():
    lc = LearnedCapacity(1000)
    for _ in range(10):
        lc.observe(400, 400)
    assert lc.blocks == lc.floor == 250  # a burst of misses cannot empty the index
    for _ in range(1000):
        lc.observe(400, 0)
    assert lc.blocks == 1000  # never above what is configured
    lc.check()
    lc.blocks = 1001
    with pytest.raises(AssertionError):
        lc.check()
    with pytest.raises(ValueError):
        LearnedCapacity(0)


def test_an_over_prediction_shrinks_the_cap_and_the_index_with_it():
    idx = PrefixIndex()
    idx.set_capacity("w", 100)
    lc = LearnedCapacity(100)
    old, new = chain(1, 40), chain(2, 50)
    idx.insert("w", old, 1.0)
    idx.insert("w", new, 2.0)
    touches = tuple(idx.touch_time("w", h) for h in new)
    idx.insert("w", new, 3.0)  # the request's own hint
    # 50 blocks of 16 tokens matched, the engine had 30 blocks' worth: it lost 20
    removed = correct(idx, "w", lc, 50, 800, 480, 16, touches)
    assert lc.blocks == 80 and idx.capacity("w") == 80
    # everything older than the first block it lacked went (the old chain: 40), and
    # the cap evicted nothing more (50 left, under 80)
    assert removed == 40
    assert idx.match(new, 4.0).blocks.get("w") == 50
    assert "w" not in idx.match(old, 4.0).blocks
    idx.check()
    lc.check()


def test_a_held_prediction_grows_the_cap_back_and_no_learning_without_a_match():
    idx = PrefixIndex()
    idx.set_capacity("w", 100)
    lc = LearnedCapacity(200)
    lc.blocks = 100
    assert correct(idx, "w", lc, 50, 800, 800, 16, (1.0,) * 50) == 0
    assert lc.blocks == 101 and idx.capacity("w") == 101
    assert correct(idx, "w", lc, 0, 0, 0, 16, None) == 0
    assert lc.blocks == 101


def test_without_a_learned_cap_only_the_older_entries_go():
    idx = PrefixIndex()
    idx.set_capacity("w", 100)
    idx.insert("w", chain(1, 10), 1.0)
    idx.insert("w", chain(2, 10), 2.0)
    touches = tuple(idx.touch_time("w", h) for h in chain(2, 10))
    assert correct(idx, "w", None, 10, 160, 0, 16, touches) == 10
    assert idx.capacity("w") == 100
    idx.check()


def _plain_link(learn: bool = True):
    """An approximate-mode link (kind openai, 16,000 KV tokens configured), not started."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from radixfleet.config import WorkerSpec, parse_config
    from radixfleet.engines.link import EngineLink
    from radixfleet.engines.manager import Engines
    from radixfleet.fleet.pool import Pool

    cfg = parse_config({"index": {"learn_capacity": learn}})
    idx = PrefixIndex()
    eng = Engines(cfg, Pool(cfg, idx), idx, CollectorRegistry())
    spec = WorkerSpec(url="http://127.0.0.1:9", id="p", kind="openai", kv_capacity_tokens=16_000)
    link = EngineLink(SimpleNamespace(id="p"), spec, eng)
    link._apply_capacity()
    return link, idx


def test_the_live_link_learns_its_cap_from_answers_and_forgets_it_in_sync():
    from radixfleet.engines.keyspace import SpaceKey
    from radixfleet.engines.link import Placement

    link, idx = _plain_link()
    bt = link.space.block_bytes // 4  # tokens per byte-space block
    configured = 16_000 // bt
    assert idx.capacity("p") == configured and link.learned.blocks == configured
    hashes = chain(3, 40)
    idx.insert("p", hashes, 1.0)
    touches = tuple(idx.touch_time("p", h) for h in hashes)
    sk = SpaceKey(hashes, 40 * bt, bt, False)
    # 40 blocks believed, the engine reported 10 blocks' worth cached: 30 lost
    link.observe(Placement(sk, 40, 0, 0, touches), (40 * bt, 10 * bt), None, 2.0)
    assert link.learned.blocks == configured - 30 == idx.capacity("p")
    assert link.describe()["index_cap_blocks"] == configured - 30
    link.events_synced()  # exact from here: events say
    assert idx.capacity("p") == configured == link.learned.blocks


def test_learn_capacity_false_keeps_the_configured_cap():
    from radixfleet.engines.keyspace import SpaceKey
    from radixfleet.engines.link import Placement

    link, idx = _plain_link(learn=False)
    bt = link.space.block_bytes // 4
    hashes = chain(4, 40)
    idx.insert("p", hashes, 1.0)
    sk = SpaceKey(hashes, 40 * bt, bt, False)
    link.observe(Placement(sk, 40, 0, 0, (1.0,) * 40), (40 * bt, 0), None, 2.0)
    assert link.learned is None and idx.capacity("p") == 16_000 // bt
