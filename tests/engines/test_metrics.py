"""Engine /metrics pages: parsing a real vLLM page, SGLang's and our agent's, every
bad page refused with its cause, and the scraper against a real aiohttp server on
loopback (fixture page, garbage, 500s, timeouts, a page that changes)."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from radixfleet.engines.engine_metrics import (
    EngineMetrics,
    EngineMetricsError,
    MetricsFailure,
    MetricsKind,
    MetricsScraper,
    ScraperState,
    detect_kind,
    fetch_metrics,
    parse_metrics,
)
from radixfleet_tools.agent.server import AgentConfig, create_app

VLLM_PAGE = (Path(__file__).parents[1] / "data" / "vllm_metrics.txt").read_text()


def _set(page: str, series: str, value: str) -> str:
    """The page with every sample line of ``series`` given ``value``."""
    out = []
    for line in page.splitlines():
        if line.startswith(series + "{") or line.startswith(series + " "):
            line = line.rsplit(" ", 1)[0] + " " + value
        out.append(line)
    return "\n".join(out) + "\n"


def _drop(page: str, series: str) -> str:
    return (
        "\n".join(
            l for l in page.splitlines() if not (l.startswith(series + "{") or l.startswith(series + " "))
        )
        + "\n"
    )


def _vllm_dp2(page: str) -> str:
    """The fixture as a data-parallel server of two engines: engine 1's rows are
    engine 0's with other values (vLLM repeats cache_config_info per engine)."""
    extra = []
    for line in page.splitlines():
        if 'engine="0"' in line and not line.startswith("#"):
            line = line.replace('engine="0"', 'engine="1"')
            name = line.split("{", 1)[0]
            value = {
                "vllm:num_requests_waiting": "3.0",
                "vllm:num_requests_running": "5.0",
                "vllm:kv_cache_usage_perc": "0.5",
                "vllm:prefix_cache_queries_total": "100.0",
                "vllm:prefix_cache_hits_total": "40.0",
            }.get(name)
            if value is not None:
                line = line.rsplit(" ", 1)[0] + " " + value
            extra.append(line)
    return page + "\n".join(extra) + "\n"


# ---------------------------------------------------------------- parsing: vLLM


def test_the_live_vllm_page_reads_exactly():
    m = parse_metrics(VLLM_PAGE, MetricsKind.VLLM)
    assert m == EngineMetrics(
        kind=MetricsKind.VLLM,
        waiting_requests=0,
        running_requests=0,
        kv_usage=0.0,
        kv_capacity_tokens=4096 * 32,
        block_size=32,
        prefix_caching=True,
        prefix_hash_algo="sha256",
        prefix_queries_tokens=0.0,
        prefix_hits_tokens=0.0,
        prefilled_requests=0.0,
        start_time_s=1796290557.25,
        models=("tiny",),
        instances=1,
    )
    assert m.kv_capacity_blocks == 4096
    assert detect_kind(VLLM_PAGE) is MetricsKind.VLLM


def test_vllm_values_are_read_from_their_own_series_not_lookalikes():
    page = _set(VLLM_PAGE, "vllm:num_requests_waiting", "7.0")
    page = _set(page, "vllm:num_requests_waiting_by_reason", "99.0")  # prefix of the name
    page = _set(page, "vllm:num_requests_running", "2.0")
    page = _set(page, "vllm:kv_cache_usage_perc", "0.25")
    page = _set(page, "vllm:prefix_cache_queries_total", "1000.0")
    page = _set(page, "vllm:prefix_cache_queries_created", "5.0")
    page = _set(page, "vllm:prefix_cache_hits_total", "640.0")
    page = _set(page, "vllm:time_to_first_token_seconds_count", "12.0")
    page = _set(page, "vllm:time_to_first_token_seconds_sum", "99.0")
    m = parse_metrics(page, MetricsKind.VLLM)
    assert (m.waiting_requests, m.running_requests, m.kv_usage) == (7, 2, 0.25)
    assert (m.prefix_queries_tokens, m.prefix_hits_tokens) == (1000.0, 640.0)
    assert m.prefilled_requests == 12.0


