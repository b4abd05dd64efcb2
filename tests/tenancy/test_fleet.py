"""Tenancy live: a router in-process in front of simulated agents
(tests/router/test_bad_input.py's ``fleet``). A tenant over its rate limit gets 429
with Retry-After and the x-ratelimit-* headers while another tenant is served; at
overload, sheddable requests absorb the shedding while critical ones are admitted, and
a tenant under its fair share is admitted while the heavy tenant is shed;
with the admission queue on, a request the shedder refuses waits, is served once there
is room, gets its 429 past max_wait, and leaves the queue (its tokens given back) when
its client goes away."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from radixfleet.wire.errors import Overloaded
from tests.router.fleet import fleet  # noqa: F401  (fleet: the fixture)

pytestmark = pytest.mark.integration

KEYS = {
    "tenant": {
        "source": "api_key",
        "api_keys": [
            {"tenant": "acme", "key": "k-acme", "name": "acme-chat"},
            {"tenant": "acme", "key": "k-batch", "name": "acme-batch"},
            {"tenant": "free", "key": "k-free"},
        ],
    }
}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sample(router, name: str, **labels) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_tenant_over_its_limit_gets_429_with_headers_while_another_is_served(fleet):  # noqa: F811
    await fleet.start(
        {
            "keys": KEYS,
            "tenancy": {
                "tenants": {
                    "free": {
                        "requests_per_s": 0.05,
                        "request_burst": 2,
                        "tokens_per_min": 6,
                        "token_burst": 1000,
                    }
                }
            },
        }
    )
    await fleet.agent("m")
    await fleet.routable(1)
    body = {"model": "m", "prompt": "a question from the free tier", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as c:
        url = fleet.base + "/v1/completions"
        for i in range(2):  # an admitted answer carries the limits too, as OpenAI's do
            r = await c.post(url, json=body, headers=auth("k-free"))
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "2"
            assert r.headers["x-ratelimit-remaining-requests"] == str(1 - i)
            assert r.headers["x-ratelimit-limit-tokens"] == "1000"
        r = await c.post(url, json=body, headers=auth("k-free"))
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "tenant free is over its rate limit" in err["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 20
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert r.headers["x-ratelimit-limit-tokens"] == "1000"
        # the two answers took their prompt and their 4 completion tokens each
        assert 1000 - 2 * 40 <= int(r.headers["x-ratelimit-remaining-tokens"]) <= 1000 - 2 * 5
        assert "x-request-id" in r.headers
        for _ in range(5):  # acme has no limit
            r = await c.post(url, json=body, headers=auth("k-acme"))
            assert r.status_code == 200, r.text
            assert not any(h.startswith("x-ratelimit-") for h in r.headers)
    router = fleet.router
    name = "radixfleet_tenant_requests_total"
    assert sample(router, name, tenant="free", priority="standard", outcome="limited") == 1
    assert sample(router, name, tenant="free", priority="standard", outcome="admitted") == 2
    assert sample(router, name, tenant="acme", priority="standard", outcome="admitted") == 5
    assert "radixfleet_tenant_requests_total{" in router.metrics.render().decode()


async def test_at_overload_sheddable_requests_absorb_the_shedding_and_critical_ones_are_admitted(
    fleet,  # noqa: F811
):
    """One slow agent; two critical clients in a closed loop next to sixteen
    sheddable ones that come back 20 ms after each 429 (every loop bounded in time
    and count)."""
    await fleet.start(
        {
            "keys": KEYS,
            "tenancy": {
                "keys": {"acme-chat": {"priority": "critical"}},
                # a critical request waits behind at most 10 typical requests' prefill
                "queue_scale": {"critical": 20.0, "standard": 1.0, "sheddable": 0.5},
            },
        }
    )
    await fleet.agent("m", gpu="l4")
    await fleet.routable(1)
    codes: dict[str, list[int]] = {"critical": [], "sheddable": []}
    url = fleet.base + "/v1/completions"
    deadline = time.monotonic() + 4.0

    async def client(c: httpx.AsyncClient, cls: str, n: int) -> None:
        headers = auth("k-acme") if cls == "critical" else {**auth("k-batch"), "x-radixfleet-priority": cls}
        for i in range(400):
            if time.monotonic() > deadline:
                return
            prompt = f"{cls} client {n} request {i}: " + "fresh words that no cache holds " * 60
            r = await c.post(url, json={"model": "m", "prompt": prompt, "max_tokens": 2}, headers=headers)
            codes[cls].append(r.status_code)
            if r.status_code == 429:
                await asyncio.sleep(0.02)

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
        await asyncio.gather(
            *(client(c, "critical", n) for n in range(2)), *(client(c, "sheddable", n) for n in range(16))
        )
    crit, shed = codes["critical"], codes["sheddable"]
    assert crit and set(crit) == {200}, crit
    assert shed.count(429) >= 5 and 200 in shed, (shed.count(200), shed.count(429))
    router = fleet.router
    name = "radixfleet_tenant_requests_total"
    assert sample(router, name, tenant="acme", priority="critical", outcome="shed") == 0
    assert sample(router, name, tenant="acme", priority="critical", outcome="admitted") == len(crit)
    assert sample(router, name, tenant="acme", priority="sheddable", outcome="shed") == shed.count(429)


async def test_at_overload_a_tenant_under_its_share_is_admitted_while_the_heavy_one_is_shed(
    fleet,  # noqa: F811
):
    """One slow agent; sixteen clients of tenant acme in a closed loop (back 20 ms
    after each 429) next to one client of tenant free sending a request every 0.2 s,
    all of one class (standard): free, far under its half of what is admitted, is
    shed as critical is (radixfleet.route.fair_share) and never shed here; acme takes the
    shedding."""
    await fleet.start(
        {
            "keys": KEYS,
            "tenancy": {"queue_scale": {"critical": 20.0, "standard": 1.0, "sheddable": 0.5}},
        }
    )
    await fleet.agent("m", gpu="l4")
    await fleet.routable(1)
    codes: dict[str, list[int]] = {"acme": [], "free": []}
    url = fleet.base + "/v1/completions"
    deadline = time.monotonic() + 4.0

    async def client(c: httpx.AsyncClient, tenant: str, n: int) -> None:
        key = "k-batch" if tenant == "acme" else "k-free"
        for i in range(400):
            if time.monotonic() > deadline:
                return
            prompt = f"{tenant} client {n} request {i}: " + "fresh words that no cache holds " * 60
            r = await c.post(url, json={"model": "m", "prompt": prompt, "max_tokens": 2}, headers=auth(key))
            codes[tenant].append(r.status_code)
            await asyncio.sleep(
                0.02 if tenant == "acme" and r.status_code == 429 else 0.2 if tenant == "free" else 0
            )

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
        await asyncio.gather(*(client(c, "acme", n) for n in range(16)), client(c, "free", 0))
    heavy, light = codes["acme"], codes["free"]
    assert len(light) >= 5 and set(light) == {200}, light
    assert heavy.count(429) >= 5 and 200 in heavy, (heavy.count(200), heavy.count(429))
    router = fleet.router
    promoted = "radixfleet_tenant_promoted_total"
    assert sample(router, promoted, tenant="free") >= len(light) - 1  # all but the very first
    assert sample(router, promoted, tenant="acme") <= 2  # at most its first few, before free's
    name = "radixfleet_tenant_requests_total"
    assert sample(router, name, tenant="free", priority="standard", outcome="admitted") == len(light)


class Gate:
    """The shedder's verdict, switched by the test: every worker saturated or not."""

    def __init__(self) -> None:
        self.closed = True

    def check(self, *args):
        return Overloaded("every worker is saturated", retry_after_s=3.0) if self.closed else None


