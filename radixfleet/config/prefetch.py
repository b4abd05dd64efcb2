"""``warmup:`` (prefill-only warm-ups of hot roots) and ``prefetch:`` (``POST
/v1/prefetch``: its budget and its used/wasted accounting).
"""

from __future__ import annotations

from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings


@settings
class WarmupConfig:
    """``warmup:``: prefill-only warm-ups of hot roots on their replicas
    (``radixfleet.route.warmup``)."""

    enabled: bool = _opt(True, "send prefill-only warm-ups for hot-root replicas")
    min_interval_s: float = _opt(10.0, "at most one warm-up per (worker, prefix) this often", lo=0)
    timeout_s: float = _opt(30.0, "timeout of one warm-up request", lo=0, lo_open=True)


@settings
class PrefetchConfig:
    """``prefetch:``: ``POST /v1/prefetch``'s budget (a share of the fleet's prefill)
    and its used/wasted accounting (``radixfleet.server.prefetch``)."""

    enabled: bool = _opt(True, "serve POST /v1/prefetch (cache fills with a predicted prompt)")
    share: float = _opt(
        0.1, "share of the fleet's prefill capacity (tokens/s) prefetches may use", lo=0, hi=1
    )
    burst_s: float = _opt(2.0, "seconds of the prefetch budget that may be spent at once", lo=0, lo_open=True)
    window_s: float = _opt(
        30.0,
        "a prefetch no real request matched on its worker within this is counted wasted",
        lo=0,
        lo_open=True,
    )
    timeout_s: float = _opt(30.0, "timeout of one prefetch's prefill request", lo=0, lo_open=True)
    max_tracked: int = _opt(4096, "prefetches tracked for used/wasted at once (oldest counted wasted)", lo=1)