def test_vllm_data_parallel_engines_are_summed_and_capacity_taken_once():
    m = parse_metrics(_vllm_dp2(VLLM_PAGE), MetricsKind.VLLM)
    assert m.instances == 2
    assert (m.waiting_requests, m.running_requests) == (3, 5)
    assert m.kv_usage == 0.25  # mean of 0.0 and 0.5
    assert (m.prefix_queries_tokens, m.prefix_hits_tokens) == (100.0, 40.0)
    # num_gpu_blocks is already the DP total in every engine's row: not doubled
    assert m.kv_capacity_tokens == 131072 and m.block_size == 32


def test_vllm_older_usage_name_and_unset_cache_config():
    page = VLLM_PAGE.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    page = page.replace('num_gpu_blocks="4096"', 'num_gpu_blocks="None"')
    page = _drop(page, "process_start_time_seconds")
    m = parse_metrics(_set(page, "vllm:gpu_cache_usage_perc", "0.5"), MetricsKind.VLLM)
    assert m.kv_usage == 0.5
    assert m.kv_capacity_tokens is None and m.block_size == 32 and m.kv_capacity_blocks is None
    assert m.start_time_s is None


def test_vllm_page_without_cache_config_or_counters_still_reads():
    page = _drop(_drop(VLLM_PAGE, "vllm:cache_config_info"), "vllm:prefix_cache_hits_total")
    m = parse_metrics(page, MetricsKind.VLLM)
    assert m.kv_capacity_tokens is None and m.block_size is None and m.prefix_caching is None
    assert m.prefix_hits_tokens is None and m.prefix_queries_tokens == 0.0


def test_restart_is_seen_in_start_time_or_counters_going_back():
    a = parse_metrics(_set(VLLM_PAGE, "vllm:prefix_cache_queries_total", "500.0"), MetricsKind.VLLM)
    same = parse_metrics(_set(VLLM_PAGE, "vllm:prefix_cache_queries_total", "900.0"), MetricsKind.VLLM)
    assert not same.restarted_since(a)
    assert parse_metrics(VLLM_PAGE, MetricsKind.VLLM).restarted_since(a)  # 500 -> 0
    later = _set(
        _set(VLLM_PAGE, "process_start_time_seconds", "1796299999.0"),
        "vllm:prefix_cache_queries_total",
        "900.0",
    )
    assert parse_metrics(later, MetricsKind.VLLM).restarted_since(a)


# ---------------------------------------------------- parsing: SGLang and the agent

SGLANG_PAGE = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
{rows_queue}
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
{rows_running}
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
{rows_usage}
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
{rows_max}
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{model_name="qwen"}} 8128902.0
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{{model_name="qwen"}} 4000000.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="qwen"}} 3.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="qwen"}} 9.0
sglang:time_to_first_token_seconds_sum{{model_name="qwen"}} 2.5
sglang:time_to_first_token_seconds_count{{model_name="qwen"}} 9.0
"""


def _sglang_page(per_rank: dict[tuple[int, int], tuple[float, float, float, float]]) -> str:
    """SGLang's page for ranks (dp, tp) -> (queue, running, usage, max tokens)."""
    rows: dict[str, list[str]] = {"rows_queue": [], "rows_running": [], "rows_usage": [], "rows_max": []}
    names = (
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang:max_total_num_tokens",
    )
    for (dp, tp), values in per_rank.items():
        lb = (
            f'dp_rank="{dp}",engine_type="unified",model_name="qwen",moe_ep_rank="0",'
            f'pp_rank="0",tp_rank="{tp}"'
        )
        for key, name, v in zip(rows, names, values):
            rows[key].append(f"{name}{{{lb}}} {v}")
    return SGLANG_PAGE.format(**{k: "\n".join(v) for k, v in rows.items()})


