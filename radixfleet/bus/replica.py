"""``BusReplica``: one router replica on the bus (docs/DESIGN.md contract 11).

    agents --core <prefix>.load.<w>--> every replica: Pool.report_load (known workers)
    agents --JetStream <prefix>.agent.<w>--> every replica: ordered consumer from the
      stream's first retained message -> register (with snapshots) -> radixfleet.index.feedback
      (epochs, seq checks; a gap or an unknown worker -> a snapshot request to that
      agent on <prefix>.ctl.snapshot.<w>, at most one per snapshot_request_s)
    this replica --core <prefix>.router.<me>--> the others: its own in-flight counts
      per worker (changed ones within flush_s, all of them every heartbeat_s) and its
      pick-time hints (worker, keys, age); received ones feed RemoteInFlight ->
      Pool.set_remote, and index.match (hit counters) + index.insert for hints,
      recorded by the policy as its own picks are (``observe_route``: prefix_load's
      session footprints and write rates; else ``observe_pick``, the unheld blocks);
      and its policy's hot-root replication decisions (radixfleet.policies.replication
      HotRoots.listener -> apply_remote), so N replicas replicate as one router;
      each hint carries its request's session key (a digest) and prompt tokens, so
      the receiving policy records the pick as the picking one did: a session whose
      turns go to different replicas is one session in every replica's footprints
    this replica --core <prefix>.limits.<me>--> the others: what it took from its
      tenancy rate-limit buckets (radixfleet.route.tenancy ``drain``), every
      limits_interval_s, numbered (this process's epoch, then 1, 2, ...);
      received ones are charged to this replica's buckets (``debit``) once each
      (``Sequences``: a replayed or late one is dropped as ``replayed``), so the
      fleet admits about one limit (bus.share_limits)

Warm start: on each (re)subscription the stream's last sequence is read; the
replica is *caught up* once it has applied that message (at once for an empty
stream) and one ``heartbeat_s`` has passed since it subscribed, so that every live
peer's full in-flight counts have reached it too (until then its views would show
the peers' requests as idle workers). A reconnection that has to replay starts
over (``caught_up`` false again, ``lag`` in ``describe()``, both in ``/readiness``).
Agents' snapshots carry the ``Nats-Rollup: sub`` header, so the stream
keeps per worker only its last snapshot and the deltas since: the replay is bounded
by the fleet's cache size, not by uptime. ``ready()`` is true once caught up, or
when the bus cannot be reached (degraded: logged), or after ``ready_timeout_s``
from start (so a bus blip never takes every replica out of service at once).

Degrading: while the bus is not UP nothing is published, other replicas' counts
expire (``replica_ttl_s``), and agents fall back to direct push; requests never
wait on the bus. Malformed and foreign messages are counted per cause, logged
once per cause, ignored. Messages from a replica keyed with another
``keys.block_bytes`` have their hints ignored (``config_mismatch``).

Lifecycle: ``await start()``, ``await aclose()`` (idempotent; says ``bye`` so the
others drop this replica's counts at once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from prometheus_client import CollectorRegistry

from radixfleet.bus.remote_load import RemoteInFlight
from radixfleet.common.bus_connection import BusConnection, BusMetrics, BusState, Problems, check_exposure
from radixfleet.config import BusConfig, ConfigError, KeysConfig, bus_setting, parse_worker_url
from radixfleet.fleet.pool import HealthState, Pool
from radixfleet.index.feedback import Feedback
from radixfleet.keys import BYTES_PER_TOKEN
from radixfleet.policies.base import RouteRequest
from radixfleet.wire.bus_wire import (
    BadMessage,
    BusKey,
    RouterMessage,
    Sequences,
    Subjects,
    build_limits,
    build_snapshot_request,
    parse_agent,
    parse_limits,
    parse_load,
    parse_router,
)
from radixfleet.wire.errors import Conflict, Overloaded, RequestError
from radixfleet.wire.events import STATUS_OK
from radixfleet.wire.extras import require
from radixfleet.wire.identifiers import MAX_NAME_CHARS

log = logging.getLogger("radixfleet.bus")

#: beyond twice bus.max_skew_s, how long a peer's last limits sequence is kept after
#: it was heard (the delivery's latency; ``Sequences``)
_DELIVERY_SLACK_S = 10.0


def remote_request(
    hashes: list[int], session: str | None, prompt_tokens: int | None, bt: int
) -> RouteRequest:
    """A peer's pick as this replica's policy records it: the request with the
    hint's keys, its session key and its prompt tokens (a peer that sends no turn:
    the prompt as its whole blocks, the partial tail is not keyed)."""
    return RouteRequest(hashes, len(hashes) * bt if prompt_tokens is None else prompt_tokens, bt, session)


def default_replica_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return f"{host or 'router'}-{os.getpid()}"


class BusReplica:
    def __init__(
        self,
        cfg: BusConfig,
        *,
        pool: Pool,
        index,
        feedback: Feedback,
        block_bytes: int,
        registry: CollectorRegistry,
        clock=time.monotonic,
        policy=lambda: None,
        agent_token: bytes = b"",
        tenancy=lambda: None,
        url_check=None,
    ) -> None:
        # the agent credential signs and checks every message (radixfleet.wire.bus_wire.BusKey)
        check_exposure(cfg.url, agent_token, "bus.url")
        self.key = BusKey(agent_token, cfg.max_skew_s)
        self.cfg = cfg
        self.pool = pool
        self.index = index
        self.feedback = feedback
        self.block_bytes = block_bytes
        self.clock = clock
        #: the router's current policy (a reload may replace it); its hot-root
        #: replication record (``policy.hot``, prefix_load) is shared too
        self.policy = policy
        #: the router's radixfleet.route.tenancy.Tenancy (None: no limits shared)
        self.tenancy = tenancy
        #: ``await url_check(worker_id, url)`` raises a ``RequestError`` for a worker URL
        #: that may not be registered (radixfleet.fleet.registration); None: not checked
        self.url_check = url_check
        self._hot = None  # the HotRoots we listen to
        self._repl: list[tuple[str, int, int, str]] = []
        self.replica = cfg.replica_id or default_replica_id()
        self.subjects = Subjects(cfg.subject_prefix)
        self.metrics = BusMetrics(registry)
        self.bad = Problems(self.metrics.bad, "bus messages")
        self.remote = RemoteInFlight()
        self.conn = BusConnection(
            cfg.url,
            name=f"router-{self.replica}",
            metrics=self.metrics,
            on_up=self._on_up,
            on_down=self._on_down,
            connect_timeout_s=cfg.connect_timeout_s,
            backoff_s=cfg.backoff_s,
            backoff_max_s=cfg.backoff_max_s,
            options=cfg.credentials().connect_options(cfg.url, bus_setting),
            subjects=self.subjects,
        )
        #: stream sequence applied last, and the stream's identity (its creation time)
        self.applied_seq = 0
        self._stream_created = None
        #: the stream's last sequence when we subscribed; caught up once applied
        self.target_seq = 0
        self._applied_target = False  # target_seq applied since the last subscription
        self._subscribed: float | None = None  # when; peers' heartbeats due by + heartbeat_s
        self._caught_up = False  # stream applied and peers' counts heard (module docstring)
        self.caught_up_s: float | None = None  # seconds from start() to caught up
        self._started = 0.0
        self._ready_logged = False
        self._seq = 0  # our router messages
        self._dirty: set[str] = set()
        self._hints: list[tuple[str, float, list[int], str | None, int]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._limits_task: asyncio.Task | None = None
        #: our limits messages: this process's epoch (its start, unix ms) and the last
        #: sequence sent in it
        self._limits_epoch = int(time.time() * 1000)
        self._limits_seq = 0
        #: the peers' last limits (epoch, seq) applied; forgotten once any replay of
        #: what they sent would be stale anyway (``Sequences``)
        self._limits_seen = Sequences(2 * cfg.max_skew_s + _DELIVERY_SLACK_S)
        self._asked: dict[str, float] = {}  # worker -> when we last asked a snapshot
        self._subs: list = []
        self._pending: set[asyncio.Future] = set()  # snapshot requests being sent
        self._closed = False

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._started = self.clock()
        self.pool.tap = self
        self.pool.listeners.append(self)
        await self.conn.start()
        self._task = asyncio.create_task(self._publisher(), name="radixfleet-bus-publisher")
        if self.cfg.share_limits:
            self._limits_task = asyncio.create_task(self._limits_publisher(), name="radixfleet-bus-limits")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.pool.tap is self:
            self.pool.tap = None
        if self in self.pool.listeners:
            self.pool.listeners.remove(self)
        for task in (self._task, self._limits_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        nc = self.conn.nc
        if self.conn.up and nc is not None:
            try:
                self._seq += 1
                subject = self.subjects.router(self.replica)
                data = RouterMessage(
                    self.replica, self._seq, self.block_bytes, True, {}, [], bye=True
                ).to_bytes()
                await nc.publish(subject, data, headers=self.key.sign(subject, data) or None)
                await asyncio.wait_for(nc.flush(), 1.0)
            except Exception:  # noqa: BLE001 - leaving; the others expire us anyway
                pass
        await self.conn.aclose()

    # ---------------------------------------------------------------- readiness

    def configure(self, keys: KeysConfig) -> None:
        """Takes a reloaded ``keys`` section: agents' hints in a block size other than
        its ``block_bytes`` are ignored from now on."""
        self.block_bytes = keys.block_bytes

    def _check_caught_up(self) -> bool:
        """Whether the stream is applied and the peers' counts are heard now."""
        if (
            not self._caught_up
            and self._applied_target
            and self._subscribed is not None
            and self.clock() - self._subscribed >= self.cfg.heartbeat_s
        ):
            self._caught_up = True
            if self.caught_up_s is None:
                self.caught_up_s = self.clock() - self._started
            log.info(
                "bus: caught up with stream %s at seq %d and the peers' counts (%d index entries, %d peers)",
                self.cfg.stream,
                self.target_seq,
                self.index.stats().holder_entries,
                len(self.remote.replicas),
            )
        return self._caught_up

    @property
    def caught_up(self) -> bool:
        """The stream applied and the peers' counts heard, as of now."""
        return self._check_caught_up()

    def ready(self) -> bool:
        if self._check_caught_up():
            return True
        why = None
        if self.conn.state is BusState.DOWN and self.conn.attempts > 0:
            why = "the bus is unreachable: routing with direct pushes only"
        elif self.clock() - self._started >= self.cfg.ready_timeout_s:
            why = f"not caught up with the stream after {self.cfg.ready_timeout_s} s"
        if why is None:
            return False
        if not self._ready_logged:
            self._ready_logged = True
            log.warning("reporting ready without the bus's history: %s", why)
        return True

    def describe(self) -> dict:
        return {
            "url": self.cfg.url,
            "replica": self.replica,
            "state": self.conn.state.value,
            "caught_up": self._check_caught_up(),
            "applied_seq": self.applied_seq,
            "target_seq": self.target_seq,
            "lag": 0 if self._applied_target else max(0, self.target_seq - self.applied_seq),
            "caught_up_s": self.caught_up_s,
            "replicas": sorted(self.remote.replicas),
        }

    # ------------------------------------------------------------ connection

    async def _on_up(self, nc, js) -> None:
        api = require("nats.js.api", "bus", "the bus")  # connected: nats-py is there
        c = self.cfg
        cfg = api.StreamConfig(
            name=c.stream,
            subjects=[self.subjects.agents],
            max_age=c.max_age_s,
            max_bytes=c.max_bytes,
            allow_rollup_hdrs=True,
            discard=api.DiscardPolicy.OLD,
            storage=api.StorageType.FILE if c.storage == "file" else api.StorageType.MEMORY,
        )
        try:
            info = await js.add_stream(cfg)
        except Exception as exc:  # noqa: BLE001 - another replica made it differently
            self.conn.report(
                "stream_config", "stream %s exists with other settings (%s); using it as it is", c.stream, exc
            )
            info = await js.stream_info(c.stream)
        created = info.created
        last = info.state.last_seq
        start_seq = 1
        if (
            created is not None
            and created == self._stream_created
            and self.applied_seq
            and self.applied_seq <= last
        ):
            start_seq = self.applied_seq + 1  # the same stream survived: resume
        else:
            self.applied_seq = 0  # a new stream (the server lost it): replay it all
        self._stream_created = created
        self.target_seq = last
        self._subscribed = self.clock()
        self._applied_target = self._caught_up = False  # until replayed and peers heard
        if last < start_seq:
            self._mark_caught_up()
        else:
            self.metrics.lag.set(last - start_seq + 1)
        self._subs = [
            await nc.subscribe(self.subjects.routers, cb=self._on_router),
            await nc.subscribe(self.subjects.loads, cb=self._on_load),
            await nc.subscribe(self.subjects.all_limits, cb=self._on_limits),
            await js.subscribe(
                self.subjects.agents,
                cb=self._on_agent,
                ordered_consumer=True,
                stream=c.stream,
                idle_heartbeat=2.0,
                config=api.ConsumerConfig(
                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq
                ),
            ),
        ]
        self._wake.set()  # a full heartbeat now: the others learn our counts at once

    def _on_down(self) -> None:
        self._subs = []
        # nothing fresh will come: the others' counts age out through replica_ttl_s

    def _mark_caught_up(self) -> None:
        """The stream is applied up to ``target_seq`` (``caught_up`` also waits for the
        peers' heartbeats: ``_check_caught_up``)."""
        self.metrics.lag.set(0)
        self._applied_target = True

    # ------------------------------------------------------- agents' batches

    async def _on_agent(self, msg) -> None:
        now = self.clock()
        try:
            seq = msg.metadata.sequence.stream
            stored = msg.metadata.timestamp.timestamp()
        except Exception:  # noqa: BLE001 - not a JetStream delivery
            seq = stored = None
        try:
            self.key.verify(msg.subject, msg.data, msg.headers, stored)
            token = msg.subject.rsplit(".", 1)[-1]
            m = parse_agent(msg.data, token)
            if m.register and self.url_check is not None:
                await self._check_url(m)
            self._apply_agent(m, now)
        except BadMessage as exc:
            self.bad.report(exc.cause, "ignored a message on %s: %s", msg.subject, exc)
        except Exception:  # noqa: BLE001 - a peer's message must never stop the consumer
            self.metrics.bad.labels("error").inc()
            log.exception("bus: applying a message on %s failed", msg.subject)
        if seq is not None:
            self.applied_seq = seq
            if not self._applied_target:
                if seq >= self.target_seq:
                    self._mark_caught_up()
                else:
                    self.metrics.lag.set(self.target_seq - seq)

    async def _on_load(self, msg) -> None:
        try:
            self.key.verify(msg.subject, msg.data, msg.headers)
            b = parse_load(msg.data, msg.subject.rsplit(".", 1)[-1])
        except BadMessage as exc:
            self.bad.report(exc.cause, "ignored a message on %s: %s", msg.subject, exc)
            return
        w = self.pool.get(b.worker_id)
        assert b.load is not None, "parse_load returns a batch with its load"
        if w is not None:
            self.pool.report_load(w, b.load, self.clock())
            self.metrics.received.labels("load").inc()

    async def _check_url(self, m) -> None:
        """``BadMessage`` for a registration whose URL may not be registered (what
        ``POST /register`` refuses: the router itself, a host outside
        ``registration.allow``); the guard counts and logs it."""
        b = m.batch
        try:
            url = parse_worker_url(b.url, "url")
        except ConfigError as exc:
            raise BadMessage("bad_register", str(exc)) from None
        w = self.pool.get(b.worker_id)
        if w is not None and w.url == url:
            return  # registered at this URL already
        try:
            await self.url_check(b.worker_id, url)
        except RequestError as exc:
            raise BadMessage(exc.code, exc.message) from None

    def _apply_agent(self, m, now: float) -> None:
        b = m.batch
        if m.register:
            if m.block_bytes is not None and m.block_bytes != self.block_bytes:
                raise BadMessage(
                    "block_bytes_mismatch",
                    f"agent {b.worker_id} hashes {m.block_bytes}-byte blocks, "
                    f"this router keys.block_bytes={self.block_bytes}",
                )
            try:
                url = parse_worker_url(b.url, "url")
            except ConfigError as exc:
                raise BadMessage("bad_register", str(exc)) from None
            w = self.pool.get(b.worker_id)
            if w is None or w.url != url or (w.epoch is not None and w.epoch != b.epoch):
                # new to us, moved, or a new agent process: what POST /register does
                # (the same refusals: an id held at another URL, the new-worker rate)
                try:
                    self.pool.register(
                        b.worker_id, url, b.epoch, m.models, m.block_bytes, m.role, m.scheduling_policy
                    )
                except (Conflict, Overloaded) as exc:
                    raise BadMessage(exc.code, str(exc)) from None
            else:
                # a periodic snapshot is no proof of health: health checks decide that
                w.announce(m.models, m.block_bytes, m.scheduling_policy)
        code, word = self.feedback.apply(b, now)
        self.metrics.received.labels("agent").inc()
        if word != STATUS_OK:
            self._ask_snapshot(b.worker_id, now)

    def _ask_snapshot(self, wid: str, now: float) -> None:
        last = self._asked.get(wid)
        if last is not None and now - last < self.cfg.snapshot_request_s:
            return
        nc = self.conn.nc
        if not self.conn.up or nc is None:
            return
        self._asked[wid] = now
        t = asyncio.ensure_future(
            self._publish(
                self.subjects.snapshot_request(wid),
                build_snapshot_request(wid, self.replica),
                "snapshot_request",
            )
        )
        self._pending.add(t)
        t.add_done_callback(self._pending.discard)

    async def _publish(self, subject: str, data: bytes, kind: str) -> None:
        nc = self.conn.nc
        if nc is None:
            return
        try:
            await nc.publish(subject, data, headers=self.key.sign(subject, data) or None)
            self.metrics.published.labels(kind).inc()
        except Exception as exc:  # noqa: BLE001 - the bus is best effort for routers
            self.conn.lost("publish", "publish failed (%s: %s)", type(exc).__name__, exc)

    # ------------------------------------------------ our pick-time state out

    def moved(self, w) -> None:
        """Pool.tap: a local pick, prefill or finish on ``w``."""
        self._dirty.add(w.id)
        self._wake.set()

    def hint(
        self, wid: str, hashes, now: float, session: str | None = None, prompt_tokens: int | None = None
    ) -> None:
        """DataPlane._pick inserted ``hashes`` for ``wid`` at ``now``, for a request of
        ``prompt_tokens`` (default: its whole blocks) in session ``session`` (its key:
        ``TenantSalts.session_key``)."""
        if self.cfg.share_hints and hashes and self.conn.up:
            if prompt_tokens is None:
                prompt_tokens = len(hashes) * max(1, self.block_bytes // BYTES_PER_TOKEN)
            self._hints.append((wid, now, list(hashes), session, prompt_tokens))
            self._wake.set()

    def _replicated(self, op: str, key: int, depth: int, worker: str) -> None:
        """HotRoots listener: this replica's policy added or retired a replica."""
        if self.conn.up:
            self._repl.append((op, key, depth, worker))
            self._wake.set()

    def _listen_to_policy(self):
        """The current policy's HotRoots (listened to), or None."""
        hot = getattr(self.policy(), "hot", None)
        if hot is not self._hot:
            if self._hot is not None and self._hot.listener == self._replicated:
                self._hot.listener = None
            self._hot = hot
            if hot is not None and hasattr(hot, "apply_remote"):
                hot.listener = self._replicated
        return self._hot

    async def _publisher(self) -> None:
        c = self.cfg
        next_full = 0.0
        self._listen_to_policy()
        while True:
            timeout = max(0.0, next_full - self.clock())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            if c.flush_s:
                await asyncio.sleep(c.flush_s)  # coalesce a burst into one message
            self._wake.clear()
            now = self.clock()
            self._expire(now)
            self._listen_to_policy()
            if not self.conn.up:
                self._dirty.clear()
                self._hints.clear()
                self._repl.clear()
                next_full = now + c.heartbeat_s
                continue
            full = now >= next_full
            if full:
                names = [w.id for w in self.pool]
                next_full = now + c.heartbeat_s
            else:
                names = list(self._dirty)
            self._dirty.clear()
            inflight = {}
            for wid in names:
                w = self.pool.get(wid)
                if w is not None and (w.in_flight or w.in_flight_tokens or not full):
                    inflight[wid] = (max(w.in_flight, 0), max(w.in_flight_tokens, 0))
            hints = [(wid, now - t, hs) for wid, t, hs, _, _ in self._hints]
            turns = [(session, pt) for _, _, _, session, pt in self._hints]
            self._hints = []
            repl, self._repl = self._repl, []
            if not (full or inflight or hints or repl):
                continue
            self._seq += 1
            msg = RouterMessage(
                self.replica, self._seq, self.block_bytes, full, inflight, hints, repl=repl, turns=turns
            )
            await self._publish(self.subjects.router(self.replica), msg.to_bytes(), "router")

    # ------------------------------------------- the others' pick-time state in

    async def _on_router(self, msg) -> None:
        try:
            self.key.verify(msg.subject, msg.data, msg.headers)
            m = parse_router(msg.data)
        except BadMessage as exc:
            self.bad.report(exc.cause, "ignored a message on %s: %s", msg.subject, exc)
            return
        if m.replica == self.replica:
            return
        now = self.clock()
        self.metrics.received.labels("router").inc()
        self._set_remote(self.remote.apply(m, now))
        self.metrics.replicas.set(len(self.remote.replicas))
        if not (m.hints and self.cfg.share_hints) and not m.repl:
            return
        if m.block_bytes != self.block_bytes:
            self.bad.report(
                "config_mismatch",
                "replica %s keys with block_bytes=%d, this one %d: its hints are ignored",
                m.replica,
                m.block_bytes,
                self.block_bytes,
            )
            return
        hot = self._listen_to_policy()
        if hot is not None:
            for op, key, depth, wid in m.repl:
                if self.pool.get(wid) is not None:
                    hot.apply_remote(op, key, depth, wid, now)
        if not self.cfg.share_hints:
            return
        idx = self.index
        policy = self.policy()
        route = getattr(policy, "observe_route", None)
        observe = getattr(policy, "observe_pick", None)
        for i, (wid, age, hashes) in enumerate(m.hints):
            w = self.pool.get(wid)
            if w is not None and w.health is HealthState.HEALTHY and hashes:
                t = now - age
                # counted as if this replica had routed it: the decayed hit counters
                # (hot roots, replication) then see the fleet's rate, not 1/N of it
                match = idx.match(hashes, t, count=True)
                idx.insert(wid, hashes, t)
                bt = self._block_tokens(w)
                if route is not None:
                    # and the rest of the policy's own record of a pick, as if picked
                    # here (prefix_load: the session's footprint, the KV written), with
                    # the hint's session key and prompt tokens (``remote_request``)
                    route(remote_request(hashes, *m.turn(i), bt), match, wid, t)
                elif observe is not None:
                    # the KV it wrote there, in the policy's write rates: the blocks
                    # it did not hold
                    observe(wid, (len(hashes) - match.blocks.get(wid, 0)) * bt, t)

    # ------------------------------------------------- rate limits, both ways

    async def _limits_publisher(self) -> None:
        """Every ``limits_interval_s``: what this replica took from its rate-limit
        buckets since the last time, to the others (dropped while the bus is down:
        the limits are then per replica, as without a bus)."""
        subject = self.subjects.limits(self.replica)
        while True:
            await asyncio.sleep(self.cfg.limits_interval_s)
            tenancy = self.tenancy()
            if tenancy is None:
                continue
            # (a name too long for the wire stays this replica's own limit)
            used = [u for u in tenancy.drain() if len(u[1]) <= MAX_NAME_CHARS]
            if not used or not self.conn.up:
                continue
            msgs = build_limits(self.replica, self._limits_epoch, self._limits_seq + 1, used)
            self._limits_seq += len(msgs)
            for data in msgs:
                await self._publish(subject, data, "limits")

    async def _on_limits(self, msg) -> None:
        try:
            self.key.verify(msg.subject, msg.data, msg.headers)
            m = parse_limits(msg.data, msg.subject.rsplit(".", 1)[-1])
        except BadMessage as exc:
            self.bad.report(exc.cause, "ignored a message on %s: %s", msg.subject, exc)
            return
        tenancy = self.tenancy()
        if m.replica == self.replica or tenancy is None or not self.cfg.share_limits:
            return
        now = self.clock()
        if not self._limits_seen.accept(m.replica, m.epoch, m.seq, now):
            self.bad.report(
                "replayed",
                "ignored a limits message on %s: epoch %d seq %d is not after the last applied "
                "from %s (a replay, or late)",
                msg.subject,
                m.epoch,
                m.seq,
                m.replica,
            )
            return
        self.metrics.received.labels("limits").inc()
        for kind, name, requests, tokens in m.used:
            tenancy.debit(kind, name, requests, tokens, now)

    def _block_tokens(self, w) -> int:
        """Tokens per key of ``w``'s hints: its engine's token blocks, else the byte
        space's (``keys.block_bytes`` / 4)."""
        size = getattr(getattr(w.engine, "space", None), "block_size", None)
        return size if isinstance(size, int) and size > 0 else max(1, self.block_bytes // BYTES_PER_TOKEN)

    def worker_added(self, w) -> None:
        """Pool listener: a new worker starts with what the others have on it."""
        r, t = self.remote.total(w.id)
        self.pool.set_remote(w, r, t)

    def worker_removed(self, w) -> None:
        pass

    def _expire(self, now: float) -> None:
        changed = self.remote.expire(now, self.cfg.replica_ttl_s)
        if changed:
            log.info("bus: dropped the counts of replicas silent for %.1f s", self.cfg.replica_ttl_s)
            self._set_remote(changed)
            self.metrics.replicas.set(len(self.remote.replicas))

    def _set_remote(self, wids) -> None:
        for wid in wids:
            w = self.pool.get(wid)
            if w is not None:
                r, t = self.remote.total(wid)
                self.pool.set_remote(w, r, t)

    def check(self) -> None:
        self.remote.check()
        for w in self.pool:
            assert (w.remote_in_flight, w.remote_tokens) == self.remote.total(w.id), w.id
