"""Connecting an engine's KV-event stream to its worker's index entries.

``subscribe(link, engines, source, rank)`` builds, for one ``EngineLink`` and one
event source (the worker's configured ``events:``, or one data-parallel rank's
publisher from ``/kv_event_sources``), the subscriber (``radixfleet.engines.zmq_events``)
and the block map (``radixfleet.engines.block_map``) that keeps that rank's entries under
the link's holder for it (``link.holder(rank)``), joined by ``_LinkConsumer``, which
applies batches through the map and tells the link about synchronisation::

    KvEventSubscriber --on_batch--> _LinkConsumer --> EngineBlockMap.apply --> index
                      --on_gap/on_reset-->          link.events_lost / engine_restarted
                      --on_synced-->                link.events_synced (the join replayed)
                      --on_error-->                 radixfleet_engine_event_errors_total

The chain seed of a sequence's first block is the worker's token namespace
(``token_namespace_seed(model, cache_salt, adapter, block_size)``), the same seed
``radixfleet.engines.keyspace.TokenSpace`` keys requests with, so a stored chain and a
request with the same tokens meet in the index.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from radixfleet.engines.block_map import EngineBlockMap
from radixfleet.engines.kv_events import KvEventCause
from radixfleet.engines.zmq_events import KvEventSubscriber, replace_wildcard, subscriber_endpoint
from radixfleet.keys import token_namespace_seed

log = logging.getLogger("radixfleet.engines")


class _LinkConsumer:
    """The subscriber's consumer for one link (module docstring)."""

    __slots__ = ("link", "map", "prom", "rank")

    def __init__(self, link, block_map: EngineBlockMap, prom, rank: int | None) -> None:
        self.link = link
        self.map = block_map
        self.prom = prom
        self.rank = rank  # the data-parallel rank followed (None: the worker as one)

    def on_batch(self, seq: int, batch) -> None:
        if self.rank is not None and batch.dp_rank is not None and batch.dp_rank != self.rank:
            # another rank's batch on this rank's socket: its blocks are not this
            # rank's cache; applying them would make the index untrue
            self.on_error(
                KvEventCause.BAD_SHAPE, f"batch of dp_rank {batch.dp_rank} on rank {self.rank}'s stream"
            )
            self.on_gap(seq, seq + 1)
            return
        before = self.map.stats()
        self.map.on_batch(seq, batch)
        after = self.map.stats()
        self.prom.event_blocks.labels("stored").inc(after.stored_blocks - before.stored_blocks)
        self.prom.event_blocks.labels("removed").inc(after.removed_blocks - before.removed_blocks)
        eb = self.prom.event_blocks
        eb.labels("cold_stored").inc(after.cold_stored_blocks - before.cold_stored_blocks)
        eb.labels("cold_removed").inc(after.cold_removed_blocks - before.cold_removed_blocks)
        for cause, n in (
            ("unknown_medium", after.unknown_medium_blocks - before.unknown_medium_blocks),
            ("other_group", after.other_tier_blocks - before.other_tier_blocks),
        ):
            if n:
                self.prom.event_ignored.labels(self.link.worker.id, cause).inc(n)
        self.link.events_synced(self.rank)  # a no-op once in sync
        if self.map.block_size and not self.link.block_size:
            self.link.learn_block_size(self.map.block_size)

    def on_gap(self, first_missing: int, next_seq: int) -> None:
        self.link.events_lost(f"gap {first_missing}..{next_seq - 1}", self.rank)

    def on_reset(self, reason, seq: int) -> None:
        r = getattr(reason, "value", str(reason))
        if r == "restarted" and self.rank is None:
            self.link.engine_restarted("KV event sequence went back to %d" % seq)
        else:
            # one rank's engine core restarted, joined or reconnected: that rank's
            # entries go, the others' stay
            self.link.events_lost(r, self.rank)

    def on_error(self, cause, detail: str) -> None:
        self.prom.event_error(self.link.worker.id, getattr(cause, "value", str(cause)))
        self.map.on_error(cause, detail)

    def on_synced(self, seq: int) -> None:
        # the join's replay answered before any live batch (an idle engine: maybe
        # nothing at all): the rank's entries are the engine's from now on
        self.link.events_synced(self.rank)


def subscribe(
    link, engines, source=None, rank: int | None = None
) -> tuple[KvEventSubscriber, EngineBlockMap]:
    """The subscriber and block map of ``link`` for ``source`` (an
    ``radixfleet.engines.event_sources.EventSource``; None: the worker's configured
    ``events:``), keeping ``rank``'s entries (not started). Raises ``ValueError`` for
    an endpoint the subscriber cannot use."""
    spec = link.spec
    wid = link.worker.id
    host = urlsplit(link.worker.url).hostname
    model = spec.model or (link.models[0] if link.models else "")

    def root_seed(adapter, salt, block_size, _model=model):
        return token_namespace_seed(_model, salt or "", adapter, block_size)

    if source is None:
        ep, mode, topic = spec.events.endpoint, spec.events.mode, spec.events.topic
        replay_ep = spec.events.replay_endpoint or None
    else:
        ep, mode, topic, replay_ep = source.endpoint, "auto", source.topic, source.replay_endpoint
    holder = link.holder(rank)
    bmap = EngineBlockMap(holder, engines.index, root_seed, block_size=link.block_size)
    mode, endpoint = subscriber_endpoint(ep, host, mode)
    # the engine's replay socket is a ROUTER it binds: connect to it, on its host
    replay = replace_wildcard(replay_ep, host) if replay_ep else None
    sub = KvEventSubscriber(
        endpoint,
        _LinkConsumer(link, bmap, engines.prom, rank),
        mode=mode,
        topic=topic,
        replay_endpoint=replay,
        name=wid if rank is None else holder,
    )
    return sub, bmap