def test_sglang_sums_dp_ranks_and_dedupes_tp_ranks():
    page = _sglang_page(
        {
            (0, 0): (4.0, 10.0, 0.5, 100000.0),
            (0, 1): (4.0, 10.0, 0.5, 100000.0),
            (1, 0): (2.0, 6.0, 0.25, 100000.0),
            (1, 1): (2.0, 6.0, 0.25, 100000.0),
        }
    )
    assert detect_kind(page) is MetricsKind.SGLANG
    m = parse_metrics(page, MetricsKind.SGLANG)
    assert (m.waiting_requests, m.running_requests) == (6, 16)
    assert m.kv_usage == 0.375
    assert m.kv_capacity_tokens == 200000 and m.block_size is None and m.prefix_caching is None
    assert (m.prefix_queries_tokens, m.prefix_hits_tokens) == (8128902.0, 4000000.0)
    assert m.models == ("qwen",) and m.instances == 2 and m.start_time_s is None


def test_sglang_capacity_zero_means_unknown_and_usage_is_clamped():
    m = parse_metrics(_sglang_page({(0, 0): (0.0, 0.0, 1.2, 0.0)}), MetricsKind.SGLANG)
    assert m.kv_capacity_tokens is None and m.kv_usage == 1.0


@pytest.fixture
async def agent_page():
    app = create_app(AgentConfig(kv_tokens=50_000, served_model_name="agent-model"))
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    async with aiohttp.ClientSession() as s:
        async with s.get(str(srv.make_url("/metrics"))) as r:
            text = await r.text()
    await srv.close()
    return text


@pytest.mark.integration
async def test_the_agents_own_page_reads(agent_page):
    assert detect_kind(agent_page) is MetricsKind.AGENT
    m = parse_metrics(agent_page, MetricsKind.AGENT)
    assert m.kind is MetricsKind.AGENT
    assert (m.waiting_requests, m.running_requests, m.kv_usage) == (0, 0, 0.0)
    assert m.kv_capacity_tokens == 50_000
    assert (m.prefix_queries_tokens, m.prefix_hits_tokens) == (0.0, 0.0)
    assert m.prefilled_requests == 0.0
    assert m.models == ("agent-model",)
    # the agent's page is SGLang's names too: read as sglang it has no capacity series
    assert parse_metrics(agent_page, MetricsKind.SGLANG).kv_capacity_tokens is None


# ------------------------------------------------------------------ bad pages


@pytest.mark.parametrize(
    "page, cause",
    [
        ("<html><body>Not Found</body></html>", MetricsFailure.NOT_PROMETHEUS),
        ('{"error": "metrics disabled"}', MetricsFailure.NOT_PROMETHEUS),
        ("vllm:num_requests_waiting{engine=0} 1\n", MetricsFailure.NOT_PROMETHEUS),  # bad labels
        ('vllm:num_requests_waiting{engine="0"} lots\n', MetricsFailure.NOT_PROMETHEUS),
        ("", MetricsFailure.MISSING_SERIES),
        ("# HELP up Is it up\n# TYPE up gauge\nup 1\n", MetricsFailure.MISSING_SERIES),
    ],
)
def test_pages_that_are_not_a_vllm_page_are_refused_with_their_cause(page, cause):
    with pytest.raises(EngineMetricsError) as e:
        parse_metrics(page, MetricsKind.VLLM)
    assert e.value.cause is cause
    assert str(e.value).startswith(cause.value + ": ")
    assert len(e.value.detail) <= 200


def test_each_missing_required_series_is_named():
    for series in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        with pytest.raises(EngineMetricsError) as e:
            parse_metrics(_drop(VLLM_PAGE, series), MetricsKind.VLLM)
        assert e.value.cause is MetricsFailure.MISSING_SERIES and series in e.value.detail


