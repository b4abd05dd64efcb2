"""Tenancy attacks on a live router process: clients behind a trusted gateway send
thousands of distinct tenant names (metric labels must stay bounded: tenancy.top_n
named, the rest ``other``), priority headers that name no class (400) or claim a
class above their tenant's (served at its own, counted), and a rate-limited tenant
floods (429 with the x-ratelimit-* headers) — while another tenant keeps being
served, RSS and descriptors settle, nothing >= 500 is answered and nothing is
logged as a traceback.

In front of a live agent, a token-limited tenant sends what its limit must see
through: chat streams bounded by ``max_completion_tokens`` with a
``max_tokens`` of 1, hung up before their end (the engine generates what it is
charged for: at most the burst plus the refill, plus one request's output); a
request the worker refuses with 400 and one far above the burst (the tenant's next
requests are served at once, not refused for as long as the debt lasts)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.harness.router_process import RouterProcess

pytestmark = pytest.mark.integration

TOP_N = 5
#: the agent's KV pool: a prompt above it is refused with 400 context_length_exceeded
AGENT_KV_TOKENS = 4000


@pytest.fixture(scope="module")
def upstream():
    port = free_port()
    argv = ["python3", "-m", "radixfleet_tools.bench.proxy", "upstream", "--port", str(port), "--chunks", "2"]
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
        page = httpx.get(f"{r.admin}/metrics", timeout=10).text
        labels = set(re.findall(r'radixfleet_tenant_requests_total\{[^}]*tenant="([^"]*)"', page))
        assert len(labels) <= TOP_N + 1 and "other" in labels, labels
        refused = re.findall(r"radixfleet_priority_claims_refused_total\{[^}]*\} (\S+)", page)
        assert sum(float(x) for x in refused) >= 100, refused
        r.assert_settles(base)
    r.assert_no_tracebacks()


# -- token limits in front of an agent ----------------------------------------------------


@pytest.fixture(scope="module")
def agent():
    """A simulated engine that decodes fast (8-way tensor parallel on an H200, ~0.4 ms
    a token) and obeys max_completion_tokens over max_tokens, as vLLM's chat does."""
    port = free_port()
    argv = radixfleet_argv(
        "agent", "--port", str(port), "--gpu", "h200", "--tp", "8",
        "--kv-tokens", str(AGENT_KV_TOKENS), "--served-model-name", "m",
    )  # fmt: skip
    with Proc(argv, ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def _limits_config(agent: str, tenants: str) -> str:
    return (
        "listen: {host: 127.0.0.1, port: {port}}\n"
        f"workers: [{{url: {agent}, id: a}}]\n"
        "keys: {tenant: {source: header, header: x-tenant-id}}\n"
        f"tenancy:\n  tenants:\n{tenants}"
        "warmup: {enabled: false}\nreload: {watch: false}\n"
    )


def _generated(agent: str) -> float:
    """The tokens the agent has generated so far (its sglang:generation_tokens)."""
    page = httpx.get(f"{agent}/metrics", timeout=10).text
    m = re.search(r"^sglang:generation_tokens(?:_total)?(?:\{[^}]*\})? (\S+)$", page, re.M)
    assert m is not None, page[:2000]
    return float(m.group(1))


def test_streams_bounded_by_max_completion_tokens_and_hung_up_stay_within_the_limit(agent):
    """600 tokens/min with a burst of 3,000; 30 chat streams (10 at a time) of
    max_tokens 1 and max_completion_tokens 300, each hung up at 250 tokens: each is
    charged its 300 (the field the engine obeys), not its max_tokens, so the engine
    generates at most the burst + the refill + one request's output (charged the
    prompt + 1, all 30 pass and it generates ~8,000)."""
    rate_per_s, burst, bound, hang_up = 10, 3000, 300, 250
    tenants = f"    capped: {{tokens_per_min: {rate_per_s * 60}, token_burst: {burst}}}\n"
    with RouterProcess(config=_limits_config(agent, tenants)) as r:
        url = f"{r.base}/v1/chat/completions"
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "count"}],
            "stream": True,
            "max_tokens": 1,
            "max_completion_tokens": bound,
        }
        statuses: list[int] = []

        async def one(c: httpx.AsyncClient) -> None:
            async with c.stream("POST", url, json=body, headers={"x-tenant-id": "capped"}) as resp:
                statuses.append(resp.status_code)
                if resp.status_code != 200:
                    await resp.aread()
                    return
                got = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:]).get("choices", []):
                            got += len(ch.get("delta", {}).get("content") or "") // 4  # 4 bytes a token
                    if got >= hang_up:
                        return  # the client hangs up: the router closes the worker's stream

        async def run() -> None:
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=10)) as c:
                for _ in range(3):
                    await asyncio.gather(*(one(c) for _ in range(10)))

        before = _generated(agent)
        t0 = time.monotonic()
        asyncio.run(asyncio.wait_for(run(), 120))
        elapsed = time.monotonic() - t0
        time.sleep(0.5)  # the aborted generations stop
        generated = _generated(agent) - before
        assert len(statuses) == 30 and set(statuses) <= {200, 429}, statuses
        budget = burst + rate_per_s * (elapsed + 0.5) + bound
        assert generated <= budget, (generated, budget, statuses.count(200))
        assert statuses.count(429) >= 15, statuses
    r.assert_no_tracebacks()


