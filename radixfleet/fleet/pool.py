"""The worker pool: who can be routed to, and how loaded each worker is right now.

Workers come from four sources (``Source``): the YAML file, the admin API,
agents that register themselves and discovery (``radixfleet.fleet.discovery``). Per worker the pool keeps::

    health      HealthState: UNKNOWN -> HEALTHY <-> UNHEALTHY, from GET <url><path>
    breaker     Breaker: CLOSED -> OPEN (after N request failures in a row)
                -> HALF_OPEN (after open_s: one trial request) -> CLOSED | OPEN
    draining    no new requests; in-flight ones finish
    load        in_flight / in_flight_tokens counted by the router AT PICK TIME
                (before anything is awaited) + the agent's last Load report,
                + in_flight_kv: the prompt tokens of this router's requests
                until they finish (the KV each holds while it decodes, a shared
                prefix counted in each; a read-back from a colder tier needs
                room beside it: radixfleet.policies.prefix_load); other replicas' are not
                counted
                ignored once older than report_stale_s
                + remote_in_flight / remote_tokens: the other router replicas'
                pick-time counts, from the bus (radixfleet.bus; 0 without one); what
                they add also counts in the worker's QueueMark (shedding), as a
                local pick does

``Pool.tap`` (the bus, or None) is told of every local pick, prefill and finish,
so the replica can publish its own counts; the pool never awaits it.

A worker is *routable* when it is HEALTHY, not draining, and its breaker is CLOSED
or HALF_OPEN with no trial in flight. ``views()`` returns routable workers only, as
the read-only ``WorkerView`` objects policies see.

Invariants (``check()`` asserts each):

- ``_by_id`` and ``_by_url`` index the same workers, by id and by url.
- Every worker's ``in_flight >= 0`` and ``in_flight_tokens >= 0`` (remote counts too);
  ``in_flight_kv >= 0``, and 0 whenever ``in_flight`` is.
- A cached view (``Worker._view``) equals the view its worker would build now.
- A worker that is not HEALTHY, or was removed, holds nothing in the index: the
  pool calls ``index.drop_worker`` on the transition, at once.

Self-registered workers (``register``): a new one starts UNKNOWN like any other and
is routable only after its first passed health check (whoever can reach the router
can register a URL; only a probe shows that the URL answers). An id held at another
URL is refused (``Conflict``);
new entries are admitted at ``registration.rate_per_s`` (burst
``registration.burst``; ``Overloaded`` past it), new epochs at one URL at
``registration.epochs_per_min`` (``EpochBudget``; ``Overloaded`` with code
``epoch_churn`` past it: an agent restarting in a loop, or someone flapping a live
worker's registration, which drops its index entries every time), and one that stays UNHEALTHY for
``registration.unhealthy_grace_s`` is removed (``reaped``): an agent that died
without leaving must not hold its id and its place in the pool for ever.

Removing a worker with requests in flight is safe: they hold the ``Worker`` object
and release their load on it; it is simply no longer in the pool.

Views are cached per worker and rebuilt only when that worker changes (a pick, a
finish, a load report, a state change, a stale report), so a request costs two
view rebuilds rather than one per worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import aiohttp

from radixfleet.common import jsonbody
from radixfleet.config import Config, WorkerSpec
from radixfleet.keys import WorkerId
from radixfleet.policies.base import WorkerView
from radixfleet.route import served
from radixfleet.route.shedding import CALM_S, QueueMark
from radixfleet.server.intake import Throttled
from radixfleet.wire.errors import Conflict, MalformedRequest, Overloaded
from radixfleet.wire.events import (
    MAX_RATE,
    MIN_RATE,
    STATUS_EPOCH_CHURN,
    STATUS_WORKER_ID_TAKEN,
    STATUS_WORKER_ROLE_CONFLICT,
    Load,
)

log = logging.getLogger("radixfleet.pool")


class Source(str, enum.Enum):
    CONFIG = "config"  # listed in the YAML file (a reload may remove it)
    ADMIN = "admin"  # added with POST /admin/workers
    AGENT = "agent"  # registered itself (POST /internal/v1/register)
    DISCOVERY = "discovery"  # found by radixfleet.fleet.discovery (Kubernetes, DNS); it removes it


class HealthState(str, enum.Enum):
    UNKNOWN = "unknown"  # not checked yet: not routable
    HEALTHY = "healthy"  # passed success_threshold checks in a row (or registered)
    UNHEALTHY = "unhealthy"  # failed failure_threshold checks in a row


class Breaker(str, enum.Enum):
    CLOSED = "closed"  # requests flow
    OPEN = "open"  # too many failures in a row: not routable until open_until
    HALF_OPEN = "half_open"  # one trial request allowed; its outcome decides


BREAKER_GAUGE = {Breaker.CLOSED: 0, Breaker.HALF_OPEN: 1, Breaker.OPEN: 2}


class PoolTap(Protocol):
    """What ``Pool.tap`` is told (radixfleet.bus.BusReplica)."""

    def moved(self, w: Worker) -> None: ...


class Worker:
    """One worker's state, all on the router's event loop. The ``Pool`` mutates it
    (request paths through the pool's methods); what other components learn of it
    they tell it through its own methods (``follow``, ``lose_stream``: the feedback's
    event stream; ``announce``: a bus snapshot; ``attach``: its engine link). No one
    else assigns its fields."""

    __slots__ = (
        "id",
        "url",
        "source",
        "weight",
        "base_prefill",
        "models",
        "health",
        "check_fails",
        "check_oks",
        "breaker",
        "breaker_fails",
        "open_until",
        "trial",
        "draining",
        "in_flight",
        "in_flight_tokens",
        "in_flight_kv",
        "load",
        "load_until",
        "epoch",
        "next_seq",
        "removed",
        "_view",
        "_view_until",
        "block_bytes",
        "scheduling_policy",
        "models_until",
        "models_bad",
        "mark",
        "spec",
        "engine",
        "remote_in_flight",
        "remote_tokens",
        "registered_epoch",
        "unhealthy_since",
        "refused_until",
    )

    def __init__(
        self,
        wid: str,
        url: str,
        source: Source,
        weight: float = 1.0,
        prefill_tokens_per_s: float = 10_000.0,
        spec: WorkerSpec | None = None,
    ) -> None:
        self.id = WorkerId(wid)
        self.url = url  # base URL without trailing slash
        self.source = source
        self.weight = weight
        self.base_prefill = prefill_tokens_per_s  # until the agent reports its rate
        #: served models: from registration, or the worker's /v1/models (radixfleet.route.served);
        #: () = not known yet (a candidate for any model)
        self.models: tuple[str, ...] = ()
        self.models_until = 0.0  # monotonic time /v1/models is asked again (non-agents)
        self.models_bad = False  # its last /v1/models answer was unusable (logged once)
        self.block_bytes: int | None = None  # the agent's hashing block size, if it said
        #: the agent's waiting order, if it said ("": not said; the entry's
        #: ``priority_field`` decides then: radixfleet.engines.manager.forward_body)
        self.scheduling_policy = ""
        self.health = HealthState.UNKNOWN
        self.check_fails = 0  # failed health checks in a row
        self.check_oks = 0  # passed health checks in a row
        self.breaker = Breaker.CLOSED
        self.breaker_fails = 0  # request failures in a row
        self.open_until = 0.0  # monotonic time the OPEN breaker goes HALF_OPEN
        self.trial = False  # a HALF_OPEN trial request is in flight
        self.draining = False
        self.in_flight = 0  # requests picked for this worker and not finished
        self.in_flight_tokens = 0  # their prompt tokens not yet known prefilled
        self.in_flight_kv = 0  # their prompt tokens, until they finish
        self.load: Load | None = None  # the agent's last report
        self.load_until = 0.0  # monotonic time that report goes stale
        #: its last report's room and what was picked for it since (radixfleet.route.shedding)
        self.mark = QueueMark()
        self.epoch: str | None = None  # agent epoch the event stream is in (None: the
        #: next batch must start with a snapshot)
        #: the epoch its agent registered with (None: never registered); only batches
        #: of this epoch, from ``url``, are applied (radixfleet.index.feedback)
        self.registered_epoch: str | None = None
        self.unhealthy_since = 0.0  # monotonic time it last became UNHEALTHY
        self.next_seq = 0  # next event batch sequence number expected
        self.removed = False  # no longer in the pool (requests may still hold it)
        self._view: WorkerView | None = None  # cache; None = rebuild
        self._view_until = 0.0  # the cached view includes a report stale at this time
        self.spec = spec  # the YAML/admin entry it came from (kind, events, tokenizer...)
        self.engine = None  # radixfleet.engines.link.EngineLink (``attach``)
        self.remote_in_flight = 0  # other router replicas' requests on it (radixfleet.bus)
        self.remote_tokens = 0  # and their prompt tokens not yet prefilled
        #: monotonic time until which its view reads saturated: the router refused a
        #: request it could have served (``Pool.refused``; radixfleet.route.shedding)
        self.refused_until = 0.0

    # what other components tell a worker (they call these; none assigns its fields)

    def follow(self, epoch: str, next_seq: int) -> None:
        """radixfleet.index.feedback applied a batch: its stream is in ``epoch``, ``next_seq``
        expected next."""
        self.epoch, self.next_seq = epoch, next_seq

    def lose_stream(self) -> None:
        """Its event stream must restart with a snapshot (radixfleet.index.feedback)."""
        self.epoch = None

    def announce(self, models: tuple[str, ...], block_bytes: int | None, scheduling_policy: str) -> None:
        """Its agent's latest self-description (a bus snapshot: radixfleet.bus.replica)."""
        self.models, self.block_bytes, self.scheduling_policy = models, block_bytes, scheduling_policy

    def attach(self, engine) -> None:
        """Its engine link (radixfleet.engines; None: detached)."""
        self.engine = engine

    def routable(self, now: float) -> bool:
        if self.health is not HealthState.HEALTHY or self.draining:
            return False
        b = self.breaker
        if b is Breaker.CLOSED:
            return True
        if b is Breaker.OPEN and now >= self.open_until:
            self.breaker = b = Breaker.HALF_OPEN
        return b is Breaker.HALF_OPEN and not self.trial

    @property
    def role(self) -> str:
        """Its disaggregated role (``radixfleet.policies.disagg``): prefill, decode or both."""
        return self.spec.role if self.spec is not None else "both"

    def prefill_rate(self, now: float) -> float:
        """Prefill tokens/s: learned from this worker's responses, shrunk toward the
        fleet's (radixfleet.engines.link), else the configured value."""
        e = self.engine
        return e.prefill_rate(now) if e is not None else self.base_prefill

    def serves(self, model: str, adapter: str | None) -> bool:
        """Whether it may take a request for (model, adapter): ``radixfleet.route.served``."""
        return served.serves(self.models, model, adapter)

    def build_view(self, now: float) -> WorkerView:
        # the fleet's pick-time load: this replica's counts and the others' (radixfleet.bus)
        reqs = self.in_flight + self.remote_in_flight
        toks = self.in_flight_tokens + self.remote_tokens
        ld = self.load
        if ld is not None and now < self.load_until:
            rate = ld.prefill_tokens_per_s or self.prefill_rate(now)
            # within the bounds every view promises policies (radixfleet.policies.base.WorkerView)
            rate = MIN_RATE if rate < MIN_RATE else MAX_RATE if rate > MAX_RATE else rate
            return WorkerView(
                self.id,
                reqs,
                toks,
                ld.queued_requests,
                ld.queued_tokens,
                ld.running_requests,
                ld.kv_used_tokens,
                ld.kv_capacity_tokens,
                rate,
                self.weight,
                self.in_flight_kv,
                now < self.refused_until,
            )
        # no fresh report: the engine's KV capacity is still known where configured or
        # scraped (a plain engine's YAML kv_capacity_tokens); policies weigh KV by it
        e = self.engine
        cap = (e.capacity_tokens or 0) if e is not None else 0
        return WorkerView(
            self.id,
            reqs,
            toks,
            kv_capacity_tokens=cap,
            prefill_tokens_per_s=self.prefill_rate(now),
            weight=self.weight,
            in_flight_kv_tokens=self.in_flight_kv,
            saturated=now < self.refused_until,
        )

    def describe(self, now: float) -> dict:
        ld = self.load
        fresh = ld is not None and now < self.load_until
        return {
            "id": self.id,
            "url": self.url,
            "source": self.source.value,
            "role": self.role,
            "scheduling_policy": self.scheduling_policy,  # as its agent said; "": not said
            # the router refused a request it could serve lately: policies see it saturated
            "saturated": now < self.refused_until,
            "health": self.health.value,
            "breaker": self.breaker.value,
            "draining": self.draining,
            "routable": self.routable(now),
            "in_flight": self.in_flight,
            "in_flight_tokens": self.in_flight_tokens,
            "in_flight_kv_tokens": self.in_flight_kv,
            "remote_in_flight": self.remote_in_flight,
            "remote_tokens": self.remote_tokens,
            "weight": self.weight,
            "models": list(self.models),
            "reported_load": ({f: getattr(ld, f) for f in Load.__slots__} if fresh else None),
            "queue_mark": self.mark.describe(),
            "epoch": self.epoch,
            "next_seq": self.next_seq,
            **({"engine": self.engine.describe()} if self.engine is not None else {}),
        }


class EpochBudget:
    """New registration epochs per worker URL: a token bucket per URL of ``per_min``
    tokens, refilled at ``per_min`` a minute. Keyed by URL, not by the ``Worker``, so
    that re-registering an address under another id or role (a new entry each time)
    spends the same budget. Holds at most ``max(64, 2 x pool size)`` URLs: past that,
    the URLs whose budget is full again (nothing to remember) are dropped first."""

    __slots__ = ("_buckets",)

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # url -> (tokens, at)

    def _tokens(self, url: str, per_min: int, now: float) -> float:
        tokens, at = self._buckets.get(url, (float(per_min), now))
        return min(float(per_min), tokens + (now - at) * per_min / 60.0)

    def wait(self, url: str, per_min: int, now: float) -> float:
        """0.0 when ``url`` may register a new epoch now, else the seconds until it
        may. Changes nothing (``spend`` takes the epoch once the registration holds)."""
        tokens = self._tokens(url, per_min, now)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) * 60.0 / per_min

    def spend(self, url: str, per_min: int, now: float, keep: int) -> None:
        """One new epoch registered at ``url``; ``keep``: the pool's size now."""
        self._buckets[url] = (max(0.0, self._tokens(url, per_min, now) - 1.0), now)
        if len(self._buckets) > max(64, 2 * keep):
            self._prune(per_min, per_min / 60.0, now)

    def _prune(self, per_min: int, rate: float, now: float) -> None:
        full = [u for u, (t, at) in self._buckets.items() if t + (now - at) * rate >= per_min]
        for u in full:
            del self._buckets[u]

    def __len__(self) -> int:
        return len(self._buckets)


