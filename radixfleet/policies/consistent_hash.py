"""consistent_hash: consistent hashing with bounded loads (Mirrokni, Thorup,
Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018).

A ring of virtual nodes, ``round(vnodes * weight)`` points per worker at
``xxh3_64(f"{worker}\\0{i}")``. A request's key is its session (``RouteRequest.session``:
a session header or the body's ``user`` field), else the chained hash of its first
``key_blocks`` prefix blocks (which fingerprints that whole prefix). The request
walks the ring clockwise from ``key`` and takes the first worker that is not full::

    m      = in-flight requests over all routable workers, counting this one
    cap(w) = ceil(load_factor * m * weight(w) / total weight)
    full   = in_flight(w) >= cap(w)

Bound: after every placement no worker holds more than ``cap(w)`` in-flight
requests, i.e. at most ``load_factor`` times its share of the mean (rounded up).
Because ``sum cap(w) >= m`` a non-full worker always exists. Load is the router's
own in-flight count, counted at pick time.

State: the ring, rebuilt only when the set of (worker, weight) changes; a change of
order alone only remaps positions. A request with neither session nor a whole
block has no key: it goes to the least-loaded worker (reason MISS).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any

import xxhash

from radixfleet.keys import WorkerId
from radixfleet.policies.base import (
    Decision,
    MatchResult,
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
    WorkerView,
)
from radixfleet.policies.load import least_requests
from radixfleet.policies.params import param, parameters

_xxh3 = xxhash.xxh3_64_intdigest


class ConsistentHash(Policy):
    name = "consistent_hash"

    @parameters
    class Params(PolicyParams):
        vnodes: int = param(160, "virtual nodes per worker of weight 1", lo=1, hi=10_000)
        load_factor: float = param(
            1.25,
            "c: a worker is skipped while its in-flight count is >= "
            "ceil(c x its share of the fleet's in-flight requests)",
            lo=1.0,
            hi=100.0,
        )
        key_blocks: int = param(
            4, "without a session, the key is the hash of the first N prefix blocks", lo=1, hi=1_000_000
        )

    params: Params

    def __init__(self, params: PolicyParams | None = None, rng: random.Random | None = None) -> None:
        super().__init__(params, rng)
        self._sig: frozenset[Any] = frozenset()  # {(worker, weight)} the ring was built for
        self._points: list[int] = []  # sorted vnode positions
        self._owner: list[WorkerId] = []  # worker id of each point
        self._order: list[WorkerId] = []  # views' ids, in the order _pos was computed for
        self._pos: dict[WorkerId, int] = {}  # worker id -> index into views
        self._weights: dict[WorkerId, float] = {}  # worker id -> weight, as of _order
        self.rebuilds = 0

    def _sync(self, views: Sequence[WorkerView]) -> None:
        """Brings the ring up to date with ``views``. O(n) when nothing changed;
        O(n * vnodes * log) when the set of (worker, weight) changed. May rebuild."""
        ids = [v.id for v in views]
        if ids == self._order and all(v.weight == self._weights.get(v.id) for v in views):
            return
        sig = frozenset((v.id, v.weight) for v in views)
        if sig != self._sig:
            vn = self.params.vnodes
            pts = []
            for v in views:
                for i in range(max(1, round(vn * v.weight))):
                    pts.append((_xxh3(f"{v.id}\0{i}".encode()), v.id))
            pts.sort()
            self._points = [p for p, _ in pts]
            self._owner = [w for _, w in pts]
            self._sig = sig
            self.rebuilds += 1
        self._order = ids
        self._weights = {v.id: v.weight for v in views}
        self._pos = {w: i for i, w in enumerate(ids)}

    def key_of(self, request: RouteRequest) -> int | None:
        """The request's ring position: its session's hash, else the chained hash of
        its first ``key_blocks`` blocks; None when it has neither."""
        if request.session is not None:
            return _xxh3(request.session.encode("utf-8", "surrogatepass"))
        hs = request.hashes
        if not hs:
            return None
        return hs[min(self.params.key_blocks, len(hs)) - 1]

    def choose(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], now: float
    ) -> Decision:
        key = self.key_of(request)
        if key is None:
            v = least_requests(views, self.rng)
            return Decision(v.id, Reason.MISS, match.blocks.get(v.id, 0))
        self._sync(views)
        m = 1
        total_w = 0.0
        for v in views:
            m += v.in_flight
            total_w += v.weight
        if total_w <= 0:  # all weights zero: every worker is full, least-loaded below
            total_w = 1.0
        scale = self.params.load_factor * m / total_w
        points, owner, pos = self._points, self._owner, self._pos
        n = len(points)
        i = bisect.bisect_left(points, key)
        seen: set[str] = set()
        for step in range(n):
            w = owner[(i + step) % n]
            if w in seen:
                continue
            seen.add(w)
            v = views[pos[w]]
            if v.in_flight < math.ceil(scale * v.weight):
                return Decision(w, Reason.HASH, match.blocks.get(w, 0))
            if len(seen) == len(views):
                break
        # Unreachable while load_factor >= 1 (sum of caps >= m); kept as a value.
        v = least_requests(views, self.rng)
        return Decision(v.id, Reason.MISS, match.blocks.get(v.id, 0))

    def describe(self) -> dict[str, Any]:
        return {
            "params": dataclasses.asdict(self.params),
            "ring_points": len(self._points),
            "workers": len(self._pos),
            "rebuilds": self.rebuilds,
        }

    def check(self) -> None:
        """Asserts the ring's invariants: sorted points, owners in the signature."""
        assert self._points == sorted(self._points), "ring not sorted"
        assert len(self._points) == len(self._owner)
        ids = {w for w, _ in self._sig}
        assert set(self._owner) <= ids, f"{set(self._owner) - ids=}"
