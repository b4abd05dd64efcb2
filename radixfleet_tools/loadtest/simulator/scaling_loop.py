"""The autoscaling loop closed in the simulator: a flash crowd onto a new hot prefix.

Two rules drive the same controller (``Simulation(scaler=...)``: every
``interval_s`` a desired size; joins routable after ``startup_s``; scale-down only to
the largest size wanted over ``stabilization_s``; leaves drain first)::

    PrefixAwareScaler   radixfleet.fleet.scaling_signal.fleet_signal (the router's own call): the
                        DemandMeter's uncached prefill rate projected a start-up delay
                        ahead, the index's hot prefixes and their holders, KV and
                        backlog from the workers' views
    QueueDepthScaler    radixfleet.fleet.scaling_signal.queue_rule: an HPA on the agents' waiting
                        requests per replica (vLLM's num_requests_waiting)

The scenario (``FlashCrowd``): steady traffic behind a few system prompts, then a
new long shared document (a launch, a viral prompt) whose request rate ramps up,
holds and ramps down, while the baseline goes on. Both rules see the same trace,
the same seed, the same start-up delay and the same controller; the table gives
TTFT p50/p99 against the SLO, the worker-seconds spent and the peak size.
``run_flash_crowd`` runs one rule; ``compare`` runs several (``bench autoscale``).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from radixfleet.fleet.scaling_signal import AutoscaleParams, DemandMeter, fleet_signal, queue_rule
from radixfleet_tools.loadtest.arrivals import Bounds, TraceTimes
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import ACTIVE, STARTING, SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import Trace


@dataclass(frozen=True, slots=True)
class FlashCrowd:
    """The trace: Poisson baseline plus a ramped crowd onto one new prefix."""

    seed: int = 0
    duration_s: float = 480.0
    #: baseline: requests/s, spread over a few system prompts, each + a unique question
    base_rate: float = 12.0
    system_prompts: int = 4
    system_tokens: int = 2048
    question_tokens: int = 1024
    #: the crowd: a new shared document, its rate ramps 0 -> peak -> 0
    flash_start_s: float = 90.0
    ramp_s: float = 120.0
    hold_s: float = 120.0
    flash_rate: float = 150.0
    flash_prefix_tokens: int = 16_384
    flash_question_tokens: int = 512
    output_tokens: int = 32
    block_tokens: int = 512

    def rate(self, t: float) -> tuple[float, float]:
        """(baseline, crowd) requests/s at time t."""
        a = t - self.flash_start_s
        if a < 0:
            f = 0.0
        elif a < self.ramp_s:
            f = a / self.ramp_s
        elif a < self.ramp_s + self.hold_s:
            f = 1.0
        elif a < 2 * self.ramp_s + self.hold_s:
            f = 1.0 - (a - self.ramp_s - self.hold_s) / self.ramp_s
        else:
            f = 0.0
        return self.base_rate, f * self.flash_rate

    def records(self) -> list[tuple[float, int, int, list[int]]]:
        """Mooncake-shaped records (prefix-chained block ids), by thinning a Poisson
        process at the peak total rate."""
        rng = random.Random(self.seed)
        bt = self.block_tokens
        peak = self.base_rate + self.flash_rate
        sys_blocks = math.ceil(self.system_tokens / bt)
        doc_blocks = self.flash_prefix_tokens // bt
        next_id = 10_000_000
        out = []
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= self.duration_s:
                break
            base, crowd = self.rate(t)
            u = rng.random() * peak
            if u < base:
                k = rng.randrange(self.system_prompts)
                ids = [k * 100_000 + j for j in range(sys_blocks)]
                n_in = sys_blocks * bt + self.question_tokens
            elif u < base + crowd:
                ids = [9_000_000 + j for j in range(doc_blocks)]
                n_in = doc_blocks * bt + self.flash_question_tokens
            else:
                continue
            extra = math.ceil(n_in / bt) - len(ids)
            ids = ids + list(range(next_id, next_id + extra))
            next_id += extra
            out.append((t * 1000.0, n_in, self.output_tokens, ids))
        return out


class PrefixAwareScaler:
    """``radixfleet.fleet.scaling_signal.workers_needed`` on the simulated router's state."""

    name = "prefix-aware"

    def __init__(
        self,
        params: AutoscaleParams | None = None,
        *,
        interval_s: float = 5.0,
        startup_s: float = 30.0,
        stabilization_s: float = 60.0,
        half_life_s: float = 10.0,
        hot_k: int = 16,
    ) -> None:
        self.params = (params or AutoscaleParams()).validate()
        self.interval_s = interval_s
        self.startup_s = startup_s
        self.stabilization_s = stabilization_s
        self.meter = DemandMeter(half_life_s)
        self.max_workers = self.params.max_workers
        self.hot_k = hot_k
        #: (time, ScaleSignal) per tick: the signal's parts, for the report and plots
        self.history: list = []

    def on_dispatch(self, now: float, uncached_tokens: int, prompt_tokens: int) -> None:
        self.meter.observe(now, uncached_tokens, prompt_tokens)

    def desired(self, sim: Simulation, now: float) -> int:
        sig = fleet_signal(
            now,
            self.meter,
            sim.index,
            sim._views(now),
            self.params,
            lead_s=self.startup_s,
            hot_k=self.hot_k,
            block_tokens=sim.block_tokens,
        )
        self.history.append((now, sig))
        return sig.desired


