"""Prefix-aware autoscaling: the pure signal, the meter, the HPA baseline, and the loop
closed in the simulator (workers joining and leaving, the flash crowd)."""

from __future__ import annotations

import math

import pytest

from radixfleet.fleet.scaling_signal import (
    AutoscaleParams,
    Demand,
    DemandMeter,
    HotDemand,
    WorkerLoad,
    queue_rule,
    workers_needed,
)
from radixfleet_tools.loadtest.arrivals import Bounds, TraceTimes
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.scaling_loop import (
    FlashCrowd,
    PrefixAwareScaler,
    QueueDepthScaler,
    run_flash_crowd,
)
from radixfleet_tools.loadtest.simulator.simulation import ACTIVE, GONE, SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import Trace


def _load(n, tps=20_000.0, backlog=0, running=0, cap=100_000):
    return [WorkerLoad(tps, backlog, running, cap) for _ in range(n)]


def test_signal_parts_by_hand():
    p = AutoscaleParams(
        target_utilization=0.5, holder_max_rate=20.0, queue_drain_s=10.0, kv_target=0.8, output_tokens=100
    )
    # 50 req/s, 500 uncached tokens each: 25,000 tokens/s over 10,000 usable per worker
    d = Demand(50.0, 25_000.0, 100_000.0)
    sig = workers_needed(d, [], _load(2), p)
    assert (sig.compute, sig.holders, sig.kv, sig.queue, sig.desired) == (3, 0, 0, 0, 3)
    assert sig.reason == "compute" and sig.current == 2
    # a hot prefix at 90 req/s: one holder absorbs min(20, 10,000 / 500) = 20 req/s -> 5
    hot = [HotDemand(0xABC, 4096, 90.0, 2), HotDemand(0xDEF, 512, 0.5, 1)]
    sig = workers_needed(d, hot, _load(2), p)
    assert sig.holders == 5 and sig.desired == 5 and sig.reason == "holders"
    assert [(n.key, n.needed, n.per_holder_rate) for n in sig.prefixes] == [(0xABC, 5, 20.0)]
    # KV: 150 running x (500 + 100) + 5 copies x 4096 = 110,480 over 0.8 x 100,000 -> 2
    sig = workers_needed(d, hot, _load(2, running=75), p)
    assert sig.kv == 2
    # backlog: 600,000 tokens to drain in 10 s at 20,000 tokens/s -> 3 more
    sig = workers_needed(d, hot, _load(2, backlog=300_000), p)
    assert sig.queue == 3 and sig.desired == 8 and sig.reason == "holders+queue"
    # clamps
    assert workers_needed(Demand(0, 0, 0), [], _load(3), p).desired == 1
    big = workers_needed(Demand(1e4, 1e9, 1e9), [], _load(3), AutoscaleParams(max_workers=7))
    assert big.desired == 7 and big.reason == "max"
    assert big.to_json()["desired"] == 7


def test_unmeasured_workers_use_the_default_rate():
    p = AutoscaleParams(target_utilization=1.0, default_prefill_tps=5_000.0)
    load = [WorkerLoad(None, 0, 0, 0), WorkerLoad(None, 0, 0, 0)]
    assert workers_needed(Demand(1.0, 12_000.0, 12_000.0), [], load, p).compute == 3
    load = [WorkerLoad(None, 0, 0, 0), WorkerLoad(12_000.0, 0, 0, 0)]
    assert workers_needed(Demand(1.0, 12_000.0, 12_000.0), [], load, p).compute == 1


def test_params_validate():
    with pytest.raises(ValueError, match="target_utilization"):
        AutoscaleParams(target_utilization=0).validate()
    with pytest.raises(ValueError, match="min_workers"):
        AutoscaleParams(min_workers=5, max_workers=2).validate()


def test_queue_rule_is_hpa():
    assert queue_rule(0, 4, 2.0) == 1  # empty queue: the floor
    assert queue_rule(21, 4, 2.0) == 11  # ceil(21 / 2)
    assert queue_rule(8, 4, 2.0) == 4  # at target: unchanged
    assert queue_rule(8.5, 4, 2.0) == 4  # within the 10% tolerance
    assert queue_rule(500, 4, 2.0, max_workers=64) == 64


