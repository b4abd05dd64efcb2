"""Scenario and stress tests of the token radix cache (radixfleet_tools.agent.radix_cache)."""

from __future__ import annotations

import random

import pytest

from radixfleet.wire.events import Cleared, Removed, Stored
from radixfleet_tools.agent.radix_cache import AdmissionConfig, RadixCache


def chain(key, stride, ns="ns"):
    """Stand-in router hashes: chained digests of whole ``stride``-token blocks."""
    out, h = [], hash(("seed", ns)) & (2**63 - 1)
    for i in range(0, len(key) - stride + 1, stride):
        h = hash((h, tuple(key[i : i + stride]))) & (2**63 - 1)
        out.append(h)
    return out


def removed(cache):
    ev = cache.drain_events()
    return [h for e in ev if isinstance(e, Removed) for h in e.hashes]


def test_exact_lru_eviction_order_and_split():
    c = RadixCache(hash_stride=1)
    A, B, C = [1, 2, 3], [4, 5], [1, 2, 9]
    c.insert("n", A, [101, 102, 103])
    c.check()
    c.insert("n", B, [204, 205])
    c.check()
    held, node = c.insert("n", C, [101, 102, 903])
    c.check()
    assert held == 3 and node.key == [9]
    # the insert split A after two tokens: upper [1,2] with two children, no event for it
    ev = c.drain_events()
    assert ev == [Stored(None, [101, 102, 103]), Stored(None, [204, 205]), Stored(102, [903])]
    upper = c.roots["n"].children[1]
    assert upper.key == [1, 2] and upper.hashes == [101, 102] and len(upper.children) == 2
    assert c.match_prefix("n", B) == (2, c.roots["n"].children[4])  # B most recent now
    c.check()
    order = []
    for _ in range(4):
        c.evict(1)
        c.check()
        order.append(removed(c))
    # leaves oldest first: [3] (first insert), [9], then [1,2] once it is a leaf, then B
    assert order == [[103], [903], [101, 102], [204, 205]]
    assert c.total_tokens == 0 and c.evictable_tokens == 0 and not c.roots


def test_match_splits_mid_edge_and_hashes_follow_their_last_token():
    c = RadixCache(hash_stride=2)
    key = list(range(10))
    c.insert("n", key, chain(key, 2))
    c.drain_events()
    n, node = c.match_prefix("n", [0, 1, 2, 99])
    c.check()
    assert n == 3 and node.key == [0, 1, 2] and node.start == 0
    assert node.hashes == chain(key, 2)[:1]  # block 1 ends at token 2 (index 1); block 2 ends at index 3
    (lower,) = node.children.values()
    assert lower.start == 3 and lower.hashes == chain(key, 2)[1:]
    assert c.drain_events() == []  # a split changes nothing the router sees
    assert c.peek("n", key) == 10 and c.peek("other", key) == 0


def test_locks_block_eviction_and_counts_stay_exact():
    c = RadixCache()
    c.insert("n", [1, 2, 3, 4])
    c.insert("n", [1, 2, 7, 8])
    c.insert("n", [5, 6])
    n, node = c.match_prefix("n", [1, 2, 3, 4])
    c.inc_lock_ref(node)
    c.check()
    assert c.locked_tokens == 4 and c.evictable_tokens == 4
    assert c.evict(100) == 4  # only [7,8] and [5,6]; the locked path survives
    c.check()
    assert c.peek("n", [1, 2, 3, 4]) == 4 and c.peek("n", [5, 6]) == 0
    c.inc_lock_ref(node)
    c.dec_lock_ref(node)
    c.check()
    assert c.evict(100) == 0
    c.dec_lock_ref(node)
    c.check()
    assert c.evictable_tokens == 4 and c.evict(100) == 4
    c.check()
    assert c.total_tokens == 0


def test_namespaces_never_share():
    c = RadixCache()
    c.insert(("m", "tenant-a", None), [1, 2, 3])
    assert c.peek(("m", "tenant-b", None), [1, 2, 3]) == 0
    assert c.peek(("m", "tenant-a", "lora1"), [1, 2, 3]) == 0
    assert c.peek(("m", "tenant-a", None), [1, 2, 3]) == 3


def test_page_size_rounds_matches_and_inserts():
    c = RadixCache(page_size=4)
    held, _ = c.insert("n", list(range(10)))
    assert held == 8 and c.total_tokens == 8
    assert c.match_prefix("n", [0, 1, 2, 3, 4, 5, 99, 99])[0] == 4
    c.check()


