"""Pushes the agent's cache events and load to every router it is registered with.

One stream per router URL (``--router``, repeatable: every replica gets the same
truth), each with its own sequence numbers within this process's epoch::

          cache.drain_events() every interval
                     |  (fanned out to each router's pending list)
          +----------+-----------+
          v                      v
    RouterLink(r1)         RouterLink(r2)      register -> snapshot -> deltas ...
      pending, seq           pending, seq      POST /internal/v1/events (Bearer token)

A batch goes out every ``interval_s`` (~100 ms, with the load report even when
there are no events), as soon as ``max_batch_events`` events are waiting, within a
poll (10 ms) of the cache removing blocks (an eviction, a refused hint, a flush:
the router's index holds what the tree no longer does, and its next pick there
would count on it), and at once on ``flush()``.

Answers after their events (``flush``): the server awaits ``flush()`` before a
finished request's answer ends (radixfleet_tools.agent.server), so the blocks of its prompt
and answer — a conversation's next turn is that prompt, that answer and a new
message — are in every streaming router's index (HTTP: the router applied the
batch before it answered the POST; the bus: the stream holds it) before the
client can send the next turn. Without it the next turn, sent the moment the answer
is in, is picked up to an interval before the batch: the index under-predicts it by
the answer (bench/RESULTS.md, "The demo"). ``flush`` waits for one push round that
began after the call, at most ``interval_s`` (no answer waits longer than its
events would have), and not at all while no link streams (a router down or not yet
registered gets a snapshot anyway).

Per-link states: ``UNREGISTERED`` (register next), ``SNAPSHOT`` (next batch starts
with a full snapshot), ``STREAMING`` (deltas). A link snapshots after (re)registering,
after any failed POST (the router may or may not have applied it), on ``409
snapshot_required``, and on ``404 unknown_worker`` (it re-registers first). While a
router is unreachable its pending deltas are dropped, not kept: a snapshot on
reconnect carries everything they would have, so memory stays bounded by the tree.

Bus mode (``bus=AgentBus``, ``--bus nats://...``; radixfleet_tools.agent.bus): batches are
published once to a JetStream stream that every router replica consumes, the load
on a core subject. While the bus is up the HTTP links stay idle; while it is down
(or not yet up) the reporter pushes to its ``--router`` URLs as above, and they
snapshot again after the next outage.

Lifecycle: ``start()`` then ``aclose()`` (idempotent; ``async with`` works).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

import aiohttp

from radixfleet.common import background
from radixfleet.common.background import Lifecycle
from radixfleet.wire.bus_wire import load_batch
from radixfleet.wire.events import (
    EVENTS_PATH,
    REGISTER_PATH,
    STATUS_BLOCK_BYTES_MISMATCH,
    STATUS_SNAPSHOT_REQUIRED,
    STATUS_UNKNOWN_WORKER,
    STATUS_WORKER_ID_TAKEN,
    STATUS_WORKER_ROLE_CONFLICT,
    EventBatch,
    Load,
    Snapshot,
    is_tiered,
)
from radixfleet_tools.agent.dram_tier import TIER_CPU
from radixfleet_tools.agent.radix_cache import RadixCache
from radixfleet_tools.agent.router_link import LinkState, RouterLink

log = logging.getLogger(__name__)


class Reporter(Lifecycle):
    def __init__(
        self,
        routers: list[str],
        *,
        worker_id: str,
        url: str,
        models: list[str],
        cache: RadixCache,
        load: Callable[[], Load],
        token: str | None = None,
        interval_s: float = 0.1,
        max_batch_events: int = 256,
        max_pending_events: int = 10_000,
        timeout_s: float = 2.0,
        block_bytes: int | None = None,
        bus=None,
        dram=None,
        role: str = "both",
        scheduling_policy: str = "",
    ) -> None:
        if not routers and bus is None:
            raise ValueError("a reporter needs at least one router URL or a bus")
        self.links = [RouterLink(u) for u in routers]
        #: radixfleet_tools.agent.bus.AgentBus or None
        self.bus = bus
        self.worker_id = worker_id
        self.url = url
        self.models = models
        #: the block size this agent hashes with, sent at registration (None: not sent)
        self.block_bytes = block_bytes
        #: its disaggregated role, sent at registration when not "both"
        self.role = role
        #: its waiting order (radixfleet_tools.agent.scheduler.ORDERS), sent at registration
        self.scheduling_policy = scheduling_policy
        self.cache = cache
        #: radixfleet_tools.agent.dram_tier.DramTier or None: its blocks go out as "cpu"-tier events
        self.dram = dram
        self.load = load
        self.epoch = secrets.token_hex(8)
        self.interval_s = interval_s
        self.max_batch_events = max_batch_events
        self.max_pending_events = max_pending_events
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._kick = asyncio.Event()
        # push rounds begun and finished (``flush``); the event is set, then replaced,
        # at the end of each round
        self._begun = 0
        self._finished = 0
        self._round_end = asyncio.Event()

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("reporter already started")
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        if self.bus is not None:
            self.bus.kick = self.kick
            await self.bus.start()
        self._task = asyncio.create_task(self._run(), name="reporter")

    def kick(self) -> None:
        """Sends the next batch now instead of at the next interval."""
        self._kick.set()

    def _streaming(self) -> bool:
        """Whether a batch sent now reaches a router as a delta (some link streams)."""
        bus = self.bus
        if bus is not None and bus.up:
            return bus.link.state is LinkState.STREAMING
        return any(link.state is LinkState.STREAMING for link in self.links)

    async def flush(self) -> bool:
        """Sends every event logged so far now and waits until it is delivered (module
        docstring, "Answers after their events"): True once a push round that began
        after the call has finished, False when no link streams or ``interval_s``
        passed first."""
        if self._task is None or self._closed or not self._streaming():
            return False
        need = self._begun + 1  # a round in progress may have drained before the call
        self.kick()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.interval_s
        while self._finished < need:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._round_end.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        poll = min(self.interval_s, 0.01)
        while True:
            self._begun += 1
            self._distribute()
            bus = self.bus
            if bus is not None and bus.up:
                bus.due_snapshot()
                for link in self.links:  # idle while the bus carries everything
                    if link.state is LinkState.STREAMING:
                        link.state = LinkState.SNAPSHOT
                    link.pending.clear()
                await self._push_bus(bus)
            else:
                await asyncio.gather(*(self._push(link) for link in self.links))
            self._finished = self._begun
            done, self._round_end = self._round_end, asyncio.Event()
            done.set()
            # next batch after interval_s, as soon as max_batch_events are waiting, a
            # poll after the cache removed blocks, or at once when kicked (flush)
            due = loop.time() + self.interval_s
            while not self._kick.is_set() and loop.time() < due:
                pending = self.cache.pending_events + (self.dram.pending_events if self.dram else 0)
                if pending >= self.max_batch_events:
                    break
                try:
                    await asyncio.wait_for(self._kick.wait(), poll)
                except asyncio.TimeoutError:
                    pass
                if self.cache.removals_pending:
                    break
            self._kick.clear()

    def _snapshot(self) -> Snapshot:
        """Every tier's blocks: the HBM tree's chains, the DRAM tier's blocks."""
        tiers = {TIER_CPU: self.dram.held_hashes()} if self.dram is not None else {}
        return Snapshot(self.cache.snapshot_blocks(), tiers={t: hs for t, hs in tiers.items() if hs})

    def _distribute(self) -> None:
        events = self.cache.drain_events()
        if self.dram is not None:
            events = [*events, *self.dram.drain_protocol_events()]
        if not events:
            return
        links = self.links if self.bus is None else [*self.links, self.bus.link]
        gpu_only = None
        for link in links:
            if link.state is not LinkState.STREAMING:
                continue  # its snapshot will carry these
            if link.tiers:
                link.pending.extend(events)
            else:  # a router that reads no tiers would take a DRAM block for an HBM one
                if gpu_only is None:
                    gpu_only = [e for e in events if not is_tiered(e)]
                link.pending.extend(gpu_only)
            if len(link.pending) > self.max_pending_events:
                link.resnapshot()

    async def _push_bus(self, bus) -> None:
        """Publishes the load, then pending deltas (or a snapshot) to the stream."""
        link = bus.link
        await bus.publish_load(load_batch(self.worker_id, self.url, self.epoch, self.load()))
        for _ in range(8):
            if link.state is LinkState.SNAPSHOT:
                self._distribute()
                link.pending.clear()
                events: list = [self._snapshot()]
                n_taken = 0
            else:
                events = link.pending[: self.max_batch_events]
                n_taken = len(events)
                if not events:
                    return
            batch = EventBatch(self.worker_id, self.url, self.epoch, link.seq, events, None)
            link.seq += 1
            if not await bus.publish_batch(
                batch, self.models, self.block_bytes, self.role, self.scheduling_policy
            ):
                link.failures += 1
                link.resnapshot()
                return
            link.sent_batches += 1
            if link.state is LinkState.SNAPSHOT:
                link.snapshots += 1
                link.state = LinkState.STREAMING
            del link.pending[:n_taken]
            if not link.pending:
                return

    async def _post(self, link: RouterLink, path: str, body: dict) -> tuple[int, str, dict]:
        """(HTTP status, the answer's ``status`` word, the answer object or {})."""
        assert self._session is not None, "start() opens the session before it starts the pushes"
        async with self._session.post(link.base + path, json=body) as resp:
            try:
                data = await resp.json(content_type=None)
                if not isinstance(data, dict):
                    data = {}
            except (ValueError, aiohttp.ContentTypeError):
                data = {}
            return resp.status, str(data.get("status", "")), data

    async def _push(self, link: RouterLink) -> None:
        try:
            if link.state is LinkState.UNREGISTERED:
                body: dict[str, object] = {
                    "worker_id": self.worker_id,
                    "url": self.url,
                    "epoch": self.epoch,
                    "models": self.models,
                }
                if self.block_bytes is not None:
                    body["block_bytes"] = self.block_bytes
                if self.role != "both":
                    body["role"] = self.role
                if self.scheduling_policy:
                    body["scheduling_policy"] = self.scheduling_policy
                code, status, data = await self._post(link, REGISTER_PATH, body)
                if code != 200:
                    link.failures += 1
                    link.refused = status or f"http_{code}"
                    if link.failures == 1 or link.failures % 50 == 0:
                        if status == STATUS_BLOCK_BYTES_MISMATCH:
                            # a configuration error, not a transient one: say what to fix
                            log.error(
                                "router %s refused registration: this agent hashes "
                                "%s-byte blocks, the router keys.block_bytes=%s; its "
                                "cache events would never match (will keep retrying)",
                                link.base,
                                self.block_bytes,
                                data.get("block_bytes"),
                            )
                        elif status == STATUS_WORKER_ID_TAKEN:
                            log.error(
                                "router %s refused registration: worker id %s is "
                                "registered at another URL; give this agent its own "
                                "--worker-id (will keep retrying)",
                                link.base,
                                self.worker_id,
                            )
                        elif status == STATUS_WORKER_ROLE_CONFLICT:
                            log.error(
                                "router %s refused registration: %s (will keep retrying)",
                                link.base,
                                (data.get("error") or {}).get("message", "role conflict"),
                            )
                        else:
                            err = data.get("error")
                            why = err.get("message") if isinstance(err, dict) else None
                            log.warning(
                                "router %s refused registration: HTTP %d%s (will keep retrying)",
                                link.base,
                                code,
                                f": {str(why)[:300]}" if why else "",
                            )
                    return
                link.refused = None
                # a router that reads tiers says so (radixfleet.wire.events, "KV tiers")
                link.tiers = TIER_CPU in (data.get("tiers") or ())
                link.state = LinkState.SNAPSHOT
            # at most a few batches per tick, so a backlog drains quickly
            for _ in range(8):
                if link.state is LinkState.SNAPSHOT:
                    # hand undelivered events to the streaming links first, so this
                    # snapshot and the deltas that follow it meet exactly
                    self._distribute()
                    link.pending.clear()
                    events: list = [self._snapshot()]
                    n_taken = 0
                else:
                    events = link.pending[: self.max_batch_events]
                    n_taken = len(events)
                batch = EventBatch(self.worker_id, self.url, self.epoch, link.seq, events, self.load())
                link.seq += 1  # never reused: a lost batch shows as a gap, then a snapshot
                code, status, _ = await self._post(link, EVENTS_PATH, batch.to_json())
                if code == 200:
                    link.sent_batches += 1
                    if link.state is LinkState.SNAPSHOT:
                        link.snapshots += 1
                        link.state = LinkState.STREAMING
                    del link.pending[:n_taken]
                    if not link.pending:
                        return
                    continue
                link.failures += 1
                if code == 404 or status == STATUS_UNKNOWN_WORKER:
                    log.info("router %s does not know worker %s: re-registering", link.base, self.worker_id)
                    link.state = LinkState.UNREGISTERED
                elif code == 409 or status == STATUS_SNAPSHOT_REQUIRED:
                    link.state = LinkState.SNAPSHOT
                else:
                    log.warning("router %s answered HTTP %d to events; will snapshot", link.base, code)
                    link.state = LinkState.SNAPSHOT
                link.pending.clear()
                return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            link.failures += 1
            if link.failures == 1 or link.failures % 50 == 0:
                log.warning("router %s unreachable (%s); will snapshot on reconnect", link.base, exc)
            if link.state is LinkState.STREAMING:
                link.state = LinkState.SNAPSHOT
            link.pending.clear()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await background.stop(self._task)
        if self.bus is not None:
            await self.bus.aclose()
        if self._session is not None:
            await self._session.close()
