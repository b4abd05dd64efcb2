"""Per-worker capacity in the prefix index (an LRU at the engine's KV capacity for a
worker without cache events), per-worker entry counts, and keep() corrections."""

from __future__ import annotations

import random

import pytest

from radixfleet.index.prefix_index import NODE_BYTES, PrefixIndex


def chain(tag: int, n: int) -> list[int]:
    """n distinct fake hashes; chains with the same tag share their prefix."""
    return [tag * 1_000_000 + i for i in range(n)]


def held(idx: PrefixIndex, w: str, hashes) -> int:
    """How many leading blocks of ``hashes`` w holds."""
    return idx.match(hashes, 0.0, count=False).blocks.get(w, 0)


def test_over_its_cap_a_worker_loses_its_least_recently_touched_leaves_exactly():
    idx = PrefixIndex()
    a, b, c, d = chain(1, 4), chain(2, 2), chain(3, 1), chain(4, 1)
    assert idx.set_capacity("w0", 5) == 0
    idx.insert("w0", a, 1.0)
    idx.insert("w0", b, 2.0)  # 6 > 5: a's deepest block goes
    idx.check()
    assert (held(idx, "w0", a), held(idx, "w0", b), idx.entries("w0")) == (3, 2, 5)
    order = []
    for t, x in ((3.0, c), (4.0, d), (5.0, chain(5, 1)), (6.0, chain(6, 1)), (7.0, chain(7, 1))):
        idx.insert("w0", x, t)
        idx.check()
        order.append((held(idx, "w0", a), held(idx, "w0", b)))
    # one block per insert, from the oldest chain's tail up; then the next oldest
    assert order == [(2, 2), (1, 2), (0, 2), (0, 1), (0, 0)]
    assert idx.entries("w0") == 5 and idx.stats().capped_evicted_entries == 6  # 11 inserted, 5 kept
    assert idx.stats().evicted_entries == 0  # the global budget never acted


def test_a_touch_makes_a_chain_young_again():
    idx = PrefixIndex()
    idx.set_capacity("w0", 6)
    a, b = chain(1, 3), chain(2, 3)
    idx.insert("w0", a, 1.0)
    idx.insert("w0", b, 2.0)
    idx.insert("w0", a, 3.0)  # touches a: b is now least recent
    idx.insert("w0", chain(3, 2), 4.0)
    idx.check()
    assert (held(idx, "w0", a), held(idx, "w0", b)) == (3, 1)


def test_shared_prefixes_go_deepest_first_and_only_for_the_capped_worker():
    idx = PrefixIndex()
    trunk = chain(1, 2)
    y1, y2 = trunk + chain(2, 2), trunk + chain(3, 2)
    idx.insert("w0", y1, 1.0)
    idx.insert("w0", y2, 2.0)
    idx.insert("w1", y1, 1.5)  # uncapped, holds the same blocks
    assert idx.entries("w0") == 6 and idx.entries("w1") == 4
    assert idx.set_capacity("w0", 3) == 3  # y1's branch (oldest leaves) then y2's tail
    idx.check()
    assert (held(idx, "w0", y1), held(idx, "w0", y2)) == (2, 3)
    assert idx.set_capacity("w0", 1) == 2
    assert (held(idx, "w0", y1), held(idx, "w0", y2)) == (1, 1)
    assert held(idx, "w1", y1) == 4 and idx.entries("w1") == 4  # untouched
    assert idx.set_capacity("w0", 0) == 1 and idx.entries("w0") == 0
    idx.check()


def test_a_chain_longer_than_the_cap_keeps_its_first_blocks():
    idx = PrefixIndex()
    idx.set_capacity("w0", 4)
    a = chain(1, 10)
    assert idx.insert("w0", a, 1.0) == 10
    idx.check()
    assert held(idx, "w0", a) == 4 and idx.entries("w0") == 4


def test_cap_changes_none_and_unknown_workers():
    idx = PrefixIndex()
    idx.set_capacity("w9", 2)  # not yet seen: a setting, not a worker
    assert idx.capacity("w9") == 2 and "w9" not in idx.workers() and idx.entries("w9") == 0
    idx.check()
    idx.insert("w9", chain(1, 5), 1.0)
    assert idx.entries("w9") == 2
    assert idx.set_capacity("w9", None) == 0 and idx.capacity("w9") is None
    idx.insert("w9", chain(2, 5), 2.0)
    assert idx.entries("w9") == 7  # uncapped again
    idx.check()
    assert idx.set_capacity("w9", 5) == 2  # chain 1's two blocks, the older ones
    assert held(idx, "w9", chain(1, 5)) == 0 and held(idx, "w9", chain(2, 5)) == 5
    idx.check()
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError):
            idx.set_capacity("w9", bad)


def test_counts_follow_remove_clear_drop_and_snapshot():
    idx = PrefixIndex()
    a = chain(1, 6)
    idx.insert("w0", a, 1.0)
    idx.insert("w1", a[:4], 1.0)
    idx.set_capacity("w1", 10)
    assert (idx.entries("w0"), idx.entries("w1")) == (6, 4)
    idx.remove("w0", [a[2]])
    assert idx.entries("w0") == 2
    idx.check()
    idx.apply_snapshot("w1", [(a[0], None), (a[1], a[0]), (99, None)], 2.0)
    assert idx.entries("w1") == 3
    idx.check()
    assert idx.clear("w1") == 3 and idx.entries("w1") == 0 and "w1" in idx.workers()
    idx.check()
    idx.insert("w1", a, 3.0)
    idx.drop_worker("w1")
    assert "w1" not in idx.workers() and idx.entries("w1") == 0
    assert idx.capacity("w1") == 10  # the cap outlives drop_worker (a setting)
    idx.check()
    idx.set_capacity("w1", 3)
    idx.insert("w1", a, 4.0)
    assert idx.entries("w1") == 3
    idx.check()


