"""The approximate prefix index: exact match lengths, closure, budget eviction order,
hot counters, and check() after seeded random operation sequences."""

from __future__ import annotations

import math
import random

import pytest

from radixfleet.config import IndexConfig
from radixfleet.index.prefix_index import EXTRA_HOLDER_BYTES, HEAP_RECORD_BYTES, NODE_BYTES, PrefixIndex
from radixfleet.policies.base import EMPTY_MATCH


def chain(tag: int, n: int) -> list[int]:
    """n distinct fake hashes; chains with the same tag share their prefix."""
    return [tag * 1_000_000 + i for i in range(n)]


def test_match_lengths_per_worker_are_exact():
    idx = PrefixIndex()
    a = chain(1, 10)
    idx.insert("w0", a, 1.0)
    idx.insert("w1", a[:4], 2.0)
    idx.insert("w2", a[:7], 3.0)
    m = idx.match(a, 4.0)
    assert dict(m.blocks) == {"w0": 10, "w1": 4, "w2": 7}
    assert m.depth == 10
    idx.check()
    # a request that diverges after 5 blocks
    b = a[:5] + chain(2, 3)
    m = idx.match(b, 5.0)
    assert dict(m.blocks) == {"w0": 5, "w1": 4, "w2": 5}
    assert m.depth == 5
    assert idx.match(chain(3, 3), 5.0).blocks == {}
    assert idx.match([], 5.0).blocks == {}


def test_insert_with_parent_extends_a_chain_and_unknown_parents_are_dropped():
    idx = PrefixIndex()
    a = chain(1, 6)
    idx.insert("w0", a[:3], 1.0)
    assert idx.insert("w0", a[3:], 2.0, parent=a[2]) == 3
    assert idx.match(a, 3.0).blocks == {"w0": 6}
    assert idx.insert("w1", a[3:], 2.0, parent=a[2]) == 0  # w1 does not hold the parent
    assert idx.insert("w0", [99], 2.0, parent=12345) == 0
    idx.check()


def test_remove_takes_descendants_so_sets_stay_prefix_closed():
    idx = PrefixIndex()
    a = chain(1, 8)
    idx.insert("w0", a, 1.0)
    idx.insert("w1", a, 1.0)
    assert idx.remove("w0", [a[3]]) == 5
    assert dict(idx.match(a, 2.0).blocks) == {"w0": 3, "w1": 8}
    idx.check()
    assert idx.clear("w1") == 8
    assert dict(idx.match(a, 2.0).blocks) == {"w0": 3}
    assert idx.stats().nodes == 3
    assert idx.workers() == {"w0", "w1"}  # clear keeps the worker known
    idx.drop_worker("w0")
    idx.drop_worker("w1")
    assert idx.stats().nodes == 0 and idx.workers() == set()
    idx.check()


def test_snapshot_replaces_a_workers_set():
    idx = PrefixIndex()
    a, b = chain(1, 4), chain(2, 3)
    idx.insert("w0", a, 1.0)
    blocks = [(b[0], None), (b[1], b[0]), (b[2], b[1]), (77, 5555)]  # last: unknown parent
    idx.apply_snapshot("w0", blocks, 2.0)
    assert idx.match(a, 3.0).blocks == {}
    assert idx.match(b, 3.0).blocks == {"w0": 3}
    assert idx.stats().nodes == 3
    idx.check()


def budget_for(nodes: int, heap: int) -> int:
    return nodes * NODE_BYTES + heap * HEAP_RECORD_BYTES


