"""The simulator runs the live router's code: the live pool counts its
load (radixfleet.fleet.pool, radixfleet.route.core), agents' batches go through the live feedback with
its epoch/sequence checks (radixfleet.index.feedback), views come from the live
``Worker.build_view`` with its stale-report expiry, warm-ups are gated by the live
``WarmupGate`` with the router config's interval, and the agent's scheduler
withdraws the router's hint when a prompt can never fit.

Each test pins observable behaviour to exact values derived from the request
path, so that a change to the simulator's load accounting, its use of agent load
reports or its warm-up interval fails here. The one place the simulator differs
(load-only batches built lazily, radixfleet_tools/loadtest/simulator/agentlink.py) is pinned
against delivering every tick's batch.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from radixfleet.config import Config, parse_config
from radixfleet.wire.errors import PromptTooLarge
from radixfleet.wire.events import Removed
from radixfleet_tools.loadtest.arrivals import Bounds, Poisson, TraceTimes
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import API_COMPLETIONS, RequestSpec, SingleShot, make_workload

SMALL_GSP = {
    "groups": 4,
    "prompts_per_group": 6,
    "system_tokens": 256,
    "question_tokens": 32,
    "output_tokens": 16,
}


def _timed(prompts_at: list[tuple[float, str, int]]) -> list:
    """Single-shot completions at fixed times: (arrival s, prompt, max_tokens)."""
    return [
        SingleShot(RequestSpec(f"s{i}.0", API_COMPLETIONS, {"prompt": p}, mt, f"s{i}", 0, at, len(p) // 4))
        for i, (at, p, mt) in enumerate(prompts_at)
    ]


def _spy(sim: Simulation) -> list:
    """Records (now, {worker: view}, request, decision) at every pick (contract 3,
    docs/DESIGN.md)."""
    seen = []
    choose = sim.policy.choose

    def spy(req, match, views, now):
        d = choose(req, match, views, now)
        seen.append((now, {v.id: v for v in views}, req, d))
        return d

    sim.policy.choose = spy
    return seen


def _strip(report: dict) -> dict:
    r = copy.deepcopy(report)
    for k in ("wall_s", "sim_requests_per_s"):
        r.pop(k)
    r["sim"].pop("agent_batches")
    return r


# ------------------------------------------------------------------ load accounting

A = "a" * 800  # 200 tokens
B = "b" * 800
C = "c" * 800


def test_load_is_counted_at_pick_in_uncached_tokens_and_released_at_first_token():
    cfg = SimConfig(workers=1, policy="round_robin", engine=EngineSpec(kv_tokens=4096), check=True)
    specs = _timed([(0.0, A, 400), (0.0, B, 400), (1.0, C, 100), (5.0, A, 4), (5.0, B, 4)])
    sim = Simulation(
        cfg, make_workload("gsp", SMALL_GSP), TraceTimes(), Bounds(100, 1e6, 60.0), sessions=specs
    )
    seen = _spy(sim)
    sim.run()
    assert [round(now, 6) for now, *_ in seen] == [0.0, 0.0, 1.0, 5.0, 5.0]
    jobs = sim.jobs
    bt = sim.block_tokens
    a_tok = jobs[0].prompt.prompt_tokens
    views = [v["w0"] for _, v, _, _ in seen]
    decisions = [d for *_, d in seen]
    # t=0: nothing yet; then A counted at pick, its whole prompt (nothing cached)
    assert (views[0].in_flight, views[0].in_flight_tokens) == (0, 0)
    assert decisions[0].matched_blocks == 0
    assert (views[1].in_flight, views[1].in_flight_tokens) == (1, a_tok)
    # t=1: A and B decode (first tokens out): still in flight, their prompts released
    assert jobs[0].first_t < 1.0 < jobs[0].done_t and jobs[1].first_t < 1.0 < jobs[1].done_t
    assert (views[2].in_flight, views[2].in_flight_tokens) == (2, 0)
    # t=5: all done; A again: only its uncached tokens count (the index matched its
    # whole blocks, cached by the agent)
    assert all(j.ok for j in jobs[:3])
    assert (views[3].in_flight, views[3].in_flight_tokens) == (0, 0)
    d = decisions[3]
    assert d.matched_blocks == a_tok // bt > 0
    assert (views[4].in_flight, views[4].in_flight_tokens) == (1, a_tok - d.matched_blocks * bt)
    pw = sim.pool.get("w0")
    assert (pw.in_flight, pw.in_flight_tokens) == (0, 0)


def test_views_carry_the_agents_report_as_of_its_last_tick_and_drop_it_when_stale():
    specs = _timed([(0.0, A, 400), (0.0, B, 400), (1.23, C, 4)])

    def run(router_config: Config) -> list:
        cfg = SimConfig(
            workers=1,
            policy="round_robin",
            engine=EngineSpec(kv_tokens=4096),
            feedback_delay_s=0.05,
            feedback_batch_s=0.5,
            router_config=router_config,
            check=True,
        )
        sim = Simulation(
            cfg, make_workload("gsp", SMALL_GSP), TraceTimes(), Bounds(100, 1e6, 60.0), sessions=specs
        )
        seen = _spy(sim)
        sim.run()
        return [v["w0"] for _, v, _, _ in seen]

    fresh = run(Config())  # report_stale_s 2.0
    # t=0: the registration batch's report (an idle agent)
    v = fresh[0]
    assert (v.running_requests, v.queued_requests, v.kv_used_tokens, v.kv_capacity_tokens) == (0, 0, 0, 4096)
    # t=1.23: the report of the tick at 1.0 (delivered at 1.05): A and B decoding, each
    # holding its prompt and the tokens generated by 1.0
    v = fresh[2]
    assert (v.running_requests, v.queued_requests, v.kv_capacity_tokens) == (2, 0, 4096)
    assert 2 * 200 < v.kv_used_tokens < 2 * (200 + 400)
    assert v.prefill_tokens_per_s != 10_000.0  # the agent's measured rate, not the default
    # the same run with reports stale after 10 ms: at 1.23 the 1.05 report is ignored
    stale = run(parse_config({"load": {"report_stale_s": 0.01}}))
    v = stale[2]
    assert (v.running_requests, v.kv_used_tokens, v.kv_capacity_tokens) == (0, 0, 0)
    assert v.prefill_tokens_per_s == 10_000.0  # the worker's configured base rate
    assert (v.in_flight, v.in_flight_tokens) == (fresh[2].in_flight, fresh[2].in_flight_tokens)


@pytest.mark.parametrize("delay,batch,stale", [(0.005, 0.1, 2.0), (0.05, 0.2, 0.1), (0.02, 0.05, 2.0)])
def test_every_view_carries_exactly_the_report_of_the_last_tick_delivered(delay, batch, stale):
    """An oracle for the router's use of agent reports: at every pick, each worker's
    view holds the agent's state at that worker's last reporter tick at or before
    ``now - delay`` (worker i ticks at ``batch * i / workers + k * batch``), or no
    report once that one is ``stale`` seconds old — computed here from the log of
    every state change, independently of the simulator's own bookkeeping."""
    n = 3
    rc = parse_config({"load": {"report_stale_s": stale}})
    cfg = SimConfig(
        workers=n,
        policy="prefix_load",
        engine=EngineSpec(kv_tokens=1500),
        feedback_delay_s=delay,
        feedback_batch_s=batch,
        router_config=rc,
    )
    sim = Simulation(
        cfg,
        make_workload("gsp", dict(SMALL_GSP, groups=12), seed=2),
        Poisson(60.0),
        Bounds(10_000, 1e6, 60.0),
        seed=1,
    )
    changes = {w: [(0.0, sim.workers[w].load_state())] for w in range(n)}
    record = sim._record_state

    def logged(w, now):
        record(w, now)
        changes[w].append((now, sim.workers[w].load_state()))

    sim._record_state = logged
    seen = _spy(sim)
    sim.run()
    checked = stale_seen = 0
    for now, views, _, _ in seen:
        for w in range(n):
            phase = batch * w / n
            k = (now - delay - phase) // batch
            tick = phase + k * batch
            if tick < 0:  # no tick yet: the registration batch (the idle agent, sent at 0)
                state, sent = changes[w][0][1], 0.0
            else:
                state = [st for t, st in changes[w] if t <= tick][-1]
                sent = tick + delay
            v = views[f"w{w}"]
            got = (
                v.queued_requests,
                v.queued_tokens,
                v.running_requests,
                v.kv_used_tokens,
                v.kv_capacity_tokens,
                v.prefill_tokens_per_s,
            )
            if now - sent >= stale:
                stale_seen += 1
                assert got == (0, 0, 0, 0, 0, 10_000.0), (now, w)
            else:
                want = state[:5] + (state[5] or 10_000.0,)
                assert got == want, (now, w, tick)
            checked += 1
    assert checked == 3 * len(seen) == 3 * 72
    assert (stale_seen > 0) == (stale < batch)


