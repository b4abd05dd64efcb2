"""The router's own per-worker, per-model series (radixfleet.server.metrics): prompt and cached
tokens from every answer's usage, tries by outcome, the workers' reported load —
what the dashboard reads for any pool, agents or engines alike."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.fleet import fleet, until  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration

PROMPT = "system: you are a careful assistant. " * 40


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(page: dict, name: str, **labels) -> float:
    return sum(v for (n, lb), v in page.items() if n == name and all((k, x) in lb for k, x in labels.items()))


async def test_usage_tokens_and_outcomes_per_worker_and_model(fleet):  # noqa: F811
    await fleet.start({})
    await fleet.agent("m", worker_id="ag")
    await fleet.routable(1)
    async with httpx.AsyncClient(timeout=30) as c:
        prompt_tokens = cached = 0
        for i in range(3):
            body = {"model": "m", "prompt": PROMPT + f"turn {i}", "max_tokens": 4}
            r = await c.post(fleet.base + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            prompt_tokens += u["prompt_tokens"]
            cached += u["prompt_tokens_details"]["cached_tokens"]
        # a stream whose client did not ask for usage: the router asks, and counts it
        body = {"model": "m", "prompt": PROMPT + "turn 3", "max_tokens": 4, "stream": True}
        async with c.stream("POST", fleet.base + "/v1/completions", json=body) as r:
            events = [json.loads(ln[6:]) async for ln in r.aiter_lines() if ln.startswith("data: {")]
        assert not any(e.get("usage") for e in events)  # hidden from the client
        await until(lambda: fleet.router.pool.get("ag").load is not None, what="a load report")
        page = samples((await c.get(fleet.admin + "/metrics")).text)
    assert value(page, "radixfleet_worker_requests_total", worker="ag", model="m", outcome="answered") == 4
    p = value(page, "radixfleet_prompt_tokens_total", worker="ag", model="m")
    k = value(page, "radixfleet_cached_tokens_total", worker="ag", model="m")
    assert p > prompt_tokens and cached > 0 and k > cached  # the stream's usage counted too
    assert k < p
    assert value(page, "radixfleet_ttft_seconds_count") == 1  # the one stream
    assert ("radixfleet_worker_queued_requests", frozenset({("worker", "ag")})) in page
    assert ("radixfleet_worker_running_requests", frozenset({("worker", "ag")})) in page
    assert 0 <= page[("radixfleet_worker_kv_used_ratio", frozenset({("worker", "ag")}))] <= 1


async def test_a_failed_worker_and_a_client_gone_are_outcomes(fleet):  # noqa: F811
    await fleet.start({})
    m = fleet.router.metrics
    m.answered("w", "m", False, None)
    m.answered("w", "m", None, None)
    m.answered("w", "m", True, (100, 64))
    page = samples(m.render().decode())
    assert value(page, "radixfleet_worker_requests_total", outcome="failed") == 1
    assert value(page, "radixfleet_worker_requests_total", outcome="gone") == 1
    assert value(page, "radixfleet_prompt_tokens_total", worker="w") == 100
    assert value(page, "radixfleet_cached_tokens_total", worker="w") == 64
