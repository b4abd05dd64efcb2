"""Subscribing to an engine's KV-cache events over ZMQ, in order, with replay.

vLLM and SGLang publish each batch of KV events as one ZMQ PUB message of three
frames — ``topic``, ``seq`` (8 bytes, big-endian, +1 per batch from 0 at process
start), ``payload`` (msgpack, ``radixfleet.engines.kv_events``) — and may serve missed
batches from a replay endpoint. ``KvEventSubscriber`` is one asyncio SUB socket on
one engine (one data-parallel rank: each rank publishes on its own port) that hands
decoded batches, in sequence order, to an ``EventConsumer``::

    engine PUB --(topic, seq, payload)--> SUB --decode--> consumer.on_batch(seq, batch)
    engine ROUTER <--[b"", start_seq]-- DEALER            (replay, on a gap or a join)
                  --[b"", topic, seq, payload]...-->      vLLM: topic, seq, payload
                  --[b"", (b""), seq=-1, b""]-->          end marker (SGLang: no topic)

Who binds (vLLM's rule, ``ZmqEventPublisher._is_bind_endpoint``): the publisher
binds an endpoint with a wildcard (``*`` or ``::``) or an ``ipc://``/``inproc://``
one, and *connects* to any other (a concrete ``tcp://host:port``) — then the
subscriber must bind that address. ``subscriber_endpoint(engine_endpoint, host)``
applies the rule to the string the engine was configured with; ``mode`` overrides
it. Several subscribers (router replicas) on one engine work when the engine binds
(PUB fans out to every SUB); an engine that connects reaches one subscriber only.

Order and truth. The subscriber keeps the last sequence number delivered and tells
the consumer, before the batch that reveals it:

- ``on_reset(reason, seq)`` — what came before is unknown: ``"joined"`` (the first
  batch seen: the engine may have cached blocks before we subscribed),
  ``"reconnected"`` (a new connection to the engine was made: its process may have
  restarted, or batches were lost while disconnected; read from the socket monitor),
  ``"restarted"`` (the sequence went backwards: a new engine process). The consumer
  drops the engine's entries; what follows is a suffix of the engine's history.
- ``on_gap(first_missing, next_seq)`` — batches in [first_missing, next_seq) are lost
  for good: no replay endpoint, replay failed or no longer holds them, or a batch
  could not be decoded. The consumer must drop the engine's entries as well.
- ``on_batch(seq, batch)`` — the next batch, in order (replayed or live).
- ``on_error(cause, detail)`` — a frame or payload was refused (``KvEventCause``),
  or replay failed; counted here too, and logged once per cause (WARNING the first
  time, DEBUG after), never raised: nothing a peer sends stops the loop.

With a replay endpoint, a gap is first filled from it (one DEALER request per gap,
bounded by ``replay_timeout_s``, then ``on_gap`` for whatever it could not give); a
join, a reconnection or a restart replays from 0, so a subscriber that starts after
the engine still learns what the engine's replay buffer (vLLM: ``buffer_steps``
batches, 10,000 by default) still holds, after ``on_reset``. Live messages wait in the
SUB socket meanwhile (receive high-water mark ``rcvhwm``); replayed batches at or past
the live one being handled are skipped, since they arrive live anyway.

The join does not wait for the engine's next batch: on the first connection the
subscriber asks the replay endpoint at once and, if it answers (even with nothing:
an engine that has published nothing holds nothing), tells the consumer
``on_reset("joined")``, the history and ``on_synced`` — so an idle engine's
entries are known before the first request, not rebuilt while it runs; live copies
of batches the join replayed are skipped. A join whose replay fails (a full buffer
answers slowly on a busy host) is tried again, backed off, with a replay deadline that
doubles up to ``_MAX_JOIN_REPLAY_S``, until it succeeds or a live batch starts the
stream: an idle engine would otherwise stay out of sync until its first request. A
reset's replay is always fetched *before* ``on_reset``: while it is under way the
consumer keeps what it knew (an index emptied for the replay's round trip sent a
conversation's next turn away from the worker that held it).

Lifecycle: ``start()`` once, ``aclose()`` (idempotent), or ``async with``. Callbacks
run on the event loop, synchronously, and must not block; an exception from one is
logged with its traceback and counted (``consumer_error``), and the loop goes on.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import time
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from radixfleet.common import background
from radixfleet.common.background import Lifecycle
from radixfleet.engines.kv_events import DecodedBatch, KvEventCause, KvEventError, decode_batch

log = logging.getLogger("radixfleet.engines.events")

#: the longest replay deadline a retried join grows to (a full vLLM buffer, 10,000
#: batches, on a busy host)
_MAX_JOIN_REPLAY_S = 30.0

#: the replay end marker: sequence -1 as 8 signed big-endian bytes (vLLM, SGLang)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: a payload larger than this is refused by ZMQ itself (the connection is dropped):
#: a batch is one engine step's events, kilobytes; 64 MiB is a peer gone wrong
DEFAULT_MAX_MSG_BYTES = 64 * 2**20

ResetReason = Literal["joined", "reconnected", "restarted"]
Mode = Literal["auto", "bind", "connect"]


class EventConsumer(Protocol):
    """Who receives a subscriber's batches (module docstring). Called on the event
    loop, synchronously; must not block."""

    def on_batch(self, seq: int, batch: DecodedBatch) -> None:
        """The next batch in sequence order."""

    def on_gap(self, first_missing: int, next_seq: int) -> None:
        """Batches [first_missing, next_seq) are lost: drop what you know."""

    def on_reset(self, reason: ResetReason, seq: int) -> None:
        """History before ``seq`` is unknown (joined, reconnected, restarted)."""

    def on_error(self, cause: KvEventCause, detail: str) -> None:
        """A frame, payload or replay refused (count it; the subscriber logs)."""

    def on_synced(self, seq: int) -> None:
        """A join's replay answered: what was delivered since ``on_reset`` is the
        engine's known history up to ``seq`` (-1: it has published nothing)."""