@pytest.mark.parametrize("delay,batch,stale", [(0.005, 0.1, 2.0), (0.05, 0.2, 0.1), (0.0, 0.05, 2.0)])
def test_lazy_load_reports_equal_a_batch_every_tick(delay, batch, stale):
    """The seam (agentlink.py): building load-only batches when read gives the same
    run as delivering every tick's batch as an event."""
    rc = parse_config({"load": {"report_stale_s": stale}})
    base = SimConfig(
        workers=3,
        policy="prefix_load",
        engine=EngineSpec(kv_tokens=1500),
        feedback_delay_s=delay,
        feedback_batch_s=batch,
        router_config=rc,
    )
    reports = []
    for every in (False, True):
        cfg = dataclasses.replace(base, report_every_tick=every, check=True)
        sim = Simulation(
            cfg,
            make_workload("gsp", dict(SMALL_GSP, groups=12), seed=2),
            Poisson(60.0),
            Bounds(10_000, 1e6, 60.0),
            seed=1,
        )
        reports.append(sim.run().report)
    lazy, every = reports
    assert lazy["sim"]["agent_batches"] < every["sim"]["agent_batches"]
    assert _strip(lazy) == _strip(every)


def test_agent_batches_pass_the_live_epoch_and_sequence_checks():
    wl = make_workload("gsp", dict(SMALL_GSP, groups=12), seed=0)
    cfg = SimConfig(workers=3, policy="cache_aware", engine=EngineSpec(kv_tokens=1500))
    sim = Simulation(cfg, wl, Poisson(60.0), Bounds(10_000, 1e6, 60.0))
    r = sim.run().report
    assert r["sim"]["agent_batches"] == sum(ref.seq for ref in sim.refs)
    for ref in sim.refs:
        pw = sim.pool.get(ref.id)
        assert (pw.epoch, pw.next_seq) == (ref.epoch, ref.seq)
    # a gap in a stream is what the live router answers 409 to: the simulator raises
    sim = Simulation(
        cfg,
        make_workload("gsp", dict(SMALL_GSP, groups=12), seed=0),
        Poisson(60.0),
        Bounds(10_000, 1e6, 60.0),
    )
    sim.refs[1].seq += 2
    with pytest.raises(AssertionError, match=r"live feedback refused w1's batch seq 3 .*409"):
        sim.run()


