"""The offline simulator: determinism, conservation, hit rates on hand-made cases,
feedback modes, fast-forward equivalence, and the index matching the caches."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from loadtest.arrivals import Bounds, Closed, Poisson
from loadtest.report import validate
from loadtest.simulator.engine import EngineSpec
from loadtest.simulator.fleet import SimConfig, Simulation
from loadtest.workloads import API_COMPLETIONS, RequestSpec, SingleShot, make_workload

SMALL_GSP = {"groups": 4, "prompts_per_group": 6, "system_tokens": 256,
             "question_tokens": 32, "output_tokens": 16}


def _strip(report: dict) -> dict:
    r = copy.deepcopy(report)
    for k in ("wall_s", "sim_requests_per_s"):
        r.pop(k)
    return r


def _run(cfg: SimConfig, workload, arrivals=Closed(4), bounds=Bounds(10_000, 1e6, 60.0),
         seed: int = 0, sessions=None) -> Simulation:
    sim = Simulation(cfg, workload, arrivals, bounds, seed=seed, sessions=sessions)
    sim.outcome = sim.run()
    return sim


def _specs(prompts: list[str], max_tokens: int = 4) -> list:
    return [SingleShot(RequestSpec(f"s{i}.0", API_COMPLETIONS, {"prompt": p}, max_tokens,
                                   f"s{i}", 0, None, len(p) // 4))
            for i, p in enumerate(prompts)]


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
    sim = _run(cfg, make_workload("gsp", SMALL_GSP), Closed(2), Bounds(100, 1e6, 0.0),
               sessions=_specs(prompts))
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
    rr = _run(SimConfig(workers=2, policy="round_robin", check=True),
              make_workload("gsp", SMALL_GSP), Closed(1), sessions=_specs(prompts))
    assert [j.worker for j in rr.jobs] == [0, 1, 0, 1, 0]
    assert [j.cached for j in rr.jobs] == [0, 0, 512, 512, 512]
    ca = _run(SimConfig(workers=2, policy="prefix_load", check=True),
              make_workload("gsp", SMALL_GSP), Closed(1), sessions=_specs(prompts))
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


@pytest.mark.parametrize("workload,options,engine", [
    ("gsp", SMALL_GSP, EngineSpec(kv_tokens=4000)),
    ("multiturn", {"clients": 6, "rounds": 3, "question_tokens": 64, "output_tokens": 8},
     EngineSpec(kv_tokens=4000)),
    # a full batch (max_running) fast-forwards with requests queued behind it
    ("gsp", dict(SMALL_GSP, output_tokens=40), EngineSpec(kv_tokens=8000, max_running=2)),
])
def test_fast_forward_is_exact(workload, options, engine):
    wl = make_workload(workload, options, seed=2)
    cfg = SimConfig(workers=3, policy="prefix_load", engine=engine)
    fast = _run(cfg, wl, Poisson(30.0), seed=4)
    slow = _run(dataclasses.replace(cfg, fast_forward=False), make_workload(workload, options, seed=2),
                Poisson(30.0), seed=4)
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
    wl = make_workload("multiturn", {"clients": 2, "rounds": 3, "question_tokens": 32,
                                     "output_tokens": 8}, seed=0)
    sim = _run(SimConfig(workers=1, check=True), wl, Closed(1))
    jobs = sorted(sim.jobs, key=lambda j: (j.spec.session, j.spec.turn))
    for prev, j in zip(jobs, jobs[1:]):
        if j.spec.session == prev.spec.session:
            # the whole previous prompt and all but its last answer token were cached
            assert j.cached >= prev.prompt.prompt_tokens + prev.output - 1
    assert sim.outcome.report["hit_rate"] > 0.5


@pytest.mark.parametrize("mode", ["none", "events"])
def test_feedback_modes_run(mode):
    wl = make_workload("gsp", dict(SMALL_GSP, groups=12), seed=0)
    cfg = SimConfig(workers=2, policy="prefix_load", feedback=mode,
                    engine=EngineSpec(kv_tokens=1500), check=True)
    sim = _run(cfg, wl, Closed(4))
    s = sim.outcome.report["sim"]
    if mode == "none":
        assert s["events_applied"] == 0 and s["events_dropped"] > 0
    else:
        assert s["events_applied"] > 0 and s["events_dropped"] == 0
    assert sim.outcome.report["ok"] == 72


def test_events_keep_index_equal_to_caches():
    """With instant feedback, after the run each worker's index entries are exactly
    the router blocks its radix cache holds (evictions included)."""
    wl = make_workload("gsp", dict(SMALL_GSP, groups=12), seed=0)
    cfg = SimConfig(workers=3, policy="cache_aware", feedback_delay_s=0.0, feedback_batch_s=0.0,
                    engine=EngineSpec(kv_tokens=1500), check=True)
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
    slow = _run(dataclasses.replace(base, feedback_delay_s=0.5, feedback_batch_s=0.2, check=True),
                wl, Poisson(50.0))
    assert slow.outcome.report["ok"] == 72
    assert slow.outcome.report["sim"]["events_applied"] > 0


def test_hot_root_warmups_are_sent_once_and_not_reported():
    wl = make_workload("gsp", dict(SMALL_GSP, groups=1, prompts_per_group=200), seed=0)
    cfg = SimConfig(workers=4, policy="prefix_load", check=True,
                    policy_params={"warm_ahead": True, "hot_min_rate": 0.5, "holder_max_rate": 0.5})
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
    b = _run(dataclasses.replace(base, path_latency_s=0.003, check=True),
             make_workload("gsp", SMALL_GSP), Closed(1), sessions=_specs(prompts))
    ta, tb = a.outcome.report["ttft_ms"], b.outcome.report["ttft_ms"]
    ea, eb = a.outcome.report["e2e_ms"], b.outcome.report["e2e_ms"]
    for k in ("p50", "p90", "p99", "mean"):
        assert tb[k] == pytest.approx(ta[k] + 6.0)
        assert eb[k] == pytest.approx(ea[k] + 6.0)
    assert [j.cached for j in a.jobs] == [j.cached for j in b.jobs]


def test_text_reference_matches_the_load_generators():
    from loadtest.report import CacheReference, prompt_bytes
    from loadtest.simulator.reference import TextReference
    from worker_agent.tokenizer import encode

    wl = make_workload("multiturn", {"clients": 4, "rounds": 3, "question_tokens": 40,
                                     "output_tokens": 6}, seed=1)
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
