"""``response_headers:`` (what the router tells clients about itself) and
``decisions:`` (the recent routing decisions ``GET /admin/decisions`` explains).
"""

from __future__ import annotations

from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings


@settings
class ResponseHeadersConfig:
    """``response_headers:``: what a proxied answer says about the fleet (all off:
    worker ids, the fleet's size and what it caches stay internal)."""

    worker_id: bool = _opt(
        False,
        "answer each proxied request with an `x-radixfleet-worker` header naming the worker "
        "that served it (off: the fleet's worker ids and topology stay internal; for tests "
        "and load generators that count per worker)",
    )
    match_tokens: bool = _opt(
        False,
        "answer each proxied request with `x-radixfleet-available-tokens` (the best match among "
        "the eligible workers) and `x-radixfleet-predicted-tokens` (the chosen worker's) "
        "(radixfleet.route.decisions; off: what the fleet caches stays internal; for load generators "
        "that report routing quality per request)",
    )


@settings
class DecisionsConfig:
    """``decisions:``: the ring of recent routing decisions (``radixfleet.route.decisions``)."""

    size: int = _opt(
        256,
        "the last client requests' routing decisions GET /admin/decisions keeps, each with "
        "its candidates' figures (radixfleet.route.decisions: about 0.5 KB + 0.25 KB per eligible "
        "worker each; 0: none kept, none explained)",
        lo=0,
        hi=4096,
    )
