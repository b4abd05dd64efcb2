"""A token radix KV cache in the manner of SGLang's RadixAttention.

Layout (one tree per namespace; a namespace is any hashable, the agent uses
``(model, tenant, adapter)`` -- different tenants or LoRA adapters never share KV)::

    roots[ns] --+-- [t0 t1 t2 t3]  (edge: a run of tokens)
                |        +-- [t4 t5]            <- leaf: evictable when unlocked
                |        '-- [t9]
                '-- [u0 u1]

Keys are sequences of ints in ``[0, 2**64)``; the agent uses byte-chunk tokens, the
offline simulator block ids repeated per token. Only KV *sizes* are modelled, so a
node's value is the length of its edge.

Representation: every key is held as an ``array('Q')`` (``as_key``), so slicing an
edge is one memcpy and comparing two runs is one memcmp: a walk costs O(depth)
Python operations plus C work linear in the tokens compared, never a Python
operation (or an int object) per token. Callers that pass ``array('Q')`` keys are
never copied on entry; any other sequence is converted once per call.

Invariants (``check()`` asserts every one):

- every edge is an ``array('Q')`` owned by its node, non-empty, a multiple of
  ``page_size`` long, and keyed in its parent's ``children`` by its first page;
  siblings differ in their first page;
- ``node.start`` is the token depth of the node's first token;
- a locked node's ancestors are locked: ``parent.lock_ref >= child.lock_ref``;
- ``total_tokens`` = sum of edge lengths; ``evictable_tokens`` = sum over unlocked
  nodes; ``locked_tokens`` = sum over locked nodes; ``protected_tokens`` = sum over
  nodes in the protected segment, never above ``protected_capacity``;
- the LRU sets hold exactly the unlocked leaves (protected ones in their own set),
  ordered by last access tick; only leaves are ever evicted, oldest first;
- router-space block hashes: block ``j`` (1-based, ``hash_stride`` tokens each) ends
  at token ``j*hash_stride``; its hash lives in the node whose span holds the
  block's last token. Along every root-to-leaf path the held blocks are 1..m with
  no gap (the keyed region is prefix-closed).

Every mutation that changes which router blocks are held appends an exact event
(``radixfleet.wire.events.Stored`` / ``Removed`` / ``Cleared``) to the event log that the
reporter drains; splits change nothing the router can see and emit nothing.
``removals_pending`` is True exactly while the log holds a ``Removed`` or ``Cleared``
(the reporter sends those at once: ``radixfleet_tools.agent.reporter``).

Admission control (``AdmissionConfig.mode``) decides how much of an ``insert``
joins the tree when the caller asks for admission (``admit_from`` not None):

``always``      everything.
``second_hit``  the first sighting of a prefix only records its chained block
                digests in a bounded ghost list; a prefix earns residency on its
                second sighting (scan resistance: a one-off 100k prompt is never
                kept, so it cannot flush a hot system prompt).
``min_prefix``  sequences shorter than ``min_prefix_tokens`` are not kept.
``protected``   everything is admitted; nodes that a later request reuses move to a
                protected segment (at most ``protected_fraction`` of the pool) that
                eviction touches only when no probationary leaf is left (SLRU).

Tokens already in the tree are always kept; a refusal emits ``Removed`` for the
refused blocks (the router may have inserted them optimistically).

A configuration fingerprint change (RoPE scaling, context extension, position
scheme) makes every cached KV wrong: ``set_fingerprint`` flushes the whole tree.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from sortedcontainers import SortedDict

from radixfleet.wire.events import Cleared, Removed, Stored

ADMISSION_MODES = ("always", "second_hit", "min_prefix", "protected")
#: the typecode of cache keys: unsigned 64-bit tokens
KEY_TYPECODE = "Q"


def as_key(tokens: Sequence[int]) -> array:
    """``tokens`` as a cache key (``array('Q')``): the object itself when it already is
    one (no copy; the cache never mutates a caller's key), else a converted copy.
    O(1) or O(n); raises ``OverflowError`` for a token outside ``[0, 2**64)``."""
    if type(tokens) is array and tokens.typecode == KEY_TYPECODE:
        return tokens
    return array(KEY_TYPECODE, tokens)


@dataclass(slots=True)
class AdmissionConfig:
    """How insertions earn residency (see the module docstring)."""

    mode: str = "always"
    #: ``min_prefix``: shortest sequence worth keeping
    min_prefix_tokens: int = 0
    #: ``protected``: share of the pool the protected segment may hold
    protected_fraction: float = 0.5
    #: ``second_hit``: tokens per ghost digest, and how many digests are remembered
    ghost_block_tokens: int = 16
    ghost_capacity: int = 1 << 16

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"admission mode {self.mode!r} is not one of {', '.join(ADMISSION_MODES)}")
        if self.min_prefix_tokens < 0:
            raise ValueError("min_prefix_tokens must be >= 0")
        if not 0.0 < self.protected_fraction <= 1.0:
            raise ValueError("protected_fraction must be in (0, 1]")
        if self.ghost_block_tokens <= 0 or self.ghost_capacity <= 0:
            raise ValueError("ghost_block_tokens and ghost_capacity must be positive")


class Node:
    """One edge of the tree. Only ``RadixCache`` mutates nodes."""

    __slots__ = (
        "id",
        "tokens",
        "children",
        "parent",
        "start",
        "lock_ref",
        "tick",
        "hashes",
        "protected",
        "hits",
        "in_lru",
        "ns",
    )

    def __init__(self, tokens: array, parent: Node | None, start: int, nid: int) -> None:
        self.id = nid
        #: the edge's tokens (an ``array('Q')`` owned by this node)
        self.tokens = tokens
        #: first page (page_size 1: first token) -> child
        self.children: dict = {}
        self.parent = parent
        #: token depth of key[0]
        self.start = start
        #: running requests whose path passes here (ancestors hold at least as many)
        self.lock_ref = 0
        #: last access, a cache-wide counter (unique per touch: deterministic LRU)
        self.tick = 0
        #: router block hashes of the blocks whose last token lies in this edge
        self.hashes: list[int] = []
        #: in the protected segment (admission mode ``protected``)
        self.protected = False
        #: how many match_prefix calls reused this node
        self.hits = 0
        #: currently in one of the LRU sets (an unlocked leaf)
        self.in_lru = False
        #: the namespace (set on roots only)
        self.ns: Hashable = None

    @property
    def key(self) -> list[int]:
        """The edge's tokens as a list (for tests and debugging). O(len)."""
        return self.tokens.tolist()

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, start={self.start}, len={len(self.tokens)}, "
            f"lock={self.lock_ref}, tick={self.tick}, children={len(self.children)})"
        )


