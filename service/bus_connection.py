"""``BusConnection``: one NATS connection kept up, with a clean slate per connection.

    CONNECTING --connected, on_up() done--> UP --connection lost--> DOWN
        ^                                                            |
        '----------------- backoff (doubling, capped) ---------------'
    any state --aclose()--> CLOSED (terminal)

nats-py's own reconnection is off: after a loss the owner's ``on_up(nc, js)`` runs
again on a fresh connection (re-creating the stream if the server lost it, and the
subscriptions), so there is exactly one place where "the bus is usable" begins.
``on_down()`` runs at each loss; while DOWN the owner degrades (agents push
directly, routers count locally). Problems are counted per cause
(``radixfleet_bus_outages_total{cause}``) and logged once per cause until the bus
is UP again (``Problems``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Awaitable, Callable

from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("radixfleet.bus")


class BusState(enum.Enum):
    CONNECTING = "connecting"  # first attempt, or retrying after a loss
    UP = "up"  # connected and on_up() finished
    DOWN = "down"  # an attempt failed or the connection was lost; retrying
    CLOSED = "closed"  # aclose() called; terminal


class BusMetrics:
    """The bus's metrics, registered in its owner's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge("radixfleet_bus_up", "1 while the event bus connection is usable",
                        registry=registry)
        self.outages = Counter("radixfleet_bus_outages", "Bus problems by cause (the bus "
                               "degrades to direct push and local counts)", ["cause"],
                               registry=registry)
        self.received = Counter("radixfleet_bus_messages_received", "Bus messages applied, "
                                "by kind", ["kind"], registry=registry)
        self.published = Counter("radixfleet_bus_messages_published", "Bus messages sent, "
                                 "by kind", ["kind"], registry=registry)
        self.bad = Counter("radixfleet_bus_bad_messages", "Malformed or foreign bus messages "
                           "ignored, by cause", ["cause"], registry=registry)
        self.replicas = Gauge("radixfleet_bus_replicas", "Other router replicas heard on the "
                              "bus within replica_ttl_s", registry=registry)
        self.lag = Gauge("radixfleet_bus_catchup_remaining", "Stream messages still to apply "
                         "before this replica has caught up (0 once ready)", registry=registry)


class Problems:
    """Counts problems per cause; logs each cause once until ``ok()``."""

    __slots__ = ("counter", "_logged", "what")

    def __init__(self, counter: Counter, what: str) -> None:
        self.counter = counter
        self.what = what
        self._logged: set[str] = set()

    def report(self, cause: str, message: str, *args: object) -> None:
        self.counter.labels(cause).inc()
        if cause in self._logged:
            log.debug("%s: " + message, self.what, *args)
            return
        self._logged.add(cause)
        log.warning("%s: " + message, self.what, *args)

    def ok(self) -> None:
        if self._logged:
            log.info("%s: bus usable again", self.what)
            self._logged.clear()


class BusConnection:
    """Lifecycle: ``await start()`` (returns at once; connecting goes on in a task),
    ``await aclose()`` (idempotent); ``async with`` does both."""

    def __init__(self, url: str, *, name: str, metrics: BusMetrics,
                 on_up: Callable[[NATS, object], Awaitable[None]],
                 on_down: Callable[[], None] | None = None,
                 connect_timeout_s: float = 1.0, backoff_s: float = 0.5,
                 backoff_max_s: float = 5.0) -> None:
        self.url = url
        self.name = name
        self.metrics = metrics
        self.problems = Problems(metrics.outages, f"bus {url}")
        self.on_up = on_up
        self.on_down = on_down
        self.connect_timeout_s = connect_timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.state = BusState.CONNECTING
        self.nc: NATS | None = None
        self.js = None
        #: connection attempts finished (either way): readiness waits for the first
        self.attempts = 0
        self._lost = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def up(self) -> bool:
        return self.state is BusState.UP

    async def start(self) -> None:
        if self._task is not None or self.state is BusState.CLOSED:
            raise RuntimeError("BusConnection.start() twice or after aclose()")
        self._task = asyncio.create_task(self._run(), name=f"radixfleet-bus-{self.name}")

    def report(self, cause: str, message: str, *args: object) -> None:
        """A problem the owner met while UP (a failed publish...): counted, logged
        once per cause."""
        self.problems.report(cause, message, *args)

    def lost(self, cause: str, message: str, *args: object) -> None:
        """The owner found the connection unusable: drop it and reconnect."""
        self.problems.report(cause, message, *args)
        self._lost.set()

    async def _run(self) -> None:
        delay = self.backoff_s
        while True:
            self._lost.clear()
            nc = NATS()
            try:
                await nc.connect(
                    self.url, name=self.name, allow_reconnect=False,
                    # nats-py retries the first connect forever with 0; 1 = give up
                    # after a second try, our own backoff takes it from there
                    connect_timeout=self.connect_timeout_s, max_reconnect_attempts=1,
                    reconnect_time_wait=0.05,
                    closed_cb=self._on_closed, disconnected_cb=self._on_closed,
                    error_cb=self._on_error)
                self.nc, self.js = nc, nc.jetstream(timeout=max(self.connect_timeout_s, 2.0))
                await self.on_up(nc, self.js)
            except asyncio.CancelledError:
                await self._close_nc(nc)
                raise
            except Exception as exc:  # noqa: BLE001 - every failure means "retry later"
                self.attempts += 1
                cause = ("connect" if not nc.is_connected else "setup")
                self.problems.report(cause, "%s failed (%s: %s); retrying in %.1f s", cause,
                                     type(exc).__name__, exc, delay)
                await self._went_down(nc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
                continue
            self.attempts += 1
            self.state = BusState.UP
            self.metrics.up.set(1)
            self.problems.ok()
            log.info("bus %s up (%s)", self.url, self.name)
            delay = self.backoff_s
            await self._lost.wait()
            if not self.problems._logged:
                self.problems.report("lost", "connection lost; degrading until it is back")
            await self._went_down(nc)
            await asyncio.sleep(delay)

    async def _went_down(self, nc: NATS) -> None:
        was_up = self.state is BusState.UP
        self.state = BusState.DOWN
        self.metrics.up.set(0)
        self.nc = self.js = None
        await self._close_nc(nc)
        if was_up and self.on_down is not None:
            self.on_down()

    async def _close_nc(self, nc: NATS) -> None:
        if nc.is_closed:
            return
        try:
            await asyncio.wait_for(nc.close(), 1.0)
        except Exception:  # noqa: BLE001 - closing a broken connection may fail; moot
            pass

    async def _on_closed(self) -> None:
        self._lost.set()

    async def _on_error(self, exc: Exception) -> None:
        log.debug("bus %s: client error %s: %s", self.url, type(exc).__name__, exc)

    async def aclose(self) -> None:
        if self.state is BusState.CLOSED:
            return
        self.state = BusState.CLOSED
        self.metrics.up.set(0)
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass
        nc, self.nc, self.js = self.nc, None, None
        if nc is not None:
            await self._close_nc(nc)

    async def __aenter__(self) -> "BusConnection":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