def test_second_hit_admission_and_refusal_events():
    c = RadixCache(hash_stride=4, admission=AdmissionConfig("second_hit", ghost_block_tokens=4))
    key = list(range(16))
    hs = chain(key, 4)
    assert c.insert("n", key, hs, admit_from=0) == (0, None)
    assert c.total_tokens == 0 and c.stats.refusals == 1
    assert removed(c) == hs  # tells the router its optimistic insert is not true
    other = list(range(8)) + [50] * 8
    held, _ = c.insert("n", other, chain(other, 4), admit_from=0)
    assert held == 8  # the shared half was seen before; the new half is a first sighting
    held, _ = c.insert("n", key, hs, admit_from=0)
    assert held == 16
    c.check()
    # an insert without admission (admit_from=None) is never refused
    c2 = RadixCache(admission=AdmissionConfig("second_hit"))
    assert c2.insert("n", key)[0] == 16


def test_min_prefix_admission():
    c = RadixCache(admission=AdmissionConfig("min_prefix", min_prefix_tokens=10))
    assert c.insert("n", list(range(5)), admit_from=0)[0] == 0
    assert c.insert("n", list(range(12)), admit_from=0)[0] == 12
    # what is already resident is kept even for a short sequence
    assert c.insert("n", list(range(6)), admit_from=0)[0] == 6
    c.check()


def test_protected_segment_survives_a_scan():
    c = RadixCache(capacity_tokens=100, admission=AdmissionConfig("protected", protected_fraction=0.3))
    hot = list(range(1000, 1020))
    c.insert("n", hot, admit_from=0)
    c.match_prefix("n", hot)  # proven reuse -> protected
    c.check()
    assert c.protected_tokens == 20
    for i in range(50):  # a scan of one-offs, each evicting the LRU
        c.insert("n", [i * 7 + 1] * 10, admit_from=0)
        if c.total_tokens > 60:
            c.evict(c.total_tokens - 60)
        c.check()
    assert c.peek("n", hot) == 20
    # the segment never exceeds its share: promoting more demotes its LRU leaves
    for j in range(3):
        k = list(range(2000 + 100 * j, 2000 + 100 * j + 10))
        c.insert("n", k, admit_from=0)
        c.match_prefix("n", k)
        c.check()
        assert c.protected_tokens <= 30
    # cap 30: the third promotion demoted the segment's LRU leaf, the hot prompt
    assert c.protected_tokens == 30
    assert not c.roots["n"].children[1000].protected
    c.drain_events()
    scan_left = c.total_tokens - 20 - 30
    assert c.evict(1) == 20 and c.peek("n", hot) == 0  # oldest probationary leaf goes first
    assert c.evict(scan_left) == scan_left and c.protected_tokens == 30
    # last resort: with only protected leaves left, they can still be evicted
    assert c.evict(10_000) == 30
    c.check()
    assert c.total_tokens == 0


def test_second_hit_pollution_one_off_does_not_flush_hot_prompt_cache_level():
    """Cache-level version (the scheduler-level one is in test_agent_scheduler)."""

    def run(mode):
        c = RadixCache(admission=AdmissionConfig(mode))
        cap = 110_000
        system = list(range(2000))
        for i in range(3):
            c.insert("n", system + [10**6 + i] * 16, admit_from=0)
            c.match_prefix("n", system)
        for j in range(2):  # one-off 100k prompts, each needing room
            big = [2 * 10**6 + j * 200_000 + t for t in range(100_000)]
            need = 100_000 - (cap - c.total_tokens)
            if need > 0:
                c.evict(need)
            c.insert("n", big, admit_from=0)
            c.check()
        return c.peek("n", system)

    assert run("always") == 0
    assert run("second_hit") == 2000


def test_fingerprint_change_flushes_everything():
    c = RadixCache(hash_stride=1, fingerprint=("rope", None))
    c.insert("n", [1, 2], [11, 12])
    c.drain_events()
    assert c.set_fingerprint(("rope", None)) is False and c.total_tokens == 2
    n, node = c.match_prefix("n", [1, 2])
    c.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="drain"):
        c.set_fingerprint(("rope", {"type": "yarn", "factor": 4}))
    assert c.flush() is False
    c.dec_lock_ref(node)
    assert c.set_fingerprint(("rope", {"type": "yarn", "factor": 4})) is True
    assert c.drain_events() == [Cleared()] and c.total_tokens == 0 and c.snapshot_blocks() == []
    c.check()


def _apply(held: dict, events):
    """The router's view: hash -> parent, updated by events."""
    for e in events:
        if isinstance(e, Stored):
            p = e.parent
            for h in e.hashes:
                assert h not in held, "stored twice"
                held[h] = p
                p = h
        elif isinstance(e, Removed):
            for h in e.hashes:
                held.pop(h, None)
        elif isinstance(e, Cleared):
            held.clear()


