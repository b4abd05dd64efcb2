"""Serving metrics, client retry policy, datasets and load shapes of ``radixfleet loadtest``.

No processes and no sockets: metrics are computed from hand-built ``Result``s with
exact numbers, the arrival shapes run on the virtual clock (``tests.vclock``), and
datasets are read from files written here.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import email.utils
import json
import random
import statistics
import time

import pytest

from radixfleet.wire.errors import ConfigError, WorkloadError
from radixfleet_tools.loadtest import metrics
from radixfleet_tools.loadtest.arrivals import Bounds, Closed, Poisson, TraceTimes, drive
from radixfleet_tools.loadtest.cli import build_load, client_headers, parse_header, parse_rates
from radixfleet_tools.loadtest.client import Result
from radixfleet_tools.loadtest.datasets import RandomDataset, RandomParams, load_sharegpt, make_dataset
from radixfleet_tools.loadtest.report import summarize, validate
from radixfleet_tools.loadtest.retry import RetryPolicy, retry_after_s
from radixfleet_tools.loadtest.workloads import Trace, make_workload, token_count
from tests.vclock import run_virtual


def _ok(i, ttft, e2e, out_tokens, itl=(), start=0.0, worker="w0", prompt=100, retries=0, wait=0.0):
    r = Result(
        f"s{i}.0",
        f"s{i}",
        0,
        start=start,
        ok=True,
        ttft_s=ttft,
        itl_s=list(itl),
        e2e_s=e2e,
        prompt_tokens=prompt,
        cached_tokens=prompt // 2,
        output_tokens=out_tokens,
        worker=worker,
        status=200,
        retries=retries,
        retry_wait_s=wait,
    )
    return r


def _failed(i, kind="http_503", status=503, start=0.0):
    return Result(
        f"f{i}.0", f"f{i}", 0, start=start, ok=False, error_kind=kind, error="refused", status=status
    )


def _report(results, opts):
    rep = summarize("t", "http://x", {"name": "w"}, results, kv_capacity_tokens=None)
    return metrics.enrich(rep, results, opts)


# ------------------------------------------------------------------ metrics ----


def test_tpot_is_vllms_definition_and_needs_two_tokens():
    assert metrics.tpot_s(_ok(0, 0.1, 1.1, 11)) == pytest.approx(0.1)
    assert metrics.tpot_s(_ok(0, 0.1, 0.5, 1)) is None
    assert metrics.tpot_s(_failed(0)) is None


def test_enrich_reports_asked_percentiles_tpot_input_rate_goodput_and_retries():
    # 10 ok requests: TTFT 10..100 ms, E2E TTFT + 90 ms over 10 tokens (TPOT 10 ms),
    # except request 9 whose TPOT is 50 ms; two refused for good; one retried twice
    rs = [_ok(i, (i + 1) / 100, (i + 1) / 100 + 0.09, 10, itl=[0.01] * 9, start=i * 0.1) for i in range(9)]
    rs.append(_ok(9, 0.1, 0.1 + 0.45, 10, itl=[0.05] * 9, start=0.9, retries=2, wait=1.5))
    rs += [_failed(0, start=0.2), _failed(1, start=0.3)]
    opts = metrics.MetricOptions((50.0, 95.0), metrics.parse_slo("ttft:55,tpot_ms=20"))
    rep = _report(rs, opts)
    validate({"runs": [rep]})
    assert rep["percentiles"] == [50.0, 95.0]
    ttft = sorted([(i + 1) * 10.0 for i in range(9)] + [100.0])
    assert rep["ttft_ms"]["p50"] == pytest.approx(ttft[4])  # nearest rank: 5th of 10
    assert rep["ttft_ms"]["p95"] == pytest.approx(100.0)
    assert set(rep["tpot_ms"]) == {"p50", "p90", "p95", "p99", "mean"}
    assert rep["tpot_ms"]["p50"] == pytest.approx(10.0)
    assert rep["tpot_ms"]["p99"] == pytest.approx(50.0)
    assert rep["itl_ms"]["p90"] == pytest.approx(10.0) and rep["itl_ms"]["p99"] == pytest.approx(50.0)
    # duration: first send (0.0) to the last answer (0.9 + 0.55)
    assert rep["duration_s"] == pytest.approx(1.45)
    assert rep["throughput"]["input_tokens_per_s"] == pytest.approx(1000 / 1.45)
    assert rep["throughput"]["total_tokens_per_s"] == pytest.approx(1100 / 1.45)
    # goodput: TTFT <= 55 ms and TPOT <= 20 ms: requests 0..4; 9 fails TPOT, refused never count
    assert rep["goodput"] == {
        "slo": {"ttft_ms": 55.0, "tpot_ms": 20.0},
        "requests": 5,
        "share": pytest.approx(5 / 12),
        "requests_per_s": pytest.approx(5 / 1.45),
    }
    assert rep["retries"] == {"requests": 1, "attempts": 2, "wait_s": 1.5}


def test_parsers_accept_both_syntaxes_and_name_the_flag_on_bad_input():
    assert metrics.parse_percentiles("50, 90,99.9") == (50.0, 90.0, 99.9)
    assert metrics.parse_slo("ttft_ms=500,tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert metrics.parse_slo("ttft:500,e2el:2000") == {"ttft_ms": 500.0, "e2e_ms": 2000.0}
    for bad, msg in (
        ("", "is not a number"),
        ("50,x", "'x'"),
        ("0", "outside (0, 100]"),
        ("101", "outside"),
        ("50,50", "given twice"),
    ):
        with pytest.raises(
            ConfigError,
            match=r"--percentiles: .*"
            + msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
        ):
            metrics.parse_percentiles(bad)
    for bad, msg in (
        ("ttfb=5", "must be KEY=MS"),
        ("ttft", "must be KEY=MS"),
        ("ttft=fast", "not a number"),
        ("ttft=0", "must be > 0"),
        ("ttft=1,ttft_ms=2", "given twice"),
    ):
        with pytest.raises(ConfigError, match=f"--slo: .*{msg}"):
            metrics.parse_slo(bad)
    assert parse_rates("2,4,8.5") == [2.0, 4.0, 8.5]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rates("2,-1")


def test_failure_limit_every_failed_run_exceeds_any_limit_below_one():
    all_failed = _report([_failed(i) for i in range(5)], metrics.MetricOptions())
    some = _report([_ok(i, 0.01, 0.02, 2) for i in range(9)] + [_failed(0)], metrics.MetricOptions())
    assert metrics.over_failure_limit([all_failed], 0.99) == [
        "t: 5 of 5 requests failed (100.0% > --max-failures 0.99)"
    ]
    assert metrics.over_failure_limit([some], 0.0) == [
        "t: 1 of 10 requests failed (10.0% > --max-failures 0)"
    ]
    assert metrics.over_failure_limit([some], 0.1) == []
    nothing = _report([], metrics.MetricOptions())
    assert metrics.over_failure_limit([nothing], 0.5)  # a run that sent nothing measured nothing


def test_requests_export_jsonl_and_csv_hold_every_request(tmp_path):
    rs = [
        _ok(0, 0.012, 0.052, 3, itl=[0.015, 0.025], start=0.5, worker="w1", retries=1, wait=0.25),
        _failed(1, start=0.1),
    ]
    rs[0].available_tokens, rs[0].predicted_tokens = 80, 64  # the router's match headers
    path = tmp_path / "req.jsonl"
    assert metrics.write_requests(str(path), [("a", rs)]) == 2
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["f1.0", "s0.0"]  # in send order
    assert lines[1] == {
        "run": "a",
        "id": "s0.0",
        "session": "s0",
        "turn": 0,
        "send_s": 0.5,
        "ok": True,
        "status": 200,
        "error_kind": None,
        "error": None,
        "ttft_ms": 12.0,
        "tpot_ms": 20.0,
        "e2e_ms": 52.0,
        "itl_ms": [15.0, 25.0],
        "prompt_tokens": 100,
        "cached_tokens": 50,
        "available_tokens": 80,
        "predicted_tokens": 64,
        "output_tokens": 3,
        "worker": "w1",
        "retries": 1,
        "retry_wait_ms": 250.0,
    }
    assert lines[0]["status"] == 503 and lines[0]["error_kind"] == "http_503"
    assert lines[0]["ttft_ms"] is None
    assert lines[0]["available_tokens"] is None  # a target that sends no match headers
    cpath = tmp_path / "req.csv"
    metrics.write_requests(str(cpath), [("a", rs)])
    rows = list(csv.DictReader(cpath.open()))
    assert list(rows[0]) == list(metrics.REQUEST_FIELDS)
    assert rows[1]["itl_ms"] == "15 25" and rows[1]["worker"] == "w1" and rows[0]["ok"] == "False"


def test_latency_and_sweep_tables_render_every_asked_column():
    import io

    rs = [_ok(i, 0.01 * (i + 1), 0.1 + 0.01 * i, 5, itl=[0.02] * 4) for i in range(4)]
    rep = _report(rs, metrics.MetricOptions((50.0, 99.9), {"ttft_ms": 25.0}))
    rep["offered_rate"] = 4.0
    out = io.StringIO()
    metrics.render_latency([rep], out)
    metrics.render_sweep([rep], out)
    text = out.getvalue()
    for col in (
        "TTFT p50",
        "TTFT p99.9",
        "TPOT p50",
        "ITL p99.9",
        "E2E p50",
        "in tok/s",
        "goodput req/s",
        "ttft <= 25 ms",
        "offered req/s",
    ):
        assert col in text, col


# ------------------------------------------------------------------- retry -----


def test_sdk_retry_policy_statuses_bound_and_waits():
    sdk = RetryPolicy("sdk")
    assert [sdk.should_retry(s, {}, 0) for s in (400, 401, 404, 408, 409, 429, 500, 503)] == [
        False,
        False,
        False,
        True,
        True,
        True,
        True,
        True,
    ]
    assert sdk.should_retry(429, {}, 1) and not sdk.should_retry(429, {}, 2)
    assert not sdk.should_retry(503, {"x-should-retry": "false"}, 0)
    assert sdk.should_retry(400, {"x-should-retry": "true"}, 0)
    assert not RetryPolicy("none").should_retry(429, {}, 0)
    assert RetryPolicy("sdk", max_retries=5).should_retry(429, {}, 4)
    assert sdk.delay_s({"retry-after": "3"}, 0) == 3.0
    assert sdk.delay_s({"retry-after-ms": "250", "retry-after": "9"}, 0) == 0.25
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 27 < sdk.delay_s({"retry-after": date}, 0) <= 30
    rng = random.Random(1)
    # beyond 60 s, zero or unreadable: the SDK's backoff, 0.5 s * 2**n with jitter [0.75, 1]
    for headers, n, lo, hi in (
        ({"retry-after": "120"}, 0, 0.375, 0.5),
        ({}, 1, 0.75, 1.0),
        ({"retry-after": "0"}, 2, 1.5, 2.0),
        ({"retry-after": "soon"}, 9, 6, 8),
    ):
        assert lo <= sdk.delay_s(headers, n, rng) <= hi, (headers, n)
    assert retry_after_s({}) is None
    with pytest.raises(ConfigError, match="--retry"):
        RetryPolicy("always")
    with pytest.raises(ConfigError, match="--max-retries"):
        RetryPolicy("sdk", -1)


def test_headers_from_flags_and_the_openai_environment_variable(monkeypatch):
    ns = argparse.Namespace
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    assert client_headers(ns(header=["x-tenant-id: a"], api_key=None)) == {
        "x-tenant-id": "a",
        "Authorization": "Bearer sk-env",
    }
    assert client_headers(ns(header=[], api_key="sk-flag")) == {"Authorization": "Bearer sk-flag"}
    assert client_headers(ns(header=["authorization: Basic x"], api_key=None)) == {"authorization": "Basic x"}
    monkeypatch.delenv("OPENAI_API_KEY")
    assert client_headers(ns(header=[], api_key=None)) == {}
    assert parse_header("X-A:b:c") == ("X-A", "b:c")
    assert parse_header("X-A: b") == ("X-A", "b")
    for bad in ("novalue", ": x", "bad name: x", "X-A=b"):
        with pytest.raises(ConfigError, match="--header"):
            parse_header(bad)


# ------------------------------------------------------------- load shapes -----


def _now() -> float:
    return asyncio.get_running_loop().time()


def test_burstiness_keeps_the_mean_rate_and_sets_the_spread():
    rng = random.Random(3)
    for b, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        gaps = [Poisson(10.0, burstiness=b).gap(rng) for _ in range(40_000)]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.1, rel=0.04), b
        assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.08), b
    # burstiness 1 draws exactly the Poisson gaps it always drew
    a, b = random.Random(7), random.Random(7)
    assert [Poisson(5.0).gap(a) for _ in range(5)] == [b.expovariate(5.0) for _ in range(5)]
    with pytest.raises(WorkloadError, match="--burstiness"):
        Poisson(1.0, burstiness=0)


def test_rate_with_a_concurrency_cap_holds_both():
    in_flight = [0, 0]
    sent: list[float] = []

    async def send(spec):
        sent.append(_now())
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        await asyncio.sleep(1.0)  # slow answers: 50/s offered, 3 in flight at most
        in_flight[0] -= 1
        return "a"

    w = make_workload("zipf", {"requests": 500})
    stats = run_virtual(
        drive(
            w.sessions(),
            Poisson(50.0, max_concurrency=3),
            Bounds(max_requests=12, duration_s=100),
            send,
            clock=_now,
        )
    )
    assert stats.dispatched == 12 and in_flight[1] == 3
    # the cap, not the rate, paces it: three per second of answers
    assert sent[-1] == pytest.approx(3.0, abs=0.1)
    uncapped = []

    async def fast(spec):
        uncapped.append(_now())
        return "a"

    run_virtual(drive(w.sessions(), Poisson(50.0), Bounds(max_requests=12, duration_s=100), fast, clock=_now))
    assert uncapped[-1] < 1.0


def _args(**kw):
    base = dict(
        workload=None,
        dataset=None,
        dataset_path=None,
        trace=None,
        option=[],
        time_scale=None,
        skip_bad_lines=False,
        seed=0,
        rate=None,
        burstiness=1.0,
        concurrency=None,
        requests=None,
        duration=None,
        drain=30.0,
        input_len=1024,
        output_len=None,
        range_ratio=0.0,
        prefix_len=0,
        dataset_api="completions",
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_build_load_trace_alone_dataset_and_combined_shapes(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
        '{"timestamp": 50, "input_length": 600, "output_length": 4, "hash_ids": [1, 3]}\n'
    )
    w, arr, _ = build_load(_args(trace=str(trace)))
    assert isinstance(w, Trace) and isinstance(arr, TraceTimes) and len(w.sessions()) == 2
    w, arr, bounds = build_load(_args(dataset="random", requests=7, rate=4.0, concurrency=2, burstiness=0.5))
    assert isinstance(w, RandomDataset) and len(w.sessions()) == 7
    assert arr == Poisson(4.0, burstiness=0.5, max_concurrency=2) and bounds.max_requests == 7
    _, arr, _ = build_load(_args(workload="zipf", concurrency=3))
    assert arr == Closed(3)
    with pytest.raises(WorkloadError, match="give --workload NAME"):
        build_load(_args())
    with pytest.raises(WorkloadError, match="--dataset replaces"):
        build_load(_args(dataset="random", workload="zipf"))


# ---------------------------------------------------------------- datasets -----


def test_random_dataset_lengths_and_shared_prefix():
    w = RandomDataset(
        RandomParams(requests=200, input_len=100, output_len=20, range_ratio=0.5, prefix_len=30), seed=4
    )
    specs = [s.first() for s in w.sessions()]
    ins = [token_count(s.body["prompt"]) - 30 for s in specs]
    outs = [s.max_tokens for s in specs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 50
    assert min(outs) >= 10 and max(outs) <= 30
    prefixes = {s.body["prompt"][:120] for s in specs}
    assert len(prefixes) == 1  # 30 tokens = 120 bytes, the same in every prompt
    assert len({s.body["prompt"][120:160] for s in specs}) == 200
    assert [s.first().body for s in w.sessions()] == [s.body for s in specs]  # deterministic
    fixed = RandomDataset(RandomParams(requests=3, input_len=8, output_len=2), seed=0)
    assert [token_count(s.first().body["prompt"]) for s in fixed.sessions()] == [8, 8, 8]
    with pytest.raises(WorkloadError, match=r"^--range-ratio: expected a number in \[0, 1\), got 1\.0$"):
        make_dataset("random", {"range_ratio": 1.0})


def _conv(human, gpt):
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


def test_sharegpt_json_and_jsonl_with_vllms_filter(tmp_path):
    long_prompt = "x" * 4 * 1100  # 1100 tokens: over vLLM's 1024 prompt limit
    entries = [
        _conv("a" * 40, "b" * 80),
        _conv("hi", "b" * 80),  # prompt under 4 tokens
        {"conversations": [{"from": "human", "value": "lonely"}]},  # no answer
        _conv(long_prompt, "b" * 40),
        _conv("c" * 400, "d" * 16),
    ]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(entries, indent=1))
    assert load_sharegpt(str(f)) == [("a" * 40, 20), ("c" * 400, 4)]
    # a fixed output length lifts the answer-based filters
    assert load_sharegpt(str(f), output_len=64) == [("a" * 40, 64), (long_prompt, 64), ("c" * 400, 64)]
    assert load_sharegpt(str(f), limit=1) == [("a" * 40, 20)]
    jl = tmp_path / "sg.jsonl"
    jl.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    w = make_dataset("sharegpt", {"path": str(jl), "api": "chat"}, seed=0)
    specs = [s.first() for s in w.sessions()]
    assert [s.body["messages"][0]["content"] for s in specs] == ["a" * 40, "c" * 400]
    assert [s.max_tokens for s in specs] == [20, 4] and specs[0].api == "chat"


def test_sharegpt_bad_files_name_file_line_and_field(tmp_path):
    cases = {
        "empty.json": ("", "the file is empty"),
        "broken.json": ('[\n {"conversations": []},\n {oops}\n]', "line 3: not JSON"),
        "broken.jsonl": (json.dumps(_conv("a" * 40, "b" * 40)) + "\n{oops\n", "line 2: not JSON"),
        "trace.jsonl": (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n',
            "line 1: field 'conversations' missing or not a list",
        ),
        "novalue.json": (
            json.dumps([_conv("a" * 40, "b" * 40), {"conversations": [{"from": "human"}, {"value": "x"}]}]),
            "entry 1: field 'conversations[0].value' missing",
        ),
        "short.json": (json.dumps([_conv("a", "b")]), "no usable conversation among 1 entries"),
    }
    for name, (text, msg) in cases.items():
        p = tmp_path / name
        p.write_text(text)
        with pytest.raises(WorkloadError) as exc:
            load_sharegpt(str(p))
        assert str(exc.value).startswith(str(p)) and msg in str(exc.value), (name, exc.value)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_sharegpt(str(tmp_path / "missing.json"))


def test_list_workloads_names_each_workload_what_it_sends_and_its_options(capsys):
    from radixfleet_tools.loadtest.cli import configure, run
    from radixfleet_tools.loadtest.workloads import WORKLOADS

    parser = argparse.ArgumentParser()
    configure(parser)
    assert run(parser.parse_args(["--list-workloads"])) == 0
    out = capsys.readouterr().out.splitlines()
    for name in WORKLOADS:
        i = out.index(name)
        assert out[i + 1].strip(), f"{name} has no description"
        assert out[i + 2].startswith("  -o options: ")
    assert "sessions [96]" in "\n".join(out)  # mixed's defaults
