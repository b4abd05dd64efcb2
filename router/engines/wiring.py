"""Connecting an engine's KV-event stream to its worker's index entries.

``subscribe(link, engines)`` builds, for one ``EngineLink``, the subscriber
(``router.engines.zmq_events``) and the block map (``router.engines.block_map``),
joined by ``_LinkConsumer``, which applies batches through the map and tells the
link about synchronisation::

    KvEventSubscriber --on_batch--> _LinkConsumer --> EngineBlockMap.apply --> index
                      --on_gap/on_reset-->          link.events_lost / engine_restarted
                      --on_error-->                 radixfleet_engine_event_errors_total

The chain seed of a sequence's first block is the worker's token namespace
(``token_namespace_seed(model, cache_salt, adapter, block_size)``), the same seed
``router.engines.keyspace.TokenSpace`` keys requests with, so a stored chain and a
request with the same tokens meet in the index.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from router.engines.block_map import EngineBlockMap
from router.engines.zmq_events import KvEventSubscriber, replace_wildcard, subscriber_endpoint
from protocol.prefix_keys import token_namespace_seed

log = logging.getLogger("radixfleet.engines")


class _LinkConsumer:
    """The subscriber's consumer for one link (module docstring)."""

    __slots__ = ("link", "map", "prom")

    def __init__(self, link, block_map: EngineBlockMap, prom) -> None:
        self.link = link
        self.map = block_map
        self.prom = prom

    def on_batch(self, seq: int, batch) -> None:
        before = self.map.stats()
        self.map.on_batch(seq, batch)
        after = self.map.stats()
        self.prom.event_blocks.labels("stored").inc(after.stored_blocks - before.stored_blocks)
        self.prom.event_blocks.labels("removed").inc(after.removed_blocks
                                                     - before.removed_blocks)
        if not self.link.in_sync:
            self.link.events_synced()
        if self.map.block_size and not self.link.block_size:
            self.link.learn_block_size(self.map.block_size)

    def on_gap(self, first_missing: int, next_seq: int) -> None:
        self.link.events_lost(f"gap {first_missing}..{next_seq - 1}")

    def on_reset(self, reason, seq: int) -> None:
        r = getattr(reason, "value", str(reason))
        if r == "restarted":
            self.link.engine_restarted("KV event sequence went back to %d" % seq)
        else:
            self.link.events_lost(r)

    def on_error(self, cause, detail: str) -> None:
        self.prom.event_error(self.link.worker.id, getattr(cause, "value", str(cause)))
        self.map.on_error(cause, detail)


def subscribe(link, engines) -> tuple[KvEventSubscriber, EngineBlockMap]:
    """The subscriber and block map of ``link`` (not started). Raises ``ValueError``
    for an endpoint the subscriber cannot use (config validation prevents it)."""
    spec = link.spec
    wid = link.worker.id
    host = urlsplit(link.worker.url).hostname
    model = spec.model or (link.models[0] if link.models else "")

    def root_seed(adapter, salt, block_size, _model=model):
        return token_namespace_seed(_model, salt or "", adapter, block_size)

    bmap = EngineBlockMap(wid, engines.index, root_seed, block_size=link.block_size)
    mode, endpoint = subscriber_endpoint(spec.events.endpoint, host, spec.events.mode)
    # the engine's replay socket is a ROUTER it binds: connect to it, on its host
    replay = replace_wildcard(spec.events.replay_endpoint, host) \
        if spec.events.replay_endpoint else None
    sub = KvEventSubscriber(endpoint, _LinkConsumer(link, bmap, engines.prom), mode=mode,
                            topic=spec.events.topic, replay_endpoint=replay, name=wid)
    return sub, bmap
