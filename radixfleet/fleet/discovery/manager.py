"""``Discovery``: runs the configured sources and feeds their answers to the pool.

    source (k8s.py, dns.py) --snapshots()--> latest[source] --union--> Reconciler
                                                                       pool.add/remove

Each source runs in its own task. A source that raises is counted, logged once per
cause, and restarted after a backoff (``backoff_s`` doubling to ``backoff_max_s``,
reset by its next answer); meanwhile its last answer stays in ``latest``, so the
pool keeps what it last knew. Every answer is applied at once (no batching
delay): a watch event reaches the pool in the same event-loop turn that parsed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random

from prometheus_client import CollectorRegistry

from radixfleet.common.background import Backoff, Lifecycle
from radixfleet.config import DiscoveryConfig
from radixfleet.fleet.discovery.base import DiscoveryMetrics, Endpoint, Problems, Source, SourceError
from radixfleet.fleet.discovery.reconcile import Reconciler
from radixfleet.fleet.pool import Pool

log = logging.getLogger("radixfleet.discovery")


class State(enum.Enum):
    NEW = "new"  # built; start() not called
    RUNNING = "running"  # source tasks running
    CLOSED = "closed"  # aclose() called; terminal


def build_sources(cfg: DiscoveryConfig, metrics: DiscoveryMetrics) -> list[Source]:
    """The sources ``cfg`` asks for (their client libraries imported only then)."""
    out: list[Source] = []
    if cfg.kubernetes.selectors:
        from radixfleet.fleet.discovery.k8s import KubernetesSource

        out.append(KubernetesSource(cfg.kubernetes, metrics, backoff_s=cfg.backoff_s))
    pool = cfg.kubernetes.inference_pool
    if pool.name:
        from radixfleet.fleet.discovery.inference_pool import InferencePoolSource

        out.append(
            InferencePoolSource(
                cfg.kubernetes,
                metrics,
                pool.name,
                namespace=pool.namespace,
                template=pool.selector(),
                backoff_s=cfg.backoff_s,
            )
        )
    if cfg.dns.services:
        from radixfleet.fleet.discovery.dns import DnsSource

        out.append(DnsSource(cfg.dns, metrics))
    return out


class Discovery(Lifecycle):
    """Workers from ``workers.discovery``, kept in ``pool`` with Source.DISCOVERY.

    Lifecycle: ``await start()`` (no-op when nothing is configured), then
    ``await aclose()`` (idempotent; discovered workers stay in the pool);
    ``async with`` does both. ``sources`` may replace the configured ones (tests).
    """

    def __init__(
        self,
        cfg: DiscoveryConfig,
        pool: Pool,
        registry: CollectorRegistry,
        *,
        sources: list[Source] | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = DiscoveryMetrics(registry)
        self.sources = build_sources(cfg, self.metrics) if sources is None else sources
        self.reconciler = Reconciler(pool, self.metrics, cfg.max_workers)
        self.latest: dict[str, frozenset[Endpoint]] = {}  # source name -> its last answer
        self.state = State.NEW
        self._tasks: list[asyncio.Task] = []
        self._rand = random.Random()

    async def start(self) -> None:
        if self.state is State.CLOSED:
            raise RuntimeError("Discovery.start() after aclose()")
        if self.state is State.RUNNING:
            return
        self.state = State.RUNNING
        for s in self.sources:
            self._spawn(s)
        if self.sources:
            log.info("discovery started: %s", ", ".join(s.name for s in self.sources))

    async def aclose(self) -> None:
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                if not t.cancelled():
                    raise
        self._tasks.clear()
        self.reconciler.release()

    def _spawn(self, source: Source) -> None:
        self._tasks.append(asyncio.create_task(self._run(source), name=f"radixfleet-discovery-{source.name}"))

    def apply(self) -> None:
        """Applies the union of every source's last answer to the pool."""
        union: set[Endpoint] = set()
        for eps in self.latest.values():
            union |= eps
        self.reconciler.apply(union)

    async def _run(self, source: Source) -> None:
        problems = Problems(source.name, self.metrics)
        backoff = Backoff(self.cfg.backoff_s, self.cfg.backoff_max_s, self._rand)
        while True:
            try:
                async with contextlib.aclosing(source.snapshots()) as answers:
                    async for eps in answers:
                        self.latest[source.name] = eps
                        self.metrics.endpoints.labels(source.name).set(len(eps))
                        self.apply()
                        problems.ok()
                        backoff.reset()
                problems.report("ended", "the source stopped answering; restarting")
            except asyncio.CancelledError:
                raise
            except SourceError as exc:
                problems.report(
                    exc.cause,
                    "%s (keeping %d known endpoints; retry in %.1fs)",
                    exc,
                    len(self.latest.get(source.name, ())),
                    backoff.delay_s,
                )
            except Exception as exc:  # noqa: BLE001 - a peer's garbage must never kill us
                problems.report(
                    "internal",
                    "%r (keeping %d known endpoints; retry in %.1fs)",
                    exc,
                    len(self.latest.get(source.name, ())),
                    backoff.delay_s,
                )
            await backoff.sleep()
