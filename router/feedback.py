"""Applies agents' event batches (protocol.events, contract 2) to the index and pool.

Per worker the pool keeps the agent ``epoch`` the router's view follows and the
``next_seq`` it expects. A batch is applied when it continues that stream
(same epoch, ``seq == next_seq``) or when it starts with a ``snapshot`` (which
replaces the worker's entries wholesale, so any gap before it is harmless)::

    unknown worker id                       -> 404 unknown_worker (agent re-registers)
    registered with another block_bytes     -> 404 unknown_worker (the router's
      than the router's (after a reload)       keys.block_bytes was reloaded; the
                                               re-registration is refused with 409)
    epoch differs or seq gap, no snapshot   -> 409 snapshot_required (load still applied)
    worker UNHEALTHY                        -> 200, events discarded and the stream
                                               forgotten: once healthy again, its next
                                               batch gets 409 and it snapshots
    otherwise                               -> 200 ok, events applied in order

The router's own inserts at routing time are optimistic hints; these events are the
truth and override them (a ``removed`` drops a hinted block, a ``snapshot`` drops
every hint).
"""

from __future__ import annotations

import logging

from protocol.events import (
    STATUS_OK, STATUS_SNAPSHOT_REQUIRED, STATUS_UNKNOWN_WORKER,
    Cleared, EventBatch, Removed, Snapshot, Stored,
)
from router.pool import HealthState, Pool

log = logging.getLogger("radixfleet.feedback")


class Feedback:
    """Stateless but for the pool's per-worker stream positions."""

    __slots__ = ("pool", "index", "metrics", "block_bytes")

    def __init__(self, pool: Pool, index, metrics=None, block_bytes: int | None = None) -> None:
        self.pool = pool
        self.index = index
        self.metrics = metrics
        #: the router's keys.block_bytes (the router updates it on reload); None: unchecked
        self.block_bytes = block_bytes

    def apply(self, batch: EventBatch, now: float) -> tuple[int, str]:
        """Applies one batch. Returns (HTTP status, ``status`` string)."""
        w = self.pool.get(batch.worker_id)
        m = self.metrics
        if w is None or (w.block_bytes is not None and self.block_bytes is not None
                         and w.block_bytes != self.block_bytes):
            self._count(STATUS_UNKNOWN_WORKER)
            return 404, STATUS_UNKNOWN_WORKER
        if batch.load is not None:
            self.pool.report_load(w, batch.load, now)
            if m is not None:
                m.event_applied("load")
        if w.health is HealthState.UNHEALTHY:
            w.epoch = None
            self._count(STATUS_OK)
            return 200, STATUS_OK
        events = batch.events
        resync = bool(events) and isinstance(events[0], Snapshot)
        if not resync and (w.epoch != batch.epoch or batch.seq != w.next_seq):
            log.info("worker %s: batch epoch %s seq %d, expected epoch %s seq %d: snapshot "
                     "required", w.id, batch.epoch, batch.seq, w.epoch, w.next_seq)
            self._count(STATUS_SNAPSHOT_REQUIRED)
            return 409, STATUS_SNAPSHOT_REQUIRED
        idx = self.index
        wid = w.id
        for ev in events:
            cls = ev.__class__
            if cls is Stored:
                idx.insert(wid, ev.hashes, now, ev.parent)
            elif cls is Removed:
                idx.remove(wid, ev.hashes)
            elif cls is Snapshot:
                idx.apply_snapshot(wid, ev.blocks, now)
            elif cls is Cleared:
                idx.clear(wid)
            if m is not None:
                m.event_applied(ev.type)
        w.epoch = batch.epoch
        w.next_seq = batch.seq + 1
        self._count(STATUS_OK)
        return 200, STATUS_OK

    def _count(self, status: str) -> None:
        if self.metrics is not None:
            self.metrics.batches.labels(status).inc()