def test_budget_evicts_least_recently_touched_leaf_entries_first():
    a, b, c = chain(1, 4), chain(2, 4), chain(3, 4)
    idx = PrefixIndex(max_bytes=budget_for(8, 2))
    idx.insert("w0", a, 1.0)
    idx.insert("w1", b, 2.0)
    idx.insert("w0", a, 3.0)  # a re-touched: b is now the oldest
    idx.check()
    idx.insert("w2", c, 4.0)  # over budget: b's chain (w1) leaves, deepest first
    idx.check()
    assert idx.match(b, 5.0).blocks == {}
    assert idx.match(a, 5.0).blocks == {"w0": 4}
    assert idx.match(c, 5.0).blocks == {"w2": 4}
    assert idx.stats().evicted_entries == 4


def test_eviction_trims_tails_before_shared_roots():
    shared = chain(1, 2)
    x, y = shared + chain(2, 2), shared + chain(3, 2)
    idx = PrefixIndex(max_bytes=budget_for(6, 2))
    idx.insert("w0", x, 1.0)
    idx.insert("w0", y, 2.0)
    idx.check()
    idx.insert("w0", chain(4, 2), 3.0)  # needs room for 2 nodes: x's tail goes
    idx.check()
    m = idx.match(x, 4.0)
    assert m.blocks == {"w0": 2}  # the shared root survives, x's own tail is gone
    assert idx.match(y, 4.0).blocks == {"w0": 4}


def test_global_budget_not_per_worker_memory_flat_under_unique_stream():
    idx = PrefixIndex(max_bytes=200_000)
    rng = random.Random(7)
    sizes = []
    for i in range(3000):
        idx.insert(f"w{rng.randrange(16)}", chain(i + 10, rng.randrange(1, 12)), float(i))
        sizes.append(idx.stats().est_bytes)
    assert max(sizes) <= 200_000
    assert min(sizes[-1000:]) > 150_000  # full and flat, not shrinking
    idx.check()


def test_multi_holder_entries_are_counted_in_the_budget():
    idx = PrefixIndex()
    a = chain(1, 5)
    for w in ("w0", "w1", "w2"):
        idx.insert(w, a, 1.0)
    st = idx.stats()
    assert st.nodes == 5 and st.holder_entries == 15
    assert st.est_bytes == 5 * NODE_BYTES + 15 * EXTRA_HOLDER_BYTES + 3 * HEAP_RECORD_BYTES


def test_hot_counters_decay_with_the_half_life():
    idx = PrefixIndex(half_life_s=10.0)
    sys_prompt = chain(1, 4)
    idx.insert("w0", sys_prompt, 0.0)
    for i in range(100):  # 10 requests/s for 10 s
        m = idx.match(sys_prompt + chain(100 + i, 2), i / 10)
    assert 3.0 < m.rate < 12.0
    assert m.depth == 4
    later = idx.rate(sys_prompt[-1], 10.0 + 50.0)  # five half-lives later
    assert later < m.rate / 20
    hot = idx.hot_prefixes(10.0, k=3)
    assert hot[0].hash == sys_prompt[-1] and hot[0].depth == 4 and hot[0].holders == ("w0",)


def test_a_reloaded_half_life_keeps_the_counters_and_decays_them_at_the_new_rate():
    idx = PrefixIndex(half_life_s=10.0)
    sys_prompt = chain(1, 4)
    idx.insert("w0", sys_prompt, 0.0)
    for i in range(100):  # 10 requests/s for 10 s
        idx.match(sys_prompt + chain(100 + i, 2), i / 10)
    key = sys_prompt[-1]
    seen = idx.rate(key, 10.0) / (math.log(2) / 10.0)  # decayed requests at t = 10
    idx.configure(IndexConfig(max_bytes=idx.max_bytes, half_life_s=2.0), 10.0)
    lam = math.log(2) / 2.0
    assert idx.rate(key, 10.0) == pytest.approx(lam * seen)  # same count, the new rate's scale
    assert idx.rate(key, 12.0) == pytest.approx(lam * seen / 2)  # one new half-life later
    idx.configure(IndexConfig(max_bytes=idx.max_bytes, half_life_s=2.0), 50.0)  # unchanged: nothing moves
    assert idx.rate(key, 14.0) == pytest.approx(lam * seen / 4)
    idx.check()


