"""``POST /v1/prefetch`` (radixfleet.server.prefetch): the budget and the used/wasted ledger
(fast), and a router in front of in-process agents: a prefetch warms the worker the
real request then goes to, whose cached tokens come from it; a repeat is
deduplicated; bad input, an unserved model, a spent budget and a tenant over its
rate limit (a prefetch is charged as the request it sends) are answered in the data
plane's error shape with nothing warmed; prefetches do not teach the shedder its
typical request."""

from __future__ import annotations

import asyncio
import math
import os
import time

import httpx
import pytest

from radixfleet.keys import Endpoint, request_key
from radixfleet.route.admission_queue import AdmissionQueueConfig
from radixfleet.route.shedding import Shedder
from radixfleet.server.prefetch import PREFETCH_PATH, PrefetchBudget, PrefetchLedger
from radixfleet.wire.errors import Overloaded, WorkloadError
from radixfleet_tools.loadtest.client import Result, Target
from radixfleet_tools.loadtest.workloads import make_workload
from tests.router.fleet import Fleet, fleet, until  # noqa: F401 - fleet: the fixture

# ================================================================ budget


def test_budget_starts_full_and_refills_at_its_rate():
    b = PrefetchBudget()
    assert b.take("t", 2000, rate=1000, burst_s=2, now=0.0) is None  # the burst: 2 s of rate
    wait = b.take("t", 500, rate=1000, burst_s=2, now=0.0)
    assert wait == pytest.approx(0.5)  # nothing taken by a refusal
    assert b.take("t", 500, rate=1000, burst_s=2, now=0.5) is None
    assert b.spent == 2500
    b.check()


def test_budget_never_holds_more_than_its_burst():
    b = PrefetchBudget()
    b.take("t", 0, rate=100, burst_s=1, now=0.0)
    assert b.take("t", 101, rate=100, burst_s=1, now=1000.0) == math.inf  # never fits
    assert b.take("t", 100, rate=100, burst_s=1, now=1000.0) is None
    assert b.take("t", 1, rate=100, burst_s=1, now=1000.0) == pytest.approx(0.01)


def test_zero_share_refuses_every_prefetch():
    assert PrefetchBudget().take("t", 1, rate=0.0, burst_s=2, now=0.0) == math.inf


def test_one_tenants_flood_spends_its_own_part_never_anothers():
    b = PrefetchBudget()
    now = 0.0
    while b.take("flood", 100, rate=1000, burst_s=2, now=now) is None:  # alone: all 2000
        now += 0.001
    assert b.spent == pytest.approx(2000, abs=200)
    # a second tenant arrives: its own bucket, full at its half of the rate
    assert b.take("light", 1000, rate=1000, burst_s=2, now=now) is None
    assert b.take("light", 1, rate=1000, burst_s=2, now=now) == pytest.approx(0.002)
    # the flood refills at its half only: 0.1 s gives it 50 tokens, not 100
    assert b.take("flood", 100, rate=1000, burst_s=2, now=now + 0.1) is not None
    assert b.take("flood", 50, rate=1000, burst_s=2, now=now + 0.1) is None
    b.check()


def test_parts_follow_the_fair_share_weights_and_idle_tenants_are_forgotten():
    b = PrefetchBudget({"gold": 3.0})
    assert b.take("gold", 1, rate=400, burst_s=1, now=0.0) is None
    # with gold active, a weight-1 tenant holds a quarter: 100 tokens
    assert b.take("tin", 101, rate=400, burst_s=1, now=0.0) == math.inf
    assert b.take("tin", 100, rate=400, burst_s=1, now=0.0) is None
    assert len(b) == 2
    # a burst later nobody else tried: gold alone again, full at the whole 400
    assert b.take("gold", 400, rate=400, burst_s=1, now=5.0) is None
    assert len(b) == 1
    b.configure(AdmissionQueueConfig())  # a reload: gold's weight back to 1
    b.check()


def test_budget_holds_at_most_max_tenants_buckets():
    b = PrefetchBudget(max_tenants=3)
    for i in range(10):
        assert b.take(f"t{i}", 1, rate=1e6, burst_s=60, now=i * 1e-3) is None
        b.check()
    assert len(b) == 3


# ================================================================ ledger