def _engine_fields(s: WorkerSpec) -> tuple:
    return (
        s.kind,
        s.model,
        s.tokenizer,
        s.chat_template,
        s.block_size,
        s.kv_capacity_tokens,
        s.events,
        s.metrics,
    )


class Pool:
    """The routable set and its load. One event loop owns it.

    Lifecycle: ``await start()`` begins health checking; ``await aclose()``
    (idempotent) stops it. Everything else is synchronous.
    """

    def __init__(
        self,
        cfg: Config,
        index,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.index = index  # radixfleet.index.prefix_index.PrefixIndex: dropped workers leave it
        self.clock = clock
        self._by_id: dict[str, Worker] = {}
        self._by_url: dict[str, Worker] = {}
        self._routable: list[Worker] | None = None  # cache of routable workers, in order
        self._routable_until = float("inf")  # a breaker or a report changes at this time
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._checks: set[asyncio.Task] = set()
        self._first_round = asyncio.Event()  # set when the first health round is done
        self._closed = False
        self._on_change = on_change
        #: told of every worker added and removed (radixfleet.engines.Engines)
        self.listeners: list = []
        #: when the pool was made: unknown models get 503 + Retry-After, not 404,
        #: for served.STARTUP_GRACE_S after it (agents re-registering after a restart)
        self.started = clock()
        #: told ``moved(worker)`` after every local pick, prefilled and finish (radixfleet.bus)
        self.tap: PoolTap | None = None
        #: called with a worker the moment it turns unhealthy (the data plane cancels
        #: and moves the requests waiting on it)
        self.on_unhealthy: list[Callable[[Worker], None]] = []
        #: new self-registered workers admitted (registration.rate_per_s, .burst)
        self._admit_tokens = float(cfg.registration.burst)
        self._admit_t = clock()
        #: new epochs per worker URL (registration.epochs_per_min) and its refusals' log
        self._epochs = EpochBudget()
        self._churn_log = Throttled(1.0, log)
        #: self-registered workers removed after unhealthy_grace_s (a metric reads it)
        self.reaped = 0
        #: a worker with a prefill or decode role has been seen (``disaggregated``)
        self._roles = False
        for spec in cfg.workers:
            self.add(spec.id, spec.url, Source.CONFIG, spec.weight, spec.prefill_tokens_per_s, spec)

    # ------------------------------------------------------------- membership

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self):
        return iter(list(self._by_id.values()))

    def get(self, wid: str) -> Worker | None:
        return self._by_id.get(wid)

    def by_url(self, url: str) -> Worker | None:
        return self._by_url.get(url)

    def add(
        self,
        wid: str,
        url: str,
        source: Source,
        weight: float = 1.0,
        prefill_tokens_per_s: float = 10_000.0,
        spec: WorkerSpec | None = None,
    ) -> Worker:
        """Adds a worker (UNKNOWN health: routable after its first passed check).
        Raises ``ValueError`` if the id or url is taken."""
        if wid in self._by_id:
            raise ValueError(f"worker id {wid!r} already exists")
        if url in self._by_url:
            raise ValueError(f"worker url {url!r} already exists (id {self._by_url[url].id!r})")
        w = Worker(wid, url, source, weight, prefill_tokens_per_s, spec)
        if w.role != "both":
            self._roles = True  # sticky: a fleet once disaggregated checks per request
        self._by_id[wid] = w
        self._by_url[url] = w
        self._changed()
        log.info("worker %s added (%s, %s)", wid, url, source.value)
        for lis in self.listeners:
            lis.worker_added(w)
        if self._session is not None:
            self.check_soon(w)
        return w

    def disaggregated(self) -> bool:
        """Whether a worker with a prefill or decode role has been in the pool
        (``radixfleet.route.pd`` then checks each request's views; a colocated fleet, the
        common case, skips that)."""
        return self._roles

    def remove(self, wid: str) -> Worker | None:
        """Removes a worker and drops its index entries at once."""
        w = self._by_id.pop(wid, None)
        if w is None:
            return None
        del self._by_url[w.url]
        w.removed = True
        self.index.drop_worker(wid)
        self._changed()
        for lis in self.listeners:
            lis.worker_removed(w)
        log.info("worker %s removed (%d in flight finish)", wid, w.in_flight)
        return w

    def drain(self, wid: str, draining: bool = True) -> Worker | None:
        w = self._by_id.get(wid)
        if w is not None and w.draining != draining:
            w.draining = draining
            self._changed()
            log.info("worker %s %s", wid, "draining" if draining else "undrained")
        return w

    def register(
        self,
        wid: str,
        url: str,
        epoch: str,
        models: Sequence[str] = (),
        block_bytes: int | None = None,
        role: str = "both",
        scheduling_policy: str = "",
    ) -> Worker:
        """An agent announced itself (``POST /internal/v1/register`` or the bus:
        both call this). ``url`` is canonical (``radixfleet.config.parse_worker_url``);
        ``block_bytes`` (the agent's hashing block size) is recorded as said, the
        caller has checked it against the router's. ``role``: a new agent entry's
        disaggregated role. A configured entry keeps its own: an agent that says
        another (``prefill`` or ``decode``; ``both`` is an agent's default and says
        nothing) is refused, ``Conflict`` (``worker_role_conflict``), since one of the
        two is wrong and requests would run the wrong legs on it.
        ``scheduling_policy``: the agent's waiting order as said ("" : not said),
        recorded like ``block_bytes``.

        - Its id and url already paired: the entry is kept (a configured worker
          keeps its source and settings). A new epoch is a fresh process with an
          empty cache: its index entries go and its stream starts at seq 0.
        - The id held at another url: ``Conflict`` (``worker_id_taken``), unless
          the holder registered itself and is UNHEALTHY (its agent moved: a new
          port, a new pod address), which is replaced.
        - The url held under another id: the entry takes the agent's id, keeping
          its source and settings (a configured worker's reload matches it by url;
          one process per address).
        - A new epoch, id or role at a known ``url`` (a restarted agent, or
          someone flapping it): within ``registration.epochs_per_min`` for that
          URL, counted once the registration holds (else ``Overloaded``, code
          ``epoch_churn``, with the seconds until the next; the refusal logged,
          throttled); an accepted new epoch of a known worker is one log line.
        - New: admitted within ``registration.rate_per_s`` (else ``Overloaded``,
          with the seconds until the next), added UNKNOWN and probed at once:
          routable after its first passed check (a known one that is not healthy
          is probed at once too). A pool that runs no health checks (the
          simulator's, whose agents are its own) has nothing to wait for:
          healthy at once, and no rate bound.
        """
        w = self._by_id.get(wid)
        at = self._by_url.get(url)
        per_min = self.cfg.registration.epochs_per_min
        # a known URL under a new epoch, id or role (a role that changes the entry:
        # an agent's "both" says nothing to a configured one): a new process there (a
        # brand-new URL is bounded by the new-worker rate instead)
        churn = (
            self._session is not None
            and at is not None
            and (
                at.id != wid
                or at.registered_epoch != epoch
                or (at.role != role and (role != "both" or at.source is Source.AGENT))
            )
        )
        if churn:
            wait_s = self._epochs.wait(url, per_min, self.clock())
            if wait_s > 0:
                self._churn_log.warning(
                    "refused registration of %s (%s) epoch %s: more than "
                    "registration.epochs_per_min=%d new epochs at that URL in a minute",
                    wid,
                    url,
                    epoch,
                    per_min,
                )
                raise Overloaded(
                    f"worker {wid!r} registered more than {per_min} "
                    "new epochs in a minute (registration.epochs_per_min); retry later",
                    retry_after_s=wait_s,
                    code=STATUS_EPOCH_CHURN,
                )
        held = w if w is not None and w.url == url else at
        if held is not None and held.source is Source.AGENT and held.role != role:
            # the agent restarted with another role: a new entry (its cache is new too)
            log.info("worker %s registered as %s (was %s): a new entry", held.id, role, held.role)
            self.remove(held.id)
            held = None
            w = self._by_id.get(wid)
        if held is not None and role != "both" and held.role != role:
            raise Conflict(
                f"this agent registers as role {role!r} but worker {held.id!r} at its URL is "
                f"configured as {held.role!r}; start the agent with --role "
                f"{held.role} or change the worker's role in the config",
                code=STATUS_WORKER_ROLE_CONFLICT,
                param="role",
            )
        if w is not None and w.url != url:
            if w.source is not Source.AGENT or w.health is not HealthState.UNHEALTHY:
                raise Conflict(
                    f"worker id {wid!r} is registered at another URL; give this agent its own --worker-id",
                    code=STATUS_WORKER_ID_TAKEN,
                    param="worker_id",
                )
            log.info("worker %s registered at a new URL; the unhealthy old entry goes", wid)
            self.remove(wid)
            w = None
        if w is None:
            old = self._by_url.get(url)
            if old is not None:
                # the agent at a known address names it: the entry takes its id and
                # keeps its source and settings (a reload matches it by url)
                self.remove(old.id)
                w = self.add(
                    wid,
                    url,
                    old.source,
                    old.weight,
                    old.base_prefill,
                    dataclasses.replace(old.spec, id=wid)
                    if old.spec is not None
                    else WorkerSpec(url=url, id=wid, kind="agent", role=role),  # type: ignore[arg-type]
                )
            else:
                wait_s = self._admit() if self._session is not None else 0.0
                if wait_s > 0:
                    raise Overloaded("too many new workers registering; retry later", retry_after_s=wait_s)
                spec = WorkerSpec(url=url, id=wid, kind="agent", role=role)  # type: ignore[arg-type]
                w = self.add(wid, url, Source.AGENT, spec=spec)
        elif w.health is not HealthState.HEALTHY:
            self.check_soon(w)  # back (a restart at the same address): probe it now
        if self._session is None:
            self._set_health(w, HealthState.HEALTHY)
        if w.registered_epoch != epoch:
            if w.registered_epoch is not None:
                log.info(
                    "worker %s (%s) registered a new epoch %s (was %s): a new agent process",
                    wid,
                    url,
                    epoch,
                    w.registered_epoch,
                )
            if w.epoch is not None:
                self.index.drop_worker(wid)
            w.registered_epoch = w.epoch = epoch
            w.next_seq = 0
        if tuple(models) != w.models:
            w.models = tuple(models)
            self._changed(w)
        w.block_bytes = block_bytes
        w.scheduling_policy = scheduling_policy
        if churn:
            self._epochs.spend(url, per_min, self.clock(), len(self))
        return w

    def _admit(self) -> float:
        """Takes one new-registration token: 0.0, or the seconds until one is there."""
        r = self.cfg.registration
        now = self.clock()
        self._admit_tokens = min(float(r.burst), self._admit_tokens + (now - self._admit_t) * r.rate_per_s)
        self._admit_t = now
        if self._admit_tokens >= 1.0:
            self._admit_tokens -= 1.0
            return 0.0
        return (1.0 - self._admit_tokens) / r.rate_per_s

    def reap(self, now: float) -> list[str]:
        """Removes self-registered workers UNHEALTHY for ``registration.unhealthy_grace_s``
        or longer (configured and discovered ones stay: their owner removes them).
        Returns their ids."""
        grace = self.cfg.registration.unhealthy_grace_s
        gone = [
            w
            for w in self._by_id.values()
            if w.source is Source.AGENT
            and w.health is HealthState.UNHEALTHY
            and now - w.unhealthy_since >= grace
        ]
        for w in gone:
            log.warning(
                "worker %s (%s) removed: self-registered and unhealthy for %.0f s "
                "(registration.unhealthy_grace_s)",
                w.id,
                w.url,
                now - w.unhealthy_since,
            )
            self.remove(w.id)
            self.reaped += 1
        return [w.id for w in gone]

    def configure(self, cfg: Config) -> None:
        """Takes a reloaded config (health, breaker, registration and load settings
        from now on); the worker list is ``sync_config``'s."""
        self.cfg = cfg

    def sync_config(self, specs: Iterable[WorkerSpec]) -> tuple[list[str], list[str]]:
        """Applies a reloaded worker list: config workers not listed any more are
        removed, new ones added (matched by url). Returns (added, removed) ids."""
        want = {s.url: s for s in specs}
        removed: list[str] = [
            w.id for w in list(self._by_id.values()) if w.source is Source.CONFIG and w.url not in want
        ]
        for wid in removed:
            self.remove(wid)
        added = []
        for url, s in want.items():
            w = self._by_url.get(url)
            if w is None:
                if s.id in self._by_id:
                    self.remove(s.id)  # the id moved to a new url
                self.add(s.id, url, Source.CONFIG, s.weight, s.prefill_tokens_per_s, s)
                added.append(s.id)
            elif w.spec is not None and _engine_fields(w.spec) != _engine_fields(s):
                # a different engine setup: a new link (subscriber, tokenizer, scraper)
                self.remove(w.id)
                self.add(s.id, url, Source.CONFIG, s.weight, s.prefill_tokens_per_s, s)
                added.append(s.id)
            else:
                w.source = Source.CONFIG
                if w.spec is not None and w.spec.role != s.role:
                    w.spec = dataclasses.replace(w.spec, role=s.role)
                    self._roles = self._roles or s.role != "both"
                if w.weight != s.weight or w.base_prefill != s.prefill_tokens_per_s:
                    w.weight, w.base_prefill = s.weight, s.prefill_tokens_per_s
                    self._changed(w)
        return added, removed

    # ------------------------------------------------------------ routing path

    def views(self, now: float, model: str = "", adapter: str | None = None) -> list[WorkerView]:
        """Views of the routable workers, in a stable order; with ``model``, only of
        those that serve it or ``adapter`` (or whose models are not known:
        ``radixfleet.route.served``). O(workers) list, views rebuilt only for workers that
        changed."""
        ws = self._routable
        if ws is None or now >= self._routable_until:
            ws = self._rebuild_routable(now)
        out: list[WorkerView] = []
        append = out.append
        for w in ws:
            if not w.serves(model, adapter):
                continue
            v = w._view
            if v is None or now >= w._view_until:
                v = w._view = w.build_view(now)
                until = w.load_until if now < w.load_until else float("inf")
                if now < w.refused_until < until:
                    until = w.refused_until
                w._view_until = until
            append(v)
        return out

    def refused(self, model: str, adapter: str | None, now: float) -> None:
        """The shedder refused a request for ``model`` (every routable worker serving
        it was past the bound): their views read ``saturated`` for ``CALM_S`` s."""
        until = now + CALM_S
        for w in self.routable_workers(now):
            if not w.serves(model, adapter):
                continue
            w.refused_until = until
            w._view = None

    def routable_workers(self, now: float) -> list[Worker]:
        ws = self._routable
        if ws is None or now >= self._routable_until:
            ws = self._rebuild_routable(now)
        return ws

    def pick(self, w: Worker, tokens: int, held: int | None = None) -> None:
        """Counts a request on ``w`` at pick time (call before awaiting anything):
        ``tokens`` of queued prefill, and ``held`` tokens of KV it holds until it
        finishes (its prompt; None: ``tokens``)."""
        w.in_flight += 1
        w.in_flight_tokens += tokens
        w.in_flight_kv += tokens if held is None else held
        w.mark.picked(tokens, w.in_flight + w.remote_in_flight)
        w._view = None
        if self.tap is not None:
            self.tap.moved(w)
        if w.breaker is Breaker.HALF_OPEN:
            w.trial = True
            self._routable = None

    def prefilled(self, w: Worker, tokens: int) -> None:
        """The request's first byte arrived: its prompt is no longer queued prefill."""
        w.in_flight_tokens -= tokens
        w._view = None
        if self.tap is not None:
            self.tap.moved(w)

    def rate_moved(self, w: Worker) -> None:
        """``w``'s engine link learned from an answer: its view (prefill rate) is rebuilt."""
        w._view = None

    def finish(self, w: Worker, tokens_left: int, ok: bool | None, held: int = 0) -> None:
        """The request ended; ``tokens_left`` are its tokens still counted, ``held``
        the KV tokens its ``pick`` counted (0: not told; the worker's ``in_flight_kv``
        returns to 0 with its last request). ``ok``: True success, False a worker
        failure (breaker), None neither (client left, bad request)."""
        w.in_flight -= 1
        w.in_flight_tokens -= tokens_left
        kv = w.in_flight_kv - held
        w.in_flight_kv = kv if kv > 0 and w.in_flight > 0 else 0
        w._view = None
        if self.tap is not None:
            self.tap.moved(w)
        if ok is True:
            self.record_success(w)
        elif ok is False:
            self.record_failure(w)
        elif w.trial:
            w.trial = False
            self._routable = None

    def record_success(self, w: Worker) -> None:
        w.breaker_fails = 0
        if w.breaker is not Breaker.CLOSED or w.trial:
            w.trial = False
            if w.breaker is not Breaker.CLOSED:
                log.info("worker %s breaker closed", w.id)
            w.breaker = Breaker.CLOSED
            self._changed()

    def record_failure(self, w: Worker) -> None:
        w.breaker_fails += 1
        if w.breaker is Breaker.HALF_OPEN or w.breaker_fails >= self.cfg.breaker.failure_threshold:
            if w.breaker is not Breaker.OPEN:
                log.warning("worker %s breaker open after %d failures", w.id, w.breaker_fails)
            w.breaker = Breaker.OPEN
            w.open_until = self.clock() + self.cfg.breaker.open_s
            w.trial = False
            self._changed()

    def report_load(
        self, w: Worker, load: Load, now: float, stale_s: float | None = None, engine: bool = False
    ) -> None:
        """A load report (agent push or engine scrape), trusted for ``stale_s``
        (default ``load.report_stale_s``). ``engine``: read from the engine's own
        metrics, where its batch limit is learned (radixfleet.route.shedding)."""
        w.load = load
        w.mark.reported(load, now, w.in_flight + w.remote_in_flight, engine)
        w.load_until = now + (self.cfg.load.report_stale_s if stale_s is None else stale_s)
        w._view = None

    def engine_restarted(self, w: Worker) -> None:
        """``w``'s engine is a new process: what was learned of its limits goes."""
        w.mark.forget()

    def set_remote(self, w: Worker, requests: int, tokens: int) -> None:
        """The other replicas' pick-time counts on ``w`` now (radixfleet.bus). Tokens they
        added are picks since ``w``'s last report as much as this replica's own are:
        shedding (``w.mark``) counts them as the views do, so N replicas
        admit what one router would rather than each 1/N of a burst's evidence."""
        if w.remote_in_flight != requests or w.remote_tokens != tokens:
            w.mark.picked(max(0, tokens - w.remote_tokens), w.in_flight + requests)
            w.remote_in_flight = requests
            w.remote_tokens = tokens
            w._view = None

    def unavailable(self, model: str, adapter: str | None, now: float):
        """The error for a request that ``views(now, model, adapter)`` left no worker
        for: 404 naming the served models, or 503 with Retry-After
        (``radixfleet.route.served.unavailable``)."""
        return served.unavailable(
            self.routable_workers(now),
            model,
            adapter,
            in_grace=now - self.started < served.STARTUP_GRACE_S,
            retry_after_s=self.cfg.health.interval_s,
        )

    def readiness(self) -> tuple[bool, list[str]]:
        """(ready, ids of the workers it waits for). Ready when every configured,
        admin-added and discovered worker has answered its first health check or
        failed it, every healthy worker's served models are known (registered, or
        its ``/v1/models`` asked), and at least one worker is healthy: a probe that
        said ready when the first of N answered sent the next seconds' requests to
        a 503 ("no routable worker serves model x yet") or to one worker's queue."""
        waiting: list[str] = []
        healthy = False
        for w in self._by_id.values():
            if w.health is HealthState.UNKNOWN:
                if w.source is not Source.AGENT:
                    waiting.append(w.id)
            elif w.health is HealthState.HEALTHY:
                if w.source is not Source.AGENT and w.registered_epoch is None and w.models_until == 0.0:
                    waiting.append(w.id)  # models not asked yet
                else:
                    healthy = True
        return healthy and not waiting, waiting

    # ------------------------------------------------------------ health checks

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Begins health checking with ``session`` (the app's client session); the
        first round runs at once."""
        if self._closed:
            raise RuntimeError("Pool.start() after aclose()")
        if self._task is not None:
            return
        self._session = session
        self._task = asyncio.create_task(self._health_loop(), name="radixfleet-health")

    async def first_round(self, timeout_s: float) -> None:
        """Waits (at most ``timeout_s``) until the first round of health checks has
        finished, so that workers that answered are routable at once."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._first_round.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("first health checks still running after %.1fs; listening anyway", timeout_s)

    async def aclose(self) -> None:
        """Stops health checking. Idempotent."""
        self._closed = True
        tasks = [t for t in (self._task, *self._checks) if t is not None]
        self._task = None
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                if not t.cancelled():
                    raise
            except Exception:  # noqa: BLE001 - a check failing at shutdown is moot
                pass
        self._checks.clear()

    def check_soon(self, w: Worker) -> None:
        """Runs a health check of ``w`` now (a connect error made it suspect)."""
        if self._session is None or self._closed:
            return
        t = asyncio.create_task(self._check(w))
        self._checks.add(t)
        t.add_done_callback(self._checks.discard)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in list(self._by_id.values())))

    async def _health_loop(self) -> None:
        while True:
            started = self.clock()
            await self.check_all()
            self._first_round.set()
            self.reap(self.clock())
            delay = self.cfg.health.interval_s - (self.clock() - started)
            await asyncio.sleep(max(delay, 0.01))

    async def probe(self, w: Worker) -> bool:
        """One health probe of ``w`` now: whether it answered below 500 within the
        health timeout. Changes nothing (``_check`` keeps the health state); True when
        the pool is closed (nothing is known against the worker)."""
        if self._session is None or self._closed:
            return True
        h = self.cfg.health
        try:
            async with self._session.get(
                w.url + h.path, timeout=aiohttp.ClientTimeout(total=h.timeout_s)
            ) as resp:
                await resp.read()
                return resp.status < 500
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _check(self, w: Worker) -> None:
        h = self.cfg.health
        ok = await self.probe(w)
        if w.removed:
            return
        if ok and w.source is not Source.AGENT and self.clock() >= w.models_until:
            await self._fetch_models(w)
        if ok:
            w.check_fails = 0
            w.check_oks += 1
            if w.health is HealthState.UNKNOWN or (
                w.health is HealthState.UNHEALTHY and w.check_oks >= h.success_threshold
            ):
                self._set_health(w, HealthState.HEALTHY)
        else:
            w.check_oks = 0
            w.check_fails += 1
            if w.health is not HealthState.UNHEALTHY and (
                w.check_fails >= h.failure_threshold or w.health is HealthState.UNKNOWN
            ):
                self._set_health(w, HealthState.UNHEALTHY)

    async def _fetch_models(self, w: Worker) -> None:
        """Learns a non-agent worker's served models from its ``GET /v1/models``
        (bounded: 1 MB, health timeout). A failed or unusable answer keeps what was
        known; an unusable one is logged once per worker."""
        w.models_until = self.clock() + served.MODELS_REFRESH_S
        assert self._session is not None, "health checks run with the session open"
        try:
            async with self._session.get(
                w.url + "/v1/models",
                timeout=aiohttp.ClientTimeout(total=self.cfg.health.timeout_s),
            ) as resp:
                if resp.status != 200:
                    return
                raw = await resp.content.read(1 << 20)
                models = served.parse_models_answer(
                    jsonbody.loads(raw, what="the worker's /v1/models answer")
                )
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        except MalformedRequest as exc:
            if not w.models_bad:
                log.warning(
                    "worker %s: unusable /v1/models answer (%s); routing it requests for any model", w.id, exc
                )
                w.models_bad = True
            return
        w.models_bad = False
        if models != w.models and not w.removed:
            log.info("worker %s serves %s", w.id, ", ".join(models) or "(none listed)")
            w.models = models
            self._changed(w)

    def _set_health(self, w: Worker, state: HealthState) -> None:
        if w.health is state:
            return
        old, w.health = w.health, state
        if state is HealthState.UNHEALTHY:
            # A dead worker's cache is gone (or unknowable): its entries leave now.
            self.index.drop_worker(w.id)
            w.epoch = None  # its stream restarts with a snapshot
            w.unhealthy_since = self.clock()
            log.warning("worker %s unhealthy (was %s)", w.id, old.value)
            for fn in self.on_unhealthy:
                fn(w)
        elif state is HealthState.HEALTHY:
            w.breaker, w.breaker_fails, w.trial = Breaker.CLOSED, 0, False
            log.info("worker %s healthy (was %s)", w.id, old.value)
        self._changed()

    # ---------------------------------------------------------------- internals

    def _changed(self, w: Worker | None = None) -> None:
        self._routable = None
        if w is not None:
            w._view = None
        if self._on_change is not None:
            self._on_change()

    def _rebuild_routable(self, now: float) -> list[Worker]:
        ws = [w for w in self._by_id.values() if w.routable(now)]
        until = float("inf")
        for w in self._by_id.values():
            if w.breaker is Breaker.OPEN and w.open_until < until:
                until = w.open_until
        self._routable = ws
        self._routable_until = until
        return ws

    def check(self) -> None:
        """Asserts every invariant in the module docstring."""
        assert len(self._by_id) == len(self._by_url), f"{self._by_id=} {self._by_url=}"
        for wid, w in self._by_id.items():
            assert w.id == wid and self._by_url.get(w.url) is w, f"{w.id=} {w.url=}"
            assert w.in_flight >= 0 and w.in_flight_tokens >= 0, f"{w.id=} {w.in_flight=}"
            assert w.in_flight_kv >= 0 and (w.in_flight or not w.in_flight_kv), f"{w.id=} {w.in_flight_kv=}"
            assert w.remote_in_flight >= 0 and w.remote_tokens >= 0, f"{w.id=} remote"
            assert not w.removed, f"{w.id=} removed but in the pool"
            if w._view is not None and w.load is None:
                assert w._view == w.build_view(self.clock()), f"{w.id=} stale view"
        held = self.index.workers()
        for wid in held:
            holder = self._by_id.get(wid.partition("#")[0])  # a rank part is its worker's
            assert holder is not None, f"removed worker {wid!r} still in the index"
            assert holder.health is not HealthState.UNHEALTHY, f"unhealthy {wid!r} in the index"
