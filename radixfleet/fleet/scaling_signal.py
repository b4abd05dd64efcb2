"""Prefix-aware autoscaling: how many workers the fleet needs *now* (a pure signal).

A queue-depth rule scales on a symptom: by the time requests wait, the fleet is
already short, and the new workers arrive a start-up delay later while the queue
keeps growing, so the rule overshoots. This signal scales on the demand itself —
the prefill work the traffic asks for after the cache has served its share, the
holders each hot prefix needs, the KV they take — and adds the queue only as a
backlog to drain::

    per worker:  tps    = prefill tokens/s (mean of the measured rates)
                 usable = target_utilization * tps
    compute  = ceil(uncached_tps / usable)        uncached_tps: the DemandMeter's decayed
                                                  rate of prompt tokens not matched in the
                                                  index (what someone must prefill),
                                                  projected a start-up delay ahead
                                                  while it rises
    holders  = max over hot prefixes p of needed_p, where
                 needed_p = holders_needed(rate_p, uncached per request, tps,
                                           holder_max_rate, target_utilization)
               (radixfleet.policies.replication's formula: one holder absorbs
                min(holder_max_rate, usable / uncached) req/s of p)
    kv       = ceil((running * (uncached per request + output) + sum_p needed_p * depth_tokens_p)
                    / (kv_target * kv_capacity per worker))
               the running requests' own KV plus a copy of each hot prefix per holder
               it needs (cached prefixes are shared, evictable cache is no pressure)
    queue    = ceil(backlog_tokens / (queue_drain_s * tps))   backlog: the router's
                                                  in-flight uncached tokens, summed
                                                  over workers
    desired  = clamp(max(compute, holders, kv) + queue, min_workers, max_workers)

``workers_needed(demand, hot, load, params)`` is that formula: no I/O, no clock, so the
router (a gauge, per-prefix detail behind the admin token) and the simulator's
closed loop (``radixfleet_tools.loadtest.simulator.scaling_loop``) compute it from the same objects.
``DemandMeter`` is the only state: two decayed counters the request path bumps
(O(1), two floats). ``queue_rule`` is the baseline it is compared with: an HPA
scaling on waiting requests per replica.

Scale-down damping (a stabilization window) and the start-up delay belong to the
autoscaler that acts on the signal (HPA/KEDA, or the simulator's controller), not
to the signal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from radixfleet.policies.replication import holders_needed


@dataclass(frozen=True, slots=True)
class AutoscaleParams:
    """Knobs of the signal (YAML-shaped; validated by ``validate()``)."""

    #: share of a worker's prefill rate the plan may use (headroom for bursts, decode)
    target_utilization: float = 0.6
    #: req/s of one prefix a single holder absorbs at most (decode, batch slots)
    holder_max_rate: float = 50.0
    #: prefixes below this many req/s are not counted as hot
    hot_min_rate: float = 1.0
    #: the current backlog should drain within this many seconds
    queue_drain_s: float = 10.0
    #: KV utilization the plan aims at
    kv_target: float = 0.85
    #: prefill tokens/s assumed for a worker that has not reported one
    default_prefill_tps: float = 10_000.0
    #: output tokens per request assumed for the running requests' KV
    output_tokens: int = 256
    min_workers: int = 1
    max_workers: int = 1024

    def validate(self) -> AutoscaleParams:
        for name in ("target_utilization", "kv_target"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        for name in ("holder_max_rate", "queue_drain_s", "default_prefill_tps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hot_min_rate < 0:
            raise ValueError(f"hot_min_rate must be >= 0, got {self.hot_min_rate}")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}"
            )
        return self


def params_from(cfg) -> AutoscaleParams:
    """The signal's parameters from a ``radixfleet.config.AutoscaleConfig``."""
    return AutoscaleParams(
        target_utilization=cfg.target_utilization,
        holder_max_rate=cfg.holder_max_rate,
        hot_min_rate=cfg.hot_min_rate,
        queue_drain_s=cfg.queue_drain_s,
        kv_target=cfg.kv_target,
        output_tokens=cfg.output_tokens,
        min_workers=cfg.min_workers,
        max_workers=cfg.max_workers,
    ).validate()


@dataclass(frozen=True, slots=True)
class Demand:
    """What the traffic asks for (``DemandMeter.demand``)."""

    #: requests/s
    request_rate: float
    #: prompt tokens/s that no worker was believed to hold (prefill work)
    uncached_tps: float
    #: prompt tokens/s in all (the mean prompt: prompt_tps / request_rate)
    prompt_tps: float = 0.0


