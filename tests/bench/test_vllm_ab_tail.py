"""bench/vllm_ab.py's ``--tail`` analysis on hand-made records: which requests are the
slowest, what each met (requests ahead on its worker, the engines' queues, the cores
each process group used, the router's traffic-log line), the summary and the CLI's
bad input. No engines are started."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def ab():
    return load_script("vllm_ab.py")


def rec(session, turn, send_s, ttft_ms, worker, e2e_ms=None, prompt=600, cached=300, ok=True):
    return {
        "run": "pl",
        "ok": ok,
        "session": session,
        "turn": turn,
        "send_s": send_s,
        "ttft_ms": ttft_ms,
        "e2e_ms": (ttft_ms or 0) + 100 if e2e_ms is None else e2e_ms,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "worker": worker,
    }


START = 1000.0
RECORDS = [
    # three turns sent together to vllm-b, the slowest two behind the first
    rec("c1", 1, 1.0, 900, "vllm-b", prompt=601),
    rec("c2", 1, 1.0, 800, "vllm-b", prompt=602),
    rec("c3", 1, 1.0, 100, "vllm-b", prompt=603),
    rec("c4", 0, 0.0, 50, "vllm-a", e2e_ms=5000, prompt=300, cached=0),
    *[rec(f"d{i}", 2, 2.0 + i, 20, "vllm-a") for i in range(16)],
    rec("x", 1, 1.5, None, "vllm-a", e2e_ms=None, ok=False) | {"e2e_ms": None},  # failed: never in the tail
]
SAMPLES = [(START + t, [(w, 2.0), (0.0, 3.0)]) for t, w in ((0.75, 0.0), (1.0, 1.0), (1.25, 4.0), (1.5, 2.0))]
CPU = [
    (START + 0.9, {"vllm-b": 10.0, "router:pl": 1.0, "other": 5.0}),
    (START + 2.1, {"vllm-b": 11.2, "router:pl": 1.12, "other": 5.6}),
]
TRAFFIC = [
    # c2's line (same worker and prompt tokens, 2 ms after its send); a decoy far off
    {
        "worker": "vllm-b",
        "input_length": 602,
        "timestamp": (START + 1.002) * 1000,
        "ttft_ms": 250.0,
        "matched_tokens": 288,
    },
    {
        "worker": "vllm-b",
        "input_length": 601,
        "timestamp": (START + 9.0) * 1000,
        "ttft_ms": 1.0,
        "matched_tokens": 0,
    },
]


def test_tail_rows_pick_the_slowest_and_say_what_they_met(ab):
    rows = ab.tail_rows(RECORDS, START, SAMPLES, ["vllm-b", "vllm-a"], TRAFFIC, 0.1, CPU)
    assert [r["session"] for r in rows] == ["c1", "c2"]  # ceil(0.1 * 20 ok) slowest
    c1, c2 = rows
    # sent with c2, c3 on its own worker and c4 (still decoding) on the other
    assert (c1["ahead"], c1["in_flight"]) == (2, 3)
    # the last sample at or before its send, and the most queued until its first token
    assert c1["engines_at_send"]["vllm-b"] == {"waiting": 1.0, "running": 2.0}
    assert c1["most_waiting_until_first_token"] == 4.0
    # the cores each group used around its wait (1.2 s between the samples)
    assert c1["cores"] == {"vllm-b": 1.0, "router:pl": 0.1, "other": 0.5}
    # c1's only candidate line is 8 s off its send: no router-side figures
    assert "engine_ms" not in c1
    assert (c2["engine_ms"], c2["outside_ms"], c2["matched_tokens"]) == (250.0, 550.0, 288)


def test_tail_rows_without_a_clock_keep_the_records_own_figures(ab):
    rows = ab.tail_rows(RECORDS, None, SAMPLES, ["vllm-b", "vllm-a"], TRAFFIC, 0.1)
    assert [r["session"] for r in rows] == ["c1", "c2"]
    assert "engines_at_send" not in rows[0] and "engine_ms" not in rows[1]


def test_tail_summary_and_table(ab):
    rows = ab.tail_rows(RECORDS, START, SAMPLES, ["vllm-b", "vllm-a"], TRAFFIC, 0.1, CPU)
    s = ab.tail_summary(RECORDS, rows)
    assert s["requests_per_worker"] == {"vllm-b": 3, "vllm-a": 17}
    assert (s["slow"], s["slow_first_turns"], s["slow_on_busier_worker"]) == (2, 0, 2)
    assert (s["slow_mean_ttft_ms"], s["slow_mean_engine_ms"], s["slow_mean_outside_ms"]) == (
        850.0,
        250.0,
        550.0,
    )
    text = ab.render_tail("pl", rows, s)
    assert "slowest 2 by TTFT" in text and "vllm-b=1/2" in text and "router=0.10" in text


def test_engine_load_sums_each_engine_of_a_page(ab):
    page = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 5.0\n'
    )
    assert ab.engine_load(page) == (3.0, 5.0)


@pytest.mark.parametrize("share", ["0", "1.5"])
def test_tail_share_out_of_range_is_refused(ab, share, capsys):
    assert ab.main(["--tail", share]) == 2
    assert "--tail must be in (0, 1]" in capsys.readouterr().err
