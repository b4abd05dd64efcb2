"""``limits:``: what a client may hold (bodies, answers, connections, slots, queue)
and the shedding bound (``radixfleet.route.shedding``). A reload that drops the whole
section to looser defaults is a security downgrade (``radixfleet.config.reload``).
"""

from __future__ import annotations

from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings


@settings
class LimitsConfig:
    """``limits:``: what clients may hold at once and how long they may take; the
    shedding bound on queued prefill (``radixfleet.route.shedding``)."""

    max_body_bytes: int = _opt(8 * 2**20, "largest request body (413 above)", lo=1)
    max_response_bytes: int = _opt(
        64 * 2**20,
        "largest non-streamed answer, or single stream event, taken from a "
        "worker (502 above; streams are passed through, never held whole)",
        lo=1024,
    )
    max_concurrency: int = _opt(1024, "requests proxied at once", lo=1)
    max_queue: int = _opt(4096, "requests waiting for a slot (429 when full)", lo=0)
    queue_timeout_s: float = _opt(30.0, "longest wait for a slot (then 429)", lo=0, lo_open=True)
    retry_after_s: int = _opt(1, "Retry-After of a 429", lo=0)
    shutdown_timeout_s: float = _opt(30.0, "on SIGTERM, how long in-flight requests may finish", lo=0)
    worker_queue_requests: float = _opt(
        0.5,
        "shed (429 + Retry-After) when every eligible worker has more than this many "
        "typical requests' worth of prefill queued (radixfleet.route.shedding); 0 = never shed",
        lo=0,
    )
    worker_queue_min_s: float = _opt(
        0.05, "the shedding bound is at least this many seconds of queued prefill", lo=0
    )
    header_timeout_s: float = _opt(10.0, "a request head must arrive within this (408)", lo=0, lo_open=True)
    body_timeout_s: float = _opt(
        30.0, "a request body must arrive within this after its head (408)", lo=0, lo_open=True
    )
    max_buffered_body_bytes: int = _opt(
        1 << 30,
        "request body bytes the router holds at once, all connections together "
        "(received and not yet answered); a body past it is refused (429 + Retry-After)",
        lo=1,
    )
    max_connections: int = _opt(
        8192,
        "client connections held open at once; past it the longest-idle one is "
        "closed, or the new one refused (429) if none is idle. Also capped below the "
        "process's open-file limit",
        lo=1,
    )