def test_meter_rates_and_projection():
    m = DemandMeter(half_life_s=5.0)
    t = 0.0
    while t < 200.0:  # a steady 20 req/s of 100 uncached tokens
        m.observe(t, 100, 400)
        t += 0.05
    d = m.demand(t)
    assert d.request_rate == pytest.approx(20.0, rel=0.05)
    assert d.uncached_tps == pytest.approx(2000.0, rel=0.05)
    assert d.prompt_tps == pytest.approx(8000.0, rel=0.05)
    assert m.demand(t, lead_s=30.0).request_rate == pytest.approx(d.request_rate, rel=0.05)
    # a ramp r(t) = 0.5 t: the projection 30 s ahead is close to the rate then
    m = DemandMeter(half_life_s=5.0)
    t, next_at = 0.0, 0.0
    while t < 100.0:
        t = next_at
        m.observe(t, 1, 1)
        next_at = t + 1.0 / max(0.5 * t, 0.5)
    now = t
    est = m.demand(now)
    ahead = m.demand(now, lead_s=30.0)
    assert est.request_rate < 0.5 * now  # the plain estimate lags
    assert ahead.request_rate == pytest.approx(0.5 * (now + 30.0), rel=0.15)
    m.check()


def _tiny_trace(n=600, rate=20.0):
    recs = []
    for i in range(n):
        ids = [i % 3, 100 + i % 3, 10_000 + i]
        recs.append((i * 1000.0 / rate, 3 * 64, 4, ids))
    return Trace.from_records(recs, block_tokens=64)


class _Script:
    """A scaler that wants a fixed size per period (deterministic join/leave)."""

    name = "script"
    interval_s, startup_s, stabilization_s, max_workers = 1.0, 3.0, 0.0, 16

    def __init__(self, plan):
        self.plan = plan

    def on_dispatch(self, now, uncached, prompt):
        pass

    def desired(self, sim, now):
        for until, n in self.plan:
            if now < until:
                return n
        return self.plan[-1][1]


def test_workers_join_after_startup_and_leave_drained():
    cfg = SimConfig(
        workers=2, engine=EngineSpec(kv_tokens=20_000), level="block", policy="round_robin", check=True
    )
    sc = _Script([(8.0, 2), (20.0, 5), (100.0, 1)])
    sim = Simulation(cfg, _tiny_trace(), TraceTimes(), Bounds(None, None, 60.0), scaler=sc)
    rep = sim.run().report
    assert rep["ok"] == rep["requests"] == 600
    a = rep["autoscale"]
    assert a["joins"] == 3 and a["peak_workers"] == 5 and a["leaves"] == 4
    # no request reached a worker before its start-up delay was over, or after it left
    joined = {}
    for t, active, _starting, _draining, _desired in a["timeline"]:
        if t >= 9.0 + 3.0 and t < 20.0:
            assert active == 5, (t, active)
    for job in sim.jobs:
        ref = sim.refs[job.worker]
        if ref.requested_at > 0:  # a joiner
            joined[ref.id] = ref
            assert job.arrival >= ref.requested_at + sc.startup_s
        if ref.left_at is not None:
            assert job.arrival <= ref.left_at
    assert len(joined) == 3
    assert [r.state for r in sim.refs].count(ACTIVE) == 1
    assert all(r.state is GONE for r in sim.refs if r.state is not ACTIVE)
    # worker-seconds: each worker from its request to its leaving (or the end)
    assert a["worker_seconds"] == pytest.approx(
        sum((r.left_at if r.left_at is not None else sim.now) - r.requested_at for r in sim.refs)
    )
    sim.check()


