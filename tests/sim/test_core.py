"""The offline simulator: determinism, conservation, hit rates on hand-made cases,
feedback modes, fast-forward equivalence, and the index matching the caches."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from radixfleet_tools.loadtest.arrivals import Bounds, Closed, Poisson
from radixfleet_tools.loadtest.report import validate
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


def _strip(report: dict) -> dict:
    r = copy.deepcopy(report)
    for k in ("wall_s", "sim_requests_per_s"):
        r.pop(k)
    return r


def _run(
    cfg: SimConfig,
    workload,
    arrivals=Closed(4),
    bounds=Bounds(10_000, 1e6, 60.0),
    seed: int = 0,
    sessions=None,
) -> Simulation:
    sim = Simulation(cfg, workload, arrivals, bounds, seed=seed, sessions=sessions)
    sim.outcome = sim.run()
    return sim


def _specs(prompts: list[str], max_tokens: int = 4) -> list:
    return [
        SingleShot(
            RequestSpec(f"s{i}.0", API_COMPLETIONS, {"prompt": p}, max_tokens, f"s{i}", 0, None, len(p) // 4)
        )
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("policy", ["round_robin", "random", "cache_aware", "prefix_load"])
def test_same_seed_same_report(policy):
    wl = make_workload("gsp", SMALL_GSP, seed=3)
    cfg = SimConfig(workers=3, policy=policy, engine=EngineSpec(kv_tokens=3000))
    a = _run(cfg, wl, Poisson(40.0), seed=5).outcome.report
    b = _run(cfg, make_workload("gsp", SMALL_GSP, seed=3), Poisson(40.0), seed=5).outcome.report
    assert _strip(a) == _strip(b)
    validate({"runs": [a]})
    assert a["name"] == policy and a["ok"] == 24 and a["wall_s"] > 0 and a["sim_requests_per_s"] > 0


def test_different_seed_differs():
    wl = make_workload("gsp", SMALL_GSP, seed=3)
    cfg = SimConfig(workers=3, policy="random")
    a = _run(cfg, wl, Poisson(40.0), seed=1).outcome.report
    b = _run(cfg, wl, Poisson(40.0), seed=2).outcome.report
    assert a["workers"] != b["workers"]


def test_conservation_with_rejections_and_cancellations():
    # 3 prompts of 100 tokens never fit a 64-token pool (the agent's 400), the rest
    # fit; a short duration with no drain grace cancels whatever is still running
    prompts = ["a" * 400, "b" * 40, "c" * 400, "d" * 40, "e" * 400, "f" * 40, "g" * 40]
    cfg = SimConfig(workers=2, policy="round_robin", engine=EngineSpec(kv_tokens=64), check=True)
    sim = _run(
        cfg, make_workload("gsp", SMALL_GSP), Closed(2), Bounds(100, 1e6, 0.0), sessions=_specs(prompts)
    )
    r = sim.outcome.report
    assert r["requests"] == 7 and r["ok"] + r["errors"] == 7
    assert r["errors_by_kind"] == {"http_400": 3}
    assert r["ok"] == 4
    # now with a deadline shorter than one decode: everything in flight is cancelled
    wl = make_workload("gsp", SMALL_GSP)
    sim = _run(SimConfig(workers=2, check=True), wl, Closed(4), Bounds(100, 0.02, 0.0))
    r = sim.outcome.report
    assert r["requests"] == r["ok"] + r["errors"] > 0
    assert r["errors_by_kind"].get("cancelled", 0) == sim.cancelled > 0
    assert all(j.ok is not None for j in sim.jobs)


def test_hand_made_hits_one_worker():
    a = "x" * 4000  # 1000 tokens
    prompts = [a, a + "y" * 400, "z" * 400, a, a + "y" * 400 + "w" * 40]
    cfg = SimConfig(workers=1, policy="round_robin", check=True)
    sim = _run(cfg, make_workload("gsp", SMALL_GSP), Closed(1), sessions=_specs(prompts))
    cached = [j.cached for j in sim.jobs]
    # the engine recomputes at least the last prompt token (its logits give token 1)
    assert cached == [0, 1000, 0, 999, 1100]
    oracle = [j.oracle for j in sim.jobs]
    assert oracle == [0, 1000, 0, 1000, 1100]
    r = sim.outcome.report
    assert r["prompt_tokens"] == 1000 + 1100 + 100 + 1000 + 1110
    assert r["hit_rate"] == pytest.approx(sum(cached) / r["prompt_tokens"])
    assert r["oracle_hit_rate"] == pytest.approx(sum(oracle) / r["prompt_tokens"])


def test_hand_made_hits_routing():
    a, b = "p" * 2048, "q" * 2048  # 512 tokens each, 4 router blocks of 128 bytes
    prompts = [a + "1" * 64, b + "2" * 64, a + "3" * 64, b + "4" * 64, a + "5" * 64]
    rr = _run(
        SimConfig(workers=2, policy="round_robin", check=True),
        make_workload("gsp", SMALL_GSP),
        Closed(1),
        sessions=_specs(prompts),
    )
    assert [j.worker for j in rr.jobs] == [0, 1, 0, 1, 0]
    assert [j.cached for j in rr.jobs] == [0, 0, 512, 512, 512]
    ca = _run(
        SimConfig(workers=2, policy="prefix_load", check=True),
        make_workload("gsp", SMALL_GSP),
        Closed(1),
        sessions=_specs(prompts),
    )
    w = [j.worker for j in ca.jobs]
    assert w[2] == w[0] and w[4] == w[0] and w[3] == w[1]
    assert [j.cached for j in ca.jobs][2:] == [512, 512, 512]
    assert ca.outcome.report["hit_rate"] == pytest.approx(rr.outcome.report["hit_rate"])


def test_prefix_load_beats_round_robin_and_reaches_oracle():
    wl = make_workload("gsp", dict(SMALL_GSP, groups=8), seed=1)
    res = {}
    for p in ("round_robin", "prefix_load"):
        res[p] = _run(SimConfig(workers=4, policy=p), wl, Closed(4)).outcome.report
    assert res["prefix_load"]["hit_rate"] > res["round_robin"]["hit_rate"] + 0.2
    assert res["prefix_load"]["hit_rate"] <= res["prefix_load"]["oracle_hit_rate"] + 1e-9
    assert res["prefix_load"]["hit_rate"] > res["prefix_load"]["oracle_hit_rate"] - 0.05


@pytest.mark.parametrize(
    "workload,options,engine",
    [
        ("gsp", SMALL_GSP, EngineSpec(kv_tokens=4000)),
        (
            "multiturn",
            {"clients": 6, "rounds": 3, "question_tokens": 64, "output_tokens": 8},
            EngineSpec(kv_tokens=4000),
        ),
        # a full batch (max_running) fast-forwards with requests queued behind it
        ("gsp", dict(SMALL_GSP, output_tokens=40), EngineSpec(kv_tokens=8000, max_running=2)),
    ],
)
def test_fast_forward_is_exact(workload, options, engine):
    wl = make_workload(workload, options, seed=2)
    cfg = SimConfig(workers=3, policy="prefix_load", engine=engine)
    fast = _run(cfg, wl, Poisson(30.0), seed=4)
    slow = _run(
        dataclasses.replace(cfg, fast_forward=False),
        make_workload(workload, options, seed=2),
        Poisson(30.0),
        seed=4,
    )
    assert fast.outcome.report["sim"]["fast_forwarded_steps"] > 0
    assert slow.outcome.report["sim"]["fast_forwarded_steps"] == 0
    assert len(fast.jobs) == len(slow.jobs)
    for a, b in zip(fast.jobs, slow.jobs):
        assert (a.worker, a.cached, a.output, a.ok) == (b.worker, b.cached, b.output, b.ok)
        assert a.first_t == pytest.approx(b.first_t, rel=1e-9, abs=1e-12)
        assert a.done_t == pytest.approx(b.done_t, rel=1e-9, abs=1e-12)
    fr, sr = fast.outcome.report, slow.outcome.report
    assert fr["hit_rate"] == sr["hit_rate"]
    assert fr["itl_ms"]["p50"] == pytest.approx(sr["itl_ms"]["p50"], rel=1e-3)


def test_multiturn_answers_are_cached_like_live():
    # each turn's prompt holds the previous answer: one worker serves it from cache
    wl = make_workload(
        "multiturn", {"clients": 2, "rounds": 3, "question_tokens": 32, "output_tokens": 8}, seed=0
    )
    sim = _run(SimConfig(workers=1, check=True), wl, Closed(1))
    jobs = sorted(sim.jobs, key=lambda j: (j.spec.session, j.spec.turn))
    for prev, j in zip(jobs, jobs[1:]):
        if j.spec.session == prev.spec.session:
            # the whole previous prompt and all but its last answer token were cached
            assert j.cached >= prev.prompt.prompt_tokens + prev.output - 1
    assert sim.outcome.report["hit_rate"] > 0.5


@pytest.mark.parametrize("mode", ["none", "events", "plain"])
def test_feedback_modes_run(mode):
    wl = make_workload("gsp", dict(SMALL_GSP, groups=12), seed=0)
    cfg = SimConfig(
        workers=2, policy="prefix_load", feedback=mode, engine=EngineSpec(kv_tokens=1500), check=True
    )
    sim = _run(cfg, wl, Closed(4))
    s = sim.outcome.report["sim"]
    if mode == "events":
        assert s["events_applied"] > 0 and s["events_dropped"] == 0
    else:
        assert s["events_applied"] == 0 and s["events_dropped"] > 0
    # a plain engine sends nothing at all, not even its load
    assert (sim.batches == 0) == (mode == "plain")
    assert sim.outcome.report["ok"] == 72


def _agent_plain(learn: bool) -> Simulation:
    from radixfleet.config import Config, IndexConfig

    wl = make_workload("agent", {"sessions": 8, "steps": 6}, seed=0)
    rc = dataclasses.replace(Config(), index=IndexConfig(learn_capacity=learn))
    cfg = SimConfig(
        workers=2,
        policy="prefix_load",
        feedback="plain",
        router_config=rc,
        engine=EngineSpec(kv_tokens=6000),
        check=True,
    )
    return _run(cfg, wl, Poisson(6.0), Bounds(48, 1e6, 600.0))


def test_plain_engines_are_seen_as_the_live_router_sees_them():
    """``feedback="plain"``: views carry the router's own counts, the engine's KV
    capacity and prefill rate, no queue or KV use; the index is capped at the
    capacity, which the answers' cached tokens teach down where the engine holds
    less (its KV also holds outputs and partial blocks the router never hashed)."""
    sim = _agent_plain(learn=True)
    assert sim.outcome.report["ok"] == 48
    cap_blocks = 6000 // sim.block_tokens
    views = sim._views(sim.now)
    for v in views:
        assert v.kv_capacity_tokens == 6000 and v.queued_tokens == 0 and v.kv_used_tokens == 0
    for r in sim.refs:
        lc = sim._learned[r.id]
        lc.check()
        assert lc.configured == cap_blocks
        assert sim.index.capacity(r.id) == lc.blocks, r.id  # the index is aged at it
    assert min(sim._learned[r.id].blocks for r in sim.refs) < cap_blocks  # it learned
    off = _agent_plain(learn=False)
    assert off._learned == {}
    assert all(off.index.capacity(r.id) == cap_blocks for r in off.refs)


def test_events_keep_index_equal_to_caches():
    """With instant feedback, after the run each worker's index entries are exactly
    the router blocks its radix cache holds (evictions included)."""
    wl = make_workload("gsp", dict(SMALL_GSP, groups=12), seed=0)
    cfg = SimConfig(
        workers=3,
        policy="cache_aware",
        feedback_delay_s=0.0,
        feedback_batch_s=0.0,
        engine=EngineSpec(kv_tokens=1500),
        check=True,
    )
    sim = _run(cfg, wl, Closed(3))
    evicted = sum(w.cache.stats.evicted_tokens for w in sim.workers)
    assert evicted > 0
    for ref, worker in zip(sim.refs, sim.workers):
        held = {h for h, _ in worker.cache.snapshot_blocks()}
        indexed = {h for h, n in sim.index._nodes.items() if n.held_by(ref.id)}
        assert indexed == held, ref.id


def test_delayed_feedback_and_load_reports():
    wl = make_workload("gsp", dict(SMALL_GSP, groups=12), seed=0)
    base = SimConfig(workers=3, policy="prefix_load", engine=EngineSpec(kv_tokens=1500))
    slow = _run(
        dataclasses.replace(base, feedback_delay_s=0.5, feedback_batch_s=0.2, check=True), wl, Poisson(50.0)
    )
    assert slow.outcome.report["ok"] == 72
    assert slow.outcome.report["sim"]["events_applied"] > 0


def test_hot_root_warmups_are_sent_once_and_not_reported():
    wl = make_workload("gsp", dict(SMALL_GSP, groups=1, prompts_per_group=200), seed=0)
    cfg = SimConfig(
        workers=4,
        policy="prefix_load",
        check=True,
        policy_params={"warm_ahead": True, "hot_min_rate": 0.5, "holder_max_rate": 0.5},
    )
    sim = _run(cfg, wl, Poisson(200.0))
    r = sim.outcome.report
    warm = [j for j in sim.jobs if j.warm]
    assert warm and r["sim"]["warmups"] == len(warm)
    assert r["requests"] == 200 and r["ok"] == 200  # warm-ups are not client requests
    assert all(j.ok and j.max_tokens == 1 for j in warm)
    # at most one warm-up per (worker, prefix) per interval
    keys = [(j.worker, j.prompt.hashes[-1]) for j in warm]
    assert len(keys) == len(set(keys))


def test_path_latency_adds_both_ways():
    prompts = ["k" * 400, "m" * 800, "k" * 400 + "n" * 40]
    base = SimConfig(workers=1, policy="round_robin")
    a = _run(base, make_workload("gsp", SMALL_GSP), Closed(1), sessions=_specs(prompts))
    b = _run(
        dataclasses.replace(base, path_latency_s=0.003, check=True),
        make_workload("gsp", SMALL_GSP),
        Closed(1),
        sessions=_specs(prompts),
    )
    ta, tb = a.outcome.report["ttft_ms"], b.outcome.report["ttft_ms"]
    ea, eb = a.outcome.report["e2e_ms"], b.outcome.report["e2e_ms"]
    for k in ("p50", "p90", "p99", "mean"):
        assert tb[k] == pytest.approx(ta[k] + 6.0)
        assert eb[k] == pytest.approx(ea[k] + 6.0)
    assert [j.cached for j in a.jobs] == [j.cached for j in b.jobs]


def test_text_reference_matches_the_load_generators():
    from radixfleet_tools.agent.tokenizer import encode
    from radixfleet_tools.loadtest.report import CacheReference, prompt_bytes
    from radixfleet_tools.loadtest.simulator.reference import TextReference

    wl = make_workload(
        "multiturn", {"clients": 4, "rounds": 3, "question_tokens": 40, "output_tokens": 6}, seed=1
    )
    theirs, ours = CacheReference(500), TextReference(500)
    for s in wl.sessions():
        spec = s.first()
        while spec is not None:
            data = prompt_bytes(spec)
            assert ours.observe_prompt(data, encode(data)) == theirs.observe(spec)
            answer = " abc" * 6
            theirs.observe_answer(spec, answer)
            ours.observe_answer_bytes(data, encode(data), answer.encode(), encode(answer.encode()))
            spec = s.follow(answer)
    theirs.check()
    ours.check()
    assert ours.pooled.tokens == theirs.pooled.tokens


def test_unread_answers_weigh_on_the_pooled_cache_as_real_text_does():
    """Single-shot answers: the simulator stands each for unique ids of its length
    (``observe_unread_answer``); the load generator caches the real text. Every
    prompt's (oracle, pooled) counts and the pooled cache's occupancy agree, with a
    capacity small enough that answers push prompts out."""
    from radixfleet_tools.agent.tokenizer import encode
    from radixfleet_tools.loadtest.report import CacheReference, prompt_bytes
    from radixfleet_tools.loadtest.simulator.reference import TextReference
    from radixfleet_tools.loadtest.workloads import text_of

    wl = make_workload(
        "gsp",
        {
            "groups": 3,
            "prompts_per_group": 6,
            "system_tokens": 64,
            "question_tokens": 12,
            "output_tokens": 30,
        },
        seed=2,
    )
    theirs, ours = CacheReference(400), TextReference(400)
    for k, s in enumerate(wl.sessions()):
        spec = s.first()
        data = prompt_bytes(spec)
        assert ours.observe_prompt(data, encode(data)) == theirs.observe(spec), k
        answer = text_of(spec.max_tokens, f"answer/{k}")
        theirs.observe_answer(spec, answer)
        ours.observe_unread_answer(data, encode(data), spec.max_tokens, 2**56 + k)
        assert ours.pooled.tokens == theirs.pooled.tokens, k
    assert theirs.pooled.cache.stats.evicted_nodes > 0  # the answers did push entries out
    theirs.check()
    ours.check()


def _overload(timeout_s, fast_forward=True, check=False, latency=0.0):
    """One worker, 20 requests arriving at 40/s, each decoding 200 tokens: the later
    ones queue behind the batch (max_running 4) for longer and longer."""
    wl = make_workload("gsp", dict(SMALL_GSP, groups=2, prompts_per_group=10, output_tokens=200), seed=1)
    cfg = SimConfig(
        workers=1,
        policy="round_robin",
        timeout_s=timeout_s,
        check=check,
        fast_forward=fast_forward,
        path_latency_s=latency,
        engine=EngineSpec(kv_tokens=20_000, max_running=4),
    )
    return _run(cfg, wl, Poisson(40.0), Bounds(20, 1e6, 1e6))


def test_timeout_fails_late_requests_and_frees_the_worker():
    base = _overload(None)
    e2e = sorted(j.done_t - j.arrival for j in base.jobs)
    cut = (e2e[7] + e2e[8]) / 2  # between the 8th and 9th to finish
    sim = _overload(cut, check=True)
    r = sim.outcome.report
    assert r["requests"] == 20 and r["ok"] + r["errors"] == 20
    assert r["errors_by_kind"] == {"timeout": r["errors"]}
    # the first 8 finish before any timeout fires; the rest queue past it (overload:
    # each later wave starts after its requests' deadline is near, and is cut off)
    assert r["ok"] == 8 and r["sim"]["timed_out"] == r["errors"] == 12
    for j in sim.jobs:
        if j.ok:
            assert j.done_t - j.arrival <= cut + 1e-9
        else:
            assert j.error_kind == "timeout" and j.done_t == pytest.approx(j.arrival + cut)
    # timed-out requests were cancelled at the worker (KV returned); the run ends with
    # the last client, so the last cancellations may still wait for their step's end
    w = sim.workers[0]
    s = w.sched
    assert s.stats.cancelled > 0
    left = list(s.waiting) + list(s.prefilling) + list(s.running)
    assert all(req.rid.error_kind == "timeout" for req in left)
    assert {id(req) for req in left} <= {id(req) for req in w._cancels}
    pw = sim.pool.get("w0")  # the live pool the simulated router counts load in
    assert pw.in_flight == 0 and pw.in_flight_tokens == 0
    # freed capacity: those that finished did so no later than without the timeout
    ok_ids = {j.idx for j in sim.jobs if j.ok}
    before = {j.idx: j.done_t for j in base.jobs}
    assert all(j.done_t <= before[j.idx] + 1e-9 for j in sim.jobs if j.idx in ok_ids)


def test_timeout_same_with_and_without_fast_forward():
    base = _overload(None)
    cut = sorted(j.done_t - j.arrival for j in base.jobs)[10]
    fast, slow = _overload(cut), _overload(cut, fast_forward=False)
    assert fast.outcome.report["sim"]["fast_forwarded_steps"] > 0
    for a, b in zip(fast.jobs, slow.jobs):
        assert (a.ok, a.error_kind, a.output) == (b.ok, b.error_kind, b.output)
        assert a.done_t == pytest.approx(b.done_t, rel=1e-9)


def test_generous_timeout_changes_nothing():
    a, b = _overload(None).outcome.report, _overload(1e4).outcome.report
    assert b["sim"].pop("timed_out") == 0 and a["sim"].pop("timed_out") == 0
    assert _strip(a) == _strip(b)


def test_timeout_before_arrival_with_path_latency():
    sim = _overload(0.0005, latency=0.001, check=True)  # gone before reaching the worker
    r = sim.outcome.report
    assert r["ok"] == 0 and r["errors_by_kind"] == {"timeout": 20}
    assert sim.workers[0].sched.stats.submitted == 0