def test_another_kinds_page_is_missing_series_with_a_hint():
    with pytest.raises(EngineMetricsError) as e:
        parse_metrics(VLLM_PAGE, MetricsKind.SGLANG)
    assert e.value.cause is MetricsFailure.MISSING_SERIES
    assert "looks like a vllm page" in e.value.detail


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-1.0"])
def test_nan_inf_or_negative_required_values_are_bad_values(value):
    with pytest.raises(EngineMetricsError) as e:
        parse_metrics(_set(VLLM_PAGE, "vllm:num_requests_running", value), MetricsKind.VLLM)
    assert e.value.cause is MetricsFailure.BAD_VALUE


def test_a_bad_optional_value_only_drops_that_field():
    m = parse_metrics(_set(VLLM_PAGE, "vllm:prefix_cache_hits_total", "NaN"), MetricsKind.VLLM)
    assert m.prefix_hits_tokens is None and m.prefix_queries_tokens == 0.0


def test_model_filter_reads_one_model_and_refuses_a_page_of_others():
    page = _vllm_dp2(VLLM_PAGE)
    other = page.replace('model_name="tiny"', 'model_name="big"')
    both = page + "\n".join(l for l in other.splitlines() if l.startswith("vllm:num_requests")) + "\n"
    assert parse_metrics(both, MetricsKind.VLLM).models == ("big", "tiny")
    assert parse_metrics(both, MetricsKind.VLLM).waiting_requests == 6
    m = parse_metrics(both, MetricsKind.VLLM, model="tiny")
    assert m.models == ("tiny",) and m.waiting_requests == 3
    with pytest.raises(EngineMetricsError) as e:
        parse_metrics(page, MetricsKind.VLLM, model="llama")
    assert e.value.cause is MetricsFailure.WRONG_MODEL and "'tiny'" in e.value.detail


# -------------------------------------------------------------- fetch and scraper


class Page:
    """What the loopback server answers: a body, a status, or a delay."""

    def __init__(self) -> None:
        self.body: bytes = VLLM_PAGE.encode()
        self.status = 200
        self.delay_s = 0.0
        self.hits = 0
        self.accept_encoding: str | None = None  # the last request's


