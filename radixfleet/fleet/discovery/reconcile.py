"""Applies the desired set of discovered endpoints to the pool, as diffs.

Ownership is by URL: the reconciler only ever removes a worker that it added and
that the pool still holds with ``Source.DISCOVERY`` (an agent that registers on a
discovered URL keeps that source under its own id; the reconciler follows the URL).
Workers from the YAML file, the admin API or self-registration are never touched;
a discovered endpoint whose URL or id they already hold is skipped and counted.

Invariant (``check()``, true after every ``apply``): every URL in ``owned`` is in
the pool with source DISCOVERY, and ``len(owned) <= max_workers``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from radixfleet.engines.adapters import KINDS
from radixfleet.fleet.discovery.base import DiscoveryMetrics, Endpoint, Problems
from radixfleet.fleet.pool import Pool, Source

log = logging.getLogger("radixfleet.discovery")


class Reconciler:
    """Diff-applies desired endpoint sets to ``pool``. Synchronous; one event loop."""

    def __init__(self, pool: Pool, metrics: DiscoveryMetrics, max_workers: int) -> None:
        self.pool = pool
        self.metrics = metrics
        self.max_workers = max_workers
        self.owned: dict[str, Endpoint] = {}  # url -> endpoint this reconciler added
        self._problems = Problems("reconcile", metrics)

    def apply(self, desired: Iterable[Endpoint]) -> tuple[list[str], list[str]]:
        """Makes the pool's discovered workers equal ``desired`` (deduplicated by
        URL, then by id; cut to ``max_workers`` in URL order). O(len(desired) +
        len(owned)). Returns (added ids, removed ids)."""
        want = self._select(desired)
        pool = self.pool
        # Forget what was taken from us (admin DELETE, a reload listing the URL).
        for url in [u for u in self.owned if not self._ours(u)]:
            del self.owned[url]
        removed: list[str] = []
        for url in [u for u in self.owned if u not in want]:
            w = pool.by_url(url)
            assert w is not None, "what we own is in the pool (the loop above forgot the rest)"
            del self.owned[url]
            pool.remove(w.id)
            removed.append(w.id)
        added = []
        for url, ep in want.items():
            if url in self.owned:
                continue
            w = pool.by_url(url)
            if w is not None:
                self._problems.report(
                    "conflict",
                    "%s (%s) is already a %s worker %r: kept as it is",
                    ep.id,
                    url,
                    w.source.value,
                    w.id,
                )
                continue
            taken = pool.get(ep.id)
            if taken is not None:
                self._problems.report(
                    "conflict", "worker id %r is taken by %s: %s skipped", ep.id, taken.url, url
                )
                continue
            kind = next((k for k in KINDS if k == ep.kind), None) or "auto"
            spec = dataclasses.replace(ep.template, url=url, id=ep.id, kind=kind)
            pool.add(ep.id, url, Source.DISCOVERY, spec=spec)
            self.owned[url] = ep
            added.append(ep.id)
        if added:
            self.metrics.changes.labels("added").inc(len(added))
        if removed:
            self.metrics.changes.labels("removed").inc(len(removed))
        if added or removed:
            log.info(
                "discovery: %d added, %d removed, %d discovered workers",
                len(added),
                len(removed),
                len(self.owned),
            )
        return added, removed

    def _ours(self, url: str) -> bool:
        w = self.pool.by_url(url)
        return w is not None and w.source is Source.DISCOVERY

    def _select(self, desired: Iterable[Endpoint]) -> dict[str, Endpoint]:
        by_url: dict[str, Endpoint] = {}
        ids: set[str] = set()
        for ep in sorted(desired, key=lambda e: (e.url, e.id, e.kind)):
            if ep.url in by_url or ep.id in ids:
                continue  # dual-stack twins, or two sources naming one worker
            by_url[ep.url] = ep
            ids.add(ep.id)
        if len(by_url) > self.max_workers:
            self._problems.report(
                "too_many",
                "%d endpoints discovered, keeping the first %d (workers.discovery.max_workers)",
                len(by_url),
                self.max_workers,
            )
            by_url = dict(list(by_url.items())[: self.max_workers])
        return by_url

    def release(self) -> None:
        """Forgets ownership without touching the pool (shutdown: the workers stay
        until the process ends, in-flight requests unaffected)."""
        self.owned.clear()

    def check(self) -> None:
        """Asserts the module invariant."""
        assert len(self.owned) <= self.max_workers, f"{len(self.owned)=}"
        for url, ep in self.owned.items():
            w = self.pool.by_url(url)
            assert w is not None and w.source is Source.DISCOVERY, f"{url=} {ep=} {w=}"