class QueueDepthScaler:
    """An HPA on waiting requests per replica (``radixfleet.fleet.scaling_signal.queue_rule``)."""

    def __init__(
        self,
        target_per_worker: float = 4.0,
        *,
        interval_s: float = 5.0,
        startup_s: float = 30.0,
        stabilization_s: float = 60.0,
        min_workers: int = 1,
        max_workers: int = 1024,
    ) -> None:
        self.target = target_per_worker
        self.name = f"queue-depth (target {target_per_worker:g} waiting/worker)"
        self.interval_s = interval_s
        self.startup_s = startup_s
        self.stabilization_s = stabilization_s
        self.min_workers = min_workers
        self.max_workers = max_workers

    def on_dispatch(self, now: float, uncached_tokens: int, prompt_tokens: int) -> None:
        pass

    def desired(self, sim: Simulation, now: float) -> int:
        views = sim._views(now)
        queued = sum(v.queued_requests for v in views)
        current = sum(1 for r in sim.refs if r.state in (ACTIVE, STARTING))
        return queue_rule(queued, current, self.target, self.min_workers, self.max_workers)


def run_flash_crowd(
    scaler,
    crowd: FlashCrowd = FlashCrowd(),
    *,
    workers: int = 2,
    slo_ms: float = 2000.0,
    policy: str = "prefix_load",
    model: str = "llama-3-8b",
    gpu: str = "h100",
    seed: int = 0,
    check: bool = False,
) -> dict:
    """One rule on the flash crowd; returns its row (figures, SLO verdict, report)."""
    trace = Trace.from_records(
        crowd.records(), block_tokens=crowd.block_tokens, path="flash-crowd", seed=crowd.seed
    )
    cfg = SimConfig(
        workers=workers, policy=policy, engine=EngineSpec(model=model, gpu=gpu), level="block", check=check
    )
    sim = Simulation(
        cfg,
        trace,
        TraceTimes(),
        Bounds(None, None, 600.0),
        seed=seed,
        name=scaler.name if scaler is not None else f"fixed {workers}",
        scaler=scaler,
    )
    out = sim.run()
    rep = out.report
    a = rep.get("autoscale") or {
        "worker_seconds": workers * sim.now,
        "peak_workers": workers,
        "joins": 0,
        "leaves": 0,
        "timeline": [],
    }
    p99 = rep["ttft_ms"]["p99"]
    return {
        "rule": rep["name"],
        "requests": rep["requests"],
        "ok": rep["ok"],
        "ttft_p50_ms": rep["ttft_ms"]["p50"],
        "ttft_p99_ms": p99,
        "slo_ms": slo_ms,
        "slo_met": p99 is not None and p99 <= slo_ms and rep["ok"] == rep["requests"],
        "worker_seconds": a["worker_seconds"],
        "peak_workers": a["peak_workers"],
        "joins": a["joins"],
        "leaves": a["leaves"],
        "hit_rate": rep["hit_rate"],
        "timeline": a["timeline"],
        "sim_duration_s": rep["sim"]["sim_duration_s"],
        "crowd": asdict(crowd),
        "sim": sim if check else None,
    }


def default_rules(
    startup_s: float = 30.0, interval_s: float = 5.0, stabilization_s: float = 60.0, max_workers: int = 64
) -> list:
    """The rules the bench and the test compare, sharing one controller's settings
    (and one ``max_workers`` cap, as an operator would set on the HPA)."""
    i, up, st = interval_s, startup_s, stabilization_s
    return [
        PrefixAwareScaler(
            AutoscaleParams(max_workers=max_workers), interval_s=i, startup_s=up, stabilization_s=st
        ),
        QueueDepthScaler(4.0, max_workers=max_workers, interval_s=i, startup_s=up, stabilization_s=st),
        QueueDepthScaler(1.0, max_workers=max_workers, interval_s=i, startup_s=up, stabilization_s=st),
    ]


def compare(
    crowd: FlashCrowd = FlashCrowd(), *, workers: int = 2, slo_ms: float = 2000.0, seed: int = 0, rules=None
) -> list[dict]:
    """Every rule on the same trace and seed; rows in rule order."""
    rows = []
    for sc in rules if rules is not None else default_rules():
        rows.append(run_flash_crowd(sc, crowd, workers=workers, slo_ms=slo_ms, seed=seed))
    return rows
