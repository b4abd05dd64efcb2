"""Live session footprints: how much KV each worker's ongoing conversations need.

A worker's KV cache holds shared prefixes and the private histories of the
sessions that branch from them. Under LRU, once the histories of the sessions that
keep coming back to a worker outgrow its cache, each returning turn finds its own
history already evicted by the others' (a cyclic access pattern is LRU's worst
case): the worker's private hits fall to nothing while other workers may have room.
Neither the prefix index (it mirrors what is cached, not what will be wanted) nor
the KV-turnover rate (a flow; this is a stock) says that. This module keeps the
stock, per worker, from the routing decisions alone.

A *branch* is one session's chain of turns: a request that extends an earlier
request's prompt continues that request's branch, any other request starts one.
The continuation is found by the earlier request's *tip* — the chained hash of the
last whole block of its prompt, which a prompt that extends it carries at the same
position (``radixfleet.keys``: hash k fingerprints blocks 0..k) — looked up
from the end of the new request's hashes back over ``scan_tokens`` worth of blocks (the new
content of one turn: the last answer and the next message); or by the client's
session key (``RouteRequest.session``) when it sent one.

Each branch keeps its *home* (the worker its last turn went to), its private size
(prompt tokens beyond the shared prefix it branched from: ``match.depth`` blocks of
a shared match when it started), the time of its last turn and the gap between its
last two turns. A branch is *live* — counted in its home's footprint — from its
second turn (a request that never comes back is not a session) until ``live_gaps``
of its own gaps have passed without a turn (capped at ``idle_s``). Records that
never continued are kept ``idle_s`` for their continuation to find them, then go.

Invariants (``check()`` asserts each):

- ``_tokens[w]`` equals the sum of the private sizes of the live branches homed on
  w (within float rounding), and is >= 0; only live branches are counted.
- Every branch is reachable by its key in ``_branches`` and by its tip in
  ``_tips`` (and ``_tips`` holds nothing else); at most ``max_branches`` records.
- Every record has exactly one current entry in ``_expiry`` (a min-heap of
  (expiry time, serial, key); entries whose serial is stale are skipped).

Cost per decision: one scan of at most ``max(64, scan_tokens / block_tokens)`` dict
lookups (a continuation stops at its tip, a few blocks from the end), O(log n) heap
work per turn, amortised O(1) expiry — measured (CPython 3.11, this machine) 2.1 µs to
find a continuation and 8.9 µs for a 12k-token request that continues nothing (256
lookups at 16-token blocks). Memory: ~350 bytes a record (tracemalloc, with its
dict, tip and heap entries), so ~17 MiB at the default bound of 50,000 records; past
the bound the least recently continued record goes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from itertools import count as _counter

from radixfleet.policies.base import MatchResult, RouteRequest


@dataclass(slots=True)
class Branch:
    key: object  # the client's session key (str), else a serial number (int)
    home: str
    tip: int | None  # chained hash of the last whole block of its last prompt
    shared: int  # tokens of the shared prefix it branched from
    size: int  # private tokens as of its last turn: prompt - shared, >= 0
    last: float  # time of its last turn
    gap: float  # seconds between its last two turns; 0 until it continued
    serial: int  # its current entry in the expiry heap
    live: bool  # counted in _tokens[home]


class Footprints:
    """Per-worker live private footprint of the sessions routed (module docstring)."""

    def __init__(
        self,
        live_gaps: float = 4.0,
        idle_s: float = 300.0,
        scan_tokens: int = 4096,
        max_branches: int = 50_000,
    ) -> None:
        self.live_gaps = live_gaps
        self.idle_s = idle_s
        self.scan_tokens = scan_tokens
        self.max_branches = max_branches
        self._branches: dict[object, Branch] = {}
        self._tips: dict[int, Branch] = {}
        self._tokens: dict[str, float] = {}
        self._expiry: list[tuple[float, int, object]] = []
        self._serial = _counter()
        self._keys = _counter()

    # -- queries ---------------------------------------------------------------

    def counted(self) -> bool:
        """Whether any live session is counted anywhere."""
        return bool(self._tokens)

    def tokens(self, worker: str) -> float:
        """Private tokens of the live sessions homed on ``worker``."""
        return self._tokens.get(worker, 0.0)

    def find(self, request: RouteRequest) -> Branch | None:
        """The branch ``request`` continues, or None (it starts one)."""
        if request.session is not None:
            return self._branches.get(request.session)
        hashes = request.hashes
        n = len(hashes)
        if not n or not self._tips:
            return None
        bt = request.block_tokens
        span = max(64, self.scan_tokens // bt) if bt > 0 else 64
        get = self._tips.get
        # The request's own last block cannot be its predecessor's tip unless it is a
        # repeat of the same prompt — which also continues the branch (a retry).
        for i in range(n - 1, max(-1, n - 1 - span), -1):
            b = get(hashes[i])
            if b is not None:
                return b
        return None

    # -- updates ---------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Ends the branches whose time is up: live ones leave their home's
        footprint, and records not seen for ``idle_s`` are dropped."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, serial, key = heapq.heappop(heap)
            b = self._branches.get(key)
            if b is None or b.serial != serial:
                continue
            if b.live:
                self._uncount(b)
                b.live = False
                dead_at = b.last + self.idle_s
                if dead_at > now:
                    b.serial = next(self._serial)
                    heapq.heappush(heap, (dead_at, b.serial, key))
                    continue
            self._drop(b)
        if len(heap) > 2 * len(self._branches) + 64:
            self._compact()

    def record(
        self, request: RouteRequest, match: MatchResult, branch: Branch | None, worker: str, now: float
    ) -> None:
        """The decision for ``request`` (``branch``: what ``find`` returned) went to
        ``worker``: start or advance its branch."""
        bt = request.block_tokens
        hashes = request.hashes
        tip = hashes[-1] if hashes else None
        if branch is None:
            shared = 0 if match.private else min(match.depth * bt, request.prompt_tokens)
            if request.session is not None:
                key: object = request.session
                old = self._branches.get(key)
                if old is not None:  # the same session started again: the old record ends
                    self._drop(old)
            elif tip is None:
                return
            else:
                key = next(self._keys)
            if len(self._branches) >= self.max_branches:
                self._drop(next(iter(self._branches.values())))
            b = Branch(key, worker, tip, shared, max(0, request.prompt_tokens - shared), now, 0.0, 0, False)
            self._branches[key] = b
            if tip is not None:
                self._set_tip(b, tip)
            self._schedule(b, now + self.idle_s)
            return
        b = branch
        if b.live:
            self._uncount(b)
        gap = now - b.last
        if gap > 0:
            b.gap = gap
        b.home, b.last = worker, now
        b.size = max(0, request.prompt_tokens - b.shared)
        if tip is not None and tip != b.tip:
            self._set_tip(b, tip)
        # keep recently used records last in insertion order (the bound drops the first)
        del self._branches[b.key]
        self._branches[b.key] = b
        if b.gap > 0:
            b.live = True
            self._tokens[worker] = self._tokens.get(worker, 0.0) + b.size
            self._schedule(b, now + min(self.idle_s, self.live_gaps * b.gap))
        else:
            self._schedule(b, now + self.idle_s)

    # -- internals -------------------------------------------------------------

    def _set_tip(self, b: Branch, tip: int) -> None:
        if b.tip is not None and self._tips.get(b.tip) is b:
            del self._tips[b.tip]
        other = self._tips.get(tip)
        if other is not None and other is not b:
            # two branches at the same prompt (two identical requests): the later owns it
            other.tip = None
        self._tips[tip] = b
        b.tip = tip

    def _schedule(self, b: Branch, at: float) -> None:
        b.serial = next(self._serial)
        heapq.heappush(self._expiry, (at, b.serial, b.key))

    def _uncount(self, b: Branch) -> None:
        left = self._tokens.get(b.home, 0.0) - b.size
        if left <= 0.5:
            self._tokens.pop(b.home, None)
        else:
            self._tokens[b.home] = left

    def _drop(self, b: Branch) -> None:
        if b.live:
            self._uncount(b)
            b.live = False
        if b.tip is not None and self._tips.get(b.tip) is b:
            del self._tips[b.tip]
        if self._branches.get(b.key) is b:
            del self._branches[b.key]

    def _compact(self) -> None:
        self._expiry = [
            e for e in self._expiry if (b := self._branches.get(e[2])) is not None and b.serial == e[1]
        ]
        heapq.heapify(self._expiry)

    def check(self) -> None:
        sums: dict[str, float] = {}
        for key, b in self._branches.items():
            assert b.key == key, (key, b)
            assert b.size >= 0 and b.shared >= 0 and math.isfinite(b.last), b
            if b.live:
                sums[b.home] = sums.get(b.home, 0.0) + b.size
            if b.tip is not None:
                assert self._tips.get(b.tip) is b, b
        for tip, b in self._tips.items():
            assert b.tip == tip and self._branches.get(b.key) is b, (tip, b)
        for w in set(sums) | set(self._tokens):
            got, want = self._tokens.get(w, 0.0), sums.get(w, 0.0)
            assert got >= 0 and abs(got - want) <= 1e-6 * max(1.0, want) + 1.0, (w, got, want)
        assert len(self._branches) <= self.max_branches
        current = {(e[1], e[2]) for e in self._expiry}
        for b in self._branches.values():
            assert (b.serial, b.key) in current, b
