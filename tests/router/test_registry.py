"""How workers join, leave and are trusted: registration conflicts and bounds, event
batches applied in slices, readiness that waits for every configured worker, reloads
that keep what did not change, and `radixfleet up` checking its ports first.

In-process routers on loopback (tests/router/serve.py) and small
aiohttp workers; the live-router probes are in tests/chaos/test_registry.py."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import time

import httpx
import pytest
from aiohttp import web

from radixfleet.config import load_config, parse_config
from radixfleet.fleet.pool import HealthState, Pool
from radixfleet.index.feedback import SLICE_BLOCKS, Feedback
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.server.app import Router, RouterServer
from radixfleet.wire.events import EventBatch, Snapshot, Stored
from radixfleet_tools.harness.procs import free_port, radixfleet_argv
from tests.router.serve import FAST_HEALTH, admin_base, start_app, start_router, wait_ready

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "examples", "prefix_load.yaml")


def worker_app(model: str = "m", health_gate: asyncio.Event | None = None) -> web.Application:
    """A worker that answers health checks (after ``health_gate``, if given) and lists
    ``model``."""

    async def health(request):
        if health_gate is not None:
            await health_gate.wait()
        return web.json_response({"status": "ok"})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def complete(request):
        await request.read()
        return web.json_response(
            {"object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    return app


# ------------------------------------------------------------ registration over HTTP


@pytest.mark.integration
async def test_registration_with_a_role_against_the_configured_one_is_409():
    runner, url = await start_app(worker_app())
    runner2, url2 = await start_app(worker_app())
    router, server, base = await start_router(
        {
            "workers": [
                {"url": url, "id": "w0", "role": "prefill"},
                {"url": url2, "id": "w1", "role": "decode"},
            ]
        }
    )
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(
                base + "/internal/v1/register",
                json={"worker_id": "w0", "url": url, "epoch": "e1", "role": "decode"},
            )
            assert r.status_code == 409, r.text
            body = r.json()
            assert body["status"] == "worker_role_conflict" and body["error"]["param"] == "role"
            assert "--role prefill" in body["error"]["message"]
            assert router.pool.get("w0").role == "prefill"
            r = await c.post(
                base + "/internal/v1/register", json={"worker_id": "w0", "url": url, "epoch": "e1"}
            )
            assert r.status_code == 200, r.text
    finally:
        await server.aclose()
        await runner.cleanup()
        await runner2.cleanup()


@pytest.mark.integration
async def test_registration_under_a_configured_id_from_another_url_is_409():
    runner, url = await start_app(worker_app())
    router, server, base = await start_router({"workers": [{"url": url, "id": "w0"}]})
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(
                base + "/internal/v1/register",
                json={"worker_id": "w0", "url": "http://127.0.0.1:19998", "epoch": "e1"},
            )
            assert r.status_code == 409, r.text
            body = r.json()
            assert body["status"] == "worker_id_taken" and "w0" in body["error"]["message"]
            assert url not in r.text  # the holder's address is not given away
            assert router.pool.get("w0").url == url
            # a batch claiming the id from that URL is not applied
            batch = EventBatch("w0", "http://127.0.0.1:19998", "e1", 0, [Snapshot([(1, None)])])
            r = await c.post(base + "/internal/v1/events", json=batch.to_json())
            assert r.status_code == 404 and r.json()["status"] == "unknown_worker"
            assert router.index.workers() == set()
            # the agent at the configured URL is welcome under that id
            r = await c.post(
                base + "/internal/v1/register", json={"worker_id": "w0", "url": url, "epoch": "e2"}
            )
            assert r.status_code == 200, r.text
            r = await c.post(
                base + "/internal/v1/events",
                json=EventBatch("w0", url, "e2", 0, [Snapshot([(1, None)])]).to_json(),
            )
            assert r.status_code == 200 and router.index.workers() == {"w0"}
        router.pool.check()
    finally:
        await server.aclose()
        await runner.cleanup()


@pytest.mark.integration
async def test_new_registrations_past_the_bound_get_429_and_are_not_routable_unprobed():
    runner, url = await start_app(worker_app())
    router, server, base = await start_router(
        {"workers": [{"url": url, "id": "real"}], "registration": {"rate_per_s": 1.0, "burst": 5}}
    )
    try:
        async with httpx.AsyncClient() as c:
            codes = []
            for i in range(8):
                r = await c.post(
                    base + "/internal/v1/register",
                    json={
                        "worker_id": f"fake{i}",
                        "url": f"http://127.0.0.1:{20000 + i}",
                        "epoch": "e",
                        "models": ["m"],
                    },
                )
                codes.append(r.status_code)
                if r.status_code == 429:
                    assert int(r.headers["Retry-After"]) >= 1
                    assert r.json()["status"] == "overloaded"
            assert codes[:5] == [200] * 5 and 429 in codes[5:], codes
            # nothing answers at the fakes' URLs: never routable, every request served
            for _ in range(10):
                r = await c.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
                assert r.status_code == 200, r.text
                assert r.headers.get("x-radixfleet-worker") == "real", r.headers
            ready = (await c.get(base + "/readiness")).json()
            assert ready["routable"] == ["real"], ready
    finally:
        await server.aclose()
        await runner.cleanup()


# ---------------------------------------------------------------------- readiness


@pytest.mark.integration
async def test_readiness_waits_until_every_configured_worker_was_probed():
    """One healthy worker is not a ready router: a worker still being probed for the
    first time (here: added while the router runs, its /health slow) keeps
    /readiness at 503, naming it, until it has answered or failed."""
    gate = asyncio.Event()
    r1, fast = await start_app(worker_app())
    r2, slow = await start_app(worker_app(health_gate=gate))
    router, server, base = await start_router(
        {"workers": [{"url": fast, "id": "fast"}], "health": {**FAST_HEALTH, "timeout_s": 10.0}}
    )
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            r = await c.post(admin_base(server, base) + "/admin/workers", json={"url": slow, "id": "slow"})
            assert r.status_code in (200, 201), r.text
            r = await c.get(base + "/readiness")
            assert r.status_code == 503 and r.json()["waiting"] == ["slow"], r.text
            assert r.headers["Retry-After"]
            gate.set()
        await wait_ready(base)
    finally:
        gate.set()
        await server.aclose()
        await r1.cleanup()
        await r2.cleanup()


def test_pool_readiness_rules():
    cfg = parse_config(
        {"workers": [{"url": "http://127.0.0.1:1", "id": "a"}, {"url": "http://127.0.0.1:2", "id": "b"}]}
    )
    pool = Pool(cfg, PrefixIndex())
    assert pool.readiness() == (False, ["a", "b"])
    pool._set_health(pool.get("a"), HealthState.UNHEALTHY)
    assert pool.readiness() == (False, ["b"])
    pool.register("b", "http://127.0.0.1:2", "e", ["m"])  # healthy: no health checks run
    assert pool.readiness() == (True, [])


# ------------------------------------------------------------------------ reload


@pytest.mark.integration
async def test_reloading_the_unchanged_example_keeps_workers_and_index(tmp_path):
    """The example file's workers are the agents' default ids; agents registering
    (even under other ids) and a reload of the unchanged file must not remove and
    re-add them, which emptied their index entries."""
    apps = [await start_app(worker_app()) for _ in range(2)]
    text = open(EXAMPLE).read()
    ports = [u.rsplit(":", 1)[1] for _, u in apps]
    text = text.replace("127.0.0.1:9001", f"127.0.0.1:{ports[0]}")
    text = text.replace("127.0.0.1:9002", f"127.0.0.1:{ports[1]}")
    path = tmp_path / "router.yaml"
    path.write_text(text)
    router = Router(load_config(str(path)))
    server = RouterServer(router, port=free_port(), admin_port=0)
    base = f"http://127.0.0.1:{await server.start()}"
    try:
        await wait_ready(base)
        async with httpx.AsyncClient() as c:
            for i, (_, url) in enumerate(apps):
                # what `radixfleet agent --port P --router ...` registers by default
                wid = url.split("//", 1)[1] if i == 0 else f"agent{i}"
                r = await c.post(
                    base + "/internal/v1/register",
                    json={"worker_id": wid, "url": url, "epoch": "e", "models": ["m"]},
                )
                assert r.status_code == 200, r.text
                r = await c.post(
                    base + "/internal/v1/events",
                    json=EventBatch(wid, url, "e", 0, [Snapshot([(100 + i, None)])]).to_json(),
                )
                assert r.status_code == 200, r.text
        held = router.index.workers()
        assert len(held) == 2
        ok, _, added, removed = await router.reload()
        assert ok and added == [] and removed == []
        assert router.index.workers() == held
        router.pool.check()
    finally:
        await server.aclose()
        for runner, _ in apps:
            await runner.cleanup()


# ------------------------------------------------------------ batches in slices


async def test_large_batches_are_applied_in_slices_in_order():
    """A 300,000-block snapshot no longer holds the event loop: the loop runs between
    slices (a ticker, run at every turn of the loop, never sees more than one slice
    applied since its last turn — counted in blocks, not timed, so a busy host cannot
    fail it), a second batch of the same worker waits for the first, and the result
    equals applying it at once."""
    cfg = parse_config({})
    idx = PrefixIndex()
    pool = Pool(cfg, idx)
    fb = Feedback(pool, idx)
    pool.register("w", "http://127.0.0.1:7", "e")
    n = 300_000
    blocks = [(i + 1, i if i else None) for i in range(n)]  # one chain
    steps = []  # blocks applied between two turns of the ticker

    async def ticker():
        last = idx.entries("w")
        while True:
            await asyncio.sleep(0)
            now = idx.entries("w")
            steps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    first = asyncio.create_task(
        fb.apply_async(EventBatch("w", "http://127.0.0.1:7", "e", 0, [Snapshot(blocks)]), time.monotonic)
    )
    second = asyncio.create_task(
        fb.apply_async(EventBatch("w", "http://127.0.0.1:7", "e", 1, [Stored(n, [n + 1])]), time.monotonic)
    )
    assert await first == (200, "ok")
    assert await second == (200, "ok")  # seq 1 checked after seq 0 finished
    t.cancel()
    assert idx.entries("w") == n + 1
    assert sum(1 for s in steps if s > 0) >= n // SLICE_BLOCKS, steps
    assert max(steps) <= SLICE_BLOCKS, max(steps)
    idx.check()
    pool.check()


async def test_a_worker_turning_unhealthy_mid_batch_stops_it_cleanly():
    idx = PrefixIndex()
    pool = Pool(parse_config({}), idx)
    fb = Feedback(pool, idx)
    w = pool.register("w", "http://127.0.0.1:7", "e")
    blocks = [(i + 1, i if i else None) for i in range(4 * SLICE_BLOCKS)]
    task = asyncio.create_task(
        fb.apply_async(EventBatch("w", "http://127.0.0.1:7", "e", 0, [Snapshot(blocks)]), time.monotonic)
    )
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    pool._set_health(w, HealthState.UNHEALTHY)
    assert await task == (200, "ok")
    assert "w" not in idx.workers() and w.epoch is None
    pool.check()
    idx.check()


# -------------------------------------------------------------------- the agent


@pytest.mark.integration
def test_agent_never_advertises_a_wildcard():
    from radixfleet_tools.agent.cli import advertise_url, configure

    p = argparse.ArgumentParser()
    configure(p)
    url = advertise_url(
        p.parse_args(["--host", "0.0.0.0", "--port", "9001", "--router", "http://127.0.0.1:8000"])
    )
    assert url == "http://127.0.0.1:9001"
    out = subprocess.run(
        radixfleet_argv(
            "agent",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
            "--router",
            "http://no-such-host.invalid:8000",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--advertise-url" in out.stderr, out
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


# ---------------------------------------------------------------------- `up`


@pytest.mark.integration
def test_up_refuses_a_taken_port_before_starting_anything(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        started = time.monotonic()
        out = subprocess.run(
            radixfleet_argv("up", "--agents", "1", "--port", str(port), "--log-dir", str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "--port" in lines[0], out.stderr
    assert not any(tmp_path.iterdir()), "an agent was started (it wrote a log)"
    assert time.monotonic() - started < 30
