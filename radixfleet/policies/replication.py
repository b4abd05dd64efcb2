"""Hot-root replication: a small, bounded record of hot prefixes and their replica sets.

prefix_load consults it for requests whose deepest indexed node (``MatchResult.depth``)
is hot. The index gives the decayed request rate through that node
(``MatchResult.rate``); the prefix's *holders* are the routable workers with
``blocks[w] >= depth``. How many holders a prefix needs::

    uncached   = max(prompt_tokens - depth * block_tokens, block_tokens)   per request
    per_holder = min(holder_max_rate,
                     hot_utilization * mean holder prefill tokens/s / uncached)   req/s
    needed     = min(ceil(rate / per_holder), 1 + max_replicas, routable workers)

- ``active`` holders (holders not retired) < needed: a retired holder that still holds
  the prefix is reinstated first; otherwise the least-loaded non-holder becomes a
  replica (one per request, so replication follows the rate gradually).
- ``active > 1`` and ``rate < RETIRE_FRACTION * per_holder * (active - 1)``, or the rate
  fell below ``hot_min_rate``: the most recently added active replica is *retired*
  (the hysteresis keeps a prefix from flapping). Retired workers keep the blocks
  until their engine evicts them, but prefix_load scores them as not holding the
  prefix, so traffic concentrates on the remaining holders and the copies age out.
  A retired worker is forgotten once the index says it no longer holds the prefix.
- Original holders (holders when the record was created, or holders that were never
  added as replicas) are never retired.

Invariants (``check()``):

- at most ``capacity`` records; each record's ``replicas`` and ``retired`` are
  disjoint and ``len(replicas) <= max_replicas``;
- records are in least-recently-seen-first order (``_records`` is a dict used as an
  LRU: seeing a record moves it to the end; a new record past capacity evicts the
  first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: retire a replica when the rate would fit in one holder fewer at this utilisation
RETIRE_FRACTION = 0.5


@dataclass(slots=True)
class HotRecord:
    """One hot prefix: the node at ``depth`` whose chained hash is ``key``."""

    key: int
    depth: int
    #: decayed requests/s through the node, as last seen
    rate: float
    #: when a request through it was last seen (the caller's clock)
    last_seen: float
    #: holders needed at the last sighting
    needed: int = 1
    #: worker -> time it was added as a replica; only HotRoots changes it
    replicas: dict[str, float] = field(default_factory=dict)
    #: worker -> time it was retired (still believed to hold the prefix)
    retired: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "hash": f"{self.key:016x}",
            "depth": self.depth,
            "rate": round(self.rate, 4),
            "last_seen": self.last_seen,
            "needed": self.needed,
            "replicas": sorted(self.replicas),
            "retired": sorted(self.retired),
        }


class HotRoots:
    """The bounded record. Pure bookkeeping: the caller passes rates and times."""

    def __init__(self, capacity: int = 64, max_replicas: int = 4) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.max_replicas = max_replicas
        self._records: dict[int, HotRecord] = {}
        self.replicas_added = 0  # counters for metrics
        self.replicas_retired = 0
        #: told ``(op, key, depth, worker)`` of each local decision, op "add" or
        #: "retire" (radixfleet.bus shares them so replicas replicate as one router would)
        self.listener = None

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: int) -> bool:
        return key in self._records

    def get(self, key: int) -> HotRecord | None:
        return self._records.get(key)

    def see(self, key: int, depth: int, rate: float, now: float) -> HotRecord:
        """The record of ``key``, created if new (may evict the least recently seen),
        updated with ``rate``/``now`` and moved to the most-recent end."""
        recs = self._records
        rec = recs.pop(key, None)
        if rec is None:
            rec = HotRecord(key, depth, rate, now)
            if len(recs) >= self.capacity:
                del recs[next(iter(recs))]
        else:
            rec.rate = rate
            rec.last_seen = now
            rec.depth = depth
        recs[key] = rec
        return rec

    def drop(self, key: int) -> None:
        self._records.pop(key, None)

    def add_replica(self, rec: HotRecord, worker: str, now: float) -> None:
        assert worker not in rec.replicas, f"{worker=} already a replica of {rec=}"
        rec.retired.pop(worker, None)
        rec.replicas[worker] = now
        self.replicas_added += 1
        if self.listener is not None:
            self.listener("add", rec.key, rec.depth, worker)

    def reinstate(self, rec: HotRecord, worker: str, now: float) -> None:
        rec.retired.pop(worker)
        rec.replicas[worker] = now
        if self.listener is not None:
            self.listener("add", rec.key, rec.depth, worker)

    def retire_newest(self, rec: HotRecord, active: set[str], now: float) -> str | None:
        """Retires the most recently added replica in ``active``; returns it or None."""
        newest, t_new = None, -math.inf
        for w, t in rec.replicas.items():
            if w in active and t >= t_new:
                newest, t_new = w, t
        if newest is not None:
            del rec.replicas[newest]
            rec.retired[newest] = now
            self.replicas_retired += 1
            if self.listener is not None:
                self.listener("retire", rec.key, rec.depth, newest)
        return newest

    def retire_all(self, rec: HotRecord, now: float) -> None:
        """Retires every replica of ``rec`` (its rate fell below the hot threshold)."""
        for w in rec.replicas:
            rec.retired[w] = now
            if self.listener is not None:
                self.listener("retire", rec.key, rec.depth, w)
        self.replicas_retired += len(rec.replicas)
        rec.replicas.clear()

    def apply_remote(self, op: str, key: int, depth: int, worker: str, now: float) -> None:
        """Another router replica's decision (``listener``'s arguments), applied
        without telling the listener: its replica set becomes ours too."""
        rec = self._records.get(key)
        if op == "add":
            if rec is None:
                rec = self.see(key, depth, 0.0, now)
            if worker not in rec.replicas and len(rec.replicas) < self.max_replicas:
                rec.retired.pop(worker, None)
                rec.replicas[worker] = now
        elif op == "retire" and rec is not None and worker in rec.replicas:
            del rec.replicas[worker]
            rec.retired[worker] = now

    def records(self) -> list[HotRecord]:
        """Records, most recently seen first."""
        return list(reversed(self._records.values()))

    def describe(self) -> dict[str, Any]:
        return {
            "hot_prefixes": [r.to_json() for r in self.records()],
            "replicas_added": self.replicas_added,
            "replicas_retired": self.replicas_retired,
        }

    def check(self) -> None:
        assert len(self._records) <= self.capacity, f"{len(self._records)=} > {self.capacity=}"
        last = -math.inf
        for key, rec in self._records.items():
            assert rec.key == key, f"{rec=} filed under {key:#x}"
            assert rec.depth > 0, f"{rec=}"
            both = rec.replicas.keys() & rec.retired.keys()
            assert not both, f"{rec=}: {both} both replica and retired"
            assert len(rec.replicas) <= self.max_replicas, f"{rec=}: too many replicas"
            assert rec.last_seen >= last, f"LRU order broken at {rec=}"
            last = rec.last_seen


def holders_needed(
    rate: float,
    uncached_tokens: float,
    mean_prefill_tps: float,
    holder_max_rate: float,
    utilization: float,
    cap: int,
) -> tuple[int, float]:
    """``(needed, per_holder)``: holders a prefix at ``rate`` req/s needs (clamped to
    ``[1, cap]``) and the req/s one holder absorbs (module docstring)."""
    per_holder = min(holder_max_rate, utilization * mean_prefill_tps / uncached_tokens)
    needed = math.ceil(rate / per_holder) if per_holder > 0 else cap
    return max(1, min(needed, cap)), per_holder
