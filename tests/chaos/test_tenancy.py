"""Tenancy attacks on a live router process: clients behind a trusted gateway send
thousands of distinct tenant names (metric labels must stay bounded: tenancy.top_n
named, the rest ``other``), priority headers that name no class (400) or claim a
class above their tenant's (served at its own, counted), and a rate-limited tenant
floods (429 with the x-ratelimit-* headers) — while another tenant keeps being
served, RSS and descriptors settle, nothing >= 500 is answered and nothing is
logged as a traceback."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.chaos.harness import RouterProcess
from tests.procs import Proc, free_port

pytestmark = pytest.mark.integration

TOP_N = 5


@pytest.fixture(scope="module")
def upstream():
    port = free_port()
    argv = ["python3", "-m", "radixfleet.bench.proxy", "upstream", "--port", str(port), "--chunks", "2"]
    with Proc(argv, ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def _config(upstream: str) -> str:
    return (
        "listen: {host: 127.0.0.1, port: {port}}\n"
        f"workers: [{{url: {upstream}, id: up}}]\n"
        "keys: {tenant: {source: header, header: x-tenant-id}}\n"
        "tenancy:\n"
        f"  top_n: {TOP_N}\n"
        "  tenants:\n"
        "    capped: {requests_per_s: 0.5, request_burst: 2}\n"
        "    steady: {priority: standard}\n"
        "warmup: {enabled: false}\nreload: {watch: false}\n"
    )


def test_many_tenants_bad_priority_claims_and_a_flooding_tenant_stay_bounded(upstream):
    with RouterProcess(config=_config(upstream)) as r:
        url = f"{r.base}/v1/completions"
        body = {"model": "tiny", "prompt": "p" * 64, "max_tokens": 2}

        async def warm() -> None:  # the upstream keep-alive pool at the probe's concurrency
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=32)) as c:
                rs = await asyncio.gather(
                    *(c.post(url, json=body, headers={"x-tenant-id": "steady"}) for _ in range(64))
                )
            assert {x.status_code for x in rs} == {200}

        async def probe() -> tuple[dict[int, int], list[httpx.Response], list[int]]:
            statuses: dict[int, int] = {}
            limited: list[httpx.Response] = []
            steady: list[int] = []
            sem = asyncio.Semaphore(32)
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=32)) as c:

                async def one(i: int) -> None:
                    kind = i % 4
                    if kind == 0:
                        h = {"x-tenant-id": f"tenant-{i}"}  # a new tenant each time
                    elif kind == 1:
                        h = {
                            "x-tenant-id": f"tenant-{i}",
                            "x-radixfleet-priority": ("vip", "critical")[i % 8 == 1],
                        }
                    elif kind == 2:
                        h = {"x-tenant-id": "capped"}
                    else:
                        h = {"x-tenant-id": "steady"}
                    async with sem:
                        resp = await c.post(url, json=body, headers=h)
                    statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
                    if kind == 2 and resp.status_code == 429:
                        limited.append(resp)
                    if kind == 3:
                        steady.append(resp.status_code)

                await asyncio.gather(*(one(i) for i in range(1200)))
            return statuses, limited, steady

        asyncio.run(warm())
        base = r.resources()
        statuses, limited, steady = asyncio.run(probe())
        assert set(statuses) <= {200, 400, 429}, statuses
        assert set(steady) == {200}, steady
        assert len(limited) >= 250, len(limited)
        h = limited[0].headers
        assert h["x-ratelimit-limit-requests"] == "2" and int(h["Retry-After"]) >= 1, h
        assert limited[0].json()["error"]["code"] == "rate_limit_exceeded"
        page = httpx.get(f"{r.base}/metrics", timeout=10).text
        labels = set(re.findall(r'radixfleet_tenant_requests_total\{[^}]*tenant="([^"]*)"', page))
        assert len(labels) <= TOP_N + 1 and "other" in labels, labels
        refused = re.findall(r"radixfleet_priority_claims_refused_total\{[^}]*\} (\S+)", page)
        assert sum(float(x) for x in refused) >= 100, refused
        r.assert_settles(base)
    r.assert_no_tracebacks()
