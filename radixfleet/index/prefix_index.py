"""The router's approximate prefix index: which worker holds which prompt blocks.

Nodes are keyed by chained block hash (radixfleet.keys): because ``h_k``
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
- Per-worker counts: ``_counts[w]`` equals the number of entries w holds, for every
  known worker (``workers()`` is its key set).
- Capped workers (``set_capacity``) hold at most their cap after every mutation;
  each capped worker has its own LRU heap, every record in it is that worker's, and
  every leaf entry of that worker has a live record there (so its LRU order is exact).
  Workers the fair share has evicted from (``_tracked``) keep such a heap too; the
  workers with a heap are exactly the capped and the tracked ones.
- Within budget after every mutation (or with nothing left to evict).

Corrections. ``keep(w, hashes, k)`` truncates w's holding of one chain to its first
k blocks (a response reported only k cached blocks: w's entries for ``hashes[k:]``
and everything below them go, other workers' stay). The opposite, "w holds
``hashes[:k]``", is ``insert(w, hashes[:k], now)``: insert already adds what is
missing and touches what is there.

Eviction (the global budget, the fair share, per-worker caps) is
``radixfleet.index.eviction``'s; the colder tiers beside the tree are
``radixfleet.index.tiers``'s: both are parts of ``PrefixIndex`` (its bases), over its
state, their rules and invariants in their own docstrings.

Hot roots: each node's ``hits`` is an exponentially decayed request count kept in
"inflated" units (each request adds ``exp(lambda * (now - t0))``), so an increment
is one float add; the rate at ``now`` is ``lambda * hits * exp(-lambda*(now-t0))``
requests/s. ``t0`` moves forward (a renormalising scan) before the factor overflows.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count as _counter
from typing import TYPE_CHECKING, Any

from radixfleet.index.eviction import HEAP_RECORD_BYTES, Eviction
from radixfleet.index.tiers import COLDER_TIERS, ColderTiers
from radixfleet.policies.base import EMPTY_MATCH, MatchResult

__all__ = [
    "COLDER_TIERS",
    "DEFAULT_HALF_LIFE_S",
    "DEFAULT_MAX_BYTES",
    "EXTRA_HOLDER_BYTES",
    "HEAP_RECORD_BYTES",
    "NODE_BYTES",
    "HotPrefix",
    "IndexStats",
    "PrefixIndex",
    "tune_gc",
]

if TYPE_CHECKING:
    from radixfleet.config import IndexConfig

#: Bytes per node and per extra holder entry, measured with tracemalloc by
#: ``radixfleet bench index`` (CPython 3.11, 64-bit); the budget uses them (and
#: ``HEAP_RECORD_BYTES`` per LRU record: radixfleet.index.eviction).
NODE_BYTES = 200
EXTRA_HOLDER_BYTES = 104

DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_HALF_LIFE_S = 30.0
#: renormalise the inflated hit counters before exp() grows past e^40
_MAX_EXPONENT = 40.0


def tune_gc() -> None:
    """Raises the cyclic GC's thresholds for a process that holds a large index.

    Index nodes never outlive their removal in a cycle (``_drop_entry`` unlinks
    both directions), so reference counting frees them; but every node is a GC
    container, and with default thresholds the collector rescans millions of live
    nodes as the index grows (it more than doubles insert cost at 8 KiB prompts:
    bench/RESULTS.md "Routing work"). ``radixfleet router``, the simulator and the
    benchmarks call this once at start.
    """
    import gc

    gc.set_threshold(100_000, 50, 1000)


class _Node:
    __slots__ = ("key", "parent", "kids", "holders", "t", "hits")

    def __init__(self, key: int, parent: _Node | None, holder: str, t: float) -> None:
        self.key = key  # block hash; the node's key in PrefixIndex._nodes
        self.parent = parent  # _root for depth-1 nodes (None: _root itself)
        # kids and holders are unions the hot paths tell apart with ``x.__class__ is T``
        # (cheaper than type() or isinstance), which mypy does not narrow: typed Any,
        # their types in the comments
        self.kids: Any = None  # None | _Node | set[_Node]
        self.holders: Any = holder  # str (single holder, touch time in .t) | dict[str, float]
        self.t = t  # touch time of the single holder (unused when holders is a dict)
        self.hits = 0.0  # decayed request count, inflated units (see module docstring)

    def kid_list(self) -> tuple:
        k = self.kids
        if k is None:
            return ()
        if k.__class__ is _Node:
            return (k,)
        return tuple(k)

    def add_kid(self, kid: _Node) -> None:
        k = self.kids
        if k is None:
            self.kids = kid
        elif k.__class__ is _Node:
            self.kids = {k, kid}
        else:
            k.add(kid)

    def drop_kid(self, kid: _Node) -> None:
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
    capped_evicted_entries: int = 0  # entries evicted by per-worker caps, not the budget


@dataclass(frozen=True, slots=True)
class HotPrefix:
    hash: int
    depth: int
    rate: float  # decayed requests/s through this node
    holders: tuple[str, ...]


class PrefixIndex(Eviction, ColderTiers):
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
        self._evicted = 0  # entries evicted by the global budget
        self._capped_evicted = 0  # entries evicted by per-worker caps
        self._counts: dict[str, int] = {}  # known worker -> entries it holds
        self._caps: dict[str, int] = {}  # capped worker -> max entries (set_capacity)
        self._wheaps: dict[str, list] = {}  # capped or tracked worker -> its LRU records
        #: uncapped workers the fair share evicted from: they keep a heap in _wheaps
        self._tracked: set[str] = set()
        self._wheap_records = 0  # records in all of _wheaps (counted in the budget)
        self._init_tiers()  # the colder tiers (radixfleet.index.tiers)

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
            # read only once single is None (exactly one of the two is set); no
            # empty set allocated on the fast path
            alive: set[str] = None  # type: ignore[assignment]
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
        if count:
            seen = last.hits / inc  # decayed requests through it, this one included
            return MatchResult(blocks, depth, self._lambda * seen, seen - 1.0 < 0.5)
        rate = self._rate(last, now)
        return MatchResult(blocks, depth, rate, rate / self._lambda < 0.5)

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
            depth = 0
            p: _Node | None = n
            while p is not self._root:
                assert p is not None, f"{n=} is not under the root"
                depth += 1
                p = p.parent
            out.append(HotPrefix(n.key, depth, r, self.holders(n.key)))
        return out

    def workers(self) -> set[str]:
        return set(self._counts)

    def entries(self, worker: str) -> int:
        """Entries (blocks) ``worker`` holds. O(1)."""
        return self._counts.get(worker, 0)

    def capacity(self, worker: str) -> int | None:
        """``worker``'s cap in entries, None if uncapped."""
        return self._caps.get(worker)

    def stats(self) -> IndexStats:
        return IndexStats(
            nodes=len(self._nodes),
            holder_entries=self._entries,
            est_bytes=self._est_bytes(),
            max_bytes=self.max_bytes,
            evicted_entries=self._evicted,
            workers=len(self._counts),
            capped_evicted_entries=self._capped_evicted,
        )

    # ---------------------------------------------------------------- mutations

    def insert(self, worker: str, hashes: Sequence[int], now: float, parent: int | None = None) -> int:
        """Records that ``worker`` holds the chain ``hashes`` (hashes[0]'s parent is
        ``parent``, None for the root). Touches the whole path from the root.

        Returns the number of blocks newly held. A chain whose parent is unknown
        (or not held by ``worker``) is dropped: closure forbids attaching it.
        May evict least recently touched leaf entries to stay within budget, and a
        capped worker's own least recently touched leaf entries to stay within its
        cap (a chain longer than the cap keeps its first cap blocks).
        """
        if not hashes:
            return 0
        nodes = self._nodes
        p: _Node | None
        if parent is None:
            p = self._root
        else:
            p = nodes.get(parent)
            if p is None or not p.held_by(worker):
                return 0
            self._touch_up(p, worker, now)
        counts = self._counts
        if worker not in counts:
            counts[worker] = 0
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
        if added:
            counts[worker] += added
        if p is not self._root:
            t = p.touch_of(worker)
            assert t is not None, f"{worker=} holds {p=} it just inserted or touched"
            rec = (t, next(self._seq), p, worker)
            heapq.heappush(self._heap, rec)
            if self._wheaps:
                cap = self._caps.get(worker)
                if cap is not None:
                    self._capped_push(worker, cap, rec)
                elif worker in self._tracked:
                    self._tracked_push(worker, rec)
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
            assert parent is not None, f"live {n=} without a parent"
            removed += self._remove_subtree(n, worker)
            # The parent may have become a leaf entry with no valid heap record.
            t = parent.touch_of(worker) if parent is not self._root else None
            if t is not None:
                self._push(parent, worker, t)
        if self._est_bytes() > self.max_bytes:  # the records pushed may outweigh the entries
            self._evict_to_budget()
        return removed

    def keep(self, worker: str, hashes: Sequence[int], k: int) -> int:
        """Truncates ``worker``'s holding of the chain ``hashes`` to at most its first
        ``k`` blocks: removes its entries for ``hashes[k:]`` and every descendant of
        them it holds (other branches below ``hashes[k]`` included: the engine's prefix
        match stops where the chain stops). Other workers are untouched. Returns the
        number of entries removed. O(len(hashes) - k + entries removed).

        A correction from a response's ``cached_tokens`` (k = cached blocks): it says
        what the worker held *before* that request; the request's own prefill then
        stores the whole prompt, so a caller re-inserts the chain after keeping.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k >= len(hashes):
            return 0
        return self.remove(worker, hashes[k:])

    def touch_time(self, worker: str, key: int) -> float | None:
        """When ``worker``'s entry for ``key`` was last touched (None: not held)."""
        n = self._nodes.get(key)
        return None if n is None else n.touch_of(worker)

    def evict_older(self, worker: str, before: float) -> int:
        """Removes ``worker``'s entries last touched before ``before``. Returns the
        number removed.

        Touch monotonicity makes the removed set closed under descendants (a child
        is touched no later than its parent), so whole subtrees go and closure
        holds. A correction for an engine that evicts least recently used blocks
        first: once it is seen to have lost a block touched at ``before``, it has
        lost everything older too. O(entries of ``worker`` touched since + removed).
        """
        removed = 0
        stack = [c for c in self._root.kid_list() if c.held_by(worker)]
        while stack:
            n = stack.pop()
            t = n.touch_of(worker)
            if t < before:
                parent = n.parent
                removed += self._remove_subtree(n, worker)
                pt = parent.touch_of(worker) if parent is not self._root else None
                if pt is not None and not any(c.held_by(worker) for c in parent.kid_list()):
                    self._push(parent, worker, pt)  # a leaf now: give it an LRU record
                continue
            stack.extend(c for c in n.kid_list() if c.held_by(worker))
        if self._est_bytes() > self.max_bytes:
            self._evict_to_budget()
        return removed

    def configure(self, index: IndexConfig, now: float) -> None:
        """Takes a reloaded ``index`` section: its memory budget (a lower one is
        reached by the LRU eviction of the next inserts) and the hit counters'
        half-life. A new half-life keeps every counter's decayed value at ``now``
        and decays it at the new rate from then on (O(nodes), once)."""
        max_bytes, half_life_s = index.max_bytes, index.half_life_s
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.max_bytes = max_bytes
        lam = math.log(2) / half_life_s
        if lam != self._lambda:
            self._renormalise(now)  # the counters are their decayed values at now
            self._lambda = lam

    def set_capacity(self, worker: str, max_entries: int | None) -> int:
        """Caps ``worker`` at ``max_entries`` entries (None: uncapped). Evicts its
        least recently touched leaf entries at once if it holds more. Returns the
        number evicted. O(worker's entries) to build its LRU heap when first capped.
        """
        if max_entries is None:
            if self._caps.pop(worker, None) is not None and worker not in self._tracked:
                self._wheap_records -= len(self._wheaps.pop(worker))
            return 0
        if max_entries.__class__ is not int or max_entries < 0:
            raise ValueError(f"max_entries must be an int >= 0 or None, got {max_entries!r}")
        self._caps[worker] = max_entries
        if worker not in self._wheaps:
            self._rebuild_worker_heap(worker)
        before = self._capped_evicted
        if self._counts.get(worker, 0) > max_entries:
            self._evict_worker(worker, max_entries)
        if self._est_bytes() > self.max_bytes:  # the new heap's records count too
            self._evict_to_budget()
        return self._capped_evicted - before

    def clear(self, worker: str) -> int:
        """Removes every entry of ``worker``. O(worker's entries + their children)."""
        removed = 0
        for n in self._root.kid_list():
            if n.held_by(worker):
                removed += self._remove_subtree(n, worker)
        heap = self._wheaps.get(worker)
        if heap:  # every record in it is stale now
            self._wheap_records -= len(heap)
            heap.clear()
        return removed

    def clear_steps(self, worker: str, limit: int) -> Iterator[int]:
        """``clear`` in slices: removes ``worker``'s entries deepest first, at most
        ``limit`` per step, and yields the number removed after each step; the
        index is consistent at every yield (``check()`` holds; the one entry the
        step made a leaf gets its LRU record). Entries inserted between steps are
        removed too when they hang below what is still to be removed. O(entries
        removed) in all, so a caller can give the event loop back between steps.
        """
        root = self._root
        stack = [c for c in root.kid_list() if c.held_by(worker)]
        while stack:
            removed = 0
            while stack and removed < limit:
                n = stack[-1]
                if n.parent is None or not n.held_by(worker):
                    stack.pop()  # removed meanwhile (with its subtree)
                    continue
                kids = [c for c in n.kid_list() if c.held_by(worker)]
                if kids:
                    stack.extend(kids)
                    continue
                stack.pop()
                self._drop_entry(n, worker)
                removed += 1
            if stack:
                top = stack[-1]
                if (
                    top.parent is not None
                    and top.held_by(worker)
                    and not any(c.held_by(worker) for c in top.kid_list())
                ):
                    self._push(top, worker, top.touch_of(worker))  # a leaf now
                if self._est_bytes() > self.max_bytes:  # the record may tip it over
                    self._evict_to_budget()
            yield removed

    def drop_worker(self, worker: str) -> int:
        """``clear`` and forget the worker (its cap, a setting, is kept), and its
        parts: a holder named ``"<worker>#<part>"`` holds one part of the worker's
        cache (a data-parallel rank of its engine: radixfleet.engines.link), and what
        ends the worker's cache ends its parts' (worker ids never contain ``#``).
        O(worker's entries + known workers)."""
        prefix = worker + "#"
        removed = 0
        tiered = {w for ws in self._tiers.values() for w in ws}
        for holder in [worker, *(w for w in self._counts.keys() | tiered if w.startswith(prefix))]:
            removed += self.clear(holder) + self.clear_tiers(holder)
            self._counts.pop(holder, None)
            if holder in self._tracked:
                self._tracked.discard(holder)
                if holder not in self._caps:
                    self._wheaps.pop(holder)  # emptied by clear
        return removed

    def apply_snapshot(self, worker: str, blocks: Sequence[tuple[int, int | None]], now: float) -> None:
        """Replaces everything ``worker`` holds with ``blocks`` ((hash, parent)
        pairs, parents first). Blocks whose parent is missing are dropped."""
        self.clear(worker)
        self._counts.setdefault(worker, 0)
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
            + (len(self._heap) + self._wheap_records) * HEAP_RECORD_BYTES
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
            p = n.parent
            assert p is not None, f"live {n=} without a parent"
            n = p

    def _drop_entry(self, n: _Node, w: str) -> None:
        """Removes the single entry (n, w); deletes n if nobody holds it any more.
        The caller guarantees no child of n is held by w."""
        h = n.holders
        self._entries -= 1
        self._counts[w] -= 1
        if h.__class__ is str:
            del self._nodes[n.key]
            p = n.parent
            assert p is not None, f"live {n=} without a parent"
            p.drop_kid(n)
            n.parent = None  # marks the node dead for stale heap records
            return
        t = h.pop(w)
        self._multi -= 1
        if len(h) == 1:
            ((last, lt),) = h.items()
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

    # ---------------------------------------------------------------- invariants

    def check(self) -> None:
        """Asserts every invariant in the module docstring. O(entries)."""
        root = self._root
        assert root.holders == "" and root.parent is None, f"{root=}"
        seen = 0
        entries = 0
        multi = 0
        per_worker: dict[str, int] = {}
        capped_leaves: set[tuple[int, str]] = set()  # (id(node), w) leaf entries of capped w
        caps = self._caps
        wheaps = self._wheaps
        stack: list[_Node] = list(root.kid_list())
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
                per_worker[w] = per_worker.get(w, 0) + 1
                if w in wheaps and not any(c.held_by(w) for c in n.kid_list()):
                    capped_leaves.add((id(n), w))
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
        for w, c in self._counts.items():
            assert per_worker.get(w, 0) == c, f"{w=} holds {per_worker.get(w, 0)} entries, counted {c}"
        unknown = set(per_worker) - set(self._counts)
        assert not unknown, f"workers {unknown} hold entries but are not known"
        assert set(wheaps) == set(caps) | self._tracked, (
            f"heaps for {set(wheaps)} vs caps {set(caps)} and tracked {self._tracked}"
        )
        assert self._tracked <= set(self._counts), f"tracked {self._tracked} not known"
        assert self._wheap_records == sum(map(len, self._wheaps.values())), "worker heap count"
        live: set[tuple[int, str]] = set()
        for w, cap in caps.items():
            assert self._counts.get(w, 0) <= cap, f"{w=} holds {self._counts.get(w, 0)} > cap {cap}"
        for w in wheaps:
            for t, _, n, rw in wheaps[w]:
                assert rw == w, f"record of {rw=} in {w=}'s heap"
                if n.parent is not None and n.touch_of(w) == t:
                    live.add((id(n), w))
        self._check_tiers()
        missing = capped_leaves - live
        assert not missing, f"{len(missing)} capped leaf entries without a live heap record"
        assert self._est_bytes() <= self.max_bytes or not self._heap, "over budget"
