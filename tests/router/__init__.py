"""Tests of the router (radixfleet/server/): front door, service, registry, engines links as the
router sees them, metrics, shedding, prefetch, discovery, traffic log."""
