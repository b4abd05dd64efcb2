"""The TTFT floor of simulated runs: each request alone on an idle worker holding
every prompt token the oracle (one unbounded cache) holds.

Hand-worked from the cost model's formulas, exact for a fleet that is never busy
(one worker, one request at a time), and never above a request's simulated TTFT.
"""

from __future__ import annotations

import pytest

from radixfleet_tools.agent.cost_model import CostModel
from radixfleet_tools.loadtest.arrivals import Bounds, Closed, Poisson
from radixfleet_tools.loadtest.report import validate
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import API_COMPLETIONS, RequestSpec, SingleShot, make_workload

SMALL_GSP = {
    "groups": 3,
    "prompts_per_group": 8,
    "system_tokens": 256,
    "question_tokens": 32,
    "output_tokens": 16,
}


def _run(cfg: SimConfig, workload, arrivals, sessions=None) -> Simulation:
    sim = Simulation(cfg, workload, arrivals, Bounds(10_000, 1e6, 60.0), seed=0, sessions=sessions)
    sim.outcome = sim.run()
    return sim


def _specs(prompts: list[str], max_tokens: int = 4) -> list:
    return [
        SingleShot(
            RequestSpec(f"s{i}.0", API_COMPLETIONS, {"prompt": p}, max_tokens, f"s{i}", 0, None, len(p) // 4)
        )
        for i, p in enumerate(prompts)
    ]


def test_floor_by_hand():
    # llama-3-8b on one H100 at 60% MFU: 8.03e9 active params, attention FLOPs per
    # (query, context) pair 2 x 32 heads x (128 + 128) x 32 layers = 524,288;
    # weights 16.06 GB read at 3.35 TB/s; KV 2 x 32 x 8 x 128 x 2 = 131,072 B/token
    cost = CostModel("llama-3-8b", "h100")
    rate = 989e12 * 0.6
    weights_s = 2 * 8.03e9 / 3.35e12
    kv_s = 131_072 / 3.35e12
    # 1,000-token prompt, 600 cached: 400 new tokens after 600, compute-bound
    flops = 2 * 8.03e9 * 400 + 524_288 * 400 * (600 + 200)
    assert flops / rate > weights_s + kv_s * 1000
    assert cost.floor_ttft_s(1000, 600) == pytest.approx(flops / rate, rel=1e-12)  # 11.1 ms
    # all of it cached: the last token is still computed, a weight read (memory-bound)
    assert cost.floor_ttft_s(1000, 1000) == pytest.approx(weights_s + kv_s * 1000, rel=1e-12)
    assert cost.floor_ttft_s(1000, 5000) == cost.floor_ttft_s(1000, 999)
    assert cost.floor_ttft_s(0, 0) == 0.0
    # the scheduler in 256-token chunks (256 after 600, then 144 after 856) takes
    # longer: the same FLOPs, and the weights read twice
    two = [2 * 8.03e9 * 256 + 524_288 * 256 * (600 + 128), 2 * 8.03e9 * 144 + 524_288 * 144 * (856 + 72)]
    assert sum(two) == pytest.approx(flops, rel=1e-12)
    chunked = sum(max(f / rate, weights_s + kv_s * r) for f, r in zip(two, [856, 1000]))
    assert cost.floor_ttft_s(1000, 600) < chunked
    # more cached never costs more
    times = [cost.floor_ttft_s(3000, c) for c in range(0, 3001, 50)]
    assert times == sorted(times, reverse=True)


@pytest.mark.parametrize("latency_s", [0.0, 0.005])
def test_floor_is_the_ttft_of_an_idle_fleet(latency_s):
    # one worker, one request at a time, KV for everything: each request runs alone
    # holding what the oracle holds, so its TTFT is its floor to the digit
    a = "x" * 4000  # 1,000 tokens
    prompts = [a, a + "y" * 400, "z" * 400, a, a + "y" * 400 + "w" * 40]
    cfg = SimConfig(workers=1, policy="round_robin", path_latency_s=latency_s, check=True)
    sim = _run(cfg, make_workload("gsp", SMALL_GSP), Closed(1), sessions=_specs(prompts))
    assert [j.oracle for j in sim.jobs] == [0, 1000, 0, 1000, 1100]
    cost = CostModel("llama-3-8b", "h100")
    floors = [sim.floor_ttft_s(j) for j in sim.jobs]
    by_hand = [
        cost.floor_ttft_s(j.prompt.prompt_tokens, o) + 2 * latency_s
        for j, o in zip(sim.jobs, [0, 1000, 0, 1000, 1100])
    ]
    assert floors == pytest.approx(by_hand, rel=1e-12)
    ttfts = [j.first_t + latency_s - j.arrival for j in sim.jobs]
    assert ttfts == pytest.approx(floors, rel=1e-9)
    r = sim.outcome.report
    validate({"runs": [r]})
    assert r["floor_ttft_ms"]["p50"] == pytest.approx(sorted(floors)[2] * 1000.0)
    assert r["floor_ttft_ms"]["p99"] == pytest.approx(max(floors) * 1000.0)


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "prefix_load"])
@pytest.mark.parametrize("workload", ["gsp", "multiturn"])
def test_floor_never_above_a_requests_ttft(policy, workload):
    # a loaded, KV-bound fleet prefilling in small chunks: queues, batches, chunk
    # steps, evictions and misses only add
    wl = make_workload(workload, SMALL_GSP if workload == "gsp" else {}, seed=2)
    engine = EngineSpec(kv_tokens=3000, chunk_tokens=128)
    cfg = SimConfig(workers=3, policy=policy, engine=engine, path_latency_s=0.002)
    sim = _run(cfg, wl, Poisson(40.0))
    done = [j for j in sim.jobs if j.ok and not j.warm]
    assert len(done) >= 20
    for j in done:
        assert sim.floor_ttft_s(j) <= j.first_t + 0.002 - j.arrival + 1e-12
    r = sim.outcome.report
    assert r["floor_ttft_ms"]["p50"] <= r["ttft_ms"]["p50"]
    assert r["floor_ttft_ms"]["p99"] <= r["ttft_ms"]["p99"]