# ------------------------------------------------------------------ warm-ups


def _warm_jobs(interval_s: float | None) -> list[float]:
    rc = Config() if interval_s is None else parse_config({"warmup": {"min_interval_s": interval_s}})
    sim = Simulation(
        SimConfig(workers=2, policy="prefix_load", router_config=rc),
        make_workload("gsp", SMALL_GSP),
        TraceTimes(),
        Bounds(10, 1e6, 60.0),
        sessions=_timed([(0.0, A, 4)]),
    )
    prompt = sim._prompt(_timed([(0.0, A, 4)])[0].spec)
    for t in (1.0, 1.3, 1.6, 12.0):
        sim.now = t
        sim._warm(("w1", "nope"), prompt, len(prompt.hashes), t)
    return [j.arrival for j in sim.jobs if j.warm]


def test_warmup_interval_is_the_router_configs():
    assert Config().warmup.min_interval_s == 10.0
    assert _warm_jobs(None) == [1.0, 12.0]  # the default: one per 10 s
    assert _warm_jobs(0.5) == [1.0, 1.6, 12.0]  # a configured 0.5 s
    assert _warm_jobs(0.0) == [1.0, 1.3, 1.6, 12.0]


def test_warmups_off_in_the_router_config_are_off_in_the_simulation():
    wl = make_workload("gsp", dict(SMALL_GSP, groups=1, prompts_per_group=200), seed=0)
    params = {"warm_ahead": True, "hot_min_rate": 0.5, "holder_max_rate": 0.5}
    on = (
        Simulation(
            SimConfig(workers=4, policy="prefix_load", policy_params=params),
            wl,
            Poisson(200.0),
            Bounds(10_000, 1e6, 60.0),
        )
        .run()
        .report
    )
    off = (
        Simulation(
            SimConfig(
                workers=4,
                policy="prefix_load",
                policy_params=params,
                router_config=parse_config({"warmup": {"enabled": False}}),
            ),
            make_workload("gsp", dict(SMALL_GSP, groups=1, prompts_per_group=200), seed=0),
            Poisson(200.0),
            Bounds(10_000, 1e6, 60.0),
        )
        .run()
        .report
    )
    assert on["sim"]["warmups"] > 0 and off["sim"]["warmups"] == 0


# ------------------------------------------------------------------ too-large prompts


def test_a_prompt_that_never_fits_withdraws_the_routers_hint():
    cfg = SimConfig(
        workers=1,
        policy="round_robin",
        engine=EngineSpec(kv_tokens=64),
        feedback_delay_s=0.0,
        feedback_batch_s=0.0,
        check=True,
    )
    sim = Simulation(
        cfg,
        make_workload("gsp", SMALL_GSP),
        TraceTimes(),
        Bounds(10, 1e6, 60.0),
        sessions=_timed([(0.0, "z" * 400, 4)]),
    )
    r = sim.run().report
    assert r["errors_by_kind"] == {"http_400": 1}
    hashes = sim.jobs[0].prompt.hashes
    assert len(hashes) >= 3
    # the router hinted them at pick time; the agent's Removed events took them back
    assert sim.index.match(hashes, 1.0, count=False).blocks == {}
    assert r["sim"]["events_applied"] >= 1


def test_scheduler_withdraws_the_hint_before_raising_prompt_too_large():
    from radixfleet_tools.agent.scheduler import SchedRequest, build_scheduler

    sched = build_scheduler("llama-3-8b", "h100", kv_tokens=64, page_size=1, hash_stride=32)
    hashes = [11, 12, 13]
    with pytest.raises(PromptTooLarge):
        sched.submit(SchedRequest(1, "ns", list(range(1, 101)), 4, hashes=hashes), 0.0)
    evs = sched.cache.drain_events()
    assert [type(e) for e in evs] == [Removed] and sorted(evs[0].hashes) == hashes
