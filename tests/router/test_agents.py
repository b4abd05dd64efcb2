"""The router in front of real worker agents (``radixfleet agent`` processes, the
simulated engine): agents self-register, push events and load, follow-ups stick to
their warm worker, and a killed agent's entries leave the index."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv

pytestmark = pytest.mark.integration

SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 12


async def wait_for(pred, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_agents_register_push_events_and_keep_affinity():
    router = Router(
        parse_config(
            {
                "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 1},
                "policy": {"name": "prefix_load", "params": {"min_match_tokens": 32}},
                "response_headers": {"worker_id": True},
            }
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    agents = []
    try:
        for i in range(2):
            ap = free_port()
            p = Proc(
                radixfleet_argv(
                    "agent",
                    "--port",
                    str(ap),
                    "--worker-id",
                    f"ag{i}",
                    "--router",
                    base,
                    "--kv-tokens",
                    "200000",
                ),
                ready_url=f"http://127.0.0.1:{ap}/health",
                timeout_s=30,
            )
            agents.append(p.__enter__())
        await wait_for(lambda: len(router.pool.views(time.monotonic())) == 2, what="agents")
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
        async with httpx.AsyncClient(timeout=30) as c:
            models = (await c.get(base + "/v1/models")).json()["data"]
            model = models[0]["id"]
            workers = []
            for turn in range(3):
                r = await c.post(
                    base + "/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 4}
                )
                assert r.status_code == 200, r.text
                workers.append(r.headers["x-radixfleet-worker"])
                reply = r.json()["choices"][0]["message"]["content"]
                msgs += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": f"And then {turn}?"},
                ]
                await asyncio.sleep(0.3)  # let the agent's events arrive
        assert len(set(workers)) == 1, workers  # follow-ups stay on their warm worker
        warm = workers[0]
        # agent events reached the index (batches applied, stored events counted)
        assert router.metrics.batches.labels("ok")._value.get() > 0
        assert router.metrics._event_children["stored"]._value.get() > 0
        assert warm in router.index.workers()
        stream = await client.chat.completions.create(model=model, messages=msgs, max_tokens=4, stream=True)
        parts = [ch async for ch in stream]
        assert parts
        await client.close()
        # kill the warm agent: its entries leave at once once its health check fails
        victim = agents[int(warm[-1])]
        victim.kill()
        await wait_for(lambda: warm not in router.index.workers(), what="index drop")
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(
                base + "/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 4}
            )
        assert r.status_code == 200 and r.headers["x-radixfleet-worker"] != warm
        router.pool.check()
        router.index.check()
    finally:
        for p in agents:
            p.stop()
        await server.aclose()


async def test_agent_with_other_block_bytes_is_refused_and_says_why():
    """An agent hashing 64-byte blocks behind a router keyed on 128: every hash it
    would report is one the router never looks up, so registration is refused with
    409 block_bytes_mismatch, nothing of it reaches the index, the agent's
    /server_info names the reason, and requests are still served (load-only)."""
    router = Router(
        parse_config(
            {"keys": {"block_bytes": 128}, "workers": [{"url": "http://127.0.0.1:1", "id": "static"}]}
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    ap = free_port()
    agent = Proc(
        radixfleet_argv(
            "agent", "--port", str(ap), "--worker-id", "odd", "--router", base, "--block-bytes", "64"
        ),
        ready_url=f"http://127.0.0.1:{ap}/health",
        timeout_s=30,
    ).__enter__()
    try:
        refused = router.metrics.registrations_refused.labels("block_bytes_mismatch")
        await wait_for(lambda: refused._value.get() >= 1, what="refused registration")
        assert router.pool.get("odd") is None
        assert "odd" not in router.index.workers()
        async with httpx.AsyncClient(timeout=10) as c:
            info = (await c.get(f"http://127.0.0.1:{ap}/server_info")).json()
            assert info["block_bytes"] == 64
            assert info["routers"] == [
                {"url": base, "state": "unregistered", "refused": "block_bytes_mismatch", "sent_batches": 0}
            ]
            # the refusal itself, as the agent sees it: the router's size to use instead
            r = await c.post(
                base + "/internal/v1/register",
                json={"worker_id": "odd", "url": f"http://127.0.0.1:{ap}", "epoch": "x", "block_bytes": 64},
            )
            assert r.status_code == 409
            body = r.json()
            assert body["status"] == "block_bytes_mismatch" and body["block_bytes"] == 128
            assert "--block-bytes 128" in body["error"]["message"]
            for bad in (0, -1, "128", 1.5, True):
                r = await c.post(
                    base + "/internal/v1/register",
                    json={
                        "worker_id": "odd",
                        "url": f"http://127.0.0.1:{ap}",
                        "epoch": "x",
                        "block_bytes": bad,
                    },
                )
                assert r.status_code == 400 and r.json()["error"]["param"] == "block_bytes", bad
        router.pool.check()
    finally:
        agent.stop()
        await server.aclose()


async def test_agent_stream_counts_prompt_until_first_content_token():
    """Our agent writes the chat role chunk before prefill: the router must keep the
    prompt counted as queued prefill until the first content token (contract 10, docs/DESIGN.md)."""
    router = Router(parse_config({"health": {"interval_s": 0.2}}))
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    ap = free_port()
    # 8B at 5% MFU of an H100: a 4,000-token prefill takes about 1.3 s
    agent = Proc(
        radixfleet_argv("agent", "--port", str(ap), "--worker-id", "slow", "--router", base, "--mfu", "0.05"),
        ready_url=f"http://127.0.0.1:{ap}/health",
        timeout_s=30,
    )
    agent.__enter__()
    try:
        await wait_for(lambda: len(router.pool.views(time.monotonic())) == 1, what="agent")
        w = router.pool.get("slow")
        body = {
            "model": "llama-3-8b",
            "stream": True,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "word " * 3200}],
        }
        during = []
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", base + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                it = r.aiter_lines()
                first = await it.__anext__()
                assert '"role"' in first and '"content": ""' in first.replace('":""', '": ""')
                for _ in range(10):  # the role chunk is through; prefill is not
                    during.append((w.in_flight, w.in_flight_tokens))
                    await asyncio.sleep(0.05)
                rest = [line async for line in it]
        assert all(f == 1 and t > 3000 for f, t in during), during
        assert any('"content"' in x and '"content": ""' not in x for x in rest)
        assert (w.in_flight, w.in_flight_tokens) == (0, 0)
    finally:
        agent.__exit__(None, None, None)
        await server.aclose()
