"""bench/partition_bound.py: a trace replayed through per-worker LRU caches with each
tenant on one worker, against one pooled cache (small hand-made traces)."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def pb():
    return load_script("partition_bound.py")


def trace(path, tenants: int, turns: int) -> str:
    """Tenants taking turns, each request its tenant's two prefix blocks and one of
    its own (4-token blocks)."""
    lines, uid = [], 1000
    for _ in range(turns):
        for t in range(tenants):
            lines.append({"timestamp": len(lines), "input_length": 12, "output_length": 1,
                          "hash_ids": [10 * t, 10 * t + 1, uid]})  # fmt: skip
            uid += 1
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_one_worker_is_the_pooled_cache(pb, tmp_path):
    r = pb.bound(trace(tmp_path / "t.jsonl", 3, 5), workers=1, kv_tokens=48, block_tokens=4)
    assert r["lpt_hit_rate"] == r["modulo_hit_rate"] == r["pooled_hit_rate"] > 0


def test_a_tenant_per_worker_that_fits_loses_nothing_to_the_partition(pb, tmp_path):
    # each worker holds its tenant's prefix and one unique block; the pooled cache both
    r = pb.bound(trace(tmp_path / "t.jsonl", 2, 6), workers=2, kv_tokens=12, block_tokens=4)
    assert r["tenants"] == 2 and r["requests"] == 12
    assert r["pooled_hit_rate"] == pytest.approx(10 * 8 / (12 * 12))  # all but the first turn
    assert r["lpt_x_pooled"] == r["modulo_x_pooled"] == pytest.approx(1.0)


def test_three_tenants_on_two_workers_lose_what_one_pooled_cache_keeps(pb, tmp_path):
    # pooled, 40 tokens (10 blocks): the three prefixes and the newest unique blocks;
    # per worker 20 (5 blocks): the worker with two tenants taking turns (6 blocks a
    # round) evicts one's prefix for the other's
    r = pb.bound(trace(tmp_path / "t.jsonl", 3, 6), workers=2, kv_tokens=20, block_tokens=4)
    assert r["pooled_hit_rate"] == pytest.approx(15 * 8 / (18 * 12))  # all but the first turn
    assert r["lpt_hit_rate"] < r["pooled_hit_rate"] and r["modulo_hit_rate"] < r["pooled_hit_rate"]


@pytest.mark.parametrize(
    "content, extra",
    [('{"x": 1}\n', []), ("", []), ('{"hash_ids": [], "input_length": 3}\n', []), (None, ["--workers", "0"])],
)
def test_bad_input_is_one_line_and_exit_2(pb, tmp_path, capsys, content, extra):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    else:
        trace(path, 1, 1)
    try:
        rc = pb.main([str(path), *extra])
    except SystemExit as exc:  # argparse's own
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err
