"""The router in front of real worker agents (``radixfleet agent`` processes, the
simulated engine): agents self-register, push events and load, follow-ups stick to
their warm worker, and a killed agent's entries leave the index."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from router.app import Router, RouterServer
from router.config import parse_config
from tests.procs import Proc, free_port, radixfleet_argv

SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 12


async def wait_for(pred, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_agents_register_push_events_and_keep_affinity():
    router = Router(parse_config({
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 1},
        "policy": {"name": "prefix_load", "params": {"min_match_tokens": 32}}}))
    server = RouterServer(router, port=free_port())
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    agents = []
    try:
        for i in range(2):
            ap = free_port()
            p = Proc(radixfleet_argv("agent", "--port", str(ap), "--worker-id", f"ag{i}",
                                     "--router", base, "--kv-tokens", "200000"),
                     ready_url=f"http://127.0.0.1:{ap}/health", timeout_s=30)
            agents.append(p.__enter__())
        await wait_for(lambda: len(router.pool.views(time.monotonic())) == 2, what="agents")
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
        async with httpx.AsyncClient(timeout=30) as c:
            models = (await c.get(base + "/v1/models")).json()["data"]
            model = models[0]["id"]
            workers = []
            for turn in range(3):
                r = await c.post(base + "/v1/chat/completions",
                                 json={"model": model, "messages": msgs, "max_tokens": 4})
                assert r.status_code == 200, r.text
                workers.append(r.headers["x-radixfleet-worker"])
                reply = r.json()["choices"][0]["message"]["content"]
                msgs += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"And then {turn}?"}]
                await asyncio.sleep(0.3)  # let the agent's events arrive
        assert len(set(workers)) == 1, workers  # follow-ups stay on their warm worker
        warm = workers[0]
        # agent events reached the index (batches applied, stored events counted)
        assert router.metrics.batches.labels("ok")._value.get() > 0
        assert router.metrics._event_children["stored"]._value.get() > 0
        assert warm in router.index.workers()
        stream = await client.chat.completions.create(model=model, messages=msgs,
                                                      max_tokens=4, stream=True)
        parts = [ch async for ch in stream]
        assert parts
        await client.close()
        # kill the warm agent: its entries leave at once once its health check fails
        victim = agents[int(warm[-1])]
        victim.kill()
        await wait_for(lambda: warm not in router.index.workers(), what="index drop")
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(base + "/v1/chat/completions",
                             json={"model": model, "messages": msgs, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-radixfleet-worker"] != warm
        router.pool.check()
        router.index.check()
    finally:
        for p in agents:
            p.stop()
        await server.aclose()