@dataclass(frozen=True, slots=True)
class HotDemand:
    """One hot prefix (``PrefixIndex.hot_prefixes``): its chained hash, length in
    tokens, decayed req/s and how many workers hold it now."""

    key: int
    depth_tokens: int
    rate: float
    holders: int


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One routable worker's load (from a ``radixfleet.policies.base.WorkerView``)."""

    prefill_tps: float | None  # None: not measured yet
    #: prefill work ahead: the router's in-flight uncached tokens (the agents' queued
    #: tokens count whole prompts, most of which their caches serve)
    backlog_tokens: int
    running_requests: int
    kv_capacity_tokens: int
    queued_requests: int = 0


@dataclass(frozen=True, slots=True)
class PrefixNeed:
    key: int
    depth_tokens: int
    rate: float
    holders: int
    needed: int
    per_holder_rate: float

    def to_json(self) -> dict:
        return {
            "hash": f"{self.key:016x}",
            "depth_tokens": self.depth_tokens,
            "rate": round(self.rate, 4),
            "holders": self.holders,
            "needed": self.needed,
            "per_holder_rate": round(self.per_holder_rate, 4),
        }


@dataclass(frozen=True, slots=True)
class ScaleSignal:
    """The signal and its parts. ``desired`` is the gauge."""

    desired: int
    current: int
    compute: int
    holders: int
    kv: int
    queue: int
    #: which part decided: "compute", "holders", "kv" (ties: the first), "+queue" appended
    #: when the backlog term added workers, or "min" / "max" when clamped
    reason: str
    prefill_tps: float
    prefixes: tuple[PrefixNeed, ...] = ()

    def to_json(self) -> dict:
        return {
            "desired": self.desired,
            "current": self.current,
            "compute": self.compute,
            "holders": self.holders,
            "kv": self.kv,
            "queue": self.queue,
            "reason": self.reason,
            "prefill_tps": round(self.prefill_tps, 1),
            "prefixes": [p.to_json() for p in self.prefixes],
        }


def fleet_prefill_tps(load: Sequence[WorkerLoad], default: float) -> float:
    """Mean measured prefill rate of the workers that report one (else ``default``)."""
    rates = [w.prefill_tps for w in load if w.prefill_tps]
    return sum(rates) / len(rates) if rates else default


def workers_needed(
    demand: Demand,
    hot: Sequence[HotDemand],
    load: Sequence[WorkerLoad],
    params: AutoscaleParams = AutoscaleParams(),
) -> ScaleSignal:
    """The workers the fleet needs now (module docstring). Pure; O(workers + hot)."""
    p = params
    tps = fleet_prefill_tps(load, p.default_prefill_tps)
    usable = p.target_utilization * tps
    compute = math.ceil(demand.uncached_tps / usable - 1e-9) if demand.uncached_tps > 0 else 0
    per_request = (demand.uncached_tps / demand.request_rate) if demand.request_rate > 0 else 0.0
    per_request = max(per_request, 1.0)
    needs = []
    holders = 0
    prefix_kv = 0
    for h in hot:
        if h.rate < p.hot_min_rate:
            continue
        n, per = holders_needed(
            h.rate, per_request, tps, p.holder_max_rate, p.target_utilization, p.max_workers
        )
        needs.append(PrefixNeed(h.key, h.depth_tokens, h.rate, h.holders, n, per))
        holders = max(holders, n)
        prefix_kv += n * h.depth_tokens
    running = sum(w.running_requests for w in load)
    caps = [w.kv_capacity_tokens for w in load if w.kv_capacity_tokens > 0]
    kv = 0
    if caps:
        per_worker = sum(caps) / len(caps)
        own = per_request + p.output_tokens
        kv = math.ceil((running * own + prefix_kv) / (p.kv_target * per_worker) - 1e-9)
    backlog = sum(w.backlog_tokens for w in load)
    queue = math.ceil(backlog / (p.queue_drain_s * tps) - 1e-9) if backlog > 0 else 0
    parts = (("compute", compute), ("holders", holders), ("kv", kv))
    reason, base = max(parts, key=lambda kv_: kv_[1])
    raw = base + queue
    if queue:
        reason += "+queue"
    desired = min(max(raw, p.min_workers), p.max_workers)
    if desired != raw:
        reason = "min" if raw < p.min_workers else "max"
    needs.sort(key=lambda n: -n.rate)
    return ScaleSignal(desired, len(load), compute, holders, kv, queue, reason, tps, tuple(needs))