def waited(router, outcome: str) -> float:
    """Standard requests that left the admission queue with ``outcome``."""
    name = "radixfleet_admission_queue_wait_seconds_count"
    return sample(router, name, priority="standard", outcome=outcome)


async def until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


async def test_at_saturation_requests_wait_in_the_queue_and_a_client_gone_leaves_it(fleet):  # noqa: F811
    await fleet.start(
        {
            "keys": KEYS,
            "tenancy": {
                "queue": {"max_wait_s": 1.5},
                "tenants": {"free": {"tokens_per_min": 6, "token_burst": 100_000}},
            },
        }
    )
    await fleet.agent("m")
    await fleet.routable(1)
    router = fleet.router
    dp = router.dataplane
    q = dp.queue
    gate = Gate()
    dp.route.use_shedder(gate)
    body = {"model": "m", "prompt": "a question while the fleet is saturated", "max_tokens": 4}
    url = fleet.base + "/v1/completions"
    limit = dp.tenancy._tenants["free"][1].tokens
    full = limit.remaining()
    async with httpx.AsyncClient(timeout=30) as c:
        waiting = asyncio.ensure_future(c.post(url, json=body, headers=auth("k-acme")))
        await until(lambda: q.waiting == 1)
        # a client that gives up while queued: it leaves the queue, its tokens come back
        async with httpx.AsyncClient(timeout=0.3) as impatient:
            with pytest.raises(httpx.TimeoutException):
                await impatient.post(url, json=body, headers=auth("k-free"))
        await until(lambda: q.waiting == 1)
        q.check()
        assert limit.remaining() == full
        assert (
            sample(
                router, "radixfleet_admission_queue_wait_seconds_count", priority="standard", outcome="left"
            )
            == 1
        )
        gate.closed = False  # room: the backstop lets the waiter in
        r = await waiting
        assert r.status_code == 200, r.text
        assert q.waiting == 0
        q.check()
        # past max_wait: the 429 the shedder gave, with its Retry-After
        gate.closed = True
        t0 = time.monotonic()
        r = await c.post(url, json=body, headers=auth("k-acme"))
        assert r.status_code == 429, r.text
        assert time.monotonic() - t0 >= 1.5
        assert r.headers["Retry-After"] == "3"
    assert q.waiting == 0
    q.check()
    assert (
        sample(
            router, "radixfleet_admission_queue_wait_seconds_count", priority="standard", outcome="admitted"
        )
        == 1
    )
    assert (
        sample(
            router, "radixfleet_admission_queue_wait_seconds_count", priority="standard", outcome="expired"
        )
        == 1
    )
    assert sample(router, "radixfleet_shed_total") == 1