def test_ledger_counts_used_once_per_warmed_prefix():
    led = PrefetchLedger()
    led.warmed("w0", 11, now=0.0)
    led.warmed("w1", 22, now=0.0)
    assert led.observe("w1", [5, 11]) == 0  # another worker's prefix
    assert led.observe("w0", [5, 11, 12]) == 1  # covers w0's warmed prefix
    assert led.observe("w0", [11]) == 0  # closed: counted once
    assert len(led) == 1


def test_ledger_sweep_splits_wasted_into_evicted_and_unused():
    led = PrefetchLedger()
    led.warmed("w0", 1, now=0.0)
    led.warmed("w0", 2, now=1.0)
    led.warmed("w0", 3, now=50.0)
    held = {("w0", 2)}
    assert led.sweep(40.0, 30.0, lambda h, k: (h, k) in held) == (1, 1)
    assert len(led) == 1  # the young one stays open
    assert led.observe("w0", [3]) == 1


def test_ledger_pending_does_not_close_and_sweep_asks_the_hinted_holder():
    led = PrefetchLedger()
    led.warmed("w0", 7, now=0.0, holder="w0#1")  # a data-parallel rank's entry
    assert led.pending("w0", [6, 7]) and not led.pending("w1", [7]) and not led.pending("w0", [6])
    assert led.pending("w0", [7])  # still open
    asked = []
    assert led.sweep(31.0, 30.0, lambda h, k: asked.append((h, k)) or True) == (0, 1)
    assert asked == [("w0#1", 7)]


def test_ledger_is_bounded():
    led = PrefetchLedger(max_tracked=2)
    assert led.warmed("w", 1, 0.0) == 0
    assert led.warmed("w", 2, 0.0) == 0
    assert led.warmed("w", 3, 0.0) == 1  # the oldest pushed out
    assert led.observe("w", [1, 2, 3]) == 2


# ====================================================== against agents

SYSTEM = "You answer from the documents below, citing them by number. " * 6


def rag_body(tag: str, model: str = "m") -> dict:
    docs = "\n".join(f"[{i}] Document {i} of {tag}: " + f"fact {i} about {tag}. " * 20 for i in range(3))
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{docs}\n\nQuestion: what does {tag} say?"},
        ],
        "max_tokens": 4,
    }


def counter(fleet: Fleet, outcome: str) -> float:
    return fleet.router.metrics.prefetch.labels(outcome)._value.get()


async def agents_fleet(fleet: Fleet, raw: dict | None = None) -> None:
    await fleet.start({"policy": {"name": "prefix_load"}, **(raw or {})})
    fleet.past_grace()
    for i in range(2):
        await fleet.agent("m", worker_id=f"ag{i}")
    await fleet.routable(2)


async def settled(fleet: Fleet) -> None:
    """Every prefetch's prefill answered (the load it counted released)."""
    await until(lambda: all(w.in_flight == 0 for w in fleet.router.pool), what="prefetches done")


