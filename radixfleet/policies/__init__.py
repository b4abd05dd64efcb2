"""Routing policies: pure decisions over typed, read-only views (contract 3,
docs/DESIGN.md). Imports only ``protocol``.

Modules::

    base             RouteRequest, MatchResult, WorkerView, Decision, Policy
    registry, params YAML name -> class; parameter validation with field paths
    basic            the cache-blind baselines: round_robin, random, least_load, power_of_two
    consistent_hash  consistent hashing with bounded loads
    load             load measures and least-loaded selection shared by the strategies
    cache_aware      SGLang's cache-aware rule
    prefix_load      the default: least expected TTFT with bounded affinity
    kv_records       what prefix_load remembers: the KV each worker writes, prefixes' homes
    replication      hot-root replication (HotRoots), used by prefix_load
    footprint        per-worker live-session footprints, read by prefix_load
    disagg           worker roles (prefill, decode, both) and the decode-side pick
"""
