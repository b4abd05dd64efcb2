"""A token radix tree over prompt bytes: the oracle's unbounded cache and the pooled LRU.

Prompts are token sequences of the byte-chunk tokenizer (``BYTES_PER_TOKEN``-byte
chunks of the canonical routing bytes; a partial last chunk is a token too, padded
with NULs). The tree stores them as byte strings whose lengths are multiples of
``BYTES_PER_TOKEN``, so every comparison runs on bytes in C::

    root ──"abcd efgh"──> n1 ──"ijkl"──> n2          children keyed by the first
               │                                     token (4 bytes) of their edge
               └──"xxxx"──> n3

Invariants (``check()``):
- every non-root node has a non-empty edge, a multiple of ``BYTES_PER_TOKEN`` long,
  and is filed in its parent's ``children`` under its edge's first token;
- siblings' edges start with different tokens (so a lookup takes one dict probe);
- ``tokens`` equals the sum of all edge lengths in tokens;
- a node was used at least as recently as any of its descendants
  (``parent.last >= child.last``), because every access touches the whole path;
- if bounded, ``tokens <= capacity`` between calls (eviction removes least
  recently used *leaves* only, as SGLang's radix cache does).

``serve(data)`` is the one operation the reports need: how many leading tokens of
this prompt were cached, then cache the prompt (and evict down to capacity). It
mirrors one engine's prefix cache serving a request sequence one at a time, with
no locks and no admission control — the idealized reference the brief defines.
"""

from __future__ import annotations

import heapq

from radixfleet.keys import BYTES_PER_TOKEN

_T = BYTES_PER_TOKEN


def as_tokens(data: bytes) -> bytes:
    """Pads ``data`` with NULs to a whole number of tokens."""
    rem = len(data) % _T
    return data if rem == 0 else data + b"\x00" * (_T - rem)


def common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two token-aligned byte strings share. O(n log n) in C slices."""
    n = min(len(a), len(b)) // _T
    if a[: n * _T] == b[: n * _T]:
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * _T] == b[: mid * _T]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("edge", "parent", "children", "last")

    def __init__(self, edge: bytes, parent: _Node | None, last: int) -> None:
        self.edge = edge  # bytes on the edge from the parent (token-aligned)
        self.parent = parent
        self.children: dict[bytes, _Node] = {}  # first token of the child's edge -> child
        self.last = last  # logical time of the last access (only the tree sets it)


class PrefixTrie:
    """Token radix tree; ``capacity=None`` is unbounded (the oracle)."""

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 tokens, got {capacity}")
        self.capacity = capacity
        self.root = _Node(b"", None, 0)
        self.tokens = 0  # tokens stored (sum of edges)
        self.clock = 0  # logical time, +1 per serve()
        self.evicted = 0  # tokens evicted so far

    def match(self, data: bytes) -> int:
        """Leading tokens of ``data`` the tree holds. O(len). No side effects."""
        data = as_tokens(data)
        node, pos = self.root, 0
        while pos < len(data):
            child = node.children.get(data[pos : pos + _T])
            if child is None:
                break
            edge = child.edge
            n = common_tokens(edge, data[pos : pos + len(edge)])
            pos += n * _T
            if n * _T < len(edge):
                break
            node = child
        return pos // _T

    def serve(self, data: bytes) -> int:
        """Returns the cached leading tokens of ``data``, then caches all of it.

        Touches the whole path (LRU), may split a node, and — when bounded — evicts
        least recently used leaves until ``tokens <= capacity`` (which can include
        this prompt's own tail when the prompt alone exceeds the capacity).
        """
        data = as_tokens(data)
        self.clock += 1
        now = self.clock
        node, pos = self.root, 0
        node.last = now
        while pos < len(data):
            key = data[pos : pos + _T]
            child = node.children.get(key)
            if child is None:
                # everything before pos was matched; the rest becomes one new leaf
                leaf = _Node(data[pos:], node, now)
                node.children[key] = leaf
                self.tokens += (len(data) - pos) // _T
                break
            edge = child.edge
            n = common_tokens(edge, data[pos : pos + len(edge)])
            if n * _T < len(edge):
                # split: node -> mid(edge[:n]) -> child(edge[n:])
                mid = _Node(edge[: n * _T], node, child.last)
                node.children[key] = mid
                child.edge = edge[n * _T :]
                child.parent = mid
                mid.children[child.edge[:_T]] = child
                child = mid
            child.last = now
            pos += n * _T
            node = child
        matched = pos // _T
        if self.capacity is not None and self.tokens > self.capacity:
            self._evict()
        return matched

    def _evict(self) -> None:
        """Removes LRU leaves until under capacity. O(leaves log leaves)."""
        heap = [(n.last, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        cap = self.capacity
        assert cap is not None, "only a bounded trie evicts"
        while self.tokens > cap and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.edge[:_T]]
            freed = len(leaf.edge) // _T
            self.tokens -= freed
            self.evicted += freed
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                yield n

    def check(self) -> None:
        """Asserts every invariant of the module docstring."""
        total = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node, f"{key=} parent link broken"
                assert child.edge and len(child.edge) % _T == 0, f"{child.edge=}"
                assert child.edge[:_T] == key, f"{key=} {child.edge[:_T]=}"
                assert node.last >= child.last, f"{node.last=} < {child.last=}"
                total += len(child.edge) // _T
                stack.append(child)
        assert total == self.tokens, f"{total=} != {self.tokens=}"
        if self.capacity is not None:
            assert self.tokens <= self.capacity, f"{self.tokens=} > {self.capacity=}"