@pytest.mark.integration
async def test_prefetch_warms_the_worker_the_real_request_then_uses(fleet):
    await agents_fleet(fleet)
    tag = os.urandom(6).hex()  # a prompt nobody has sent: its cache can only be the prefetch's
    body = rag_body(tag)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.base + PREFETCH_PATH, json=body)
        assert r.status_code == 202, r.text
        ans = r.json()
        assert ans["accepted"] is True and "deduplicated" not in ans  # no tenant: never said
        warmed = ans["worker"]
        await settled(fleet)
        assert counter(fleet, "warmed") == 1 and counter(fleet, "failed") == 0
        # a repeat is deduplicated against the index: nothing sent, the same answer
        again = await c.post(fleet.base + PREFETCH_PATH, json=body)
        assert again.status_code == 202 and again.json() == ans
        assert counter(fleet, "deduplicated") == 1 and counter(fleet, "warmed") == 1
        r = await c.post(fleet.base + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-radixfleet-worker"] == warmed
        usage = r.json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.8 * usage["prompt_tokens"], usage
        assert counter(fleet, "used") == 1
        # the control: the same shape of prompt, never prefetched, has nothing cached
        r = await c.post(fleet.base + "/v1/chat/completions", json=rag_body(os.urandom(6).hex()))
        cold = r.json()["usage"]
        assert cold["prompt_tokens_details"]["cached_tokens"] < 0.5 * cold["prompt_tokens"], cold
    assert counter(fleet, "used") == 1
    assert fleet.router.metrics.prefetch_tokens._value.get() > 0


@pytest.mark.integration
async def test_prefetches_do_not_teach_the_shedder_its_typical_request(fleet):
    """A prefetch is a max_tokens 1 warm-up whose whole prompt is uncached: the
    shedder's typical request (its queue bound's unit) is the real requests' size."""
    await agents_fleet(fleet)
    shedder = fleet.router.dataplane.shedder
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.base + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        typical = shedder.typical_s
        assert typical > 0
        for _ in range(3):
            r = await c.post(fleet.base + PREFETCH_PATH, json=rag_body(os.urandom(6).hex()))
            assert r.status_code == 202, r.text
    await settled(fleet)
    assert counter(fleet, "warmed") == 3
    assert shedder.typical_s == typical


@pytest.mark.integration
async def test_the_request_a_prefetch_was_made_for_is_not_shed(fleet, monkeypatch):
    """Its prefill was admitted as the prefetch's (radixfleet.server.prefetch): a fleet that
    sheds now refuses other requests, not this one."""
    await agents_fleet(fleet)
    body = rag_body(os.urandom(6).hex())
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.base + PREFETCH_PATH, json=body)
        assert r.status_code == 202, r.text
        warmed = r.json()["worker"]
        monkeypatch.setattr(Shedder, "check", lambda *a, **k: Overloaded("saturated (test)", retry_after_s=1))
        other = await c.post(fleet.base + "/v1/chat/completions", json=rag_body(os.urandom(6).hex()))
        assert_error(other, 429, "overloaded")
        r = await c.post(fleet.base + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-radixfleet-worker"] == warmed
    assert counter(fleet, "used") == 1


@pytest.mark.integration
async def test_a_prefix_prefetch_counts_used_when_its_request_goes_on(fleet):
    """The prefetched text ends where the question starts: the prefetch's last block
    holds the chat template's closing tokens, which the real request does not share;
    the prefetch is still counted used (marked by its last block but one)."""
    await agents_fleet(fleet)
    dp = fleet.router.dataplane
    ns = dp.tenants.namespace_of(dp.tenants.identify({})[0])
    system = {"role": "system", "content": f"{os.urandom(6).hex()} {SYSTEM}"}

    def bodies(n: int) -> tuple[dict, dict]:
        user = "x" * n
        known = {"model": "m", "messages": [system, {"role": "user", "content": user}]}
        return known, {"model": "m", "messages": [system, {"role": "user", "content": user + " why?"}]}

    def hashes(body: dict) -> list[int]:
        return request_key(Endpoint.CHAT, body, tenant=ns, block_bytes=dp.cfg.keys.block_bytes).hashes

    n = next(n for n in range(1000, 1200) if hashes(bodies(n)[0])[-1] not in hashes(bodies(n)[1]))
    known, real = bodies(n)
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.post(fleet.base + PREFETCH_PATH, json=known)).status_code == 202
        await settled(fleet)
        r = await c.post(fleet.base + "/v1/chat/completions", json={**real, "max_tokens": 2})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.8 * usage["prompt_tokens"], usage
    assert counter(fleet, "used") == 1


@pytest.mark.integration
async def test_prefetch_without_worker_ids_names_no_worker(fleet):
    await agents_fleet(fleet, {"response_headers": {"worker_id": False}})
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.base + PREFETCH_PATH, json=rag_body(os.urandom(6).hex()))
    assert r.status_code == 202
    assert r.json() == {"object": "prefetch", "accepted": True}
    assert "x-radixfleet-worker" not in r.headers
    await settled(fleet)