@pytest.mark.parametrize("mode", ["always", "second_hit", "min_prefix", "protected"])
@pytest.mark.parametrize("page", [1, 4])
def test_random_ops_keep_invariants_and_events_exact(mode, page):
    rng = random.Random(f"{mode}-{page}")
    stride = 4
    c = RadixCache(
        page_size=page,
        hash_stride=stride,
        capacity_tokens=400,
        admission=AdmissionConfig(
            mode, min_prefix_tokens=6, ghost_block_tokens=4, ghost_capacity=64, protected_fraction=0.4
        ),
    )
    router: dict = {}
    locks = []
    stems = [[rng.randrange(3) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    for step in range(600):
        op = rng.random()
        ns = rng.choice(["a", "b"])
        key = rng.choice(stems)[: rng.randrange(0, 30)] + [
            rng.randrange(4) for _ in range(rng.randrange(0, 12))
        ]
        if op < 0.4:
            c.insert(ns, key, chain(key, stride, ns), admit_from=rng.choice([None, 0]))
        elif op < 0.6:
            n, node = c.match_prefix(ns, key)
            assert n == c.peek(ns, key)
            if node is not None and rng.random() < 0.5:
                c.inc_lock_ref(node)
                locks.append(node)
        elif op < 0.75 and locks:
            c.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        elif op < 0.95:
            before = c.total_tokens
            freed = c.evict(rng.randrange(1, 40))
            assert c.total_tokens == before - freed
        else:
            if not locks:
                assert c.flush()
        c.check()
        _apply(router, c.drain_events())
        snap = c.snapshot_blocks()
        assert dict(snap) == router, f"events diverged from the tree at step {step}"
    while locks:
        c.dec_lock_ref(locks.pop())
    c.evict(10**9)
    c.check()
    _apply(router, c.drain_events())
    assert c.total_tokens == 0 and router == {}


def _shape(c):
    """Everything observable about a tree: nodes (depth order), ticks, LRU, counters."""
    out = []
    for ns, root in sorted(c.roots.items()):
        stack = [root]
        while stack:
            n = stack.pop()
            out.append(
                (ns, n.id, n.start, n.key, n.tick, n.lock_ref, n.hits, list(n.hashes), n.in_lru, n.protected)
            )
            stack.extend(n.children[k] for k in sorted(n.children))
    return (
        out,
        list(c._lru),
        list(c._lru_protected),
        c.total_tokens,
        c.evictable_tokens,
        c.locked_tokens,
        c.protected_tokens,
        c.stats,
    )


@pytest.mark.parametrize("mode", ["always", "second_hit", "protected"])
def test_insert_below_and_locked_equals_a_walk_from_the_root_then_a_lock(mode):
    rng = random.Random(7)
    a, b = (RadixCache(hash_stride=4, capacity_tokens=400, admission=AdmissionConfig(mode)) for _ in range(2))
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    for _ in range(300):
        key = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        hashes = chain(key, 4)
        limit = rng.randrange(0, len(key) + 1)
        na, node_a = a.match_prefix("n", key, limit)
        nb, node_b = b.match_prefix("n", key[:limit])
        assert na == nb
        a.inc_lock_ref(node_a)
        b.inc_lock_ref(node_b)
        ha, ia = a.insert("n", key, hashes, admit_from=0, below=node_a, lock=True)
        hb, ib = b.insert("n", key, hashes, admit_from=0)
        b.inc_lock_ref(ib)
        assert ha == hb and (ia is None) == (ib is None) and (ia is None or ia.id == ib.id)
        a.check()
        b.check()
        assert _shape(a) == _shape(b)
        a.dec_lock_ref(node_a)
        b.dec_lock_ref(node_b)
        a.dec_lock_ref(ia)
        b.dec_lock_ref(ib)
        a.check()
        b.check()
        assert _shape(a) == _shape(b) and a.drain_events() == b.drain_events()
        if a.total_tokens > 300:
            assert a.evict(60) == b.evict(60)
            assert _shape(a) == _shape(b) and a.drain_events() == b.drain_events()


def test_insert_below_rejects_a_node_outside_the_tree():
    from radixfleet_tools.agent.radix_cache import as_key

    c = RadixCache()
    _, node = c.insert("n", [1, 2, 3])
    with pytest.raises(ValueError, match="not in the tree"):
        c.insert("other", [1, 2, 3, 4], below=node)
    with pytest.raises(ValueError, match="ends past the key"):
        c.insert("n", [1, 2], below=node)
    c.evict(10)
    with pytest.raises(ValueError, match="not in the tree"):
        c.insert("n", [1, 2, 3, 4], below=node)
    # keys: any int sequence converts once; an array('Q') key is used as is
    k = as_key([5, 6])
    assert as_key(k) is k and as_key((5, 6)) == k and as_key(range(5, 7)) == k
