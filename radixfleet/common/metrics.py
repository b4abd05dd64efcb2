"""What every radixfleet server's metrics registry holds besides its own series.

Each server keeps a registry of its own (two routers in one test process never share
counters); a custom registry lacks the default one's process, platform and GC
collectors, which operators' dashboards expect (``process_*``, ``python_*``).
"""

from __future__ import annotations

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry


def standard_collectors(registry: CollectorRegistry) -> None:
    """Adds the process, platform and GC collectors (``process_*``, ``python_*``)
    that the default registry has and a custom one lacks."""
    for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(c)