def test_a_match_is_private_until_a_second_request_goes_through_its_deepest_node():
    idx = PrefixIndex(half_life_s=10.0)
    turn1 = chain(1, 6)
    idx.insert("w0", turn1, 0.0)  # a conversation's first turn, as routed
    turn2 = turn1 + chain(50, 3)
    assert idx.match(turn2, 1.0, count=False).private  # a look does not count
    m = idx.match(turn2, 1.0)
    assert m.depth == 6 and m.private  # the next turn: its own context
    assert not idx.match(turn1 + chain(60, 3), 1.5).private  # another request: shared
    assert not idx.match(turn2, 1.5, count=False).private
    # two requests decay below one half in two half-lives
    assert not idx.match(turn2, 20.0, count=False).private
    assert idx.match(turn2, 23.0, count=False).private
    idx.insert("w0", turn2, 2.0)  # the turn's own blocks: through nobody yet
    assert idx.match(turn2 + chain(70, 2), 3.0).private
    assert idx.match([999], 3.0) is EMPTY_MATCH and not EMPTY_MATCH.private


def test_hot_counters_survive_renormalisation():
    idx = PrefixIndex(half_life_s=0.01)
    p = chain(1, 2)
    idx.insert("w0", p, 0.0)
    for i in range(50):
        m = idx.match(p, float(i))  # exponent passes the renormalisation bound
    assert m.rate > 0 and m.rate < 1e6


OPS = ("insert", "insert", "insert", "remove", "clear", "snapshot", "match", "extend")


@pytest.mark.parametrize("seed", range(12))
def test_check_after_seeded_random_sequences(seed):
    rng = random.Random(seed)
    idx = PrefixIndex(max_bytes=rng.choice([3_000, 20_000, 10**9]))
    workers = [f"w{i}" for i in range(rng.randrange(1, 6))]
    bases = [chain(t, 12) for t in range(1, 6)]
    now = 0.0
    for _ in range(400):
        now += rng.random()
        op = rng.choice(OPS)
        w = rng.choice(workers)
        base = rng.choice(bases)
        if op == "insert":
            cut = rng.randrange(1, len(base) + 1)
            # a tail's hashes depend on its whole prefix, as chained hashes do
            t = rng.randrange(3)
            tail = [hash((base[0], cut, t, i)) % 2**60 for i in range(rng.randrange(0, 3))]
            idx.insert(w, base[:cut] + tail, now)
        elif op == "extend":
            cut = rng.randrange(1, len(base))
            idx.insert(w, base[cut : cut + 3], now, parent=base[cut - 1])
        elif op == "remove":
            idx.remove(w, rng.sample(base, 2))
        elif op == "clear":
            (idx.drop_worker if rng.random() < 0.3 else idx.clear)(w)
        elif op == "snapshot":
            cut = rng.randrange(1, len(base))
            idx.apply_snapshot(w, [(h, base[i - 1] if i else None) for i, h in enumerate(base[:cut])], now)
        else:
            m = idx.match(base, now)
            for _wid, n in m.blocks.items():
                assert 0 < n <= len(base)
        idx.check()


def test_a_hash_seen_under_another_parent_stops_the_insert():
    idx = PrefixIndex()
    idx.insert("w0", [1, 2, 3], 1.0)
    idx.insert("w1", [9, 2, 7], 1.0)  # 2 already lives under 1: stop after 9
    idx.insert("w1", [8, 10, 3], 1.0)  # 3 collides inside a new tail: stop before it
    assert idx.match([9, 2, 7], 2.0).blocks == {"w1": 1}
    assert idx.match([8, 10, 3], 2.0).blocks == {"w1": 2}
    assert idx.match([1, 2, 3], 2.0).blocks == {"w0": 3}
    idx.check()


