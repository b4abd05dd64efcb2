"""What every discovery source shares: the endpoint it finds, the narrow source
interface, its problem accounting and the discovery metrics.

A source knows one way to find workers (Kubernetes EndpointSlices, DNS records)
and nothing about the pool::

    class MySource:
        name = "dns"                       # metric label, log prefix
        def snapshots(self) -> AsyncGenerator[frozenset[Endpoint], None]:
            ...                            # yields the WHOLE desired set each time it
                                           # changes; raises SourceError (or anything)
                                           # when it cannot see the truth any more

The manager (``radixfleet.fleet.discovery.Discovery``) restarts a source that raised, with
backoff, and meanwhile keeps the set it last yielded: an unreachable or garbled
source never empties the pool.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from radixfleet.config import WorkerSpec

log = logging.getLogger("radixfleet.discovery")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One discovered worker: pool id, base URL (``http://host:port``), engine kind,
    and the worker entry its selector gives it (model and engine settings:
    ``radixfleet.config.selector_template``; url, id and kind are this endpoint's)."""

    id: str
    url: str
    kind: str
    template: WorkerSpec = WorkerSpec()


class SourceError(Exception):
    """A source cannot see the truth right now. ``cause`` is the metric label
    (``unreachable``, ``http_status``, ``garbage``, ``watch_error``, ...)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class Source(Protocol):
    name: str

    def snapshots(self) -> AsyncGenerator[frozenset[Endpoint], None]:
        """Yields the full desired set of endpoints whenever it changes (the first
        one as soon as it is known). Runs until cancelled or it raises."""
        ...


def url_for(host: str, port: int) -> str:
    """``http://host:port`` with an IPv6 literal in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class DiscoveryMetrics:
    """Discovery's counters and gauges, registered on the router's registry::

    radixfleet_discovery_endpoints{source}         endpoints in its last set
    radixfleet_discovery_errors_total{source,cause}   problems, by cause
    radixfleet_discovery_changes_total{op}         pool adds / removes applied
    radixfleet_discovery_watch_restarts_total{source,reason}  expired (410 ->
                                                   relist) | closed | dropped
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.endpoints = Gauge(
            "radixfleet_discovery_endpoints",
            "Endpoints in a discovery source's last answer",
            ["source"],
            registry=registry,
        )
        self.errors = Counter(
            "radixfleet_discovery_errors",
            "Discovery problems (the pool keeps what it last knew)",
            ["source", "cause"],
            registry=registry,
        )
        self.changes = Counter(
            "radixfleet_discovery_changes",
            "Workers added to or removed from the pool by discovery",
            ["op"],
            registry=registry,
        )
        self.watch_restarts = Counter(
            "radixfleet_discovery_watch_restarts",
            "Kubernetes watches restarted, by reason",
            ["source", "reason"],
            registry=registry,
        )


class Problems:
    """Counts a source's problems and logs each cause once until the source has a
    success again (a down API server must not write a line per retry)."""

    __slots__ = ("source", "metrics", "_logged")

    def __init__(self, source: str, metrics: DiscoveryMetrics) -> None:
        self.source = source
        self.metrics = metrics
        self._logged: set[str] = set()  # causes logged since the last success

    def report(self, cause: str, message: str, *args: object) -> None:
        self.metrics.errors.labels(self.source, cause).inc()
        if cause in self._logged:
            log.debug("%s discovery: " + message, self.source, *args)
            return
        self._logged.add(cause)
        log.warning("%s discovery: " + message, self.source, *args)

    def ok(self) -> None:
        if self._logged:
            log.info("%s discovery: recovered", self.source)
            self._logged.clear()