def _post(r: RouterProcess, tenant: str, prompt: str, **more) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, **more}
    return httpx.post(f"{r.base}/v1/completions", json=body, headers={"x-tenant-id": tenant}, timeout=60)


def test_a_request_the_worker_refuses_gives_its_tokens_back(agent):
    """6,000 tokens/min. A 5,000-token prompt the worker refuses (400
    context_length_exceeded: above its KV pool) gives its reservation back, so the
    tenant's next 2,004-token request is served at once (kept, it would wait 10 s)."""
    with RouterProcess(config=_limits_config(agent, "    free: {tokens_per_min: 6000}\n")) as r:
        refused = _post(r, "free", "p" * 20_000)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        nxt = _post(r, "free", "q" * 8_000, max_tokens=4)
        assert nxt.status_code == 200, (nxt.status_code, nxt.headers.get("Retry-After"), nxt.text)
        assert int(nxt.headers["x-ratelimit-remaining-tokens"]) >= 6000 - 2004 - 10
    r.assert_no_tracebacks()


def test_a_request_far_above_the_burst_is_refused_and_leaves_no_debt(agent):
    """A 1 MiB prompt (262,144 tokens) against 6,000 tokens/min is refused at the door
    (400 request_too_large, naming the burst) and the tenant's next request is served
    (admitted with a full bucket, the 400 from the worker would leave the tenant 43
    minutes of debt, every request of it refused meanwhile)."""
    with RouterProcess(config=_limits_config(agent, "    pro: {tokens_per_min: 6000}\n")) as r:
        huge = _post(r, "pro", "p" * 2**20)
        assert huge.status_code == 400, huge.text
        small = _post(r, "pro", "a short question", max_tokens=4)
        assert small.status_code == 200, (small.status_code, small.headers.get("Retry-After"), small.text)
        err = huge.json()["error"]
        assert err["code"] == "request_too_large" and "token burst of 6000" in err["message"], err
        assert "Retry-After" not in huge.headers and huge.headers["x-ratelimit-limit-tokens"] == "6000"
    r.assert_no_tracebacks()


@pytest.fixture(scope="module")
def slow_upstream():
    """An OpenAI-shaped worker that streams 400 one-token events 5 ms apart and
    reports no usage (it obeys no output bound either)."""
    port = free_port()
    argv = [
        "python3", "-m", "radixfleet_tools.bench.proxy", "upstream", "--port", str(port),
        "--chunks", "400", "--chunk-delay", "0.005",
    ]  # fmt: skip
    with Proc(argv, ready_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def test_an_unbounded_stream_hung_up_is_charged_the_tokens_it_relayed(slow_upstream):
    """A chat stream naming no bound (its reservation: the prompt alone), hung up
    after 60 tokens from an engine that sends no usage, is charged those 60: hanging
    up before the usage event is no way to stream past the limit."""
    tenants = "    capped: {tokens_per_min: 60, token_burst: 100000}\n"
    with RouterProcess(config=_limits_config(slow_upstream, tenants)) as r:
        h = {"x-tenant-id": "capped"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        got = 0
        with httpx.stream("POST", f"{r.base}/v1/chat/completions", json=body, headers=h, timeout=30) as resp:
            assert resp.status_code == 200
            left = int(resp.headers["x-ratelimit-remaining-tokens"])  # after its reservation
            for line in resp.iter_lines():
                got += line.startswith("data: {")
                if got >= 60:
                    break  # the client hangs up
        time.sleep(0.3)  # the router sees it gone at its next write
        nxt = httpx.post(
            f"{r.base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, headers=h
        )
        assert nxt.status_code == 200, nxt.text
        # the stream's 60+ tokens and this request's 2, less a few seconds' refill at 1/s
        drop = left - int(nxt.headers["x-ratelimit-remaining-tokens"])
        assert 60 <= drop <= 120, drop
    r.assert_no_tracebacks()