class SubscriberState(enum.Enum):
    NEW = "new"  # constructed; start() not called yet
    RUNNING = "running"  # socket open, the receive task delivers batches
    CLOSED = "closed"  # sockets closed (or never opened); start() refuses


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    batches: int  # batches delivered (replayed included)
    replayed: int  # of those, from the replay endpoint
    gaps: int  # on_gap calls
    lost_batches: int  # batches reported lost by those gaps
    resets: dict[str, int]  # on_reset calls per reason
    errors: dict[str, int]  # refused frames/payloads/replays per KvEventCause value
    unknown_events: int  # events skipped for an unknown type
    last_seq: int | None  # the last sequence number delivered (None: none yet)
    connections: int  # successful handshakes with the engine (monitor)
    connected: bool  # a connection to the engine is up now


_BIND_RE = re.compile(r"^(ipc|inproc)://")


def subscriber_endpoint(
    engine_endpoint: str, engine_host: str | None = None, mode: Mode = "auto"
) -> tuple[Literal["bind", "connect"], str]:
    """Where and how the subscriber attaches, from the endpoint the *engine* was given.

    ``auto`` follows vLLM's rule: an engine endpoint with ``*`` or ``::`` or an
    ``ipc://``/``inproc://`` one is bound by the engine, so the subscriber connects
    (to ``engine_host`` in place of the wildcard); any other is connected to by the
    engine, so the subscriber binds it. ``bind``/``connect`` use ``engine_endpoint``
    as given. Raises ``ValueError`` (with the fix) for an endpoint it cannot use.
    """
    ep = engine_endpoint.strip()
    if not ep.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"events endpoint {engine_endpoint!r}: want tcp://, ipc:// or inproc://")
    if mode == "bind" or mode == "connect":
        return mode, ep
    if mode != "auto":
        raise ValueError(f"mode must be auto, bind or connect, got {mode!r}")
    if _BIND_RE.match(ep):
        return "connect", ep
    if "*" in ep or "::" in ep:
        if not engine_host:
            raise ValueError(
                f"events endpoint {ep!r} is a wildcard the engine binds; "
                "say which host to connect to (engine_host)"
            )
        return "connect", replace_wildcard(ep, engine_host)
    return "bind", ep


def refusal(endpoint: str, engine_host: str | None, mode: str, exc: Exception) -> tuple[str, str]:
    """Why a subscriber could not attach to the engine's ``endpoint`` (``exc``, from
    binding or connecting it), as (cause, what to write): ``address_in_use`` (the
    router must bind it and another socket holds it) or ``endpoint_refused``."""
    addr, how = str(endpoint), "?"
    if mode != "off":  # (a subscriber was made: never off)
        try:
            how, addr = subscriber_endpoint(endpoint, engine_host, cast(Mode, mode))
        except ValueError:
            pass
    if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EADDRINUSE:
        why = (
            "events.mode is bind"
            if mode == "bind"
            else f"the engine's endpoint {endpoint} is a concrete address, so the engine connects to it"
        )
        return "address_in_use", (
            f"the router must bind {addr} ({why}), and another socket holds it (if "
            "the engine binds it too, both sides bind): give the engine a wildcard "
            "endpoint such as tcp://*:PORT (it binds, the router connects; events.mode "
            f"auto), or free {addr}"
        )
    return "endpoint_refused", (
        f"the router would {how} {addr} for the engine's endpoint {endpoint}; "
        "give the engine a tcp://*:PORT (it binds, the router connects) or a "
        "tcp://ROUTER_HOST:PORT the router can bind"
    )


