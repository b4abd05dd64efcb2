"""``radixfleet analyze``: the knee, the budget, the Zipf head, replay, bad input."""

from __future__ import annotations

import json

import pytest

from radixfleet.cli import main
from radixfleet_tools.agent.cost_model import CostModel
from radixfleet_tools.bench.analyze import synthetic_log
from radixfleet_tools.loadtest.analyze import (
    Options,
    analyze,
    budget,
    find_knee,
    oracle_and_reuse,
    pooled_curve,
    zipf_head,
)
from radixfleet_tools.loadtest.arrivals import Bounds, TraceTimes
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import SimConfig, Simulation
from radixfleet_tools.loadtest.trace_format import read_trace
from radixfleet_tools.loadtest.workloads import MOONCAKE_TRACE, Trace

MOONCAKE = MOONCAKE_TRACE


def _trace(path, rows, block_tokens=4) -> str:
    with open(path, "w") as f:
        for i, ids in enumerate(rows):
            n = block_tokens * len(ids)
            f.write(
                json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
            )
    return str(path)


HAND = [[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3]]  # 44 prompt tokens at 4 per block


def test_knee_figures_by_hand(tmp_path):
    """Worked out by hand in the comments (4-token blocks, LRU leaf eviction of whole
    radix edges, as the agent's cache and the simulator's pooled reference do)."""
    data = read_trace([_trace(tmp_path / "t.jsonl", HAND)], block_tokens=4)
    reuse = oracle_and_reuse(data)
    # oracle: r1 0, r2 [1,2] 8, r3 [1] 4, r4 all 12 -> 24 of 44
    assert list(reuse["oracle_tokens"]) == [0, 8, 4, 12]
    assert reuse["distinct_units"] == 5
    got = pooled_curve(data, [8, 12, 20], jobs=1)
    # 3 blocks: r2 hits [1,2] (8), evicts [3]; r3 hits [1] (4), evicts [4];
    # r4 hits [1,2] (8) -> 20/44.  2 blocks: r1 and r2 evict their whole edge at once,
    # r3 keeps [1,5], r4 hits [1] (4) -> 4/44.  5 blocks hold everything: the oracle.
    assert got == {8: pytest.approx(4 / 44), 12: pytest.approx(20 / 44), 20: pytest.approx(24 / 44)}
    z = zipf_head(reuse, 4, 1.0)
    # counts: block 1 in 4 requests, 2 in 3, 3 in 2; deepest shared blocks: 3, 2, 1, 3
    assert z["sharing_share"] == 1.0 and z["shared_blocks"] == 3 and z["prefixes"] == 3
    assert [(c["share"], c["blocks"], c["prefixes"]) for c in z["coverage"]] == [
        (0.5, 2, 2),
        (0.8, 3, 3),
        (0.95, 3, 3),
    ]
    assert z["static_hit_rate"] == pytest.approx(24 / 44)  # (3 + 2 + 1) blocks x 4 tokens
    assert z["top_prefixes"][0] == {"requests": 4, "depth_blocks": 1}


