"""Routing knows models: a request goes only to workers serving its model (YAML workers
learn theirs from ``/v1/models``), and hot-root warm-ups keep the request's adapter. A
router in-process in front of in-process upstreams (tests/router/test_bad_input.py's
``fleet``)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from aiohttp import web

from radixfleet.keys import Endpoint, request_key
from tests.router.fleet import PROMPT, fleet, serve_app, until  # noqa: F401  (fleet: the fixture)


@pytest.mark.integration
async def test_requests_go_only_to_workers_serving_their_model(fleet):
    await fleet.start({"policy": {"name": "round_robin"}})
    await fleet.agent("model-a")
    await fleet.agent("model-b")
    await fleet.routable(2)
    async with httpx.AsyncClient(timeout=10) as c:
        for model in ("model-b", "model-a") * 4:
            r = await c.post(
                fleet.base + "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 1}
            )
            assert r.status_code == 200, (model, r.text)
            assert r.headers["x-radixfleet-worker"] == model
        fleet.past_grace()
        r = await c.post(fleet.base + "/v1/completions", json={"model": "model-c", "prompt": "x"})
        assert r.status_code == 404
        msg = r.json()["error"]["message"]
        assert "'model-c'" in msg and "'model-a', 'model-b'" in msg
        # /generate without a model: any worker
        r = await c.post(fleet.base + "/generate", json={"text": "hi"})
        assert r.status_code == 200


@pytest.mark.integration
async def test_yaml_workers_models_come_from_their_v1_models(fleet):
    u0 = await fleet.upstream("u0", model="m0")
    u1 = await fleet.upstream("u1", model="m1")
    await fleet.start(
        {"workers": [{"url": u0, "id": "u0"}, {"url": u1, "id": "u1"}], "policy": {"name": "round_robin"}}
    )
    await fleet.routable(2)
    await until(lambda: all(w.models for w in fleet.router.pool), what="models learned")
    async with httpx.AsyncClient() as c:
        for _ in range(4):
            r = await c.post(fleet.base + "/v1/completions", json={"model": "m1", "prompt": "x"})
            assert r.status_code == 200 and r.headers["x-radixfleet-worker"] == "u1"
        r = await c.post(fleet.base + "/v1/completions", json={"model": "m9", "prompt": "x"})
        assert r.status_code == 503 and r.headers["Retry-After"]  # just restarted
        fleet.past_grace()
        r = await c.post(fleet.base + "/v1/completions", json={"model": "m9", "prompt": "x"})
        assert r.status_code == 404 and "'m0', 'm1'" in r.json()["error"]["message"]


@pytest.mark.integration
async def test_hot_root_warm_ups_keep_the_adapter(fleet):
    bodies = []

    async def handle(request):
        bodies.append(json.loads(await request.read()))
        return web.json_response({"choices": [{"text": "ok"}]})

    async def health(request):
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_get("/health", health)
    runner, url = await serve_app(app)
    fleet.closers.append(runner.cleanup)
    await fleet.start({"workers": [{"url": url, "id": "w"}]})
    await fleet.routable(1)
    body = {"model": "m", "prompt": PROMPT, "lora_path": "adapter-7"}
    key = request_key(Endpoint.COMPLETIONS, body, tenant="")
    fleet.router.dataplane.warm.schedule(("w",), Endpoint.COMPLETIONS, body, key, 3, time.monotonic())
    await until(lambda: bodies, what="the warm-up")
    assert bodies[0]["lora_path"] == "adapter-7" and bodies[0]["max_tokens"] == 1