def fleet_signal(
    now: float,
    meter: DemandMeter,
    index,
    views,
    params: AutoscaleParams,
    *,
    lead_s: float = 0.0,
    hot_k: int = 16,
    block_tokens: int = 32,
) -> ScaleSignal:
    """``workers_needed`` from the router's own objects: the ``DemandMeter``, the
    ``PrefixIndex`` (its ``hot_prefixes(now, hot_k)``, depth in blocks of
    ``block_tokens``) and the routable ``WorkerView``s (a worker whose agent has not
    reported, ``kv_capacity_tokens == 0``, counts as unmeasured). ``lead_s``: the
    workers' start-up delay (the demand is projected that far while it rises).
    O(index nodes) for the hot prefixes: call it at scrape time, not per request."""
    live = {v.id for v in views}
    hot = [
        HotDemand(
            h.hash,
            h.depth * block_tokens,
            h.rate,
            # a data-parallel rank ("<worker>#<rank>") is a replica too
            sum(1 for w in h.holders if w.partition("#")[0] in live),
        )
        for h in index.hot_prefixes(now, k=hot_k)
    ]
    load = [
        WorkerLoad(
            v.prefill_tokens_per_s if v.kv_capacity_tokens else None,
            v.in_flight_tokens,
            v.running_requests,
            v.kv_capacity_tokens,
            v.queued_requests,
        )
        for v in views
    ]
    return workers_needed(meter.demand(now, lead_s), hot, load, params)


def queue_rule(
    queued_requests: int,
    current: int,
    target_per_worker: float,
    min_workers: int = 1,
    max_workers: int = 1024,
    tolerance: float = 0.1,
) -> int:
    """The baseline: Kubernetes HPA on an average-value metric (waiting requests per
    replica, e.g. vLLM's ``num_requests_waiting``)::

        desired = ceil(current * (queued / current) / target)  =  ceil(queued / target)

    unchanged while the ratio is within ``tolerance`` of 1 (HPA's default 0.1),
    clamped to ``[min_workers, max_workers]``."""
    if current < 1:
        current = 1
    ratio = (queued_requests / current) / target_per_worker
    if abs(ratio - 1.0) <= tolerance:
        return min(max(current, min_workers), max_workers)
    return min(max(math.ceil(current * ratio - 1e-9), min_workers), max_workers)


class DemandMeter:
    """Decayed rates of requests, uncached and all prompt tokens, projected ahead
    while they rise (the request path's only autoscaling cost: ``observe`` is O(1),
    six float updates).

    A counter ``c`` decays as ``exp(-lambda * dt)`` and gains 1 (or the tokens) per
    request; for a steady rate ``r`` it settles at ``r / lambda``, so ``lambda * c``
    estimates the rate. On a ramp ``r(t) = a t`` the estimate lags by ``1 / lambda``:
    ``lambda * c = a (t - 1/lambda)``. Two counters with different half-lives
    (``half_life_s`` and 4x that) lag by different times, so their difference gives
    the slope ``a``, and ``demand(now, lead_s)`` reports the rate ``lead_s`` ahead:
    ``fast + a * (1/lambda_fast + lead_s)`` when rising, the fast estimate otherwise
    (a falling rate is never projected: scaling down waits for the fact). The
    autoscaler passes its workers' start-up delay as ``lead_s``: a worker asked for
    now serves the traffic of then. Invariant (``check()``): counters are >= 0.
    """

    __slots__ = ("_lf", "_ls", "_t", "_fast", "_slow")

    def __init__(self, half_life_s: float = 10.0) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self._lf = math.log(2) / half_life_s
        self._ls = self._lf / 4.0
        self._t: float | None = None
        # [requests, uncached tokens, prompt tokens] under each half-life
        self._fast = [0.0, 0.0, 0.0]
        self._slow = [0.0, 0.0, 0.0]

    def _decay(self, now: float) -> None:
        t = self._t
        if t is not None and now > t:
            ff = math.exp(-self._lf * (now - t))
            fs = math.exp(-self._ls * (now - t))
            for i in range(3):
                self._fast[i] *= ff
                self._slow[i] *= fs
        if t is None or now > t:
            self._t = now

    def observe(self, now: float, uncached_tokens: int, prompt_tokens: int) -> None:
        """One request of ``prompt_tokens`` that leaves ``uncached_tokens`` of them to
        prefill (the policy's decision: prompt - matched blocks)."""
        self._decay(now)
        for c in (self._fast, self._slow):
            c[0] += 1.0
            c[1] += uncached_tokens
            c[2] += prompt_tokens

    def demand(self, now: float, lead_s: float = 0.0) -> Demand:
        """The rates now, or ``lead_s`` ahead while they rise."""
        self._decay(now)
        lf, ls = self._lf, self._ls
        out = []
        for i in range(3):
            fast, slow = lf * self._fast[i], ls * self._slow[i]
            slope = (fast - slow) / (1.0 / ls - 1.0 / lf)
            out.append(fast + slope * (1.0 / lf + lead_s) if slope > 0 else fast)
        return Demand(*out)

    def check(self) -> None:
        assert min(self._fast) >= 0 and min(self._slow) >= 0, f"{self._fast=} {self._slow=}"