def test_flash_crowd_prefix_aware_meets_the_slo_with_fewer_worker_seconds():
    """The prefix-aware rule's claim on a small flash crowd (same trace, seed and controller)."""
    crowd = FlashCrowd(base_rate=4.0, flash_rate=50.0, ramp_s=90.0, hold_s=60.0, duration_s=360.0)
    kw = dict(interval_s=5.0, startup_s=30.0, stabilization_s=60.0)
    pa = run_flash_crowd(
        PrefixAwareScaler(AutoscaleParams(max_workers=64), **kw), crowd, workers=2, slo_ms=2000.0
    )
    qd = run_flash_crowd(QueueDepthScaler(4.0, max_workers=64, **kw), crowd, workers=2, slo_ms=2000.0)
    assert pa["requests"] == qd["requests"] == pa["ok"] == qd["ok"]
    assert pa["slo_met"], pa["ttft_p99_ms"]
    assert pa["worker_seconds"] < qd["worker_seconds"]
    assert pa["peak_workers"] < qd["peak_workers"]
    # the prefix-aware fleet grew during the ramp and shrank after it
    sizes = [(t, a + s) for t, a, s, d, want in pa["timeline"]]
    assert max(n for t, n in sizes if 90 <= t <= 250) > 2
    assert sizes[-1][1] < max(n for _, n in sizes)
    assert not math.isnan(pa["worker_seconds"])


def test_fleet_signal_from_the_routers_own_objects_and_the_gauges():
    """What the integrator wires: meter + PrefixIndex + WorkerViews -> signal -> gauges."""
    from radixfleet.fleet.scaling_signal import fleet_signal
    from radixfleet.index.prefix_index import PrefixIndex
    from radixfleet.policies.base import WorkerView
    from radixfleet.server.metrics import Metrics

    index = PrefixIndex(half_life_s=10.0)
    hot = [11, 22, 33, 44]  # a 4-block prefix
    index.insert("w0", hot, 0.0)
    index.insert("w1", hot, 0.0)
    meter = DemandMeter(half_life_s=10.0)
    t = 0.0
    while t < 60.0:  # 40 req/s through the prefix, each leaving 256 tokens to prefill
        index.match(hot + [1000 + int(t * 100)], t)
        meter.observe(t, 256, 4 * 32 + 256)
        t += 0.025
    views = [
        WorkerView("w0", 3, 5000, 1, 200, 4, 10_000, 200_000, 20_000.0),
        WorkerView("w1", 2, 1000, 0, 0, 3, 10_000, 200_000, 20_000.0),
        WorkerView("w2", 0, 0, 0, 0, 0, 0, 0, 10_000.0),
    ]  # not reported yet
    p = AutoscaleParams(target_utilization=0.5, holder_max_rate=10.0, queue_drain_s=1.0)
    sig = fleet_signal(t, meter, index, views, p, block_tokens=32)
    # compute: 40 x 256 = 10,240 tokens/s over 0.5 x 20,000 -> 2; the prefix at ~40 req/s
    # needs ceil(40 / min(10, 10,000 / 256)) = 4 holders and has 2; backlog 6,000 over
    # 1 s x 20,000 -> 1
    assert sig.compute == 2 and sig.holders == 4 and sig.queue == 1
    assert sig.desired == 5 and sig.reason == "holders+queue"
    (need,) = [n for n in sig.prefixes if n.key == 44]
    assert need.holders == 2 and need.needed == 4 and need.depth_tokens == 128
    m = Metrics()
    m.set_autoscale(sig)
    text = m.render().decode()
    assert "radixfleet_autoscale_desired_workers 5.0" in text
    assert 'radixfleet_autoscale_workers{part="holders"} 4.0' in text
    assert sig.to_json()["prefixes"][0]["hash"] == f"{44:016x}"


def test_deploy_examples_name_the_exported_gauge():
    import glob

    import yaml

    from radixfleet.server.metrics import Metrics

    names = Metrics().render().decode()
    files = sorted(glob.glob("deploy/autoscaling/*.yaml"))
    assert len(files) == 2
    for path in files:
        docs = [d for d in yaml.safe_load_all(open(path)) if d]
        assert docs and all("apiVersion" in d and "kind" in d for d in docs)
        text = open(path).read()
        assert "radixfleet_autoscale_desired_workers" in text
    assert "radixfleet_autoscale_desired_workers" in names