@pytest.fixture
async def served():
    page = Page()

    async def metrics(request: web.Request) -> web.Response:
        page.hits += 1
        page.accept_encoding = request.headers.get("Accept-Encoding")
        if page.delay_s:
            await asyncio.sleep(page.delay_s)
        return web.Response(body=page.body, status=page.status, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    async with aiohttp.ClientSession() as session:
        yield page, str(srv.make_url("/metrics")), session
    await srv.close()


@pytest.mark.integration
async def test_fetch_reads_the_page_and_reports_transfer_failures(served, port):
    page, url, session = served
    m = await fetch_metrics(session, url, MetricsKind.VLLM)
    assert m.kv_capacity_tokens == 131072
    assert page.accept_encoding == "identity"  # no gzip for the engine to make and us to undo

    async def cause(**kw) -> MetricsFailure:
        with pytest.raises(EngineMetricsError) as e:
            await fetch_metrics(session, kw.pop("url", url), MetricsKind.VLLM, **kw)
        return e.value.cause

    assert await cause(max_bytes=1000) is MetricsFailure.TOO_LARGE
    page.status = 500
    assert await cause() is MetricsFailure.HTTP_STATUS
    page.status, page.body = 200, b"\xff\xfe garbage"
    assert await cause() is MetricsFailure.NOT_PROMETHEUS
    page.body, page.delay_s = VLLM_PAGE.encode(), 1.0
    assert await cause(timeout_s=0.1) is MetricsFailure.TIMEOUT
    # nothing listens on a fresh free port
    assert await cause(url=f"http://127.0.0.1:{port}/metrics") is MetricsFailure.UNREACHABLE


class Recorder:
    """A consumer that keeps what it was told."""

    def __init__(self) -> None:
        self.readings: list[tuple[EngineMetrics, float]] = []
        self.failures: list[tuple[MetricsFailure, str]] = []
        self.changed = asyncio.Event()

    def on_metrics(self, metrics: EngineMetrics, now: float) -> None:
        self.readings.append((metrics, now))
        self.changed.set()

    def on_failure(self, cause: MetricsFailure, detail: str) -> None:
        self.failures.append((cause, detail))
        self.changed.set()

    async def until(self, pred, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not pred():
                self.changed.clear()
                await self.changed.wait()


@pytest.mark.integration
async def test_scraper_follows_a_changing_page(served):
    page, url, session = served
    rec = Recorder()
    async with MetricsScraper(url, MetricsKind.VLLM, session, rec, interval_s=0.02) as sc:
        assert sc.state is ScraperState.RUNNING
        await rec.until(lambda: len(rec.readings) >= 1)
        assert rec.readings[0][0].waiting_requests == 0
        page.body = _set(VLLM_PAGE, "vllm:num_requests_waiting", "12.0").encode()
        await rec.until(lambda: rec.readings[-1][0].waiting_requests == 12)
        first = rec.readings[0][0]
        page.body = _set(VLLM_PAGE, "process_start_time_seconds", "1796300000.0").encode()
        await rec.until(lambda: rec.readings[-1][0].start_time_s == 1796300000.0)
        assert rec.readings[-1][0].restarted_since(first)
        now = rec.readings[-1][1]
        assert sc.latest is rec.readings[-1][0] and sc.last_ok == now
        assert sc.fresh(now) is sc.latest and not sc.is_stale(now)
    assert sc.state is ScraperState.CLOSED and not session.closed  # the session is the caller's
    assert rec.failures == [] and sc.consecutive_failures == 0
    times = [t for _, t in rec.readings]
    assert times == sorted(times)


@pytest.mark.integration
async def test_scraper_reports_each_failure_logs_each_cause_once_and_recovers(served, caplog):
    page, url, session = served
    rec = Recorder()
    caplog.set_level(logging.DEBUG, logger="radixfleet.engines.metrics")
    page.body = b"<html>maintenance</html>"
    async with MetricsScraper(
        url, MetricsKind.VLLM, session, rec, interval_s=0.01, timeout_s=0.2, name="w0"
    ) as sc:
        await rec.until(lambda: len(rec.failures) >= 3)
        page.body, page.status = VLLM_PAGE.encode(), 500
        n = len(rec.failures)
        await rec.until(
            lambda: len(rec.failures) >= n + 3 and rec.failures[-1][0] is MetricsFailure.HTTP_STATUS
        )
        page.status = 200
        await rec.until(lambda: len(rec.readings) >= 1)
        assert sc.consecutive_failures == 0 and sc.fresh(rec.readings[-1][1]) is not None
        page.body = b"# HELP up x\nup 1\n"
        await rec.until(lambda: rec.failures[-1][0] is MetricsFailure.MISSING_SERIES)
    causes = [c for c, _ in rec.failures]
    assert causes.count(MetricsFailure.NOT_PROMETHEUS) >= 3
    assert causes.count(MetricsFailure.HTTP_STATUS) >= 3
    assert sc.failures[MetricsFailure.NOT_PROMETHEUS] == causes.count(MetricsFailure.NOT_PROMETHEUS)
    assert sum(sc.failures.values()) == len(rec.failures)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(r.args[1] for r in warnings) == ["http_status", "missing_series", "not_prometheus"]
    assert all(r.args[0] == "w0" for r in warnings)
    assert sc.last_failure[0] is MetricsFailure.MISSING_SERIES


@pytest.mark.integration
async def test_timeouts_make_the_reading_stale(served):
    page, url, session = served
    rec = Recorder()
    clock_now = [1000.0]
    sc = MetricsScraper(
        url,
        MetricsKind.VLLM,
        session,
        rec,
        interval_s=0.02,
        timeout_s=0.05,
        stale_after_s=3.0,
        clock=lambda: clock_now[0],
    )
    assert sc.fresh(1000.0) is None  # nothing read yet
    await sc.start()
    try:
        await rec.until(lambda: len(rec.readings) >= 1)
        assert rec.readings[0][1] == 1000.0 and sc.last_ok == 1000.0
        page.delay_s = 1.0
        n = len(rec.readings)
        clock_now[0] = 1002.0
        await rec.until(lambda: len(rec.failures) >= 2)
        assert {c for c, _ in rec.failures} == {MetricsFailure.TIMEOUT}
        assert len(rec.readings) in (n, n + 1)  # at most one scrape was already in flight
        last = sc.last_ok
        assert sc.fresh(last + 3.0) is sc.latest  # exactly stale_after_s old: still fresh
        assert sc.fresh(last + 3.001) is None and sc.is_stale(last + 3.001)
        assert sc.latest is not None  # the old reading is kept, only marked stale
    finally:
        await sc.aclose()


@pytest.mark.integration
async def test_a_failing_consumer_does_not_stop_the_loop(served, caplog):
    page, url, session = served

    class Broken(Recorder):
        def on_metrics(self, metrics, now):
            super().on_metrics(metrics, now)
            raise RuntimeError("consumer bug")

    rec = Broken()
    async with MetricsScraper(url, MetricsKind.VLLM, session, rec, interval_s=0.01):
        await rec.until(lambda: len(rec.readings) >= 3)
    assert any("consumer" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


@pytest.mark.integration
async def test_lifecycle_is_explicit(served):
    page, url, session = served
    rec = Recorder()
    sc = MetricsScraper(url, MetricsKind.VLLM, session, rec, interval_s=10.0)
    assert sc.state is ScraperState.NEW
    await sc.aclose()  # before start: closes, idempotent
    await sc.aclose()
    assert sc.state is ScraperState.CLOSED
    with pytest.raises(RuntimeError, match="start\\(\\) is called once"):
        await sc.start()
    sc = MetricsScraper(url, MetricsKind.VLLM, session, rec, interval_s=10.0)
    await sc.start()
    with pytest.raises(RuntimeError):
        await sc.start()
    await rec.until(lambda: len(rec.readings) == 1)  # the first scrape is immediate
    await sc.aclose()
    await sc.aclose()
    assert page.hits == 1
    with pytest.raises(ValueError):
        MetricsScraper("127.0.0.1:8000/metrics", MetricsKind.VLLM, session, rec)
    with pytest.raises(ValueError):
        MetricsScraper(url, MetricsKind.VLLM, session, rec, interval_s=0)
    with pytest.raises(ValueError):
        MetricsScraper(url, "llama.cpp", session, rec)


def test_only_the_lines_read_reach_the_parser():
    # Not a timing assertion: only that the filter hands the parser a handful of lines.
    from radixfleet.engines import engine_metrics as em

    lines = em.select_lines(VLLM_PAGE, em._NAMES[MetricsKind.VLLM])
    assert 5 <= len(lines) <= 15 < len(VLLM_PAGE.splitlines())
    assert all(not math.isnan(float(l.rsplit(" ", 1)[1])) for l in lines)


def test_a_model_with_only_some_series_is_missing_series():
    page = VLLM_PAGE + 'vllm:num_requests_waiting{engine="0",model_name="big"} 1.0\n'
    with pytest.raises(EngineMetricsError) as e:
        parse_metrics(page, MetricsKind.VLLM, model="big")
    assert e.value.cause is MetricsFailure.MISSING_SERIES
    assert "vllm:num_requests_running" in e.value.detail


@pytest.mark.parametrize("seed", range(4))
def test_mangled_pages_raise_only_engine_metrics_errors(seed):
    """Seeded random edits of the real page's lines: a reading or a refusal, never
    another exception (a peer's page must not crash the router)."""
    import random

    rng = random.Random(seed)
    lines = VLLM_PAGE.splitlines()
    alphabet = '{}"=, \t\\#abc019.eE+-:_NaInf\x00é'
    outcomes = set()
    for _ in range(300):
        page = list(lines)
        for _ in range(rng.randint(1, 5)):
            j = rng.randrange(len(page))
            s = page[j]
            if (
                s.startswith(("vllm:num_req", "vllm:kv_cache", "vllm:cache_config", "vllm:prefix"))
                or rng.random() < 0.1
            ):
                k = rng.randrange(len(s) + 1)
                op = rng.random()
                s = (
                    s[:k] + rng.choice(alphabet) + s[k:]
                    if op < 0.4
                    else s[:k] + s[k + 1 :]
                    if op < 0.7
                    else s.replace("tiny", "x")
                    if op < 0.8
                    else s[:k]
                )
            page[j] = s
        try:
            m = parse_metrics("\n".join(page), MetricsKind.VLLM, model=rng.choice([None, "tiny"]))
        except EngineMetricsError as e:
            outcomes.add(e.cause)
        else:
            assert m.waiting_requests >= 0 and 0.0 <= m.kv_usage <= 1.0
            outcomes.add("ok")
    assert "ok" in outcomes and len(outcomes) >= 2  # both readings and refusals seen


def _parser_samples(lines: list[str]) -> dict:
    """What prometheus_client's own parser reads from ``lines``: samples by name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_every_sample_line_of_the_live_page_reads_as_the_parser_reads_it():
    """The plain-shape reader against prometheus_client on all ~600 lines of the
    recorded vLLM page (not only the series the router reads): names, labels, values
    and their types (int where the text is one) agree, and the page is read without
    the parser at all."""
    from radixfleet.engines import engine_metrics as em

    lines = [l for l in VLLM_PAGE.splitlines() if l and not l.startswith("#")]
    assert len(lines) > 300
    for line in lines:
        assert em._PLAIN_SAMPLE.fullmatch(line), line  # every vLLM line is of the plain shape
    got, want = em._parse(lines), _parser_samples(lines)
    assert got == want
    assert [type(v) for rows in got.values() for _, v in rows] == [
        type(v) for rows in want.values() for _, v in rows
    ]


@pytest.mark.parametrize(
    "line",
    [
        'm{a="x\\"y",b="z"} 1',  # an escaped quote: the parser's
        'm{a="x\\\\y"} 2.5',  # an escaped backslash
        'm{a="x\\ny"} 3',  # an escaped line feed
        'm{a="1",a="2"} 4',  # a label given twice
        "m 1_000",  # an underscore: the parser refuses it
        'm{a="1"} 5 1700000000000',  # a timestamp: dropped
        "m +Inf",
        "m -1e-3",
        'm{a="1",} 7',  # a trailing comma
        'm{ a="1"} 8',  # a space inside the braces
    ],
)
def test_lines_of_other_shapes_read_as_the_parser_reads_them(line):
    from radixfleet.engines import engine_metrics as em

    try:
        want = _parser_samples([line])
    except Exception:
        with pytest.raises(EngineMetricsError) as e:
            em._parse([line])
        assert e.value.cause is MetricsFailure.NOT_PROMETHEUS
        return
    assert em._parse([line]) == want


def test_lines_are_found_by_their_exact_name_at_a_line_start():
    from radixfleet.engines import engine_metrics as em

    page = (
        "# HELP a_b help\n# TYPE a_b gauge\n"
        'a_b{x="1"} 1\r\n'  # CRLF: the CR is not part of the line
        "a_bc 2\n"  # a longer name
        "xa_b 3\n"  # the name inside another
        "a_b\t4\n"
        "a_b 5"  # no final line feed
    )
    assert em.select_lines(page, ("a_b",)) == ['a_b{x="1"} 1', "a_b\t4", "a_b 5"]
    assert em.select_lines(page, ("a_bc", "zz")) == ["a_bc 2"]
