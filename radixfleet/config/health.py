"""The pool's view of each worker's health: ``health:`` (active checks),
``breaker:`` (request failures) and ``load:`` (reported load going stale).
"""

from __future__ import annotations

from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings


@settings
class HealthConfig:
    """``health:``: the pool's active checks of each worker."""

    path: str = _opt("/health", "health-check path on each worker")
    interval_s: float = _opt(2.0, "seconds between checks", lo=0, lo_open=True)
    timeout_s: float = _opt(1.0, "timeout of one check", lo=0, lo_open=True)
    failure_threshold: int = _opt(2, "failed checks in a row before unhealthy", lo=1)
    success_threshold: int = _opt(1, "passed checks in a row before healthy again", lo=1)


@settings
class BreakerConfig:
    """``breaker:``: a worker's circuit breaker, opened by request failures in a row."""

    failure_threshold: int = _opt(3, "request failures in a row that open the breaker", lo=1)
    open_s: float = _opt(5.0, "seconds open before one trial request", lo=0, lo_open=True)


@settings
class LoadConfig:
    """``load:``: how long an agent's reported load is believed."""

    report_stale_s: float = _opt(2.0, "an agent's load report is ignored after this", lo=0, lo_open=True)