def replace_wildcard(endpoint: str, host: str) -> str:
    """``tcp://*:P`` / ``tcp://[::]:P`` / ``tcp://:::P`` -> ``tcp://host:P`` (IPv6 hosts
    bracketed). Other endpoints are returned unchanged."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://") :]
    addr, sep, port = rest.rpartition(":")
    if not sep or addr not in ("*", "[::]", "::", "[*]"):
        return endpoint
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{h}:{port}"


class _CauseLog:
    """Counts refusals per cause; logs each cause at WARNING the first time, DEBUG after."""

    __slots__ = ("name", "counts")

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: dict[str, int] = {}  # KvEventCause value -> count

    def __call__(self, cause: KvEventCause, detail: str) -> None:
        c = cause.value
        n = self.counts.get(c, 0)
        self.counts[c] = n + 1
        if n == 0:
            log.warning(
                "kv events from %s: %s (%s); further %s are counted, not logged", self.name, detail, c, c
            )
        else:
            log.debug("kv events from %s: %s (%s)", self.name, detail, c)


class KvEventSubscriber(Lifecycle):
    """One engine's KV events, decoded and in order, to one consumer (module docstring).

    ``endpoint`` is the address to bind or connect as ``mode`` says (see
    ``subscriber_endpoint`` to derive both from the engine's own setting);
    ``replay_endpoint`` the engine's replay ROUTER address to connect to (None: no
    replay). ``topic`` must equal the engine's (vLLM ``kv_events_config.topic``;
    ZMQ filters by prefix, so other topics sharing the prefix are refused here).
    Only the subscriber's task mutates its fields.
    """

    def __init__(
        self,
        endpoint: str,
        consumer: EventConsumer,
        *,
        mode: Literal["bind", "connect"] = "connect",
        topic: str = "",
        replay_endpoint: str | None = None,
        replay_timeout_s: float = 2.0,
        max_replay_batches: int = 100_000,
        rcvhwm: int = 100_000,
        max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
        name: str | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if mode not in ("bind", "connect"):
            raise ValueError(f"mode must be 'bind' or 'connect' (see subscriber_endpoint), got {mode!r}")
        if not replay_timeout_s > 0:
            raise ValueError(f"replay_timeout_s must be positive, got {replay_timeout_s}")
        if max_replay_batches <= 0 or rcvhwm < 0 or max_msg_bytes <= 0:
            raise ValueError("max_replay_batches, max_msg_bytes must be positive, rcvhwm >= 0")
        self.endpoint = endpoint
        self.mode = mode
        self.topic = topic.encode("utf-8")
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.max_replay_batches = max_replay_batches
        self.name = name or endpoint  # for log lines
        self.state = SubscriberState.NEW
        self._consumer = consumer
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._rcvhwm = rcvhwm
        self._max_msg_bytes = max_msg_bytes
        self._sub: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._bound: str | None = None  # the address actually bound (bind mode)
        # sequence state
        #: last seq delivered; None: nothing yet; -1: nothing, but the join's replay
        #: said the engine has published nothing (its history is known)
        self._last: int | None = None
        self._rejoin = False  # a new connection was made since the last batch
        self._join_due = False  # first connection made: ask the replay endpoint now
        #: live copies of batches up to here were delivered by the join's replay
        self._replayed_upto: int | None = None
        # counters
        self._batches = self._replayed = self._gaps = self._lost = self._unknown = 0
        self._resets: dict[str, int] = {}
        self._connections = 0
        self._connected = False
        self._errors = _CauseLog(self.name)
        self.last_batch_at: float | None = None  # time.monotonic() of the last delivery

    @classmethod
    def for_engine(
        cls,
        engine_endpoint: str,
        consumer: EventConsumer,
        *,
        engine_host: str | None = None,
        mode: Mode = "auto",
        engine_replay_endpoint: str | None = None,
        **kwargs,
    ) -> KvEventSubscriber:
        """A subscriber for an engine configured with ``engine_endpoint`` (and, if
        any, ``engine_replay_endpoint``: vLLM's ``replay_endpoint``, a ROUTER it
        always binds), ``engine_host`` standing in for their wildcards. Other keyword
        arguments as the constructor's. Raises ``ValueError`` naming the fix."""
        how, addr = subscriber_endpoint(engine_endpoint, engine_host, mode)
        replay = None
        if engine_replay_endpoint:
            replay = engine_replay_endpoint.strip()
            if "*" in replay or "::" in replay:
                if not engine_host:
                    raise ValueError(
                        f"replay endpoint {replay!r} is a wildcard; say which host "
                        "to connect to (engine_host)"
                    )
                replay = replace_wildcard(replay, engine_host)
        return cls(addr, consumer, mode=how, replay_endpoint=replay, **kwargs)

    # ------------------------------------------------------------------ queries

    @property
    def address(self) -> str | None:
        """The bound address (bind mode, after start: resolves ``tcp://...:0``), else
        the endpoint connected to."""
        return self._bound if self.mode == "bind" else self.endpoint

    @property
    def last_seq(self) -> int | None:
        """The last sequence number delivered (None: none yet)."""
        return None if self._last is None or self._last < 0 else self._last

    @property
    def history_known(self) -> bool:
        """Whether the engine's history since the join is known: a batch was
        delivered, or the join's replay answered (module docstring)."""
        return self._last is not None

    @property
    def connected(self) -> bool:
        return self._connected

    def stats(self) -> SubscriberStats:
        return SubscriberStats(
            batches=self._batches,
            replayed=self._replayed,
            gaps=self._gaps,
            lost_batches=self._lost,
            resets=dict(self._resets),
            errors=dict(self._errors.counts),
            unknown_events=self._unknown,
            last_seq=self.last_seq,
            connections=self._connections,
            connected=self._connected,
        )

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Opens the socket (binds or connects) and starts delivering. Raises
        ``zmq.ZMQError`` for a bind that fails (address in use) or a malformed
        endpoint; a connect to an engine that is down does not fail (ZMQ retries in the
        background, ``connected`` tells)."""
        if self.state is not SubscriberState.NEW:
            raise RuntimeError(f"subscriber is {self.state.value}; start() is called once")
        sub = self._ctx.socket(zmq.SUB)
        mon = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sub.setsockopt(zmq.MAXMSGSIZE, self._max_msg_bytes)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            if self.mode == "bind":
                sub.bind(self.endpoint)
                self._bound = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sub.connect(self.endpoint)
        except BaseException:
            self.state = SubscriberState.CLOSED
            _close_sub(sub, mon)
            raise
        self._sub, self._mon = sub, mon
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.name}")
        self.state = SubscriberState.RUNNING

    async def aclose(self) -> None:
        """Stops delivering and closes the sockets. Idempotent; safe before start()."""
        if self.state is SubscriberState.CLOSED:
            return
        self.state = SubscriberState.CLOSED
        task, self._task = self._task, None
        await background.stop(task)
        sub, mon, self._sub, self._mon = self._sub, self._mon, None, None
        if sub is not None:
            _close_sub(sub, mon)
        self._connected = False

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        sub, mon = self._sub, self._mon
        assert sub is not None and mon is not None, "start() opens the sockets before this task"
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        join_at: float | None = None  # when the (next) join is due; None: none pending
        join_backoff = background.Backoff(0.5, 10.0)
        join_timeout_s = self.replay_timeout_s
        while True:
            try:
                wait_ms = None if join_at is None else max(0.0, (join_at - loop.time()) * 1000.0)
                ready = dict(await poller.poll(wait_ms))
                # Connection events first: a handshake that precedes a message in time
                # must mark it as the first of a new connection.
                if mon in ready:
                    self._drain_monitor(mon)
                    if self._join_due:
                        self._join_due = False
                        join_at = loop.time()
                        join_backoff.reset()
                        join_timeout_s = self.replay_timeout_s
                if join_at is not None and loop.time() >= join_at:
                    # a failed join is tried again, backed off and with a longer
                    # replay deadline (a full replay buffer is slow on a busy
                    # host), until it succeeds or a live batch starts the stream
                    if await self._join(join_timeout_s):
                        join_at = None
                    else:
                        join_at = loop.time() + join_backoff.next_s()
                        join_timeout_s = min(join_timeout_s * 2.0, _MAX_JOIN_REPLAY_S)
                if sub in ready:
                    for _ in range(1024):  # bounded, so the monitor is looked at again
                        frames = _recv_now(sub)
                        if frames is None:
                            break
                        await self._handle(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug of ours; never let it end the subscription
                log.exception("kv events loop of %s failed; going on", self.name)
                await asyncio.sleep(0.1)

    def _drain_monitor(self, mon: zmq.asyncio.Socket) -> None:
        while (frames := _recv_now(mon)) is not None:
            try:
                ev = parse_monitor_message(frames).get("event")
            except (ValueError, IndexError, KeyError):
                continue
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connections += 1
                self._connected = True
                if self._connections > 1:
                    self._rejoin = True
                elif self.replay_endpoint is not None and self._last is None:
                    self._join_due = True
                log.info("kv events: connected to %s (connection %d)", self.name, self._connections)
            elif ev == zmq.EVENT_DISCONNECTED:
                self._connected = False
                log.info("kv events: disconnected from %s", self.name)

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._error(KvEventCause.BAD_FRAMES, f"message of {len(frames)} frames, want 3")
            return
        topic, seqb, payload = frames
        if topic != self.topic:
            self._error(KvEventCause.BAD_TOPIC, f"topic {topic[:40]!r}, want {self.topic!r}")
            return
        if len(seqb) != 8:
            self._error(KvEventCause.BAD_SEQ, f"sequence frame of {len(seqb)} bytes, want 8")
            return
        seq = int.from_bytes(seqb, "big")
        if self._replayed_upto is not None and not self._rejoin:
            if seq <= self._replayed_upto:
                return  # sent live while the join's replay carried it
            self._replayed_upto = None
        last = self._last
        if last is None or self._rejoin or seq <= last:
            reason: ResetReason = "joined" if last is None else "reconnected" if self._rejoin else "restarted"
            self._rejoin = False
            self._replayed_upto = None
            # fetched before the reset: meanwhile the consumer keeps what it knew
            got = await self._replay_from(0) if self.replay_endpoint is not None and seq > 0 else None
            self._reset(reason, seq)
            if got is not None:
                self._deliver_replay(got, 0, seq, after_reset=True)
        elif seq != last + 1:
            if self.replay_endpoint is not None:
                got = await self._replay_from(last + 1)
                if got is None:
                    self._gap(last + 1, seq)
                else:
                    self._deliver_replay(got, last + 1, seq, after_reset=False)
            else:
                self._gap(last + 1, seq)
        self._deliver(seq, payload, replayed=False)

    async def _join(self, timeout_s: float) -> bool:
        """The first connection's join, before any live batch (module docstring).
        False: the replay failed and no live batch has come since (the caller tries
        again later; the first live batch would also join)."""
        got = await self._replay_from(0, timeout_s)
        if self._last is not None or self.state is not SubscriberState.RUNNING:
            return True  # a live batch started the stream meanwhile: nothing to join
        if got is None:
            return False
        self._reset("joined", got[0][0] if got else 0)
        self._last = -1
        self._deliver_replay(got, 0, None, after_reset=True)
        self._replayed_upto = self._last
        try:
            self._consumer.on_synced(self._last)
        except Exception:
            self._consumer_failed("on_synced")
        return True

    def _deliver(self, seq: int, payload: bytes, replayed: bool) -> None:
        self._last = seq
        try:
            batch = decode_batch(payload)
        except KvEventError as e:
            self._error(e.cause, f"batch {seq}: {e.detail}")
            self._gap(seq, seq + 1)
            return
        self._batches += 1
        self.last_batch_at = time.monotonic()
        if replayed:
            self._replayed += 1
        if batch.unknown:
            self._unknown += len(batch.unknown)
            names = sorted(set(batch.unknown))
            self._error(
                KvEventCause.UNKNOWN_TYPE,
                f"batch {seq}: skipped {len(batch.unknown)} events of unknown type "
                f"{names[:5]}{' ...' if len(names) > 5 else ''}",
            )
        try:
            self._consumer.on_batch(seq, batch)
        except Exception:
            self._consumer_failed("on_batch")

    def _deliver_replay(
        self, got: list[tuple[int, bytes]], first: int, upto: int | None, after_reset: bool
    ) -> None:
        """Delivers the replayed batches ``got`` in [first, upto) (None: no end),
        reporting as lost what they lack. After a reset, a missing head is history
        from before the join, not a loss."""
        expect = first
        for seq, payload in got:
            if seq < expect:
                continue  # duplicate or older than asked
            if upto is not None and seq >= upto:
                break  # the live copy is the one being handled, or still queued
            if seq > expect and not (after_reset and expect == first):
                self._gap(expect, seq)
            self._deliver(seq, payload, replayed=True)
            expect = seq + 1
        if upto is not None and expect < upto and not (after_reset and expect == first):
            self._gap(expect, upto)

    async def _replay_from(
        self, start: int, timeout_s: float | None = None
    ) -> list[tuple[int, bytes]] | None:
        """Asks the replay endpoint for every batch from ``start``; None on failure.

        A fresh DEALER per request, closed after: a late answer to a timed-out
        request can never be mistaken for the next one's."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_msg_bytes)
        loop = asyncio.get_running_loop()
        timeout_s = self.replay_timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + timeout_s
        out: list[tuple[int, bytes]] = []
        assert self.replay_endpoint is not None, "called only with a replay endpoint"
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                left = deadline - loop.time()
                # (flags: POLLIN, the default; pyzmq's stub omits the argument)
                if left <= 0 or not await sock.poll(left * 1000):
                    self._error(
                        KvEventCause.REPLAY_FAILED,
                        f"no end of replay from {start} within {timeout_s:g}s ({len(out)} batches received)",
                    )
                    return None
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # vLLM: topic, seq, payload
                    topic, seqb, payload = frames
                    if seqb == END_SEQ:
                        return out
                    if topic != self.topic:
                        self._error(KvEventCause.BAD_TOPIC, f"replayed topic {topic[:40]!r}")
                        continue
                elif len(frames) == 2:  # SGLang: seq, payload
                    seqb, payload = frames
                    if seqb == END_SEQ:
                        return out
                else:
                    self._error(
                        KvEventCause.BAD_FRAMES, f"replay message of {len(frames)} frames, want 2 or 3"
                    )
                    continue
                if len(seqb) != 8:
                    self._error(KvEventCause.BAD_SEQ, f"replayed sequence frame of {len(seqb)} bytes")
                    continue
                out.append((int.from_bytes(seqb, "big"), payload))
                if len(out) > self.max_replay_batches:
                    self._error(
                        KvEventCause.REPLAY_FAILED,
                        f"replay from {start} exceeds {self.max_replay_batches} batches",
                    )
                    return None
        except zmq.ZMQError as e:
            self._error(KvEventCause.REPLAY_FAILED, f"replay from {start}: {e}")
            return None
        finally:
            sock.close(linger=0)

    def _reset(self, reason: ResetReason, seq: int) -> None:
        self._resets[reason] = self._resets.get(reason, 0) + 1
        if reason != "joined":
            log.info(
                "kv events from %s: %s at seq %d; the engine's entries are dropped", self.name, reason, seq
            )
        try:
            self._consumer.on_reset(reason, seq)
        except Exception:
            self._consumer_failed("on_reset")

    def _gap(self, first_missing: int, next_seq: int) -> None:
        self._gaps += 1
        self._lost += next_seq - first_missing
        log.debug("kv events from %s: batches %d..%d lost", self.name, first_missing, next_seq - 1)
        try:
            self._consumer.on_gap(first_missing, next_seq)
        except Exception:
            self._consumer_failed("on_gap")

    def _error(self, cause: KvEventCause, detail: str) -> None:
        self._errors(cause, detail)
        try:
            self._consumer.on_error(cause, detail)
        except Exception:
            log.exception("kv events consumer of %s failed in on_error", self.name)

    def _consumer_failed(self, where: str) -> None:
        self._errors.counts[KvEventCause.CONSUMER_ERROR.value] = (
            self._errors.counts.get(KvEventCause.CONSUMER_ERROR.value, 0) + 1
        )
        log.exception("kv events consumer of %s failed in %s", self.name, where)


def _recv_now(sock: zmq.asyncio.Socket) -> list[bytes] | None:
    """One waiting message, or None. (An asyncio socket's non-blocking receive returns
    an already finished future; ``zmq.Again`` is its exception when nothing waits.)"""
    # typed Awaitable by pyzmq; an asyncio socket's is an asyncio Future
    fut = cast("asyncio.Future[list[bytes]]", sock.recv_multipart(zmq.NOBLOCK))
    try:
        return fut.result()
    except zmq.Again:
        return None


def _close_sub(sub: zmq.asyncio.Socket, mon: zmq.asyncio.Socket | None) -> None:
    try:
        sub.disable_monitor()
    except zmq.ZMQError:
        pass
    if mon is not None:
        mon.close(linger=0)
    sub.close(linger=0)