@pytest.mark.integration
async def test_a_tenant_is_told_of_its_own_deduplication_and_learns_nothing_of_anothers(fleet):
    """A tenant's clients share its cache by configuration: its repeat is deduplicated
    (said, and its tokens given back); the same text from another tenant is keyed in
    that tenant's own namespace and warmed for it."""
    keys = [{"tenant": "acme", "key": "k-acme"}, {"tenant": "beta", "key": "k-beta"}]
    limits = {"tokens_per_min": 0.001, "token_burst": 100_000}
    await agents_fleet(
        fleet,
        {
            "keys": {"tenant": {"source": "api_key", "api_keys": keys}},
            "tenancy": {"tenants": {"acme": limits}},
        },
    )
    acme, beta = {"Authorization": "Bearer k-acme"}, {"Authorization": "Bearer k-beta"}
    body = rag_body(os.urandom(6).hex())
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.base + PREFETCH_PATH, json=body, headers=acme)
        assert r.status_code == 202 and r.json()["deduplicated"] is False, r.text
        left = int(r.headers["x-ratelimit-remaining-tokens"])
        await settled(fleet)
        r = await c.post(fleet.base + PREFETCH_PATH, json=body, headers=acme)
        assert r.status_code == 202 and r.json()["deduplicated"] is True, r.text
        assert int(r.headers["x-ratelimit-remaining-tokens"]) >= left  # its tokens given back
        r = await c.post(fleet.base + PREFETCH_PATH, json=body, headers=beta)
        assert r.status_code == 202 and r.json()["deduplicated"] is False, r.text
    await settled(fleet)
    assert counter(fleet, "warmed") == 2 and counter(fleet, "deduplicated") == 1


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and isinstance(err["message"], str) and "type" in err, err


@pytest.mark.integration
async def test_bad_prefetches_are_refused_with_nothing_warmed(fleet):
    await agents_fleet(fleet)
    url = fleet.base + PREFETCH_PATH
    async with httpx.AsyncClient(timeout=30) as c:
        assert_error(await c.post(url, content=b"{not json"), 400, "malformed_request")
        assert_error(await c.post(url, json=[1, 2]), 400, "malformed_request")
        assert_error(await c.post(url, json={"model": "m"}), 400, "malformed_request")
        assert_error(await c.post(url, json={"model": "m", "messages": "hi"}), 400, "malformed_request")
        r = await c.post(url, json=rag_body("x", model="nobody-serves-this"))
        assert r.status_code == 404, r.text
        assert r.json()["error"]["type"] == "not_found_error" or r.json()["error"]["code"], r.text
    assert counter(fleet, "warmed") == 0
    assert all(w.in_flight == 0 for w in fleet.router.pool)


@pytest.mark.integration
async def test_prefetch_over_budget_is_429_and_warms_nothing(fleet):
    # 1e-6 of the fleet's prefill, 1 s of it: no prompt fits
    await agents_fleet(fleet, {"prefetch": {"share": 0.000001, "burst_s": 1.0}})
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.base + PREFETCH_PATH, json=rag_body(os.urandom(6).hex()))
        assert_error(r, 429, "overloaded")
        assert int(r.headers["Retry-After"]) >= 1
    assert counter(fleet, "warmed") == 0
    assert fleet.router.metrics.prefetch_dropped.labels("budget")._value.get() == 1
    assert all(w.in_flight == 0 for w in fleet.router.pool)


@pytest.mark.integration
async def test_a_prefetch_is_charged_to_its_tenants_rate_limits(fleet):
    """One request and its prompt + 1 token: over the limit it is a 429 with the
    x-ratelimit-* headers and nothing warmed, and it spent what a real request of the
    tenant would have had; another tenant is served."""
    keys = [{"tenant": "acme", "key": "k-acme"}, {"tenant": "free", "key": "k-free"}]
    limits = {"requests_per_s": 0.001, "request_burst": 2, "tokens_per_min": 0.001, "token_burst": 100_000}
    await agents_fleet(
        fleet,
        {
            "keys": {"tenant": {"source": "api_key", "api_keys": keys}},
            "tenancy": {"tenants": {"acme": limits}},
        },
    )
    acme = {"Authorization": "Bearer k-acme"}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.base + PREFETCH_PATH, json=rag_body(os.urandom(6).hex()), headers=acme)
        assert r.status_code == 202, r.text
        assert r.headers["x-ratelimit-remaining-requests"] == "1"
        spent = 100_000 - int(r.headers["x-ratelimit-remaining-tokens"])
        assert spent > 200  # the prompt's tokens (a few hundred) and the one generated
        r = await c.post(fleet.base + PREFETCH_PATH, json=rag_body(os.urandom(6).hex()), headers=acme)
        assert r.status_code == 202, r.text
        r = await c.post(fleet.base + PREFETCH_PATH, json=rag_body(os.urandom(6).hex()), headers=acme)
        assert_error(r, 429, "rate_limit_exceeded")
        assert r.headers["x-ratelimit-remaining-requests"] == "0" and "Retry-After" in r.headers
        await settled(fleet)
        assert counter(fleet, "warmed") == 2  # the refused one warmed nothing
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}
        r = await c.post(fleet.base + "/v1/completions", json=body, headers=acme)
        assert_error(r, 429, "rate_limit_exceeded")  # the prefetches spent the burst
        free = {"Authorization": "Bearer k-free"}
        r = await c.post(fleet.base + "/v1/completions", json=body, headers=free)
        assert r.status_code == 200, r.text
    tr = fleet.router.metrics.tenant_requests
    assert tr.labels("acme", "standard", "admitted")._value.get() == 2
    assert tr.labels("acme", "standard", "limited")._value.get() == 2