def test_find_knee_and_budget_by_hand():
    assert find_knee([0, 1, 2, 3, 4], [0, 0.6, 0.8, 0.9, 1.0]) == 1  # 0.6 - 0.25 is the most
    assert find_knee([0, 1, 2, 3, 4], [0, 0.1, 0.2, 0.5, 1.0]) == 0  # convex: no knee above
    assert find_knee([0, 1], [0, 1]) == 0
    cost = CostModel("llama-3-8b", "h100")
    b = budget(cost, workers=4, concurrency=10, mean_context_tokens=1000.0)
    cap = int((80e9 * 0.9 - 8.03e9 * 2) // 131072)  # HBM x 0.9 - weights, over 128 KiB/token
    assert b["kv_capacity_tokens"] == cap
    assert b["working_set_tokens"] == 10_000
    assert b["per_worker_tokens"] == cap - 10_000 and b["fleet_tokens"] == 4 * (cap - 10_000)
    assert b["fleet_bytes"] == 4 * (cap - 10_000) * 131072


def _sim(trace: Trace, workers: int, kv: int) -> dict:
    cfg = SimConfig(workers=workers, engine=EngineSpec(kv_tokens=kv), level="block", policy="round_robin")
    return Simulation(cfg, trace, TraceTimes(), Bounds(None, None, 600.0)).run().report


@pytest.mark.parametrize("source", ["mooncake", "traffic_log"])
def test_figures_match_the_simulators_references(tmp_path, source):
    """analyze's oracle and pooled figures are the simulator's own on the same trace."""
    if source == "mooncake":
        paths, kv = [MOONCAKE], 150_000
        data = read_trace(paths, max_requests=500)
    else:
        paths, kv = synthetic_log(str(tmp_path / "log"), 1500, active=30), 40_000
        data = read_trace(paths)
    trace = Trace.from_records(data.records, block_tokens=data.block_tokens)
    rep = _sim(trace, 3, kv)
    assert rep["ok"] == rep["requests"] == len(data.records)
    reuse = oracle_and_reuse(data)
    oracle = reuse["oracle_tokens"].sum() / reuse["prompt_tokens"].sum()
    assert oracle == pytest.approx(rep["oracle_hit_rate"], abs=1e-12)
    pooled = pooled_curve(data, [3 * kv], jobs=1)[3 * kv]
    assert pooled == pytest.approx(rep["pooled_hit_rate"], abs=1e-12)
    assert 0 < pooled < oracle


def test_cli_table_json_plots_and_replay(tmp_path, capsys):
    paths = synthetic_log(str(tmp_path / "log"), 1200, active=20)
    out, plots = tmp_path / "a.json", tmp_path / "plots"
    rc = main(
        [
            "analyze",
            str(tmp_path / "log"),
            "--agents",
            "2",
            "--concurrency",
            "8",
            "--policies",
            "round_robin,prefix_load",
            "--kv-tokens",
            "30000",
            "--jobs",
            "1",
            "--json",
            str(out),
            "--plots",
            str(plots),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["inputs"]["requests"] == 1200 and res["inputs"]["files"] == paths
    assert res["inputs"]["format"] == "traffic_log" and res["tokens"]["token_ratio"] == 1.0
    curve = [p["hit_rate"] for p in res["knee_curve"]]
    assert curve == sorted(curve) and curve[-1] == pytest.approx(res["oracle_hit_rate"])
    assert res["knee"] in [
        {k: p[k] for k in ("kv_tokens", "kv_bytes", "hit_rate")} for p in res["knee_curve"]
    ]
    assert res["at_budget"]["kv_tokens"] == res["budget"]["fleet_tokens"]
    assert [r["name"] for r in res["policies"]] == ["round_robin", "prefix_load"]
    assert all(r["requests"] == 1200 for r in res["policies"])
    text = capsys.readouterr().out
    for word in (
        "oracle",
        "knee",
        "budget / worker",
        "slope past budget",
        "Zipf head 50%",
        "round_robin",
        "prefix_load",
    ):
        assert word in text
    for name in ("knee.png", "zipf_head.png", "policies.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "lines, args, message",
    [
        (
            [
                '{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}',
                '{"timestamp": 1, "input_len',
            ],
            ["--block-tokens", "4"],
            "line 2: not JSON",
        ),
        (
            ['{"timestamp": 0, "format": "radixfleet.traffic/7"}'],
            [],
            "line 1: 'format' is 'radixfleet.traffic/7', from another radixfleet version",
        ),
        ([], [], "no requests"),
        (
            ['{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}'],
            ["--block-tokens", "4", "--agent-model", "llama-3-70b", "--gpu", "l4"],
            "tp: llama-3-70b weights (141.2 GB) do not fit 1 x l4",
        ),
        (
            ['{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}'],
            ["--block-tokens", "4", "--agent-model", "mistral"],
            "--agent-model: unknown preset 'mistral'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, lines, args, message):
    p = tmp_path / "log.jsonl"
    p.write_text("".join(line + "\n" for line in lines))
    assert main(["analyze", str(p), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("radixfleet analyze: error:")


def test_skip_bad_counts_and_goes_on(tmp_path, capsys):
    rows = [
        json.dumps({"timestamp": i, "input_length": 8, "output_length": 1, "hash_ids": [1, 2 + i % 2]})
        for i in range(6)
    ]
    rows[2] = rows[2][:20]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(rows) + "\n")
    out = tmp_path / "a.json"
    assert (
        main(
            ["analyze", str(p), "--block-tokens", "4", "--skip-bad-lines", "--jobs", "1", "--json", str(out)]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["inputs"]["requests"] == 5 and res["inputs"]["skipped_lines"] == 1
    assert res["inputs"]["first_skipped"] == [f"{p}:3"]


def test_options_validate():
    from radixfleet.wire.errors import ConfigError

    with pytest.raises(ConfigError, match="--concurrency"):
        Options(concurrency=0).validate()
    with pytest.raises(ConfigError, match="--concurrency: 100000 running requests"):
        analyze([MOONCAKE], Options(concurrency=100_000, points=3, jobs=1))


def _log_line(i: int, ids, **kw) -> str:
    from radixfleet.server.traffic_log import FORMAT

    rec = {
        "timestamp": 1000.0 + i,
        "input_length": 96,
        "output_length": 4,
        "hash_ids": ids,
        "format": FORMAT,
        "block_tokens": 32,
        "routed_tokens": 96,
        "tenant": "",
        "model": "m",
        "adapter": None,
        "worker": "w0",
        "available_tokens": 0,
        "matched_tokens": 0,
        "cached_tokens": 0,
        "ttft_ms": None,
        "status": 200,
        "broken": False,
        "sample_rate": 1.0,
    }
    rec.update(kw)
    return json.dumps(rec)


def test_routing_loss_and_capacity_loss_by_hand(tmp_path, capsys):
    """Four served requests of 96 tokens (384 in all), worked out by hand:

    r0  nothing anywhere                 capacity 96
    r1  64 held elsewhere, went to a     capacity 32, routing 64 (available 64, predicted 0)
        worker holding none
    r2  96 held by its worker, 64        prediction gap 32 (delivered 64)
        delivered
    r3  64 held and delivered 80         capacity 32, prediction gap -16 (the agent
                                         matched past the router's blocks)

    capacity 160, routing 64, prediction gap 16, delivered 144: 384 in all. A shed
    line and a line of an earlier version (no ``available_tokens``) are left out."""
    lines = [
        _log_line(0, [1, 2, 3]),
        _log_line(1, [1, 2, 4], available_tokens=64, matched_tokens=0, cached_tokens=0),
        _log_line(2, [1, 2, 3], available_tokens=96, matched_tokens=96, cached_tokens=64),
        _log_line(3, [1, 2, 5], available_tokens=64, matched_tokens=64, cached_tokens=80),
        _log_line(4, [1, 2, 6], worker="", status=429, cached_tokens=None),
    ]
    old = json.loads(_log_line(5, [1, 2, 7], cached_tokens=32))
    del old["available_tokens"]
    lines.append(json.dumps(old))
    p = tmp_path / "traffic.jsonl"
    p.write_text("\n".join(lines) + "\n")
    res = analyze([str(p)], Options(jobs=1))
    r = res["observed"]["routing"]
    assert r["requests"] == 4 and r["prompt_tokens"] == 384
    assert (r["capacity_loss_tokens"], r["routing_loss_tokens"], r["prediction_gap_tokens"]) == (160, 64, 16)
    assert r["delivered_tokens"] == 144
    assert r["capacity_loss_share"] == pytest.approx(160 / 384)
    assert r["routing_loss_share"] == pytest.approx(64 / 384)
    assert r["captured_share"] == pytest.approx(160 / 224)  # predicted over available
    assert res["observed"]["shed_requests"] == 1
    out = tmp_path / "a.json"
    assert main(["analyze", str(p), "--jobs", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "capacity loss" in text and "routing loss" in text and "prediction gap" in text
    assert json.loads(out.read_text())["observed"]["routing"] == r
    # a log of an earlier version: no split, no rows
    p.write_text(json.dumps(old) + "\n")
    assert analyze([str(p)], Options(jobs=1))["observed"]["routing"] is None
