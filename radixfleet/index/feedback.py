"""Applies agents' event batches (radixfleet.wire.events, contract 2 of docs/DESIGN.md) to the
index and pool.

Per worker the pool keeps the agent ``epoch`` the router's view follows and the
``next_seq`` it expects. A batch is applied when it continues that stream
(same epoch, ``seq == next_seq``) or when it starts with a ``snapshot`` (which
replaces the worker's entries wholesale, so any gap before it is harmless)::

    unknown worker id                       -> 404 unknown_worker (agent re-registers)
    not from the URL and epoch the worker   -> 404 unknown_worker: only the agent that
      registered with (or never registered)    registered may speak for a worker (its
                                               re-registration is refused with 409 if
                                               the id is someone else's)
    registered with another block_bytes     -> 404 unknown_worker (the router's
      than the router's (after a reload)       keys.block_bytes was reloaded; the
                                               re-registration is refused with 409)
    seq gap, no snapshot                    -> 409 snapshot_required (load still applied)
    worker UNHEALTHY                        -> 200, events discarded and the stream
                                               forgotten: once healthy again, its next
                                               batch gets 409 and it snapshots
    otherwise                               -> 200 ok, events applied in order

Tiers (``radixfleet.wire.events``, "KV tiers"): a ``stored``/``removed`` event of a colder
tier (an agent's DRAM tier: ``"cpu"``) goes to the index's tier sets
(``PrefixIndex.tier_add`` / ``tier_discard``), not the tree; a tier the index does
not know (``COLDER_TIERS``) is counted (``unknown_tier``) and ignored. ``cleared``
and ``snapshot`` replace every tier (a snapshot's ``tiers`` are its colder blocks);
a stream stopped mid-batch drops the worker's tiers with its tree.

The router's own inserts at routing time are optimistic hints; these events are the
truth and override them (a ``removed`` drops a hinted block, a ``snapshot`` drops
every hint).

Large batches. ``apply_async`` applies a batch in slices of ``SLICE_BLOCKS`` blocks
and yields to the event loop between them (a 300,000-block snapshot once held the
loop for 1.3 s: every request and health check waited). Batches of one worker are
applied one at a time, in arrival order (a per-worker lock), so ``seq`` checks see
each batch's predecessor finished. Between slices the world may change: a worker
removed, turned UNHEALTHY or re-registered with a new epoch stops the batch there
(what was applied is dropped by that change; the stream is forgotten). While a
snapshot is being applied, the worker holds the part applied so far. ``apply`` is
the same steps without yielding (the simulator and the bus call it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Generator

from radixfleet.config import KeysConfig, parse_worker_url
from radixfleet.fleet.pool import HealthState, Pool
from radixfleet.index.prefix_index import COLDER_TIERS
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.events import (
    STATUS_OK,
    STATUS_SNAPSHOT_REQUIRED,
    STATUS_UNKNOWN_WORKER,
    TIER_GPU,
    Cleared,
    EventBatch,
    Removed,
    Snapshot,
    Stored,
)

log = logging.getLogger("radixfleet.feedback")

#: blocks applied between two yields to the event loop (~4 us each: ~15 ms a slice)
SLICE_BLOCKS = 4096

Steps = Generator[None, None, "tuple[int, str]"]


class Feedback:
    """Stateless but for the pool's per-worker stream positions and the per-worker
    locks of batches being applied in slices."""

    __slots__ = ("pool", "index", "metrics", "block_bytes", "_busy", "unknown_tiers")

    def __init__(self, pool: Pool, index, metrics=None, block_bytes: int | None = None) -> None:
        self.pool = pool
        self.index = index
        self.metrics = metrics
        #: the router's keys.block_bytes (``configure`` on reload); None: unchecked
        self.block_bytes = block_bytes
        #: worker id -> [its lock, batches holding or awaiting it] (apply_async)
        self._busy: dict[str, list] = {}
        #: events of a tier the index does not know, ignored (``radixfleet.wire.events``)
        self.unknown_tiers = 0

    def configure(self, keys: KeysConfig) -> None:
        """Takes a reloaded ``keys`` section: agents registered with a block size other
        than its ``block_bytes`` are refused from now on."""
        self.block_bytes = keys.block_bytes

    def apply(self, batch: EventBatch, now: float) -> tuple[int, str]:
        """Applies one batch at once. Returns (HTTP status, ``status`` string)."""
        steps = self._steps(batch, now)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    async def apply_async(self, batch: EventBatch, clock: Callable[[], float]) -> tuple[int, str]:
        """Applies one batch in slices, yielding to the loop between them, after every
        earlier batch of the same worker. Returns (HTTP status, ``status`` string)."""
        wid = batch.worker_id
        busy = self._busy.get(wid)
        if busy is None:
            busy = self._busy[wid] = [asyncio.Lock(), 0]
        busy[1] += 1
        try:
            async with busy[0]:
                steps = self._steps(batch, clock())
                while True:
                    try:
                        next(steps)
                    except StopIteration as done:
                        return done.value
                    await asyncio.sleep(0)
        finally:
            busy[1] -= 1
            if busy[1] == 0:
                del self._busy[wid]

    def _steps(self, batch: EventBatch, now: float) -> Steps:
        """The batch's work; yields between slices, returns (HTTP status, word)."""
        w = self.pool.get(batch.worker_id)
        m = self.metrics
        if (
            w is None
            or not self._speaks_for(w, batch)
            or (
                w.block_bytes is not None
                and self.block_bytes is not None
                and w.block_bytes != self.block_bytes
            )
        ):
            self._count(STATUS_UNKNOWN_WORKER)
            return 404, STATUS_UNKNOWN_WORKER
        if batch.load is not None:
            self.pool.report_load(w, batch.load, now)
            if m is not None:
                m.event_applied("load")
        if w.health is HealthState.UNHEALTHY:
            w.lose_stream()
            self._count(STATUS_OK)
            return 200, STATUS_OK
        events = batch.events
        resync = bool(events) and isinstance(events[0], Snapshot)
        if not resync and (w.epoch != batch.epoch or batch.seq != w.next_seq):
            log.info(
                "worker %s: batch epoch %s seq %d, expected epoch %s seq %d: snapshot required",
                w.id,
                batch.epoch,
                batch.seq,
                w.epoch,
                w.next_seq,
            )
            self._count(STATUS_SNAPSHOT_REQUIRED)
            return 409, STATUS_SNAPSHOT_REQUIRED
        idx = self.index
        wid = w.id
        budget = SLICE_BLOCKS
        for ev in events:
            cls = ev.__class__
            if (cls is Stored or cls is Removed) and ev.tier != TIER_GPU:
                self._tier_event(wid, ev)
                budget -= len(ev.hashes)
                if budget <= 0:
                    budget = SLICE_BLOCKS
                    yield
                    if not self._still(w, batch):
                        return self._stopped(w)
            elif cls is Stored:
                hashes, parent = ev.hashes, ev.parent
                for i in range(0, len(hashes), SLICE_BLOCKS):
                    part = hashes[i : i + SLICE_BLOCKS]
                    idx.insert(wid, part, now, parent if i == 0 else hashes[i - 1])
                    budget -= len(part)
                    if budget <= 0:
                        budget = SLICE_BLOCKS
                        yield
                        if not self._still(w, batch):
                            return self._stopped(w)
            elif cls is Removed:
                hashes = ev.hashes
                for i in range(0, len(hashes), SLICE_BLOCKS):
                    idx.remove(wid, hashes[i : i + SLICE_BLOCKS])
                    budget -= min(SLICE_BLOCKS, len(hashes) - i)
                    if budget <= 0:
                        budget = SLICE_BLOCKS
                        yield
                        if not self._still(w, batch):
                            return self._stopped(w)
            elif cls is Snapshot:
                blocks = ev.blocks
                idx.clear_tiers(wid)
                for removed in idx.clear_steps(wid, SLICE_BLOCKS):
                    budget -= removed
                    if budget <= 0:
                        budget = SLICE_BLOCKS
                        yield
                        if not self._still(w, batch):
                            return self._stopped(w)
                idx.apply_snapshot(wid, (), now)  # cleared (hints inserted meanwhile), known
                insert = idx.insert
                for i in range(0, len(blocks), SLICE_BLOCKS):
                    for key, parent in blocks[i : i + SLICE_BLOCKS]:
                        insert(wid, (key,), now, parent)
                    budget -= min(SLICE_BLOCKS, len(blocks) - i)
                    if budget <= 0:
                        budget = SLICE_BLOCKS
                        yield
                        if not self._still(w, batch):
                            return self._stopped(w)
                for tier, keys in ev.tiers.items():
                    self._tier_event(wid, Stored(None, keys, tier=tier))
            elif cls is Cleared:
                idx.clear(wid)
                idx.clear_tiers(wid)
            if m is not None:
                m.event_applied(ev.type)
        w.follow(batch.epoch, batch.seq + 1)
        self._count(STATUS_OK)
        return 200, STATUS_OK

    def _tier_event(self, wid: str, ev: Stored | Removed) -> None:
        """A colder tier's stored/removed: into the index's tier sets (module docstring)."""
        tier = ev.tier
        if tier == TIER_GPU:
            return  # a snapshot's "gpu" tier: its blocks are the snapshot's own
        if tier not in COLDER_TIERS:
            self.unknown_tiers += 1
            if self.metrics is not None:
                self.metrics.event_applied("unknown_tier")
            return
        if ev.__class__ is Stored:
            self.index.tier_add(wid, tier, ev.hashes)
        else:
            self.index.tier_discard(wid, tier, ev.hashes)

    @staticmethod
    def _speaks_for(w, batch: EventBatch) -> bool:
        """Whether ``batch`` comes from the agent ``w`` registered: its epoch and URL."""
        if w.registered_epoch is None or batch.epoch != w.registered_epoch:
            return False
        if batch.url == w.url:
            return True
        try:
            return parse_worker_url(batch.url, "url") == w.url
        except ConfigError:
            return False

    def _still(self, w, batch: EventBatch) -> bool:
        """Whether a batch paused between slices may go on (see the module docstring)."""
        return not w.removed and w.health is not HealthState.UNHEALTHY and w.registered_epoch == batch.epoch

    def _stopped(self, w) -> tuple[int, str]:
        w.lose_stream()  # whatever it held is gone or stale: the stream restarts
        if w.removed:
            self._count(STATUS_UNKNOWN_WORKER)
            return 404, STATUS_UNKNOWN_WORKER
        if w.health is not HealthState.UNHEALTHY:
            # re-registered mid-batch: its entries belong to the new process now
            self.index.clear(w.id)
            self.index.clear_tiers(w.id)
        self._count(STATUS_OK)
        return 200, STATUS_OK

    def _count(self, status: str) -> None:
        if self.metrics is not None:
            self.metrics.batches.labels(status).inc()
