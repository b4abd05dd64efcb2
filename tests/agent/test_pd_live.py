"""A live disaggregated fleet of agents: the router (radixfleet.route.pd) in front of one
``--role prefill`` and one ``--role decode`` agent on loopback, speaking vLLM's
``kv_transfer_params`` protocol end to end (radixfleet_tools.agent.server's module docstring):
both legs run, the prefill side keeps the prompt's KV (a second request with the same
prefix hits there), the decode side pulls the KV and counts it, bad params are 400s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet_tools.agent.server import AGENT_KEY, Agent, AgentConfig, create_app
from radixfleet_tools.harness.procs import free_port

pytestmark = pytest.mark.integration

HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1, "success_threshold": 1}
SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 20
MODEL = "llama-3-8b"


def chat(user: str, **kw) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 4,
        **kw,
    }


async def metrics(c: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await c.get(url + "/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@contextlib.asynccontextmanager
async def fleet():
    """Router + a prefill agent ``p0`` + a decode agent ``d0``; yields the router's
    URL and the agents by id (with their URLs)."""
    router = Router(
        parse_config(
            {
                "health": HEALTH,
                "policy": {"name": "prefix_load"},
                "disagg": {"colocate_below_tokens": 0},  # every request takes both legs
                "response_headers": {"worker_id": True},
            }
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    base = f"http://127.0.0.1:{await server.start()}"
    runners: list[web.AppRunner] = []
    agents: dict[str, tuple[Agent, str]] = {}
    try:
        for wid, role in (("p0", "prefill"), ("d0", "decode")):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            app = create_app(
                AgentConfig(kv_tokens=100_000, worker_id=wid, role=role), routers=[base], advertise_url=url
            )
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", port).start()
            agents[wid] = (app[AGENT_KEY], url)
        deadline = time.monotonic() + 10
        while len(router.pool.views(time.monotonic())) < 2 or not router.pool.disaggregated():
            assert time.monotonic() < deadline, "agents never registered"
            await asyncio.sleep(0.05)
        yield base, agents, router
    finally:
        for r in reversed(runners):
            await r.cleanup()
        await server.aclose()


async def until(pred, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_both_legs_run_and_the_prefill_side_keeps_the_prompt():
    async with fleet() as (base, agents, router), httpx.AsyncClient(timeout=30) as c:
        prefill, purl = agents["p0"]
        decode, durl = agents["d0"]
        r = await c.post(base + "/v1/chat/completions", json=chat("What is a radix tree?"))
        assert r.status_code == 200, r.text
        assert r.headers["x-radixfleet-worker"] == "d0"
        one = r.json()
        assert len(one["choices"][0]["message"]["content"]) > 0
        n = one["usage"]["prompt_tokens"]
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # d0 held nothing
        m = await metrics(c, purl)
        assert m["radixfleet_agent_remote_decode_prefills_total"] == 1
        assert m["radixfleet_agent_prompt_tokens_total"] == n  # the prefill leg ran there
        d = await metrics(c, durl)
        assert d["radixfleet_agent_kv_transfers_in_total"] == 1
        assert d["radixfleet_agent_kv_transferred_in_tokens_total"] == n - 1
        assert d["radixfleet_agent_kv_transferred_in_bytes_total"] == decode.cost.kv_transfer_bytes(n - 1)
        assert d["radixfleet_agent_prefill_tokens_total"] == 1  # only the last prompt token

        # streamed, same system prefix: the prefill side hits on what the first left
        body = chat("And a trie?", stream=True, stream_options={"include_usage": True})
        async with c.stream("POST", base + "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            assert s.headers["x-radixfleet-worker"] == "d0"
            events = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
        assert len(text) > 0
        usage = chunks[-1]["usage"]
        # d0 kept the first prompt's KV: the shared prefix is local there, the rest pulled
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        m2 = await metrics(c, purl)
        assert m2["radixfleet_agent_remote_decode_prefills_total"] == 2
        assert m2["radixfleet_agent_cached_tokens_total"] > 0  # the prefill-side hit
        assert prefill.cache.total_tokens >= n  # both prompts kept in its tree
        d2 = await metrics(c, durl)
        assert d2["radixfleet_agent_kv_transfers_in_total"] == 2
        pulled = d2["radixfleet_agent_kv_transferred_in_tokens_total"] - (n - 1)
        assert 0 < pulled < usage["prompt_tokens"] - 1
        prefill.sched.check()
        decode.sched.check()

        # the router's index learned both sides' events (its keys are salted per
        # tenant, so counted, not named): each holds the first prompt's whole blocks
        blocks = n // decode.block_tokens

        async def indexed() -> bool:
            return router.index.entries("p0") >= blocks and router.index.entries("d0") >= blocks

        await until(indexed)


async def test_bad_kv_transfer_params_are_400s_naming_the_field():
    async with fleet() as (_base, agents, _router), httpx.AsyncClient(timeout=30) as c:
        _decode, durl = agents["d0"]
        good = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "p0",
            "remote_block_ids": [],
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        }
        cases = [
            ("kv_transfer_params", "not an object"),
            ("kv_transfer_params.do_remote_prefill", {**good, "do_remote_prefill": "yes"}),
            ("kv_transfer_params.do_remote_decode", {**good, "do_remote_decode": 1}),
            ("kv_transfer_params.remote_block_ids", {**good, "remote_block_ids": "0-3"}),
            ("kv_transfer_params.remote_block_ids", {**good, "remote_block_ids": [1, "2"]}),
            ("kv_transfer_params.remote_block_ids", {**good, "remote_block_ids": [1, 2, 3]}),
            ("kv_transfer_params.remote_engine_id", {**good, "remote_engine_id": None}),
            ("kv_transfer_params.remote_host", {**good, "remote_host": 7}),
            ("kv_transfer_params.remote_port", {**good, "remote_port": "8000"}),
            ("kv_transfer_params.remote_port", {**good, "remote_port": 70000}),
            ("kv_transfer_params.do_remote_prefill", {**good, "do_remote_decode": True}),
        ]
        for field, params in cases:
            r = await c.post(durl + "/v1/chat/completions", json=chat("hi", kv_transfer_params=params))
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field, (field, r.text)
        # the prompt's blocks are what the prefill side names: a made-up list is refused
        d = await metrics(c, durl)
        assert d["radixfleet_agent_kv_transfers_in_total"] == 0
        assert d["radixfleet_agent_bad_requests_total"] == len(cases)
