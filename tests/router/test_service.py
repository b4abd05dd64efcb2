"""Router service integration tests on loopback: a real router (in-process, on a free
port) in front of real aiohttp upstreams (radixfleet_tools.bench.proxy.upstream_app,
in-process or as killable processes)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from aiohttp import web

from radixfleet.config import load_config, parse_config
from radixfleet.keys import Endpoint, request_key
from radixfleet.server.app import Router, RouterServer
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.bench.proxy import upstream_app
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from tests.router.serve import FAST_HEALTH, admin_base, start_app, start_router, upstream_proc, wait_ready

pytestmark = pytest.mark.integration


LONG_PROMPT = "You are a helpful assistant. " * 20  # several 128-byte blocks


@pytest.fixture
async def two_upstreams():
    runners, urls = [], []
    for i in range(2):
        r, u = await start_app(upstream_app(f"u{i}", chunks=5, model="m"))
        runners.append(r)
        urls.append(u)
    yield urls
    for r in runners:
        await r.cleanup()


# ------------------------------------------------------------------ data plane


@pytest.mark.parametrize("front", [True, False], ids=["raw_front", "aiohttp_app"])
async def test_openai_sdk_streams_and_non_streams(two_upstreams, front):
    router, runner, base = await start_router(
        {"workers": [{"url": u} for u in two_upstreams], "policy": {"name": "round_robin"}}, front=front
    )
    try:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        comp = await client.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=4)
        assert comp.choices[0].text == "ok"
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}]
        )
        assert chat.choices[0].message.content == "ok"
        stream = await client.completions.create(model="m", prompt=LONG_PROMPT, stream=True)
        texts = [c.choices[0].text async for c in stream]
        assert texts == ["x"] * 5
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        deltas = [c.choices[0].delta.content async for c in stream]
        assert deltas == ["x"] * 5
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
        await client.close()
        router.pool.check()
        assert all(w.in_flight == 0 and w.in_flight_tokens == 0 for w in router.pool)
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


async def test_headers_tenant_and_request_id_reach_worker(two_upstreams):
    router, runner, base = await start_router({"workers": [{"url": two_upstreams[0]}]})
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(
                base + "/v1/completions",
                json={"model": "m", "prompt": "hi"},
                headers={"x-request-id": "req-123"},
            )
            assert r.status_code == 200
            assert r.headers["x-request-id"] == "req-123"
            assert r.headers["x-radixfleet-worker"] == "127.0.0.1:" + two_upstreams[0].rsplit(":", 1)[1]
            r2 = await c.post(base + "/generate", json={"text": "hello"})
            assert r2.status_code == 200 and r2.headers["x-request-id"]
            assert r2.headers["x-request-id"] != "req-123"
            stats = (await c.get(two_upstreams[0] + "/stats")).json()
            assert stats["paths"][-2:] == ["/v1/completions", "/generate"]
            # the default tenant's secret salt, always sent
            assert stats["tenants"][-1] == router.salts.salt("") != ""
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


@pytest.mark.parametrize("front", [True, False], ids=["raw_front", "aiohttp_app"])
@pytest.mark.parametrize("on", [False, True], ids=["default_off", "on"])
async def test_the_worker_header_names_the_worker_only_when_configured(two_upstreams, front, on):
    # Worker ids (and so the fleet's size and layout) are internal: by default no
    # answer names its worker — not a JSON answer, not a stream, not an error relayed
    # from a worker; response_headers.worker_id: true names it on each of them.
    async def busy(request):
        await request.read()
        return web.json_response({"error": {"message": "busy"}}, status=429, headers={"Retry-After": "2"})

    async def health(request):
        return web.Response(text="ok")

    refusing = web.Application()
    refusing.router.add_post("/v1/completions", busy)
    refusing.router.add_get("/health", health)
    refusing_runner, refusing_url = await start_app(refusing)
    raw = {
        "workers": [{"url": two_upstreams[0], "id": "good"}],
        **({"response_headers": {"worker_id": True}} if on else {}),
    }
    router, runner, base = await start_router(raw, front=front, worker_header=False)
    lone, lone_runner, lone_base = await start_router(
        {"workers": [{"url": refusing_url, "id": "refusing"}], "retries": {"max_attempts": 1}},
        front=front,
        worker_header=on,
    )
    try:
        async with httpx.AsyncClient() as c:
            plain = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "hi"})
            streamed = await c.post(
                base + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}
            )
            refused = await c.post(lone_base + "/v1/completions", json={"model": "m", "prompt": "hi"})
        assert plain.status_code == 200 and streamed.status_code == 200, (plain.text, streamed.text)
        assert b"data: [DONE]" in streamed.content
        assert refused.status_code == 429 and refused.headers["retry-after"] == "2", refused.text
        for r, worker in ((plain, "good"), (streamed, "good"), (refused, "refusing")):
            assert r.headers["x-request-id"]
            assert r.headers.get("x-radixfleet-worker") == (worker if on else None), r.headers
            assert worker not in r.text
        assert router.cfg.response_headers.worker_id is on
    finally:
        for rn in (runner, lone_runner):
            await rn.aclose() if isinstance(rn, RouterServer) else await rn.cleanup()
        await refusing_runner.cleanup()


async def test_bad_inputs_get_their_statuses_and_never_500(two_upstreams):
    router, runner, base = await start_router(
        {"workers": [{"url": two_upstreams[0]}], "limits": {"max_body_bytes": 1000}}
    )
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "m", "prompt": "\xff\xfe"}', 400, "UTF-8"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"model": "m"}', 400, "'prompt' is required"),
        (b'{"model": 3, "prompt": "x"}', 400, "'model' must be a string"),
        (b'{"model": "m", "prompt": 5}', 400, "'prompt' must be"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', 400, "'stream'"),
        (json.dumps({"model": "m", "prompt": "x" * 2000}).encode(), 413, "exceeds the limit"),
    ]
    try:
        async with httpx.AsyncClient() as c:
            for body, status, needle in cases:
                r = await c.post(
                    base + "/v1/completions", content=body, headers={"Content-Type": "application/json"}
                )
                assert r.status_code == status, (body, r.text)
                err = r.json()["error"]
                assert needle in err["message"] and err["type"] and err["code"], err
            r = await c.post(base + "/v1/chat/completions", json={"model": "m"})
            assert r.status_code == 400 and "'messages' is required" in r.text
            r = await c.post(
                base + "/v1/chat/completions", json={"model": "m", "messages": [{"content": "x"}]}
            )
            assert r.status_code == 400 and "role" in r.text

            async def chunked():
                yield b'{"model": "m", "prompt": "'
                yield b"y" * 2000
                yield b'"}'

            r = await c.post(base + "/v1/completions", content=chunked())
            assert r.status_code == 413
            r = await c.get(base + "/no/such/path")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = await c.get(base + "/v1/completions")
            assert r.status_code == 405
            # nothing accepted was lost: a good request still works
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "ok"})
            assert r.status_code == 200
        rejected = router.metrics.rejected
        assert rejected.labels("400", "malformed_request")._value.get() >= 8
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


async def test_no_healthy_worker_is_503():
    dead = f"http://127.0.0.1:{free_port()}"
    router = Router(parse_config({"workers": [{"url": dead}], "health": FAST_HEALTH}))
    runner = RouterServer(router, port=free_port(), admin_port=0)
    base = f"http://127.0.0.1:{await runner.start()}"
    try:
        async with httpx.AsyncClient() as c:
            r = await c.get(base + "/readiness")
            assert r.status_code == 503
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "no_worker_available"
            assert (await c.get(base + "/health")).status_code == 200
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


async def test_concurrency_limit_queue_full_is_429(two_upstreams):
    router, runner, base = await start_router(
        {
            "workers": [{"url": two_upstreams[0]}],
            "limits": {"max_concurrency": 1, "max_queue": 1, "retry_after_s": 3},
        }
    )
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            slow = {"model": "m", "prompt": "x", "delay_s": 0.6}
            adm = router.admission

            async def until(pred):
                deadline = time.monotonic() + 5
                while not pred():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)

            first = asyncio.create_task(c.post(base + "/v1/completions", json=slow))
            await until(lambda: adm.active == 1)
            queued = asyncio.create_task(c.post(base + "/v1/completions", json=slow))
            await until(lambda: len(adm._waiters) == 1)
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 429
            assert r.headers["Retry-After"] == "3"
            assert r.json()["error"]["code"] == "overloaded"
            assert (await first).status_code == 200
            assert (await queued).status_code == 200  # the queued one was served
        router.admission.check()
        assert router.admission.active == 0
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


async def test_5xx_is_retried_on_another_worker(two_upstreams):
    async def fail(request):
        await request.read()
        return web.json_response({"error": {"message": "boom"}}, status=503)

    async def health(request):
        return web.Response(text="ok")

    bad = web.Application()
    bad.router.add_post("/v1/completions", fail)
    bad.router.add_get("/health", health)
    bad_runner, bad_url = await start_app(bad)
    router, runner, base = await start_router(
        {
            "workers": [{"url": bad_url, "id": "bad"}, {"url": two_upstreams[0], "id": "good"}],
            "policy": {"name": "round_robin"},
            "breaker": {"failure_threshold": 100},
        }
    )
    try:
        async with httpx.AsyncClient() as c:
            for _ in range(6):
                r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
                assert r.status_code == 200 and r.headers["x-radixfleet-worker"] == "good"
        assert router.metrics.retries.labels("status")._value.get() >= 3
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()
        await bad_runner.cleanup()


async def test_a_500_from_a_worker_going_down_is_retried_one_still_up_is_not(two_upstreams):
    """A 5xx before the client saw a byte is answered once (502) while its worker
    still answers its health probe; a worker whose probe fails right after (an engine
    stopped mid-request) took the generation down with it, so another worker runs it."""
    up = {"ok": True}

    async def fail(request):
        await request.read()
        return web.json_response({"error": {"message": "engine dead"}}, status=500)

    async def health(request):
        return web.Response(text="ok") if up["ok"] else web.Response(status=503)

    bad = web.Application()
    bad.router.add_post("/v1/completions", fail)
    bad.router.add_get("/health", health)
    bad_runner, bad_url = await start_app(bad)
    router, runner, base = await start_router(
        {
            "workers": [{"url": bad_url, "id": "bad"}, {"url": two_upstreams[0], "id": "good"}],
            "policy": {"name": "round_robin"},
            "breaker": {"failure_threshold": 100},
            # the periodic probes never catch the change first: only the one after the 500
            "health": {"interval_s": 60, "timeout_s": 1.0},
        }
    )
    try:
        async with httpx.AsyncClient() as c:
            seen = set()
            for _ in range(4):  # round robin: some land on "bad" first
                r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
                seen.add(r.status_code)
            assert 502 in seen  # still up: a 5xx is answered once, not run again
            up["ok"] = False
            for _ in range(4):
                r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
                assert r.status_code == 200 and r.headers["x-radixfleet-worker"] == "good"
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()
        await bad_runner.cleanup()


async def test_killed_worker_costs_no_request_and_leaves_the_index():
    pa, ua = upstream_proc("a", chunks=40, chunk_delay=0.05)
    pb, ub = upstream_proc("b", chunks=40, chunk_delay=0.05)
    with pa, pb:
        router, runner, base = await start_router(
            {
                "workers": [{"url": ua, "id": "a"}, {"url": ub, "id": "b"}],
                "policy": {"name": "round_robin"},
                # a's death is a refused connection, seen at once; b, busy with this
                # load on a loaded CI machine, once took over FAST_HEALTH's 0.5 s to answer
                # a probe and was marked unhealthy too (503s)
                "health": {**FAST_HEALTH, "timeout_s": 3.0},
            }
        )
        try:
            async with httpx.AsyncClient(timeout=10) as c:
                # a stream on each worker; kill a's process while they run
                async def stream():
                    async with c.stream(
                        "POST",
                        base + "/v1/completions",
                        json={"model": "m", "prompt": LONG_PROMPT, "stream": True},
                    ) as r:
                        body = b"".join([chunk async for chunk in r.aiter_bytes()])
                        return r.headers["x-radixfleet-worker"], body

                streams = [asyncio.create_task(stream()) for _ in range(2)]
                statuses = []

                async def load(stop_at):
                    while time.monotonic() < stop_at:
                        r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": LONG_PROMPT})
                        statuses.append(r.status_code)

                loop_end = time.monotonic() + 1.5
                loaders = [asyncio.create_task(load(loop_end)) for _ in range(4)]
                await asyncio.sleep(0.5)
                assert "a" in router.index.workers()
                pa.kill()
                await asyncio.gather(*loaders)
                results = await asyncio.gather(*streams)
            assert statuses and set(statuses) == {200}, statuses
            by_worker = dict(results)
            a_body = by_worker["a"]
            assert b'"code": "upstream_failed"' in a_body and a_body.endswith(b"data: [DONE]\n\n")
            assert by_worker["b"].count(b"data: ") == 41 and b"upstream_failed" not in by_worker["b"]
            # the dead worker is out of the index and not routable
            assert "a" not in router.index.workers()
            assert [v.id for v in router.pool.views(time.monotonic())] == ["b"]
            router.pool.check()
            router.index.check()
        finally:
            await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


async def test_client_disconnect_frees_load():
    p, u = upstream_proc("slow", chunks=100, chunk_delay=0.05)
    with p:
        router, runner, base = await start_router({"workers": [{"url": u, "id": "s"}]})
        try:
            async with httpx.AsyncClient(timeout=10) as c:
                async with c.stream(
                    "POST",
                    base + "/v1/completions",
                    json={"model": "m", "prompt": LONG_PROMPT, "stream": True},
                ) as r:
                    async for _ in r.aiter_bytes():
                        break
                    assert router.pool.get("s").in_flight == 1
            deadline = time.monotonic() + 3
            while router.pool.get("s").in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert router.pool.get("s").in_flight == 0
            assert router.pool.get("s").in_flight_tokens == 0
        finally:
            await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


async def test_tenants_never_match_each_other(two_upstreams, monkeypatch):
    monkeypatch.setenv("T_A_KEY", "key-a")
    router, runner, base = await start_router(
        {
            "workers": [{"url": u} for u in two_upstreams],
            "keys": {
                "tenant": {
                    "source": "api_key",
                    "api_keys": [{"tenant": "A", "key_env": "T_A_KEY"}, {"tenant": "B", "key": "key-b"}],
                }
            },
            "policy": {"name": "prefix_load", "params": {"min_match_tokens": 0}},
        }
    )
    body = {"model": "m", "prompt": LONG_PROMPT}
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 401
            r = await c.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            ra = await c.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer key-a"})
            assert ra.status_code == 200
            assert ra.headers["x-radixfleet-worker"]
        ka = request_key(Endpoint.COMPLETIONS, body, tenant=router.salts.salt("A"))
        kb = request_key(Endpoint.COMPLETIONS, body, tenant=router.salts.salt("B"))
        now = time.monotonic()
        assert router.index.match(ka.hashes, now, count=False).best == len(ka.hashes) > 0
        assert router.index.match(kb.hashes, now, count=False).blocks == {}
        async with httpx.AsyncClient() as c:
            rb = await c.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer key-b"})
            assert rb.status_code == 200
            stats = (await c.get(two_upstreams[0] + "/stats")).json()["tenants"] + (
                await c.get(two_upstreams[1] + "/stats")
            ).json()["tenants"]
        # workers see each tenant's secret salt, never its name
        assert sorted(stats) == sorted([router.salts.salt("A"), router.salts.salt("B")])
        # B's request was a miss although A's identical prompt is indexed
        req = router.metrics.requests
        misses = sum(
            s.value
            for m in req.collect()
            for s in m.samples
            if s.name.endswith("_total") and s.labels["reason"] == "miss"
        )
        assert misses == 2
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


# --------------------------------------------------------- admin, agents, auth


async def test_admin_and_agent_apis_require_their_tokens(two_upstreams, monkeypatch):
    monkeypatch.setenv("RADIXFLEET_ADMIN_TOKEN", "adm")
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", "agt")
    router, runner, base = await start_router({"workers": [{"url": two_upstreams[0]}]})
    try:
        async with httpx.AsyncClient() as c:
            for method, path in (
                ("GET", "/admin/workers"),
                ("GET", "/admin/index"),
                ("POST", "/admin/reload"),
                ("POST", "/admin/workers"),
            ):
                for hdr in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer agt"}):
                    r = await c.request(method, admin_base(runner, base) + path, headers=hdr)
                    assert r.status_code == 401, (path, hdr, r.text)
            for path in ("/internal/v1/events", "/internal/v1/register"):
                for hdr in ({}, {"Authorization": "Bearer adm"}):
                    r = await c.post(base + path, json={}, headers=hdr)
                    assert r.status_code == 401
            ok = {"Authorization": "Bearer adm"}
            r = await c.get(admin_base(runner, base) + "/admin/workers", headers=ok)
            assert r.status_code == 200 and len(r.json()["workers"]) == 1
            r = await c.get(admin_base(runner, base) + "/admin/index", headers=ok)
            assert r.status_code == 200 and r.json()["policy"]["name"] == "prefix_load"
            assert "hot_prefixes" in r.json() and "nodes" in r.json()["stats"]
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


def test_refuses_non_loopback_without_tokens(monkeypatch):
    """The agent API is the data port's (listen.host), the admin API the admin
    listener's (admin.host): each off loopback needs its own token."""
    monkeypatch.delenv("RADIXFLEET_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("RADIXFLEET_AGENT_TOKEN", raising=False)
    both = parse_config({"listen": {"host": "0.0.0.0"}, "admin": {"host": "0.0.0.0"}})
    with pytest.raises(ConfigError, match="auth.admin_token_env.*RADIXFLEET_ADMIN_TOKEN"):
        Router(both)
    data = parse_config({"listen": {"host": "0.0.0.0"}})
    with pytest.raises(ConfigError, match="auth.agent_token_env"):
        Router(data)
    monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", "b")
    Router(data)  # the admin listener on loopback: no admin token needed
    with pytest.raises(ConfigError, match="auth.admin_token_env"):
        Router(both)
    monkeypatch.setenv("RADIXFLEET_ADMIN_TOKEN", "a")
    Router(both)  # both set: allowed


async def test_admin_add_drain_remove_worker(two_upstreams):
    router, runner, base = await start_router(
        {"workers": [{"url": two_upstreams[0], "id": "w0"}], "policy": {"name": "round_robin"}}
    )
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(admin_base(runner, base) + "/admin/workers", json={"url": "ftp://x"})
            assert r.status_code == 400 and "worker.url" in r.text
            r = await c.post(
                admin_base(runner, base) + "/admin/workers", json={"url": two_upstreams[1], "idd": 1}
            )
            assert r.status_code == 400 and "unknown key" in r.text
            r = await c.post(
                admin_base(runner, base) + "/admin/workers", json={"url": two_upstreams[1], "id": "w1"}
            )
            assert r.status_code == 201
            r = await c.post(
                admin_base(runner, base) + "/admin/workers", json={"url": two_upstreams[1], "id": "w1"}
            )
            assert r.status_code == 409
            deadline = time.monotonic() + 3
            while len(router.pool.views(time.monotonic())) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            seen = set()
            for _ in range(4):
                r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": LONG_PROMPT})
                seen.add(r.headers["x-radixfleet-worker"])
            assert seen == {"w0", "w1"}
            assert "w1" in router.index.workers()
            r = await c.post(admin_base(runner, base) + "/admin/workers/w1/drain")
            assert r.status_code == 200 and r.json()["worker"]["draining"] is True
            for _ in range(3):
                r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
                assert r.headers["x-radixfleet-worker"] == "w0"
            r = await c.delete(admin_base(runner, base) + "/admin/workers/w1")
            assert r.status_code == 200
            assert "w1" not in router.index.workers()  # entries gone at once
            r = await c.delete(admin_base(runner, base) + "/admin/workers/w1")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            router.pool.check()
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


async def test_agent_registration_and_events(two_upstreams):
    router, runner, base = await start_router({"workers": [{"url": two_upstreams[0]}]})
    ev_url = base + "/internal/v1/events"
    reg = {"worker_id": "ag", "url": two_upstreams[1], "epoch": "e1", "models": ["m"]}
    key = request_key(Endpoint.COMPLETIONS, {"model": "m", "prompt": LONG_PROMPT})
    h = key.hashes
    now = time.monotonic

    def batch(seq, events, epoch="e1", load=None):
        b = {"worker_id": "ag", "url": two_upstreams[1], "epoch": epoch, "seq": seq, "events": events}
        if load is not None:
            b["load"] = load
        return b

    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(ev_url, json=batch(0, []))
            assert r.status_code == 404 and r.json()["status"] == "unknown_worker"
            r = await c.post(base + "/internal/v1/register", json={"worker_id": "ag"})
            assert r.status_code == 400
            r = await c.post(base + "/internal/v1/register", json=reg)
            assert r.status_code == 200 and r.json()["status"] == "ok"
            deadline = time.monotonic() + 5  # routable after its first probe (Pool.register)
            while not any(v.id == "ag" for v in router.pool.views(now())):
                assert time.monotonic() < deadline, "the registered agent never turned routable"
                await asyncio.sleep(0.01)
            r = await c.post(
                ev_url,
                json=batch(
                    0,
                    [{"type": "stored", "parent": None, "hashes": h[:3]}],
                    load={"queued_requests": 2, "queued_tokens": 500, "prefill_tokens_per_s": 5000},
                ),
            )
            assert r.status_code == 200, r.text
            assert router.index.match(h, now(), count=False).blocks.get("ag") == 3
            view = next(v for v in router.pool.views(now()) if v.id == "ag")
            assert view.queued_tokens == 500 and view.prefill_tokens_per_s == 5000
            r = await c.post(ev_url, json=batch(1, [{"type": "removed", "hashes": [h[1]]}]))
            assert r.status_code == 200
            assert router.index.match(h, now(), count=False).blocks.get("ag") == 1
            # a sequence gap -> snapshot required, nothing applied
            r = await c.post(ev_url, json=batch(5, [{"type": "stored", "parent": h[0], "hashes": h[1:4]}]))
            assert r.status_code == 409 and r.json()["status"] == "snapshot_required"
            assert router.index.match(h, now(), count=False).blocks.get("ag") == 1
            # not the epoch it registered with: not its agent (it re-registers)
            r = await c.post(ev_url, json=batch(2, [], epoch="e0"))
            assert r.status_code == 404 and r.json()["status"] == "unknown_worker"
            # the snapshot resynchronises whatever the gap
            blocks = [[h[0], None], [h[1], h[0]]]
            r = await c.post(ev_url, json=batch(9, [{"type": "snapshot", "blocks": blocks}]))
            assert r.status_code == 200
            assert router.index.match(h, now(), count=False).blocks.get("ag") == 2
            r = await c.post(ev_url, json=batch(10, [{"type": "cleared"}]))
            assert r.status_code == 200
            assert "ag" not in router.index.match(h, now(), count=False).blocks
            # malformed batches
            for bad in (
                {"worker_id": "ag"},
                batch(11, [{"type": "nope"}]),
                batch(11, [{"type": "stored", "parent": None, "hashes": [-1]}]),
            ):
                r = await c.post(ev_url, json=bad)
                assert r.status_code == 400, bad
            r = await c.post(ev_url, content=b"{oops")
            assert r.status_code == 400
            # re-registering with a new epoch (agent restarted): its stream restarts
            r = await c.post(base + "/internal/v1/register", json={**reg, "epoch": "e2"})
            assert r.status_code == 200
            r = await c.post(ev_url, json=batch(0, [], epoch="e2"))
            assert r.status_code == 200
        router.pool.check()
        router.index.check()
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


# ------------------------------------------------------------------- reload


def _writer(path):
    def write(text):
        path.write_text(text)
        # make sure the mtime changes even on coarse clocks
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    return write


_RELOAD_HEALTH = "health: {interval_s: 0.1, timeout_s: 0.5, failure_threshold: 1, success_threshold: 1}\n"


async def test_reload_invalid_keeps_old_valid_adds_and_removes(two_upstreams, tmp_path):
    # The file watcher is off in every version of the file: only /admin/reload reloads,
    # so each answer below is the outcome of exactly that reload (no race with a poll).
    path = tmp_path / "router.yaml"
    a, b = two_upstreams
    write = _writer(path)
    health = _RELOAD_HEALTH + "response_headers: {worker_id: true}\n"
    nowatch = "reload: {watch: false}\n"
    write(f"workers: [{{url: '{a}', id: wa}}]\npolicy: {{name: round_robin}}\n{health}{nowatch}")
    router = Router(parse_config(__import__("yaml").safe_load(path.read_text()), str(path)))
    runner = RouterServer(router, port=free_port(), admin_port=0)
    base = f"http://127.0.0.1:{await runner.start()}"
    try:
        await wait_ready(base)
        assert not any(t.get_coro().__name__ == "_watch_config" for t in router._tasks)
        async with httpx.AsyncClient() as c:
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": LONG_PROMPT})
            assert r.headers["x-radixfleet-worker"] == "wa"
            write(f"workers: [{{url: '{b}', id: wb}}]\npolicy: {{name: cache-aware}}\n{health}{nowatch}")
            r = await c.post(admin_base(runner, base) + "/admin/reload")
            assert r.status_code == 400
            assert "policy.name: 'cache-aware' is not one of" in r.json()["error"]["message"]
            assert [w.id for w in router.pool] == ["wa"]
            assert router.policy.name == "round_robin"
            assert router.metrics.reload_failures.labels(reason="invalid")._value.get() == 1
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200 and r.headers["x-radixfleet-worker"] == "wa"
            write(f"workers: [{{url: '{b}', id: wb}}]\npolicy: {{name: least_load}}\n{health}{nowatch}")
            r = await c.post(admin_base(runner, base) + "/admin/reload")
            assert r.status_code == 200, r.text
            assert r.json()["added"] == ["wb"] and r.json()["removed"] == ["wa"]
            assert router.policy.name == "least_load"
            assert "wa" not in router.index.workers()
            deadline = time.monotonic() + 3
            while not router.pool.views(time.monotonic()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.headers["x-radixfleet-worker"] == "wb"
        router.pool.check()
    finally:
        await runner.aclose()


async def test_admin_reload_applies_a_security_downgrade_only_when_its_body_asks(two_upstreams, tmp_path):
    path = tmp_path / "router.yaml"
    a, _ = two_upstreams
    write = _writer(path)
    common = f"workers: [{{url: '{a}', id: wa}}]\n{_RELOAD_HEALTH}reload: {{watch: false}}\n"
    write(common + "keys: {tenant: {source: api_key, api_keys: [{tenant: acme, key: sk-acme}]}}\n")
    router = Router(load_config(str(path)))
    runner = RouterServer(router, port=free_port(), admin_port=0)
    base = f"http://127.0.0.1:{await runner.start()}"
    try:
        await wait_ready(base)
        write(common)  # the API keys gone
        async with httpx.AsyncClient() as c:
            r = await c.post(admin_base(runner, base) + "/admin/reload")
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"].startswith(
                "the new file lowers security: keys.tenant.source: api_key -> none"
            )
            for body, problem in (
                (b"[true]", "reload body must be a JSON object"),
                (b'{"allow_security_downgrade": "yes"}', "'allow_security_downgrade' must be a boolean"),
                (b'{"allow": true}', "unknown field 'allow'; valid: allow_security_downgrade"),
            ):
                r = await c.post(admin_base(runner, base) + "/admin/reload", content=body)
                assert r.status_code == 400 and r.json()["error"]["message"] == problem, r.text
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 401  # still the running config
            r = await c.post(
                admin_base(runner, base) + "/admin/reload", json={"allow_security_downgrade": True}
            )
            assert r.status_code == 200, r.text
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200, r.text
        assert router.metrics.reload_failures.labels(reason="downgrade")._value.get() == 1
    finally:
        await runner.aclose()


async def test_file_watcher_reloads_a_changed_file_on_its_own(two_upstreams, tmp_path):
    # Nothing else reloads here: the change can only be the watcher's doing.
    path = tmp_path / "router.yaml"
    a, b = two_upstreams
    write = _writer(path)
    write(
        f"workers: [{{url: '{a}', id: wa}}]\npolicy: {{name: round_robin}}\n{_RELOAD_HEALTH}"
        "reload: {poll_interval_s: 0.05}\n"
    )
    router = Router(parse_config(__import__("yaml").safe_load(path.read_text()), str(path)))
    runner = RouterServer(router, port=free_port(), admin_port=0)
    base = f"http://127.0.0.1:{await runner.start()}"
    try:
        await wait_ready(base)
        assert [w.id for w in router.pool] == ["wa"]
        write(
            f"workers: [{{url: '{a}', id: wa}}, {{url: '{b}', id: wb}}]\n"
            f"policy: {{name: least_load}}\n{_RELOAD_HEALTH}reload: {{poll_interval_s: 0.05}}\n"
        )
        deadline = time.monotonic() + 10
        while len(router.pool) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert sorted(w.id for w in router.pool) == ["wa", "wb"]
        assert router.policy.name == "least_load"
        # an invalid edit is refused by the watcher too, and counted once
        write(f"workers: []\npolicy: {{name: nope}}\n{_RELOAD_HEALTH}")
        deadline = time.monotonic() + 10
        while (
            router.metrics.reload_failures.labels(reason="invalid")._value.get() < 1
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # several more polls: an unchanged file is not re-read
        assert router.metrics.reload_failures.labels(reason="invalid")._value.get() == 1
        assert sorted(w.id for w in router.pool) == ["wa", "wb"]
        router.pool.check()
    finally:
        await runner.aclose()


async def test_reload_without_config_file_is_409(two_upstreams):
    router, runner, base = await start_router({"workers": [{"url": two_upstreams[0]}]})
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(admin_base(runner, base) + "/admin/reload")
            assert r.status_code == 409 and r.json()["error"]["code"] == "no_config_file"
    finally:
        await runner.aclose() if isinstance(runner, RouterServer) else await runner.cleanup()


# ------------------------------------------------------------ the process


def test_cli_router_process_graceful_shutdown_and_sighup(tmp_path):
    pu, uu = upstream_proc("u")
    port, admin_port = free_port(), free_port()
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        f"listen: {{port: {port}}}\nadmin: {{port: {admin_port}}}\nworkers: [{{url: '{uu}', id: u}}]\n"
        "policy: {name: round_robin}\nreload: {watch: false}\n"
    )
    base = f"http://127.0.0.1:{port}"
    with pu, Proc(radixfleet_argv("router", "--config", str(cfg)), ready_url=base + "/health") as pr:
        deadline = time.monotonic() + 10
        while httpx.get(base + "/readiness").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # SIGHUP reloads the file: a bad one is refused (metric), the router lives on
        cfg.write_text("policy: {name: nope}\n")
        os.kill(pr.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 5
        while (
            'radixfleet_config_reload_failures_total{reason="invalid"} 1.0'
            not in httpx.get(f"http://127.0.0.1:{admin_port}/metrics").text
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # a slow request in flight survives SIGTERM
        with httpx.Client(timeout=10) as c:
            import threading

            out = {}

            def slow():
                out["r"] = c.post(
                    base + "/v1/completions", json={"model": "m", "prompt": "x", "delay_s": 0.8}
                )

            t = threading.Thread(target=slow)
            t.start()
            time.sleep(0.3)
            os.kill(pr.proc.pid, signal.SIGTERM)
            t.join(10)
        assert out["r"].status_code == 200
        assert pr.proc.wait(10) == 0


def test_cli_bad_input_exits_2(tmp_path):
    import subprocess

    for argv in (
        ["router", "--worker", "ftp://x"],
        ["router", "--policy", "nope"],
        ["router", "--config", str(tmp_path / "missing.yaml")],
        ["router", "--config", "x.yaml", "--worker", "http://a:1"],
    ):
        p = subprocess.run(radixfleet_argv(*argv), capture_output=True, text=True, timeout=20)
        assert p.returncode == 2, (argv, p.stdout, p.stderr)
        assert p.stderr.count("\n") == 1 and "error" in p.stderr, p.stderr


class FakeWorker:
    """An OpenAI-shaped worker that counts what it started, finished and saw cancelled
    (its client, the router, closed the connection), and that can hang like a stopped
    process: ``hang()`` makes every request in progress and every health check wait
    forever (until cancelled). ``answer`` may replace the non-streamed answer's
    (status, content type, body); ``sse`` the streamed answer's bytes (``gap_s`` in
    the request: a pause after each part)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = self.finished = self.cancelled = 0
        self.hung = False
        self.answer: tuple[int, str, bytes] | None = None
        self.sse: list[bytes] | None = None

    def hang(self) -> None:
        self.hung = True

    async def _stall(self) -> None:
        if self.hung:
            await asyncio.Event().wait()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.started += 1
        try:
            delay = body.get("delay_s", 0)
            if body.get("stream"):
                await asyncio.sleep(delay)
                await self._stall()
                sr = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await sr.prepare(request)
                for part in self.sse or [b'data: {"choices": [{"text": "x"}]}\n\n', b"data: [DONE]\n\n"]:
                    await sr.write(part)
                    await asyncio.sleep(body.get("gap_s", 0))
                    await self._stall()
                await sr.write_eof()
                self.finished += 1
                return sr
            await asyncio.sleep(delay)
            await self._stall()
            status, ctype, data = self.answer or (
                200,
                "application/json",
                json.dumps({"choices": [{"text": self.name}], "usage": {"prompt_tokens": 1}}).encode(),
            )
            self.finished += 1
            return web.Response(status=status, body=data, content_type=ctype)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def health(self, request: web.Request) -> web.Response:
        await self._stall()
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/health", self.health)
        return app


@pytest.fixture
async def fake_workers():
    runners, out = [], []
    for name in ("a", "b"):
        fw = FakeWorker(name)
        r, fw.url = await start_app(fw.app())
        runners.append(r)
        out.append(fw)
    yield out
    for r in runners:
        await r.cleanup()


async def _eventually(cond, within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_non_streamed_answer_slower_than_first_byte_s_runs_once(fake_workers):
    # A non-streamed answer sends nothing until its generation is done: the first-byte
    # timeout is for streams. It must succeed, having run on one worker only.
    router, runner, base = await start_router(
        {
            "workers": [{"url": fw.url, "id": fw.name} for fw in fake_workers],
            "policy": {"name": "round_robin"},
            "timeouts": {"first_byte_s": 0.2},
        }
    )
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x", "delay_s": 0.8})
            assert r.status_code == 200, r.text
        assert sum(fw.started for fw in fake_workers) == 1
        assert sum(fw.finished for fw in fake_workers) == 1
        assert router.metrics.retries.labels("timeout")._value.get() == 0
        assert all(w.in_flight == 0 for w in router.pool)
    finally:
        await runner.aclose()


async def test_a_timed_out_generation_is_cancelled_not_sent_again(fake_workers):
    # a stream silent past first_byte_s, and a non-streamed answer past total_s: 504,
    # one attempt each, cancelled on its worker (the connection closed)
    router, runner, base = await start_router(
        {
            "workers": [{"url": fw.url, "id": fw.name} for fw in fake_workers],
            "policy": {"name": "round_robin"},
            "retries": {"max_attempts": 3},
            "timeouts": {"first_byte_s": 0.2, "total_s": 0.6},
            "breaker": {"failure_threshold": 100},
        }
    )
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            for body in ({"stream": True, "delay_s": 5}, {"delay_s": 5}):
                t0 = time.monotonic()
                r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x", **body})
                assert r.status_code == 504, r.text
                assert r.json()["error"]["code"] == "upstream_timeout"
                assert time.monotonic() - t0 < 2.0
            await _eventually(lambda: sum(fw.cancelled for fw in fake_workers) == 2)
        assert sum(fw.started for fw in fake_workers) == 2
        assert sum(fw.finished for fw in fake_workers) == 0
        assert router.metrics.retries.labels("timeout")._value.get() == 0
        assert all(w.in_flight == 0 for w in router.pool)
    finally:
        await runner.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_request_on_a_hung_worker_moves_within_a_health_interval(fake_workers, stream):
    # The worker stops answering anything (as a SIGSTOPped process does): once its
    # health checks mark it unhealthy, the request waiting on it is cancelled there
    # and answered by the other worker, long before any timeout.
    health = {"interval_s": 0.2, "timeout_s": 0.2, "failure_threshold": 2, "success_threshold": 1}
    router, runner, base = await start_router(
        {
            "workers": [{"url": fw.url, "id": fw.name} for fw in fake_workers],
            "policy": {"name": "round_robin"},
            "health": health,
            "timeouts": {"first_byte_s": 30, "total_s": 60},
        }
    )
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            t0 = time.monotonic()
            req = asyncio.ensure_future(
                c.post(
                    base + "/v1/completions",
                    json={"model": "m", "prompt": "x", "delay_s": 0.3, "stream": stream},
                )
            )
            await _eventually(lambda: sum(fw.started for fw in fake_workers) == 1)
            hung = next(fw for fw in fake_workers if fw.started)
            other = next(fw for fw in fake_workers if fw is not hung)
            hung.hang()
            r = await req
            took = time.monotonic() - t0
            assert r.status_code == 200, r.text
            assert r.headers["x-radixfleet-worker"] == other.name
            # unhealthy after ~2 failed checks (<= 3 intervals + timeouts), then at once
            assert took < 2.5, took
            await _eventually(lambda: hung.cancelled == 1)
        assert hung.finished == 0 and other.started == other.finished == 1
        assert router.metrics.retries.labels("unhealthy")._value.get() == 1
        assert all(w.in_flight == 0 and w.in_flight_tokens == 0 for w in router.pool)
        assert not router.dataplane.attempts._waiting
    finally:
        await runner.aclose()


async def test_a_stream_begun_on_a_worker_that_hangs_ends_with_an_error_event(fake_workers):
    # the client already has bytes, so the request cannot move: once the worker is
    # unhealthy its stream ends with one well-formed error event, and the worker's
    # request is cancelled, long before first_byte_s
    health = {"interval_s": 0.2, "timeout_s": 0.2, "failure_threshold": 2, "success_threshold": 1}
    a = fake_workers[0]
    router, runner, base = await start_router(
        {
            "workers": [{"url": a.url, "id": "a"}],
            "health": health,
            "timeouts": {"first_byte_s": 30, "total_s": 60},
        }
    )
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            t0 = time.monotonic()
            async with c.stream(
                "POST",
                base + "/v1/completions",
                json={"model": "m", "prompt": "x", "stream": True, "gap_s": 0.5},
            ) as r:
                assert r.status_code == 200
                a.hang()  # after its first event
                body = b"".join([chunk async for chunk in r.aiter_raw()])
            took = time.monotonic() - t0
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and len(events) == 3, body
        assert json.loads(events[0][6:])["choices"][0]["text"] == "x"
        assert json.loads(events[1][6:])["error"]["code"] == "upstream_failed"
        assert took < 2.5, took
        await _eventually(lambda: a.cancelled == 1)
        assert all(w.in_flight == 0 and w.in_flight_tokens == 0 for w in router.pool)
    finally:
        await runner.aclose()


async def test_worker_errors_reach_the_client_wrapped_and_without_addresses(fake_workers):
    a = fake_workers[0]
    router, runner, base = await start_router(
        {
            "workers": [{"url": a.url}],
            "policy": {"name": "round_robin"},
            "breaker": {"failure_threshold": 100},
            "limits": {"max_response_bytes": 4096},
        }
    )
    host = a.url.split("//")[1]
    trace = b"Traceback (most recent call last):\n  File \"/srv/vllm/x.py\"\nKeyError: 'x'"
    try:
        async with httpx.AsyncClient(timeout=10) as c:

            async def post():
                r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
                assert r.headers["content-type"].startswith("application/json"), r.headers
                assert host not in r.text and "127.0.0.1" not in r.text and "Traceback" not in r.text, r.text
                return r.status_code, r.json()["error"]

            # a 500 with a stack trace: 502, once (the worker may have run it)
            a.answer = (500, "text/plain", trace)
            status, err = await post()
            assert status == 502 and err["code"] == "upstream_error" and a.started == 1
            # a 503 is retried (here: no other worker) and keeps its status
            a.answer = (503, "text/plain", b"overloaded at " + host.encode())
            status, err = await post()
            assert status == 503 and err["type"] == "service_unavailable"
            # a 4xx keeps the worker's message, in the OpenAI shape
            a.answer = (
                400,
                "application/json",
                json.dumps(
                    {
                        "object": "error",
                        "message": "maximum context length is 4096 tokens",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                ).encode(),
            )
            status, err = await post()
            assert status == 400 and err == {
                "message": "maximum context length is 4096 tokens",
                "type": "BadRequestError",
                "code": 400,
                "param": None,
            }
            a.answer = (404, "text/plain", b"404: Not Found")
            status, err = await post()
            assert status == 404 and err["type"] == "not_found_error"
            # an answer past limits.max_response_bytes: 502, not held
            a.answer = (200, "application/json", b'{"x": "' + b"y" * 8192 + b'"}')
            status, err = await post()
            assert status == 502 and err["code"] == "upstream_response_too_large"
        assert all(w.in_flight == 0 for w in router.pool)
    finally:
        await runner.aclose()


async def test_hot_prefix_gets_warmed_replica(two_upstreams):
    router, runner, base = await start_router(
        {
            "workers": [{"url": u, "id": f"w{i}"} for i, u in enumerate(two_upstreams)],
            "policy": {
                "name": "prefix_load",
                "params": {
                    "warm_ahead": True,
                    "hot_min_rate": 0.5,
                    "holder_max_rate": 0.5,
                    "min_match_tokens": 0,
                },
            },
            "warmup": {"min_interval_s": 60},
        }
    )
    body = {"model": "m", "prompt": LONG_PROMPT}
    try:
        async with httpx.AsyncClient() as c:
            for _ in range(40):
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200
            deadline = time.monotonic() + 3
            while router.metrics.warmups.labels("ok")._value.get() < 1:
                assert time.monotonic() < deadline, "no warm-up was sent"
                await asyncio.sleep(0.02)
            stats = [(await c.get(u + "/stats")).json() for u in two_upstreams]
            info = (await c.get(admin_base(runner, base) + "/admin/index")).json()
        # one warm-up per (worker, prefix) within min_interval_s, at most one per worker
        assert 1 <= router.metrics.warmups.labels("ok")._value.get() <= 2
        assert info["hot_prefixes"] and info["hot_prefixes"][0]["rate"] > 0.5
        assert sum(s["requests"] for s in stats) >= 41
    finally:
        await runner.aclose()


async def test_registration_block_bytes_checked_and_reload_refuses_old_size(two_upstreams, tmp_path):
    """An agent that says its block_bytes is registered only when it matches the
    router's keys.block_bytes; after a reload changes the router's, the agent's
    batches get 404 unknown_worker (it re-registers, and is refused with 409)."""
    path = tmp_path / "router.yaml"
    path.write_text(f"workers:\n  - url: {two_upstreams[0]}\nkeys:\n  block_bytes: 128\n")
    router = Router(parse_config(__import__("yaml").safe_load(path.read_text()), str(path)))
    server, base = await start_app(router.app)
    reg = {"worker_id": "ag", "url": two_upstreams[1], "epoch": "e1", "block_bytes": 128}
    batch = {"worker_id": "ag", "url": two_upstreams[1], "epoch": "e1", "seq": 0, "events": []}
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(base + "/internal/v1/register", json={**reg, "block_bytes": 256})
            assert r.status_code == 409 and r.json()["status"] == "block_bytes_mismatch"
            assert router.pool.get("ag") is None
            r = await c.post(base + "/internal/v1/register", json=reg)
            assert r.status_code == 200
            assert router.pool.get("ag").block_bytes == 128
            r = await c.post(base + "/internal/v1/events", json=batch)
            assert r.status_code == 200
            path.write_text(f"workers:\n  - url: {two_upstreams[0]}\nkeys:\n  block_bytes: 256\n")
            ok, msg, _, _ = await router.reload()
            assert ok, msg
            r = await c.post(base + "/internal/v1/events", json={**batch, "seq": 1})
            assert r.status_code == 404 and r.json()["status"] == "unknown_worker"
            r = await c.post(base + "/internal/v1/register", json={**reg, "epoch": "e2"})
            assert r.status_code == 409 and r.json()["block_bytes"] == 256
            # an agent that does not say its size is taken at its word, as before
            r = await c.post(
                base + "/internal/v1/register", json={k: v for k, v in reg.items() if k != "block_bytes"}
            )
            assert r.status_code == 200
    finally:
        await server.cleanup()
