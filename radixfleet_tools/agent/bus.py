"""``AgentBus``: an agent's side of the bus (used by ``radixfleet_tools.agent.reporter``).

One publication reaches every router replica::

    snapshot (+ registration: url, models, block_bytes), header Nats-Rollup: sub
        -> JetStream <prefix>.agent.<w>; the stream drops that worker's older messages
    deltas (stored/removed/cleared)  -> JetStream <prefix>.agent.<w>, seq + 1 each
    load, every reporter interval    -> core <prefix>.load.<w> (only the latest matters)
    <- core <prefix>.ctl.snapshot.<w>: a replica saw a gap or does not know us

The link's states follow the HTTP ``RouterLink``'s (``SNAPSHOT`` then ``STREAMING``;
registration rides on every snapshot). A snapshot also goes out every
``snapshot_interval_s``, which bounds what the stream keeps per worker. A failed
publish (no ack in time, no stream) counts as an outage: the connection is dropped
and re-made, the link snapshots on its return, and meanwhile the reporter pushes
directly to its ``--router`` URLs, if it has any.

With the agent token (``RADIXFLEET_AGENT_TOKEN``) every publication is signed and
every snapshot request checked (``radixfleet.wire.bus_wire.BusKey``): the routers drop an
unsigned registration as the HTTP agent API refuses one without the token. The
NATS server's own credentials and TLS: ``credentials`` (``--bus-user``,
``--bus-creds-file``, ``--bus-tls-ca-file``, ...; ``radixfleet.common.bus_connection``).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry

from radixfleet.common.background import Lifecycle
from radixfleet.common.bus_connection import (
    BusConnection,
    BusCredentials,
    BusMetrics,
    Problems,
    check_exposure,
)
from radixfleet.wire.bus_wire import (
    ROLLUP_HEADER,
    BadMessage,
    BusKey,
    Subjects,
    build_agent,
    build_load,
    parse_snapshot_request,
)
from radixfleet.wire.events import EventBatch
from radixfleet_tools.agent.router_link import LinkState, RouterLink

log = logging.getLogger("radixfleet.bus")


class AgentBus(Lifecycle):
    """Lifecycle: ``await start()``, ``await aclose()`` (idempotent); ``async with``.
    Only the reporter task touches ``link``; ``up`` says whether to use it."""

    def __init__(
        self,
        url: str,
        *,
        worker_id: str,
        subject_prefix: str = "radixfleet",
        snapshot_interval_s: float = 30.0,
        registry: CollectorRegistry | None = None,
        publish_timeout_s: float = 2.0,
        token: str = "",
        credentials: BusCredentials = BusCredentials(),
    ) -> None:
        """Raises ``ConfigError`` (naming the ``--bus-*`` flag) for a tokenless bus off
        loopback or credentials that cannot be read."""
        check_exposure(url, token, "--bus")
        self.key = BusKey(token)
        self.worker_id = worker_id
        self.subjects = Subjects(subject_prefix)
        self.subject = self.subjects.agent(worker_id)
        self.link = RouterLink(url)
        # no answer to read capabilities from: routers on a bus read tiers (an agent
        # with a DRAM tier needs routers of this version or newer)
        self.link.tiers = True
        self.link.state = LinkState.SNAPSHOT  # registration rides on snapshots
        self.snapshot_interval_s = snapshot_interval_s
        self.publish_timeout_s = publish_timeout_s
        self.metrics = BusMetrics(registry or CollectorRegistry())
        self.bad = Problems(self.metrics.bad, "bus messages")
        self.conn = BusConnection(
            url,
            name=f"agent-{worker_id}",
            metrics=self.metrics,
            on_up=self._on_up,
            on_down=self._on_down,
            options=credentials.connect_options(url, agent_flag),
            subjects=self.subjects,
        )
        self.kick = None  # set by the reporter: send the next batch now
        self._last_snapshot = 0.0

    @property
    def up(self) -> bool:
        return self.conn.up

    async def start(self) -> None:
        await self.conn.start()

    async def aclose(self) -> None:
        await self.conn.aclose()

    async def _on_up(self, nc, js) -> None:
        await nc.subscribe(self.subjects.snapshot_request(self.worker_id), cb=self._on_request)
        self.link.resnapshot()

    def _on_down(self) -> None:
        self.link.resnapshot()

    async def _on_request(self, msg) -> None:
        try:
            self.key.verify(msg.subject, msg.data, msg.headers)
            wid = parse_snapshot_request(msg.data)
        except BadMessage as exc:
            self.bad.report(exc.cause, "ignored a snapshot request: %s", exc)
            return
        if wid == self.worker_id and self.link.state is LinkState.STREAMING:
            self.link.resnapshot()
            if self.kick is not None:
                self.kick()

    def due_snapshot(self) -> None:
        """Forces a snapshot once ``snapshot_interval_s`` has passed since the last."""
        if (
            self.link.state is LinkState.STREAMING
            and time.monotonic() - self._last_snapshot >= self.snapshot_interval_s
        ):
            self.link.resnapshot()

    async def publish_batch(
        self,
        batch: EventBatch,
        models: list[str],
        block_bytes: int | None,
        role: str = "both",
        scheduling_policy: str = "",
    ) -> bool:
        """Publishes one batch to the stream; False (and the connection re-made) if
        the bus did not acknowledge it."""
        js = self.conn.js
        if js is None:
            return False
        snap = batch.events and batch.events[0].__class__.__name__ == "Snapshot"
        data = build_agent(batch, models, block_bytes, role, scheduling_policy)
        headers = {**(ROLLUP_HEADER if snap else {}), **self.key.sign(self.subject, data)}
        try:
            await js.publish(self.subject, data, timeout=self.publish_timeout_s, headers=headers or None)
        except Exception as exc:  # noqa: BLE001 - any failure: degrade, reconnect
            self.conn.lost(
                "publish",
                "publishing to %s failed (%s: %s); pushing directly until the bus is back",
                self.subject,
                type(exc).__name__,
                exc,
            )
            return False
        if snap:
            self._last_snapshot = time.monotonic()
        self.metrics.published.labels("agent").inc()
        return True

    async def publish_load(self, batch: EventBatch) -> None:
        nc = self.conn.nc
        if nc is None:
            return
        subject, data = self.subjects.load(self.worker_id), build_load(batch)
        try:
            await nc.publish(subject, data, headers=self.key.sign(subject, data) or None)
            self.metrics.published.labels("load").inc()
        except Exception as exc:  # noqa: BLE001
            self.conn.lost("publish", "publishing load failed (%s: %s)", type(exc).__name__, exc)


def agent_flag(name: str) -> str:
    """The ``radixfleet agent`` flag of a ``BusCredentials`` field."""
    return "--bus-" + name.replace("_", "-")