@dataclass(slots=True)
class CacheStats:
    """Monotone counters; the agent exports them as Prometheus counters."""

    inserted_tokens: int = 0
    evicted_tokens: int = 0
    evicted_nodes: int = 0
    #: insertions cut short by admission control, and the tokens they left out
    refusals: int = 0
    refused_tokens: int = 0
    flushes: int = 0


class RadixCache:
    """Token radix tree with lock refs, exact LRU leaf eviction and admission control.

    Args:
        page_size: match/insert granularity in tokens (1: a match may end anywhere).
        hash_stride: tokens per router block (``block_bytes // BYTES_PER_TOKEN``);
            None disables router hashes and events.
        capacity_tokens: the KV pool size (sizes the protected segment).
        admission: the admission policy; default ``always``.
        fingerprint: the engine configuration the cached KV was computed under.
        record_events: keep the event log (the simulator may turn it off).
        disabled: keep nothing (SGLang's ``--disable-radix-cache``): every
            admission-controlled insert is refused, so the tree stays empty, every
            match is 0, and the refused blocks go out as ``Removed`` (the router's
            optimistic hints are corrected). Inserts with ``admit_from=None`` (the
            reference caches' use) are not admission-controlled and still insert.
    """

    def __init__(
        self,
        *,
        page_size: int = 1,
        hash_stride: int | None = None,
        capacity_tokens: int = 0,
        admission: AdmissionConfig | None = None,
        fingerprint: Hashable = None,
        record_events: bool = True,
        disabled: bool = False,
    ) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        if hash_stride is not None and hash_stride <= 0:
            raise ValueError("hash_stride must be positive or None")
        self.page_size = page_size
        self.disabled = disabled
        self.hash_stride = hash_stride
        self.capacity_tokens = capacity_tokens
        self.admission = admission or AdmissionConfig()
        self.fingerprint = fingerprint
        self.record_events = record_events and hash_stride is not None
        self.stats = CacheStats()
        self._ids = itertools.count(1)
        self._tick = 0
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._mode = self.admission.mode
        self._clear_state()

    def _clear_state(self) -> None:
        self.roots: dict[Hashable, Node] = {}
        #: token counts, kept exactly (see invariants)
        self.total_tokens = 0
        self.evictable_tokens = 0
        self.locked_tokens = 0
        self.protected_tokens = 0
        # (tick, id) -> node: unlocked leaves, oldest first
        self._lru: SortedDict = SortedDict()
        self._lru_protected: SortedDict = SortedDict()
        self._events: list = []
        #: whether ``_events`` holds a ``Removed`` or ``Cleared``
        self._removals = False
        self._ghost.clear()

    @property
    def protected_capacity(self) -> int:
        if self._mode != "protected":
            return 0
        return int(self.capacity_tokens * self.admission.protected_fraction)

    # ------------------------------------------------------------------ helpers

    def _page_key(self, key: array, pos: int):
        return key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])

    def _common(self, a: array, b: array) -> int:
        """Length of the common prefix of a and b, rounded down to a page.
        O(n log n) bytes compared in C, O(log n) Python steps."""
        lo, hi = 0, min(len(a), len(b))
        # invariant: a[:lo] == b[:lo]; the answer is < hi+1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo - lo % self.page_size

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _lru_set(self, node: Node) -> SortedDict:
        return self._lru_protected if node.protected else self._lru

    def _lru_add(self, node: Node) -> None:
        node.in_lru = True
        self._lru_set(node)[(node.tick, node.id)] = node

    def _lru_discard(self, node: Node) -> None:
        if node.in_lru:
            del self._lru_set(node)[(node.tick, node.id)]
            node.in_lru = False

    def _touch(self, node: Node) -> None:
        if node.in_lru:
            self._lru_discard(node)
            node.tick = self._next_tick()
            self._lru_add(node)
        else:
            node.tick = self._next_tick()

    def _walk(self, ns: Hashable, key: array, split: bool, n: int | None = None, below: Node | None = None):
        """Longest match of ``key[:n]``: (length, deepest node, path). May split a node.
        O(depth) Python steps; each edge is compared with one slice equality.
        ``below`` (see ``insert``): the walk resumes there; the path still lists
        every node from the root's child down, as a walk from the root would."""
        root = self.roots.get(ns)
        if root is None:
            return 0, None, []
        if n is None or n > len(key):
            n = len(key)
        path: list[Node] = []
        if below is None:
            node, pos = root, 0
        else:
            p = below
            while p.parent is not None:
                path.append(p)
                p = p.parent
            if p is not root or below is root:
                raise ValueError(
                    f"insert(below=...): {below!r} is not in the tree of {ns!r}; "
                    "pass a node this namespace holds (a locked one stays)"
                )
            path.reverse()
            node, pos = below, below.start + len(below.tokens)
            if pos > n:
                raise ValueError(f"insert(below=...): {below!r} ends past the key ({n} tokens)")
        get_page = self._page_key if self.page_size > 1 else None
        while pos < n:
            child = node.children.get(key[pos] if get_page is None else get_page(key, pos))
            if child is None:
                break
            ckey = child.tokens
            end = pos + len(ckey)
            if end <= n:
                seg = key[pos:end]
                if seg == ckey:
                    pos = end
                    node = child
                    path.append(child)
                    continue
            else:
                seg = key[pos:n]
            m = self._common(seg, ckey)
            if m == 0:
                break
            if split:
                node = self._split(child, m)
                path.append(node)
            else:
                path.append(child)
            pos += m
            break
        return pos, node, path

    def _split(self, child: Node, k: int) -> Node:
        """Cuts ``child`` after ``k`` tokens; returns the new upper node. Emits nothing."""
        parent = child.parent
        assert parent is not None, f"only a root has no parent: {child=}"
        ckey = child.tokens
        upper = Node(ckey[:k], parent, child.start, next(self._ids))
        upper.lock_ref = child.lock_ref
        upper.tick = child.tick
        upper.protected = child.protected
        upper.hits = child.hits
        if self.hash_stride is not None and child.hashes:
            s = self.hash_stride
            n_up = min(len(child.hashes), (child.start + k) // s - child.start // s)
            upper.hashes = child.hashes[:n_up]
            child.hashes = child.hashes[n_up:]
        parent.children[self._page_key(ckey, 0)] = upper
        child.tokens = ckey = ckey[k:]
        child.start += k
        child.parent = upper
        upper.children[self._page_key(ckey, 0)] = child
        return upper

    def _parent_hash(self, node: Node) -> int | None:
        p = node.parent
        while p is not None:
            if p.hashes:
                return p.hashes[-1]
            p = p.parent
        return None

    # --------------------------------------------------------------- public API

    def match_prefix(
        self, ns: Hashable, key: Sequence[int], limit: int | None = None
    ) -> tuple[int, Node | None]:
        """Longest cached prefix of ``key[:limit]``: ``(tokens, last node)``.
        O(depth) Python steps + O(tokens compared) in C (see ``as_key``).

        Side effects: may split a node so that the returned node ends exactly at
        the match; touches the path (LRU); counts a hit on every matched node and,
        in ``protected`` mode, promotes reused nodes into the protected segment.
        The node is None when the namespace holds nothing; lock it with
        ``inc_lock_ref`` to keep the prefix resident.
        """
        n, node, path = self._walk(ns, as_key(key), True, limit)
        if not path:
            return 0, None
        first_tick = self._tick + 1
        for p in path:
            self._touch(p)
            p.hits += 1
        if self._mode == "protected":
            for p in path:
                if not p.protected:
                    self._protect(p, first_tick)
        return n, node

    def peek(self, ns: Hashable, key: Sequence[int], limit: int | None = None) -> int:
        """Length of the longest cached prefix of ``key[:limit]``; no side effects.
        O(depth) + C."""
        return self._walk(ns, as_key(key), False, limit)[0]

    def unheld_hashes(self, ns: Hashable, key: Sequence[int], hashes: Sequence[int]) -> list[int]:
        """The router block hashes of ``key`` that the tree does not hold."""
        if self.hash_stride is None:
            return []
        return list(hashes[self.peek(ns, key) // self.hash_stride :])

    def report_unheld(self, ns: Hashable, key: Sequence[int], hashes: Sequence[int]) -> None:
        """Emits ``Removed`` for the blocks of ``key`` the tree does not hold (the
        router inserted them optimistically for a request that never cached them)."""
        if self.record_events:
            gone = self.unheld_hashes(ns, key, hashes)
            if gone:
                self._append_removed(gone)

    def insert(
        self,
        ns: Hashable,
        key: Sequence[int],
        hashes: Sequence[int] | None = None,
        *,
        admit_from: int | None = None,
        below: Node | None = None,
        lock: bool = False,
    ) -> tuple[int, Node | None]:
        """Makes ``key`` resident (as admission allows): ``(held tokens, node)``.

        ``hashes`` are the router block hashes of ``key`` (block j ends at token
        ``j*hash_stride``; the list may stop early -- the rest is not keyed).
        ``admit_from``: None inserts everything; otherwise admission control decides
        about ``key[admit_from:]`` (``key[:admit_from]`` was decided by an earlier
        call for the same request, so its sightings are not counted twice).
        Returns the length now held and the node ending exactly there (lock it to
        pin it). Side effects: may split one node, adds at most one leaf, emits
        ``Stored`` for the new leaf's blocks and ``Removed`` for refused blocks.
        O(depth) Python steps + O(len(key)) in C.

        ``below``: a node of this tree whose path from the root spells ``key[:d]``
        for its end depth ``d`` -- the node a request holds a lock on after matching
        or inserting a prefix of ``key`` (a locked node stays in the tree, and a
        split keeps its end depth). The walk resumes there, so only ``key[d:]`` is
        compared; the result and every side effect are those of a walk from the
        root. Raises ``ValueError`` for a node not in the tree or past the key.
        ``lock``: also ``inc_lock_ref`` the returned node (a new leaf then never
        passes through the LRU set: the same state, two sorted-set updates fewer).
        """
        key = as_key(key)
        page = self.page_size
        if page > 1 and len(key) % page:
            key = key[: len(key) - len(key) % page]
        root = self.roots.get(ns)
        if root is None:
            if not key:
                return 0, None
            root = self.roots[ns] = Node(array(KEY_TYPECODE), None, 0, next(self._ids))
            root.ns = ns
        m, node, path = self._walk(ns, key, True, None, below)
        for p in path:
            self._touch(p)
        limit = len(key) if admit_from is None else max(m, self._admit(ns, key, admit_from))
        limit -= limit % page
        if limit > m:
            new = Node(key[m:limit], node, m, next(self._ids))
            new.tick = self._next_tick()
            if hashes and self.hash_stride is not None:
                s = self.hash_stride
                new.hashes = list(hashes[m // s : min(limit // s, len(hashes))])
            self._lru_discard(node)  # no longer a leaf
            node.children[self._page_key(new.tokens, 0)] = new
            size = limit - m
            self.total_tokens += size
            self.evictable_tokens += size
            self.stats.inserted_tokens += size
            if not lock:  # else locked below, before anyone can see it in the LRU
                self._lru_add(new)
            if new.hashes and self.record_events:
                self._events.append(Stored(self._parent_hash(new), list(new.hashes)))
            node = new
        if limit < len(key):
            self.stats.refusals += 1
            self.stats.refused_tokens += len(key) - limit
            if hashes and self.record_events:
                assert self.hash_stride is not None, "record_events implies a hash_stride"
                gone = list(hashes[limit // self.hash_stride :])
                if gone:
                    self._events.append(Removed(gone))
                    self._removals = True
        if not root.children:
            del self.roots[ns]
            return 0, None
        node = node if limit else None
        if lock:
            self.inc_lock_ref(node)
        return limit, node

    def inc_lock_ref(self, node: Node | None) -> None:
        """Locks ``node`` and its ancestors against eviction. O(depth)."""
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                size = len(node.tokens)
                self.evictable_tokens -= size
                self.locked_tokens += size
                self._lru_discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Node | None) -> None:
        """Undoes one ``inc_lock_ref(node)``. O(depth)."""
        while node is not None and node.parent is not None:
            assert node.lock_ref > 0, f"dec_lock_ref on an unlocked node: {node=}"
            if node.lock_ref == 1:
                size = len(node.tokens)
                self.evictable_tokens += size
                self.locked_tokens -= size
                if not node.children:
                    self._lru_add(node)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, n_tokens: int) -> int:
        """Evicts unlocked leaves, least recently used first, until ``n_tokens`` are
        freed or nothing is evictable; returns the tokens freed (whole leaves, so it
        may exceed the ask). Probationary leaves go before protected ones.
        O(k log n) for k leaves evicted; a parent left childless becomes a leaf in turn.
        """
        freed = 0
        while freed < n_tokens:
            if self._lru:
                _, node = self._lru.popitem(0)
            elif self._lru_protected:
                _, node = self._lru_protected.popitem(0)
            else:
                break
            node.in_lru = False
            freed += self._delete_leaf(node)
        return freed

    def _delete_leaf(self, node: Node) -> int:
        size = len(node.tokens)
        parent = node.parent
        assert parent is not None, f"only a root has no parent, and a root is no leaf: {node=}"
        del parent.children[self._page_key(node.tokens, 0)]
        self.total_tokens -= size
        self.evictable_tokens -= size
        if node.protected:
            self.protected_tokens -= size
        self.stats.evicted_tokens += size
        self.stats.evicted_nodes += 1
        if node.hashes and self.record_events:
            self._append_removed(node.hashes)
        node.parent = None
        if parent.parent is None:
            if not parent.children:
                del self.roots[parent.ns]
        elif not parent.children and parent.lock_ref == 0:
            self._lru_add(parent)
        return size

    def _append_removed(self, hashes: list[int]) -> None:
        self._removals = True
        ev = self._events
        if ev and type(ev[-1]) is Removed:
            ev[-1].hashes.extend(hashes)
        else:
            ev.append(Removed(list(hashes)))

    def flush(self) -> bool:
        """Drops the whole tree (``Cleared``); refused (False) while any node is locked."""
        if self.locked_tokens:
            return False
        self._clear_state()
        self.stats.flushes += 1
        if self.record_events:
            self._events.append(Cleared())
            self._removals = True
        return True

    def set_fingerprint(self, fingerprint: Hashable) -> bool:
        """Adopts a new engine configuration; a different one flushes everything.

        Returns True when the tree was flushed. Raises ``RuntimeError`` while
        requests hold locks (drain the engine first: their KV is about to be wrong).
        """
        if fingerprint == self.fingerprint:
            return False
        if self.locked_tokens:
            raise RuntimeError("cannot change the engine fingerprint while requests run; drain first")
        self.fingerprint = fingerprint
        self.flush()
        return True

    @property
    def pending_events(self) -> int:
        """Events logged since the last drain."""
        return len(self._events)

    @property
    def removals_pending(self) -> bool:
        """Whether the events since the last drain remove blocks (``Removed``,
        ``Cleared``): what a router's index holds and this tree no longer does."""
        return self._removals

    def drain_events(self) -> list:
        """The events since the last drain, oldest first."""
        ev, self._events = self._events, []
        self._removals = False
        return ev

    def snapshot_blocks(self) -> list[tuple[int, int | None]]:
        """Every held router block as ``(hash, parent)``, parents first. O(nodes)."""
        out: list[tuple[int, int | None]] = []
        for root in self.roots.values():
            stack: list[tuple[Node, int | None]] = [(c, None) for c in root.children.values()]
            while stack:
                node, parent = stack.pop()
                for h in node.hashes:
                    out.append((h, parent))
                    parent = h
                stack.extend((c, parent) for c in node.children.values())
        return out

    # ------------------------------------------------------------- admission

    def _admit(self, ns: Hashable, key: array, start: int) -> int:
        """How far into ``key`` admission lets the tree grow (>= start)."""
        if self.disabled:
            return start
        mode = self._mode
        if mode == "always" or mode == "protected":
            return len(key)
        if mode == "min_prefix":
            return len(key) if len(key) >= self.admission.min_prefix_tokens else start
        # second_hit: chained digests of ghost blocks; residency needs a prior sighting
        g = self.admission.ghost_block_tokens
        ghost, cap = self._ghost, self.admission.ghost_capacity
        h = hash(("ghost", ns))
        admitted, ok = start, True
        for i in range(0, len(key), g):
            end = min(i + g, len(key))
            h = hash((h, key[i:end].tobytes()))
            if end <= start:
                continue
            if h in ghost:
                ghost.move_to_end(h)
                if ok:
                    admitted = end
            else:
                ok = False
                ghost[h] = None
                if len(ghost) > cap:
                    ghost.popitem(last=False)
        return admitted

    def _protect(self, node: Node, path_tick: int) -> None:
        """Moves a reused node into the protected segment, demoting the segment's
        least recently used unlocked leaves to make room; never demotes the path
        being promoted (ticks >= path_tick). No room: the node stays probationary."""
        size = len(node.tokens)
        cap = self.protected_capacity
        while self.protected_tokens + size > cap and self._lru_protected:
            (tick, _), victim = self._lru_protected.peekitem(0)
            if tick >= path_tick:
                break
            self._lru_discard(victim)
            victim.protected = False
            self.protected_tokens -= len(victim.tokens)
            self._lru_add(victim)
        if self.protected_tokens + size > cap:
            return
        was_in = node.in_lru
        self._lru_discard(node)
        node.protected = True
        self.protected_tokens += size
        if was_in:
            self._lru_add(node)

    # ------------------------------------------------------------- invariants

    def check(self) -> None:
        """Asserts every invariant in the module docstring. O(nodes)."""
        total = evictable = locked = protected = leaves = pleaves = 0
        page, s = self.page_size, self.hash_stride
        for ns, root in self.roots.items():
            assert root.parent is None and not root.tokens and root.lock_ref == 0, f"{ns=} {root=}"
            assert root.ns == ns, f"{ns=} {root.ns=}"
            assert root.children, f"empty root kept for {ns=}"
            # (node, next expected block number, keyed frontier still open)
            stack = [(c, 1, True) for c in root.children.values()]
            for c in root.children.values():
                assert c.parent is root, f"{c=}"
            while stack:
                node, next_block, open_ = stack.pop()
                n = len(node.tokens)
                assert type(node.tokens) is array and node.tokens.typecode == KEY_TYPECODE, (
                    f"edge not a cache key {node=}"
                )
                assert n > 0 and n % page == 0, f"bad edge length {node=}"
                assert node.parent.children.get(self._page_key(node.tokens, 0)) is node, f"{node=}"
                assert node.lock_ref >= 0, f"{node=}"
                if node.parent.parent is not None:
                    assert node.parent.lock_ref >= node.lock_ref, f"lock below unlocked {node=}"
                    assert node.start == node.parent.start + len(node.parent.tokens), f"{node=}"
                else:
                    assert node.start == 0, f"{node=}"
                total += n
                if node.lock_ref:
                    locked += n
                else:
                    evictable += n
                if node.protected:
                    protected += n
                is_leaf = not node.children
                want_lru = is_leaf and node.lock_ref == 0
                assert node.in_lru == want_lru, f"LRU membership wrong {node=}"
                if want_lru:
                    sset = self._lru_protected if node.protected else self._lru
                    assert sset.get((node.tick, node.id)) is node, f"{node=} missing from LRU"
                    if node.protected:
                        pleaves += 1
                    else:
                        leaves += 1
                # router blocks
                if s is None:
                    assert not node.hashes
                    nb, still_open = next_block, open_
                else:
                    first = node.start // s + 1
                    count = (node.start + n) // s - node.start // s
                    if node.hashes:
                        assert open_ and first == next_block, f"gap in keyed blocks {node=}"
                    assert len(node.hashes) <= count, f"too many hashes {node=}"
                    still_open = open_ and len(node.hashes) == count
                    nb = first + len(node.hashes)
                for c in node.children.values():
                    assert c.parent is node, f"{c=} {node=}"
                    stack.append((c, nb, still_open))
        assert total == self.total_tokens, (total, self.total_tokens)
        assert evictable == self.evictable_tokens, (evictable, self.evictable_tokens)
        assert locked == self.locked_tokens, (locked, self.locked_tokens)
        assert protected == self.protected_tokens, (protected, self.protected_tokens)
        assert leaves == len(self._lru) and pleaves == len(self._lru_protected), (
            leaves,
            len(self._lru),
            pleaves,
            len(self._lru_protected),
        )
        if self._mode == "protected":
            assert self.protected_tokens <= self.protected_capacity
        assert len(self._ghost) <= self.admission.ghost_capacity
        assert self._removals == any(type(e) in (Removed, Cleared) for e in self._events), self._removals