def test_a_flooding_worker_evicts_its_own_entries_not_the_others():
    """The shared budget is fair: a worker inserting without end (one serving a model
    nobody asks for) loses its own least recently touched entries once it holds more
    than the others; their older entries stay. (Max-min fair: it may use the part of
    the budget the others leave free.)"""
    idx = PrefixIndex(max_bytes=200 * (NODE_BYTES + HEAP_RECORD_BYTES))
    idx.insert("a", chain(1, 40), 1.0)
    idx.insert("b", chain(2, 40), 2.0)
    for i in range(500):
        idx.insert("flood", chain(100 + i, 8), 10.0 + i)
        idx.check()
    assert idx.entries("a") == 40 and idx.entries("b") == 40
    assert idx.match(chain(1, 40), 600.0, count=False).blocks == {"a": 40}
    assert idx.entries("flood") > 40  # it uses what the others leave free
    # the newest of the flood stay, its oldest went first (LRU within the worker)
    assert idx.match(chain(599, 8), 600.0, count=False).blocks == {"flood": 8}
    assert idx.match(chain(100, 8), 600.0, count=False).blocks == {}
    assert idx.stats().est_bytes <= idx.max_bytes


def test_equal_workers_still_share_one_lru():
    """With every worker at its fair share the global LRU order is unchanged."""
    idx = PrefixIndex(max_bytes=9 * NODE_BYTES + 3 * HEAP_RECORD_BYTES)  # three chains
    for i in range(4):
        idx.insert("a" if i % 2 == 0 else "b", chain(i + 1, 3), float(i))
        idx.check()
    assert idx.match(chain(1, 3), 9.0, count=False).blocks == {}  # a's oldest went
    assert idx.match(chain(4, 3), 9.0, count=False).blocks == {"b": 3}


def test_fair_share_stress_keeps_every_invariant():
    rng = random.Random(11)
    idx = PrefixIndex(max_bytes=60_000)
    workers = ["w0", "w1", "w2", "w3"]
    for step in range(3000):
        w = rng.choice(workers) if rng.random() < 0.6 else "w0"  # w0 floods
        op = rng.random()
        now = float(step)
        if op < 0.7:
            tag = rng.randrange(40) if rng.random() < 0.5 else 1000 + step
            idx.insert(w, chain(tag, rng.randrange(1, 12)), now)
        elif op < 0.8:
            idx.remove(w, chain(rng.randrange(40), 1))
        elif op < 0.85:
            idx.set_capacity(w, rng.choice([None, 50, 200]))
        elif op < 0.9:
            idx.drop_worker(w)
        elif op < 0.95:
            idx.apply_snapshot(
                w, [(k, None if i == 0 else k - 1) for i, k in enumerate(chain(rng.randrange(40), 5))], now
            )
        else:
            idx.evict_older(w, now - 50)
        if step % 10 == 0:
            idx.check()
    idx.check()


def test_clear_steps_removes_deepest_first_and_stays_consistent_between_steps():
    rng = random.Random(5)
    idx = PrefixIndex()
    idx.set_capacity("c", 10_000)
    for w in ("a", "c"):
        for tag in range(30):  # a tree: chains sharing prefixes, and one long chain
            idx.insert(w, chain(tag % 7, rng.randrange(1, 40)), float(tag))
        idx.insert(w, chain(99, 500), 50.0)
    idx.insert("b", chain(3, 20), 60.0)
    b_before = idx.entries("b")
    for w in ("a", "c"):
        total = idx.entries(w)
        seen = 0
        for i, removed in enumerate(idx.clear_steps(w, 37)):
            assert removed <= 37
            seen += removed
            idx.check()
            assert idx.entries(w) == total - seen
            if i == 3:  # the world moves between steps: a hint lands meanwhile
                total += idx.insert(w, chain(99, 5) + [424242], 70.0)
        assert idx.entries(w) == 0
    assert idx.entries("b") == b_before
    idx.check()
