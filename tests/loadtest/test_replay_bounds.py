"""Replays run whole unless bounded; a bound that cuts a run says so in the report and the table."""

from __future__ import annotations

import io
import json

from radixfleet.cli import main
from radixfleet_tools.loadtest.arrivals import Bounds
from radixfleet_tools.loadtest.report import render_table, summarize, validate
from radixfleet_tools.loadtest.workloads import make_workload


def _trace(path, n: int) -> str:
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "timestamp": i * 2000,
                        "input_length": 600,
                        "output_length": 4,
                        "hash_ids": [i % 3, 100 + i],
                    }
                )
                + "\n"
            )
    return str(path)


def test_simulate_trace_replays_whole_by_default(tmp_path):
    """Trace timestamps span 2,400 s, far past the old 120 s default: all 1,200 run."""
    trace = _trace(tmp_path / "t.jsonl", 1200)
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "simulate",
                "--trace",
                trace,
                "--workers",
                "2",
                "--kv-tokens",
                "20000",
                "--policies",
                "round_robin",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (r,) = json.loads(out.read_text())["runs"]
    assert r["requests"] == 1200 and r["workload_requests"] == 1200
    assert r["stopped_by"] == "exhausted" and r["cut"] is None


def test_simulate_bound_that_cuts_says_so(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl", 300)
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "simulate",
                "--trace",
                trace,
                "--workers",
                "2",
                "--kv-tokens",
                "20000",
                "--policies",
                "round_robin",
                "--duration",
                "100",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (r,) = json.loads(out.read_text())["runs"]
    assert r["requests"] == 50 and r["stopped_by"] == "duration"
    assert r["cut"] == "cut by --duration 100 s: 50 of the workload's 300 requests sent"
    text = capsys.readouterr().out
    assert "50/50*" in text and "* round_robin: cut by --duration 100 s" in text
    assert (
        main(
            [
                "simulate",
                "--trace",
                trace,
                "--workers",
                "2",
                "--kv-tokens",
                "20000",
                "--policies",
                "round_robin",
                "--requests",
                "20",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (r,) = json.loads(out.read_text())["runs"]
    assert r["requests"] == 20 and r["cut"].startswith("cut by --requests 20: 20 of")


def test_multiturn_planned_requests_and_cut_note():
    w = make_workload("multiturn", {"clients": 4, "rounds": 3}, 0)
    assert sum(s.planned_requests for s in w.sessions()) == 12
    b = Bounds(None, None)
    assert b.cut_note("exhausted", 12, 12) is None
    assert "failed turn ends its session" in b.cut_note("exhausted", 7, 12)
    assert Bounds(120, None).cut_note("requests", 120, 320) == (
        "cut by --requests 120: 120 of the workload's 320 requests sent"
    )
    # --requests equal to the workload's size: the bound cut nothing
    assert Bounds(80, None).cut_note("requests", 80, 80) is None


def test_table_keeps_long_run_names_and_explains_columns():
    name = "round_robin-with-a-very-long-descriptive-run-name-" * 3
    r = summarize(name, "u", {}, [], kv_capacity_tokens=10)
    validate({"runs": [r]})
    buf = io.StringIO()
    render_table([r], file=buf)
    text = buf.getvalue()
    assert name in text  # not cut to a fixed width
    for word in ("oracle:", "pooled:", "imbalance:"):
        assert word in text


async def test_unbounded_drive_ends_when_the_workload_does():
    """With no duration bound nothing times out a wait: the dispatcher must see the
    last request leave (it once waited forever for a change that had happened)."""
    import asyncio

    from radixfleet_tools.loadtest.arrivals import Closed, drive

    w = make_workload("multiturn", {"clients": 5, "rounds": 3, "question_tokens": 4, "output_tokens": 2}, 0)

    async def send(spec):
        await asyncio.sleep(0.001)
        return "ok"

    stats = await asyncio.wait_for(drive(w.sessions(), Closed(2), Bounds(None, None), send), 10)
    assert stats.dispatched == 15 and stats.stopped_by == "exhausted"