@pytest.mark.integration
async def test_prefetch_is_dropped_first_when_the_router_is_full(fleet):
    await agents_fleet(fleet, {"limits": {"max_concurrency": 1}})
    dp = fleet.router.dataplane
    dp.admission.active = 1  # a real request holds the only slot
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(fleet.base + PREFETCH_PATH, json=rag_body(os.urandom(6).hex()))
        assert_error(r, 429, "overloaded")
        assert "Retry-After" in r.headers
    finally:
        dp.admission.active = 0
    assert fleet.router.metrics.prefetch_dropped.labels("load")._value.get() == 1
    assert counter(fleet, "warmed") == 0
    await asyncio.sleep(0)


# ================================================ the load generator's RAG


def test_rag_knows_its_chunks_a_lead_ahead():
    w = make_workload("rag", {"requests": "3", "k": "2", "documents": "5", "lead_ms": "250"}, seed=1)
    for s in w.sessions():
        spec = s.first()
        assert spec.lead_s == pytest.approx(0.25)
        known, full = spec.prefetch["messages"], spec.body["messages"]
        assert known[0] == full[0]  # the shared system prompt
        assert full[1]["content"].startswith(known[1]["content"]) and len(full[1]["content"]) > len(
            known[1]["content"]
        )  # the chunks, then the question
    spec = make_workload("rag", {"requests": "1", "api": "completions"}).sessions()[0].first()
    assert spec.lead_s == pytest.approx(0.3)  # the default lead
    assert spec.body["prompt"].startswith(spec.prefetch["prompt"])
    spec = make_workload("rag", {"requests": "1", "lead_ms": "0"}).sessions()[0].first()
    assert spec.lead_s is None and spec.prefetch is None


@pytest.mark.parametrize("bad", ["-1", "60001", "x"])
def test_rag_lead_is_validated(bad):
    with pytest.raises(WorkloadError, match="lead_ms"):
        make_workload("rag", {"lead_ms": bad})


@pytest.mark.integration
async def test_loadtest_client_prefetches_at_retrieval_time(fleet):
    await agents_fleet(fleet)
    w = make_workload("rag", {"requests": "2", "k": "2", "documents": "4", "lead_ms": "200"}, seed=7)
    specs = [s.first() for s in w.sessions()]
    async with Target("t", fleet.base, prefetch=True) as t:
        await t.probe()
        r = Result(specs[0].id, specs[0].session, 0)
        t0 = time.monotonic()
        assert await t.send(specs[0], r) is not None, r.error
        assert time.monotonic() - t0 >= 0.2  # the lead waited out
    assert r.ok and r.prefetch_status == 202 and not r.prefetch_dedup
    # the real request found its chunks cached by the prefetch
    assert r.cached_tokens >= 0.7 * r.prompt_tokens, (r.cached_tokens, r.prompt_tokens)
    assert counter(fleet, "used") == 1
    async with Target("t", fleet.base, prefetch=False) as t:  # the baseline: no prefetch
        await t.probe()
        r = Result(specs[1].id, specs[1].session, 0)
        assert await t.send(specs[1], r) is not None, r.error
    assert r.ok and r.prefetch_status is None
    assert counter(fleet, "warmed") == 1