def test_keep_truncates_one_workers_chain_with_its_descendants():
    idx = PrefixIndex()
    a = chain(1, 8)
    x = a[:5] + chain(2, 3)  # a branch below a[4]
    idx.insert("w0", a, 1.0)
    idx.insert("w0", x, 2.0)
    idx.insert("w1", a, 1.0)
    assert idx.entries("w0") == 11
    assert idx.keep("w0", a, 3) == 8  # a[3:] (5) and x's tail (3)
    idx.check()
    assert held(idx, "w0", a) == 3 and held(idx, "w0", x) == 3 and idx.entries("w0") == 3
    assert held(idx, "w1", a) == 8  # other workers keep theirs
    assert idx.keep("w0", a, 3) == 0 and idx.keep("w0", a, 8) == 0 and idx.keep("w0", a, 50) == 0
    with pytest.raises(ValueError):
        idx.keep("w0", a, -1)
    # the opposite correction is insert: it adds what is missing and touches the rest
    assert idx.insert("w0", a[:6], 3.0) == 3
    assert held(idx, "w0", a) == 6
    assert idx.keep("w0", a, 0) == 6 and idx.entries("w0") == 0
    idx.check()


def test_keep_on_a_capped_worker_keeps_its_lru_order_exact():
    idx = PrefixIndex()
    idx.set_capacity("w0", 6)
    a, b = chain(1, 4), chain(2, 2)
    idx.insert("w0", a, 1.0)
    idx.insert("w0", b, 2.0)
    idx.keep("w0", a, 2)  # a[1] becomes a leaf: it needs a record of its own
    idx.check()
    idx.insert("w0", chain(3, 3), 3.0)  # 7 > 6: a[1] is the oldest leaf
    idx.check()
    assert (held(idx, "w0", a), held(idx, "w0", b)) == (1, 2)


def test_global_budget_still_bounds_everything_and_counts_stay_right():
    per_node = NODE_BYTES
    idx = PrefixIndex(max_bytes=40 * per_node + 40 * 96)
    idx.set_capacity("w0", 25)
    for i in range(30):
        idx.insert(f"w{i % 3}", chain(i, 5), float(i))
        idx.check()
    st = idx.stats()
    assert st.evicted_entries > 0 and st.est_bytes <= st.max_bytes
    assert sum(idx.entries(w) for w in idx.workers()) == st.holder_entries


def test_uncapped_inserts_cost_nothing_new_in_the_heaps():
    idx = PrefixIndex()
    for i in range(50):
        idx.insert("w0", chain(i, 4), float(i))
    # no per-worker heap exists until a worker is capped
    assert idx._wheaps == {} and idx._wheap_records == 0
    assert idx.set_capacity("w0", 1_000) == 0
    assert idx._wheap_records == 50  # one record per leaf (chain end), built once
    idx.check()


@pytest.mark.parametrize("seed", range(8))
def test_check_after_every_op_with_mixed_capped_and_uncapped_workers(seed):
    rng = random.Random(seed)
    big = rng.random() < 0.5
    idx = PrefixIndex(max_bytes=2**40 if big else 300 * NODE_BYTES + 200 * 96)
    workers = [f"w{i}" for i in range(6)]
    roots = [chain(t, 12) for t in range(8)]
    branches = [
        r[: rng.randrange(1, 10)] + chain(100 + i, rng.randrange(1, 6)) for i, r in enumerate(roots * 2)
    ]
    pool = roots + branches
    now = 0.0
    for _step in range(1_500):
        if rng.random() < 0.7:
            now += rng.choice([0.0, 0.5, 1.0])
        w = rng.choice(workers)
        c = rng.choice(pool)
        op = rng.random()
        if op < 0.45:
            k = rng.randrange(1, len(c) + 1)
            idx.insert(w, c[:k], now)
        elif op < 0.55:
            k = rng.randrange(1, len(c))
            idx.insert(w, c[k:], now, parent=c[k - 1])
        elif op < 0.63:
            idx.remove(w, [rng.choice(c)])
        elif op < 0.72:
            before = idx.entries(w)
            removed = idx.keep(w, c, rng.randrange(0, len(c) + 1))
            assert idx.entries(w) == before - removed
        elif op < 0.82:
            cap = rng.choice([None, 0, 1, 3, 8, 20, 60])
            before = idx.entries(w)
            ev = idx.set_capacity(w, cap)
            assert idx.capacity(w) == cap
            assert idx.entries(w) == (before if cap is None else min(before, cap))
            assert ev == before - idx.entries(w)
        elif op < 0.86:
            idx.clear(w)
            assert idx.entries(w) == 0
        elif op < 0.88:
            idx.drop_worker(w)
            assert w not in idx.workers()
        elif op < 0.92:
            blocks, parent = [], None
            for h in rng.choice(roots)[: rng.randrange(1, 12)]:
                blocks.append((h, parent))
                parent = h
            idx.apply_snapshot(w, blocks, now)
        else:
            idx.match(c, now)
        idx.check()
        cap = idx.capacity(w)
        assert cap is None or idx.entries(w) <= cap
    assert sum(idx.entries(w) for w in idx.workers()) == idx.stats().holder_entries
