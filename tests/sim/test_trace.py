"""Trace replay in the simulator: block level agrees with text level, and scales."""

from __future__ import annotations

import pytest

from radixfleet.wire.errors import WorkloadError
from radixfleet_tools.loadtest.arrivals import Bounds, TraceTimes
from radixfleet_tools.loadtest.simulator import blocktrace
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.prompts import block_prompt, chain_block_ids
from radixfleet_tools.loadtest.simulator.simulation import SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import make_workload
from tests.sim.traces import BLOCK, _trace


def _run(path: str, level: str, workers: int, policy: str, kv: int | None = None):
    wl = make_workload("trace", {"path": path, "block_tokens": BLOCK}, seed=0)
    cfg = SimConfig(
        workers=workers, policy=policy, level=level, engine=EngineSpec(kv_tokens=kv or 1_000_000), check=True
    )
    return Simulation(cfg, wl, TraceTimes(), Bounds(10_000, 1e6, 60.0)).run().report


@pytest.mark.parametrize(
    "workers,policy,kv",
    [(1, "round_robin", None), (3, "round_robin", None), (1, "round_robin", 900), (3, "least_load", 1200)],
)
def test_text_and_block_level_agree(tmp_path, workers, policy, kv):
    path = _trace(tmp_path)
    text = _run(path, "text", workers, policy, kv)
    block = _run(path, "block", workers, policy, kv)
    assert text["sim"]["level"] == "text" and block["sim"]["level"] == "block"
    assert text["ok"] == block["ok"] == 60
    assert text["prompt_tokens"] == block["prompt_tokens"]
    # same cache, same tokens: they agree exactly here (0.002 leaves room for a
    # chance collision of random text tokens in other traces)
    assert abs(text["hit_rate"] - block["hit_rate"]) <= 0.002, (text["hit_rate"], block["hit_rate"])
    assert abs(text["oracle_hit_rate"] - block["oracle_hit_rate"]) <= 0.02
    assert text["hit_rate"] > 0.2


def test_cache_aware_policies_agree_roughly(tmp_path):
    path = _trace(tmp_path)
    text = _run(path, "text", 3, "prefix_load")
    block = _run(path, "block", 3, "prefix_load")
    assert abs(text["hit_rate"] - block["hit_rate"]) <= 0.05


def test_block_prompt_units_and_hashes():
    p = block_prompt([7, 9, 3], 2 * BLOCK + 5, BLOCK, seed=11)
    assert list(p.units) == [7] * BLOCK + [9] * BLOCK + [3] * 5
    assert p.hashes == chain_block_ids([7, 9], 11)  # the partial tail is not keyed
    assert p.prompt_tokens == 2 * BLOCK + 5 and p.last_tokens == 5
    # chained: a hash fingerprints its whole prefix
    assert chain_block_ids([1, 2], 0)[1] != chain_block_ids([3, 2], 0)[1]
    with pytest.raises(WorkloadError):
        block_prompt([1, 2], 5 * BLOCK, BLOCK, seed=0)


def test_repeat_shifts_time_and_ids(tmp_path):
    wl = make_workload("trace", {"path": _trace(tmp_path, n=10), "block_tokens": BLOCK})
    recs = blocktrace.repeat(wl.records, 3)
    assert len(recs) == 30
    assert [r[0] for r in recs] == sorted(r[0] for r in recs)
    first = {i for r in recs[:10] for i in r[3]}
    third = {i for r in recs[20:] for i in r[3]}
    assert not first & third
    sessions = blocktrace.sessions(wl, recs)
    assert sessions[10].first().arrival_s > sessions[9].first().arrival_s


def test_shared_mooncake_trace_block_level_is_fast():
    wl = make_workload("trace", {"max_requests": 400}, seed=0)
    cfg = SimConfig(workers=8, policy="prefix_load", engine=EngineSpec(kv_tokens=300_000))
    r = Simulation(cfg, wl, TraceTimes(), Bounds(400, 1e6, 600.0)).run().report
    assert r["ok"] + r["errors"] == 400
    assert r["sim"]["level"] == "block" and r["sim"]["block_tokens"] == 512
    assert 0.0 < r["hit_rate"] <= r["oracle_hit_rate"] + 0.01
    assert r["wall_s"] < 20
