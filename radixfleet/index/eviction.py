"""The prefix index's eviction: the global memory budget, the fair share between
workers and per-worker caps (``radixfleet.index.prefix_index.PrefixIndex``'s base; it works on
the index's own state, whose invariants ``PrefixIndex.check`` asserts).

Memory: one global budget (``max_bytes``) for the whole index, never one per
worker (smg #2137). The estimate counts nodes and extra holder entries at sizes
measured with tracemalloc (``bench index``). Over budget, the least recently
touched *leaf* holder entries go first: a min-heap of (touch time, node, worker)
records, one pushed per inserted chain end; stale records (re-touched or removed
entries) are skipped when popped and compacted away when the heap outgrows the
entries. Evicting an entry walks up and evicts ancestors that became leaves with
the same touch time, so one insert's chain leaves together, deepest first.

Fair share. The budget is shared, but no worker may crowd the others out of it: a
worker flooding the index (one serving a model nobody asks for, or a broken agent)
once evicted every other worker's entries. When the least recently touched leaf
belongs to a worker holding under half the mean of the workers holding any (its
fair share of what fits), that entry stays and the worker holding the most entries
loses its own least recently touched leaf instead. So every worker keeps at least
half the mean while another holds more, and a flood evicts its own entries; the
budget the others leave free stays usable (work-conserving), and workers near the
mean share one LRU as before (the half keeps ordinary imbalance off the slower
path). Such a largest worker gets its own LRU heap (as a capped one has), built
once from its leaves (O(its entries)) and kept until it is dropped; choosing it
costs O(workers).

Per-worker capacity. A worker whose entries are only the router's own guesses (an
engine that sends no cache events) must not look warmer than its engine can be:
``set_capacity(w, n)`` caps w at n entries (the engine's KV capacity in blocks), and
over the cap w's least recently touched *leaf* entries go first, by the same rules
as the global budget (deepest first, whole chains of one touch time together, closure
and touch monotonicity kept), independent of other workers. A capped worker's chain
ends are pushed on its own heap as well as the global one (which still enforces
``max_bytes`` over everything); an uncapped worker's insert pays only its count
update and one truthiness test.
A cap is a setting, not state: ``clear`` and ``drop_worker`` keep it (a worker that
comes back healthy is still capped); ``set_capacity(w, None)`` removes it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

#: bytes per LRU heap record, measured with tracemalloc by ``radixfleet bench index``
#: (CPython 3.11, 64-bit); the budget counts them
HEAP_RECORD_BYTES = 96


class Eviction:
    """Eviction over ``PrefixIndex``'s state (module docstring). Only the index
    calls these methods, on itself."""

    # the index's state these methods keep (``PrefixIndex.__init__`` sets it)
    max_bytes: int
    _root: Any  # the tree's sentinel node
    _nodes: dict[int, Any]
    _entries: int
    _heap: list[tuple[float, int, Any, str]]
    _seq: Iterator[int]
    _evicted: int
    _capped_evicted: int
    _counts: dict[str, int]
    _caps: dict[str, int]
    _wheaps: dict[str, list]
    _tracked: set[str]
    _wheap_records: int
    # the index's own node bookkeeping these methods use
    _drop_entry: Callable[[Any, str], None]
    _est_bytes: Callable[[], int]

    def _evict_to_budget(self) -> None:
        root = self._root
        counts = self._counts
        holding = sum(1 for c in counts.values() if c)  # workers holding entries
        # records of under-share workers passed over (pushed back at the end)
        kept: list[tuple[float, int, Any, str]] = []
        while self._est_bytes() + len(kept) * HEAP_RECORD_BYTES > self.max_bytes:
            heap = self._heap
            if not heap:
                # Every record went stale without a leaf behind it: rebuild once.
                self._compact_heap()
                if not self._heap:
                    for w in self._wheaps:  # what is left may be stale capped records
                        self._rebuild_worker_heap(w)
                    break
                heap = self._heap
            t, _, n, w = heapq.heappop(heap)
            if n.parent is None or n.touch_of(w) != t:
                continue  # stale: node gone or entry re-touched since
            if any(c.held_by(w) for c in n.kid_list()):
                continue  # not a leaf for w; its children's records come first
            if 2 * counts[w] * holding < self._entries:
                # w holds under half its fair share: the largest holder pays instead
                kept.append((t, _, n, w))
                self._evict_largest()
                holding = sum(1 for c in counts.values() if c)
                continue
            # Evict n, then ancestors that became leaves with the same touch time.
            while True:
                parent = n.parent
                self._drop_entry(n, w)
                self._evicted += 1
                if parent is root:
                    break
                pt = parent.touch_of(w)
                if pt != t:
                    heap_w = self._wheaps.get(w)
                    if heap_w is not None and not any(c.held_by(w) for c in parent.kid_list()):
                        # a capped worker's new leaf may have no record in its own heap
                        # (it was no leaf when the heap was built): keep its LRU exact
                        heapq.heappush(heap_w, (pt, next(self._seq), parent, w))
                        self._wheap_records += 1
                    break
                if any(c.held_by(w) for c in parent.kid_list()):
                    break
                n = parent
            if not counts[w]:
                holding -= 1
        for rec in kept:
            heapq.heappush(self._heap, rec)
        if len(self._heap) > 2 * self._entries + 1024:
            self._compact_heap()

    def _evict_largest(self) -> None:
        """Evicts the least recently touched leaf entry of the worker holding the most
        entries (the fair share's victim), through its own heap (built the first time).
        O(workers + log its records)."""
        counts = self._counts
        big = max(counts, key=counts.__getitem__)
        if big not in self._wheaps:
            self._tracked.add(big)
            self._rebuild_worker_heap(big)
        before = self._capped_evicted
        self._evict_worker(big, counts[big] - 1)
        moved = self._capped_evicted - before
        self._capped_evicted -= moved
        self._evicted += moved

    def _tracked_push(self, w: str, rec: tuple) -> None:
        """A tracked worker's own record of an insert's chain end (compacted as its
        heap outgrows its entries)."""
        heap = self._wheaps[w]
        heapq.heappush(heap, rec)
        self._wheap_records += 1
        if len(heap) > 2 * self._counts[w] + 1024:
            self._rebuild_worker_heap(w)

    def _push(self, n: Any, w: str, t: float) -> None:
        """Records (n, w) touched at t as an LRU candidate, in w's heap too if capped."""
        rec = (t, next(self._seq), n, w)
        heapq.heappush(self._heap, rec)
        heap = self._wheaps.get(w)
        if heap is not None:
            heapq.heappush(heap, rec)
            self._wheap_records += 1

    def _capped_push(self, w: str, cap: int, rec: tuple) -> None:
        """The capped part of ``insert``: w's own record, then its cap or compaction."""
        heap = self._wheaps[w]
        heapq.heappush(heap, rec)
        self._wheap_records += 1
        c = self._counts[w]
        if c > cap:
            self._evict_worker(w, cap)
        elif len(heap) > 2 * c + 1024:
            self._rebuild_worker_heap(w)

    def _evict_worker(self, w: str, cap: int) -> None:
        """Evicts w's least recently touched leaf entries until it holds ``cap``."""
        root = self._root
        counts = self._counts
        heap = self._wheaps[w]
        rebuilt = False
        while counts.get(w, 0) > cap:
            if not heap:
                # A leaf lost its record (cannot happen while check() holds): rebuild once.
                assert not rebuilt, f"{w=} over its cap with no leaf entries"
                self._rebuild_worker_heap(w)
                heap = self._wheaps[w]
                rebuilt = True
                continue
            t, _, n, _w = heapq.heappop(heap)
            self._wheap_records -= 1
            if n.parent is None or n.touch_of(w) != t:
                continue  # stale: node gone or entry re-touched since
            if any(c.held_by(w) for c in n.kid_list()):
                continue  # not a leaf for w; its children's records come first
            while True:
                parent = n.parent
                self._drop_entry(n, w)
                self._capped_evicted += 1
                if parent is root:
                    break
                pt = parent.touch_of(w)
                if any(c.held_by(w) for c in parent.kid_list()):
                    break
                if pt != t or counts[w] <= cap:
                    # parent is a leaf now; give it a record (it may have none: it
                    # was never a chain end) so the LRU order stays exact
                    self._push(parent, w, pt)
                    break
                n = parent
        if len(heap) > 2 * counts.get(w, 0) + 1024:
            self._rebuild_worker_heap(w)

    def _rebuild_worker_heap(self, w: str) -> None:
        """Rebuilds w's heap from its leaf entries. O(w's entries + their children)."""
        recs = []
        seq = self._seq
        stack = [c for c in self._root.kid_list() if c.held_by(w)]
        while stack:
            n = stack.pop()
            leaf = True
            for c in n.kid_list():
                if c.held_by(w):
                    stack.append(c)
                    leaf = False
            if leaf:
                recs.append((n.touch_of(w), next(seq), n, w))
        heapq.heapify(recs)
        old = self._wheaps.get(w)
        self._wheap_records += len(recs) - (len(old) if old is not None else 0)
        self._wheaps[w] = recs

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
