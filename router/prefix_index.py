"""The router's approximate prefix index: which worker holds which prompt blocks.

Nodes are keyed by chained block hash (router.prefix_keys): because ``h_k``
fingerprints the whole prefix up to block k, one flat ``dict`` from hash to node
*is* the tree — a match walks the request's hashes through it, never a child
table. Each node keeps its parent and children (for subtree removal and leaf
tests), the workers that hold it with their last-touch times, and a decayed
request counter (hot roots)::

    _root (sentinel, holds nothing)
      ├── n(h1) holders {w0: t, w1: t}      n.kids: None | _Node | set[_Node]
      │     └── n(h2) holders "w0" (t)      n.holders: str (one holder, time in n.t)
      │           └── n(h3) ...                        | dict[str, float] (several)
      └── n(h1') ...

Invariants (``check()`` asserts each):

- Every node is reachable from ``_root`` through ``kids`` and ``parent`` agrees;
  ``_nodes`` maps each node's hash to it and holds nothing else.
- Every node has at least one holder (a node nobody holds is deleted).
- Prefix closure: if worker w holds a node, w holds its parent.
- Touch monotonicity: for each worker, a parent's touch time >= its child's. Every
  touch touches the whole path from the root with one ``now`` (taking the max), so
  LRU order over holder entries evicts deepest-first and never breaks closure.
- ``_entries`` equals the number of (node, worker) holder entries; ``_multi`` the
  number of those in nodes with more than one holder.

Memory: one global budget (``max_bytes``) for the whole index, never one per
worker (smg #2137). The estimate counts nodes and extra holder entries at sizes
measured with tracemalloc (``bench index``). Over budget, the least recently
touched *leaf* holder entries go first: a min-heap of (touch time, node, worker)
records, one pushed per inserted chain end; stale records (re-touched or removed
entries) are skipped when popped and compacted away when the heap outgrows the
entries. Evicting an entry walks up and evicts ancestors that became leaves with
the same touch time, so one insert's chain leaves together, deepest first.

Hot roots: each node's ``hits`` is an exponentially decayed request count kept in
"inflated" units (each request adds ``exp(lambda * (now - t0))``), so an increment
is one float add; the rate at ``now`` is ``lambda * hits * exp(-lambda*(now-t0))``
requests/s. ``t0`` moves forward (a renormalising scan) before the factor overflows.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from itertools import count as _counter
from typing import Iterable, Sequence

from policies.base import EMPTY_MATCH, MatchResult

#: Bytes per node and per extra holder entry, measured with tracemalloc by
#: ``radixfleet bench index`` (CPython 3.11, 64-bit); the budget uses them.
NODE_BYTES = 200
EXTRA_HOLDER_BYTES = 104
HEAP_RECORD_BYTES = 96

DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_HALF_LIFE_S = 30.0
#: renormalise the inflated hit counters before exp() grows past e^40
_MAX_EXPONENT = 40.0


def tune_gc() -> None:
    """Raises the cyclic GC's thresholds for a process that holds a large index.

    Index nodes never outlive their removal in a cycle (``_drop_entry`` unlinks
    both directions), so reference counting frees them; but every node is a GC
    container, and with default thresholds the collector rescans millions of live
    nodes as the index grows (it more than doubles insert cost at 8 KiB prompts).
    The router and the benchmarks call this once at start.
    """
    import gc

    gc.set_threshold(100_000, 50, 1000)


class _Node:
    __slots__ = ("key", "parent", "kids", "holders", "t", "hits")

    def __init__(self, key: int, parent: "_Node", holder: str, t: float) -> None:
        self.key = key  # block hash; the node's key in PrefixIndex._nodes
        self.parent = parent  # _root for depth-1 nodes
        self.kids = None  # None | _Node | set[_Node]
        self.holders = holder  # str (single holder, touch time in .t) | dict[str, float]
        self.t = t  # touch time of the single holder (unused when holders is a dict)
        self.hits = 0.0  # decayed request count, inflated units (see module docstring)

    def kid_list(self) -> tuple:
        k = self.kids
        if k is None:
            return ()
        if k.__class__ is _Node:
            return (k,)
        return tuple(k)

    def add_kid(self, kid: "_Node") -> None:
        k = self.kids
        if k is None:
            self.kids = kid
        elif k.__class__ is _Node:
            self.kids = {k, kid}
        else:
            k.add(kid)

    def drop_kid(self, kid: "_Node") -> None:
        k = self.kids
        if k is kid:
            self.kids = None
        elif k.__class__ is set:
            k.discard(kid)
            if len(k) == 1:
                self.kids = next(iter(k))

    def held_by(self, w: str) -> bool:
        h = self.holders
        return h == w if h.__class__ is str else w in h

    def touch_of(self, w: str) -> float | None:
        h = self.holders
        if h.__class__ is str:
            return self.t if h == w else None
        return h.get(w)

    def __repr__(self) -> str:  # for assertion messages
        return f"_Node({self.key:#x}, holders={self.holders!r})"


@dataclass(frozen=True, slots=True)
class IndexStats:
    nodes: int
    holder_entries: int
    est_bytes: int
    max_bytes: int
    evicted_entries: int
    workers: int


@dataclass(frozen=True, slots=True)
class HotPrefix:
    hash: int
    depth: int
    rate: float  # decayed requests/s through this node
    holders: tuple[str, ...]


class PrefixIndex:
    """Approximate per-worker prefix index over chained block hashes.

    Not thread-safe; one event loop owns it. All methods are synchronous and
    allocate little on the hot paths (``match``, ``insert``).
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.max_bytes = max_bytes
        self._lambda = math.log(2) / half_life_s
        self._t0 = 0.0  # time origin of the inflated hit counters
        self._root = _Node(0, None, "", 0.0)  # sentinel; holders "" means nobody
        self._nodes: dict[int, _Node] = {}
        self._entries = 0  # (node, worker) holder entries
        self._multi = 0  # entries living in nodes with several holders
        self._heap: list[tuple[float, int, _Node, str]] = []  # LRU candidate records
        self._seq = _counter()
        self._evicted = 0
        self._workers: set[str] = set()

    # ------------------------------------------------------------------ queries

    def match(self, hashes: Sequence[int], now: float, count: bool = True) -> MatchResult:
        """Per worker, the number of leading ``hashes`` it holds.

        O(blocks matched + workers dropped along the path). With ``count``, the
        request is recorded in the decayed counter of every matched node.
        """
        nodes = self._nodes
        get = nodes.get
        n = get(hashes[0]) if hashes else None
        if n is None:
            return EMPTY_MATCH
        inc = self._inflation(now) if count else 0.0
        h = n.holders
        if h.__class__ is str:
            # Fast path: one holder; follow it until it stops holding.
            blocks: dict = {}
            alive: set | None = None
            single = h
        else:
            blocks = {}
            alive = set(h)
            single = None
        depth = 0
        last = n
        for key in hashes:
            n = get(key)
            if n is None:
                break
            last = n
            if count:
                n.hits += inc
            h = n.holders
            if single is not None:
                if h.__class__ is str:
                    if h != single:
                        if single not in blocks:
                            blocks[single] = depth
                        single = None
                        alive = set()
                elif single not in h:
                    blocks[single] = depth
                    single = None
                    alive = set()
            else:
                hn = 1 if h.__class__ is str else len(h)
                if hn != len(alive):
                    # Closure: holders(child) is a subset of holders(parent).
                    if h.__class__ is str:
                        for w in alive:
                            if w != h:
                                blocks[w] = depth
                        alive = {h} if h in alive else set()
                    else:
                        for w in alive:
                            if w not in h:
                                blocks[w] = depth
                        alive = alive.intersection(h)
            depth += 1
        if single is not None:
            blocks[single] = depth
        elif alive:
            for w in alive:
                blocks[w] = depth
        rate = self._lambda * last.hits / inc if count else self._rate(last, now)
        return MatchResult(blocks, depth, rate)

    def rate(self, key: int, now: float) -> float:
        """Decayed requests/s through the node of ``key`` (0 if absent)."""
        n = self._nodes.get(key)
        return 0.0 if n is None else self._rate(n, now)

    def holders(self, key: int) -> tuple[str, ...]:
        n = self._nodes.get(key)
        if n is None:
            return ()
        h = n.holders
        return (h,) if h.__class__ is str else tuple(sorted(h))

    def hot_prefixes(self, now: float, k: int = 10, min_rate: float = 0.0) -> list[HotPrefix]:
        """The ``k`` hottest prefixes: nodes whose rate exceeds every child's.

        O(nodes); meant for ``/admin/index`` and metrics, not the request path.
        """
        scale = self._lambda * math.exp(-self._lambda * (now - self._t0))
        cands: list[tuple[float, _Node]] = []
        for n in self._nodes.values():
            r = n.hits * scale
            if r <= min_rate or r <= 0.0:
                continue
            # The deepest node that carries the rate: a child with (almost) the same
            # rate is the same hot prefix, extended.
            if any(c.hits * scale >= 0.9 * r for c in n.kid_list()):
                continue
            cands.append((r, n))
        top = heapq.nlargest(k, cands, key=lambda x: x[0])
        out = []
        for r, n in top:
            depth, p = 0, n
            while p is not self._root:
                depth += 1
                p = p.parent
            out.append(HotPrefix(n.key, depth, r, self.holders(n.key)))
        return out

    def workers(self) -> set[str]:
        return set(self._workers)

    def stats(self) -> IndexStats:
        return IndexStats(
            nodes=len(self._nodes),
            holder_entries=self._entries,
            est_bytes=self._est_bytes(),
            max_bytes=self.max_bytes,
            evicted_entries=self._evicted,
            workers=len(self._workers),
        )

    # ---------------------------------------------------------------- mutations

    def insert(
        self, worker: str, hashes: Sequence[int], now: float, parent: int | None = None
    ) -> int:
        """Records that ``worker`` holds the chain ``hashes`` (hashes[0]'s parent is
        ``parent``, None for the root). Touches the whole path from the root.

        Returns the number of blocks newly held. A chain whose parent is unknown
        (or not held by ``worker``) is dropped: closure forbids attaching it.
        May evict least recently touched leaf entries to stay within budget.
        """
        if not hashes:
            return 0
        nodes = self._nodes
        if parent is None:
            p = self._root
        else:
            p = nodes.get(parent)
            if p is None or not p.held_by(worker):
                return 0
            self._touch_up(p, worker, now)
        self._workers.add(worker)
        added = 0
        get = nodes.get
        for i, key in enumerate(hashes):
            n = get(key)
            if n is None:
                # Everything below a new node is new: build the tail in one tight loop.
                n = _Node(key, p, worker, now)
                nodes[key] = n
                p.add_kid(n)
                new = 1
                for key in hashes[i + 1 :]:
                    if key in nodes:
                        break  # a collision with another chain: stop (see below)
                    c = _Node(key, n, worker, now)
                    nodes[key] = c
                    n.kids = c
                    n = c
                    new += 1
                self._entries += new
                added += new
                p = n
                break
            elif n.parent is not p:
                # A hash reached through another parent: a 64-bit collision or a
                # caller mixing namespaces. Stop rather than corrupt the tree.
                break
            else:
                h = n.holders
                if h.__class__ is str:
                    if h == worker:
                        if now > n.t:
                            n.t = now
                    else:
                        n.holders = {h: n.t, worker: now}
                        self._entries += 1
                        self._multi += 2
                        added += 1
                else:
                    old = h.get(worker)
                    if old is None:
                        h[worker] = now
                        self._entries += 1
                        self._multi += 1
                        added += 1
                    elif now > old:
                        h[worker] = now
            p = n
        if p is not self._root:
            heapq.heappush(self._heap, (p.touch_of(worker), next(self._seq), p, worker))
        if self._est_bytes() > self.max_bytes:
            self._evict_to_budget()
        elif len(self._heap) > 2 * self._entries + 1024:
            self._compact_heap()
        return added

    def remove(self, worker: str, hashes: Iterable[int]) -> int:
        """Removes ``worker``'s entries for ``hashes`` and every descendant it holds
        (closure). Returns the number of entries removed."""
        removed = 0
        for key in hashes:
            n = self._nodes.get(key)
            if n is None or not n.held_by(worker):
                continue
            parent = n.parent
            removed += self._remove_subtree(n, worker)
            # The parent may have become a leaf entry with no valid heap record.
            t = parent.touch_of(worker) if parent is not self._root else None
            if t is not None:
                heapq.heappush(self._heap, (t, next(self._seq), parent, worker))
        return removed

    def clear(self, worker: str) -> int:
        """Removes every entry of ``worker``. O(worker's entries + their children)."""
        removed = 0
        for n in self._root.kid_list():
            if n.held_by(worker):
                removed += self._remove_subtree(n, worker)
        return removed

    def drop_worker(self, worker: str) -> int:
        """``clear`` and forget the worker."""
        removed = self.clear(worker)
        self._workers.discard(worker)
        return removed

    def apply_snapshot(
        self, worker: str, blocks: Sequence[tuple[int, int | None]], now: float
    ) -> None:
        """Replaces everything ``worker`` holds with ``blocks`` ((hash, parent)
        pairs, parents first). Blocks whose parent is missing are dropped."""
        self.clear(worker)
        self._workers.add(worker)
        for key, parent in blocks:
            self.insert(worker, (key,), now, parent)

    # ---------------------------------------------------------------- internals

    def _inflation(self, now: float) -> float:
        x = self._lambda * (now - self._t0)
        if x > _MAX_EXPONENT:
            self._renormalise(now)
            x = 0.0
        return math.exp(x)

    def _renormalise(self, now: float) -> None:
        f = math.exp(-self._lambda * (now - self._t0))
        for n in self._nodes.values():
            if n.hits:
                n.hits *= f
        self._t0 = now

    def _rate(self, n: _Node, now: float) -> float:
        return self._lambda * n.hits * math.exp(-self._lambda * (now - self._t0))

    def _est_bytes(self) -> int:
        return (
            len(self._nodes) * NODE_BYTES
            + self._multi * EXTRA_HOLDER_BYTES
            + len(self._heap) * HEAP_RECORD_BYTES
        )

    def _touch_up(self, n: _Node, w: str, now: float) -> None:
        """Touches ``w``'s entries from ``n`` up to the root (stops where already newer)."""
        root = self._root
        while n is not root:
            h = n.holders
            if h.__class__ is str:
                if n.t >= now:
                    return
                n.t = now
            else:
                if h[w] >= now:
                    return
                h[w] = now
            n = n.parent

    def _drop_entry(self, n: _Node, w: str) -> None:
        """Removes the single entry (n, w); deletes n if nobody holds it any more.
        The caller guarantees no child of n is held by w."""
        h = n.holders
        self._entries -= 1
        if h.__class__ is str:
            del self._nodes[n.key]
            n.parent.drop_kid(n)
            n.parent = None  # marks the node dead for stale heap records
            return
        t = h.pop(w)
        self._multi -= 1
        if len(h) == 1:
            (last, lt), = h.items()
            n.holders = last
            n.t = lt
            self._multi -= 1
        del t

    def _remove_subtree(self, top: _Node, w: str) -> int:
        """Removes w's entries in the subtree under ``top`` (w holds ``top``)."""
        # Post-order without recursion: collect w's entries, drop deepest first.
        stack = [top]
        order = []
        while stack:
            n = stack.pop()
            order.append(n)
            for c in n.kid_list():
                if c.held_by(w):
                    stack.append(c)
        for n in reversed(order):
            self._drop_entry(n, w)
        return len(order)

    def _evict_to_budget(self) -> None:
        root = self._root
        while self._est_bytes() > self.max_bytes:
            heap = self._heap
            if not heap:
                # Every record went stale without a leaf behind it: rebuild once.
                self._compact_heap()
                if not self._heap:
                    break
                heap = self._heap
            t, _, n, w = heapq.heappop(heap)
            if n.parent is None or n.touch_of(w) != t:
                continue  # stale: node gone or entry re-touched since
            if any(c.held_by(w) for c in n.kid_list()):
                continue  # not a leaf for w; its children's records come first
            # Evict n, then ancestors that became leaves with the same touch time.
            while True:
                parent = n.parent
                self._drop_entry(n, w)
                self._evicted += 1
                if parent is root or parent.touch_of(w) != t:
                    break
                if any(c.held_by(w) for c in parent.kid_list()):
                    break
                n = parent
        if len(self._heap) > 2 * self._entries + 1024:
            self._compact_heap()

    def _compact_heap(self) -> None:
        """Rebuilds the heap from the current leaf entries. O(entries)."""
        recs = []
        seq = self._seq
        for n in self._nodes.values():
            h = n.holders
            kids = n.kid_list()
            if h.__class__ is str:
                if not any(c.held_by(h) for c in kids):
                    recs.append((n.t, next(seq), n, h))
            else:
                for w, t in h.items():
                    if not any(c.held_by(w) for c in kids):
                        recs.append((t, next(seq), n, w))
        heapq.heapify(recs)
        self._heap = recs

    # ---------------------------------------------------------------- invariants

    def check(self) -> None:
        """Asserts every invariant in the module docstring. O(entries)."""
        root = self._root
        assert root.holders == "" and root.parent is None, f"{root=}"
        seen = 0
        entries = 0
        multi = 0
        stack = list(root.kid_list())
        while stack:
            n = stack.pop()
            seen += 1
            assert self._nodes.get(n.key) is n, f"{n=} not indexed under its hash"
            h = n.holders
            if h.__class__ is str:
                assert h, f"{n=} has no holder"
                held = {h: n.t}
            else:
                assert len(h) >= 2, f"{n=} dict holders must have >= 2 entries"
                held = h
                multi += len(h)
            entries += len(held)
            p = n.parent
            assert p is not None, f"{n=} live node without parent"
            for w, t in held.items():
                if p is not root:
                    pt = p.touch_of(w)
                    assert pt is not None, f"closure broken: {w=} holds {n=} not parent {p=}"
                    assert pt >= t, f"touch order broken for {w=}: parent {pt} < child {t}"
            for c in n.kid_list():
                assert c.parent is n, f"{c=} parent mismatch under {n=}"
                stack.append(c)
            if n.kids.__class__ is set:
                assert len(n.kids) >= 2, f"{n=} kid set must have >= 2 members"
        assert seen == len(self._nodes), f"{seen=} reachable vs {len(self._nodes)=} indexed"
        assert entries == self._entries, f"{entries=} vs counter {self._entries}"
        assert multi == self._multi, f"{multi=} vs counter {self._multi}"
        assert self._est_bytes() <= self.max_bytes or not self._heap, "over budget"