def test_live_floor_and_table_columns():
    # a live run against simulated agents: the floor of each ok request from the
    # load generator's own oracle count, and two table columns with their legend
    import io

    from radixfleet_tools.loadtest.client import Result
    from radixfleet_tools.loadtest.report import FLOOR_LEGEND, floor_ttft_ms, render_table, summarize

    def res(i: int, est: int, oracle: int, ok: bool = True) -> Result:
        return Result(
            f"r{i}", "s", 0, ok=ok, ttft_s=0.05 if ok else None, e2e_s=0.1 if ok else None,
            prompt_tokens=est, est_prompt_tokens=est, oracle_cached=oracle, worker="w0",
        )  # fmt: skip

    cost = CostModel("llama-3-8b", "h100")
    results = [res(0, 1000, 600), res(1, 1000, 1000), res(2, 4000, 0, ok=False)]
    floor = floor_ttft_ms(cost, results)
    want = sorted([cost.floor_ttft_s(1000, 600), cost.floor_ttft_s(1000, 1000)])
    assert floor["p50"] == pytest.approx(want[0] * 1000) and floor["p99"] == pytest.approx(want[1] * 1000)
    run = summarize("pl", "u", {}, results, kv_capacity_tokens=None)
    plain = io.StringIO()
    render_table([run], file=plain)
    assert "floor p50" not in plain.getvalue()
    run["floor_ttft_ms"] = floor
    validate({"runs": [run]})
    buf = io.StringIO()
    render_table([run], file=buf)
    out = buf.getvalue()
    assert "floor p50 ms" in out and "floor p99 ms" in out and f"{want[1] * 1000:.1f}" in out
    assert " ".join(FLOOR_LEGEND.split()[:6]) in " ".join(out.split())
