"""``autoscale:``: the prefix-aware autoscaling signal (``radixfleet.fleet.scaling_signal``)."""

from __future__ import annotations

from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import setting as _opt


@settings
class AutoscaleConfig:
    """``autoscale:``: the signal's plan (``radixfleet.fleet.scaling_signal``). Invariant:
    ``min_workers <= max_workers``."""

    target_utilization: float = _opt(
        0.6, "share of a worker's prefill rate the plan may use", lo=0, hi=1, lo_open=True
    )
    holder_max_rate: float = _opt(
        50.0, "req/s of one prefix a single holder absorbs at most", lo=0, lo_open=True
    )
    hot_min_rate: float = _opt(1.0, "prefixes below this many req/s are not counted as hot", lo=0)
    queue_drain_s: float = _opt(10.0, "the backlog should drain within this many seconds", lo=0, lo_open=True)
    kv_target: float = _opt(0.85, "KV utilization the plan aims at", lo=0, hi=1, lo_open=True)
    output_tokens: int = _opt(256, "output tokens per request assumed for running requests' KV", lo=0)
    startup_s: float = _opt(
        30.0, "a new worker's start-up delay: rising demand is projected this far ahead", lo=0
    )
    half_life_s: float = _opt(10.0, "half-life of the demand meter's rates", lo=0, lo_open=True)
    hot_k: int = _opt(16, "hot prefixes considered (and shown per prefix)", lo=1)
    min_workers: int = _opt(1, "the signal never asks for fewer", lo=1)
    max_workers: int = _opt(1024, "the signal never asks for more", lo=1)

    @document_check
    def _check(self) -> None:
        if self.max_workers < self.min_workers:
            raise ConfigError(
                "max_workers",
                f"expected an integer >= min_workers ({self.min_workers}), got {self.max_workers}",
            )
