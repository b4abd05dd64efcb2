"""Real agent processes on loopback: two agents + a fake router, and SGLang's router
(``smg``) fronting two agents."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from radixfleet.keys import Endpoint, request_key
from radixfleet.wire.events import Snapshot
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.loadtest.smg import find_smg, missing_message
from tests.agent.fakes import FakeRouter

pytestmark = pytest.mark.integration


def agent_argv(port, *extra):
    return radixfleet_argv(
        "agent",
        "--engine",
        "sim",
        "--agent-model",
        "llama-3-8b",
        "--gpu",
        "h100",
        "--kv-tokens",
        "50000",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    )


async def until(pred, timeout=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_two_agents_report_cached_tokens_and_events():
    rport, a, b = free_port(), free_port(), free_port()
    fake = FakeRouter()
    await fake.start(rport)
    env = {"RADIXFLEET_AGENT_TOKEN": "tok"}
    router = f"http://127.0.0.1:{rport}"
    try:
        with (
            Proc(
                agent_argv(a, "--router", router, "--worker-id", "wa"),
                env=env,
                ready_url=f"http://127.0.0.1:{a}/health",
            ),
            Proc(
                agent_argv(b, "--router", router, "--worker-id", "wb"),
                env=env,
                ready_url=f"http://127.0.0.1:{b}/health",
            ),
        ):
            await until(lambda: {"wa", "wb"} <= {r["worker_id"] for r in fake.registrations})
            body = {
                "model": "llama-3-8b",
                "max_tokens": 3,
                "messages": [
                    {"role": "system", "content": "You are a careful assistant. " * 10},
                    {"role": "user", "content": "What is a radix tree?"},
                ],
            }
            key = request_key(Endpoint.CHAT, body)
            async with httpx.AsyncClient(timeout=10) as c:
                r1 = (await c.post(f"http://127.0.0.1:{a}/v1/chat/completions", json=body)).json()
                r2 = (await c.post(f"http://127.0.0.1:{a}/v1/chat/completions", json=body)).json()
                r3 = (await c.post(f"http://127.0.0.1:{b}/v1/chat/completions", json=body)).json()
            n = r1["usage"]["prompt_tokens"]
            assert n == key.prompt_tokens
            assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
            assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # b never saw it
            # the router's view of each worker holds exactly the prompt's router-space blocks
            await until(
                lambda: (
                    set(key.hashes) <= set(fake.held.get("wa", {}))
                    and set(key.hashes) <= set(fake.held.get("wb", {}))
                )
            )
            for wid in ("wa", "wb"):
                first = next(bt for bt in fake.batches if bt.worker_id == wid)
                assert first.seq == 0 and isinstance(first.events[0], Snapshot)
                seqs = [bt.seq for bt in fake.batches if bt.worker_id == wid]
                assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            loads = [bt.load for bt in fake.batches if bt.worker_id == "wa" and bt.load]
            assert loads[-1].kv_capacity_tokens == 50_000 and loads[-1].kv_used_tokens > 0
            assert set(fake.auth) == {"Bearer tok"}
            assert {r["url"] for r in fake.registrations} == {
                f"http://127.0.0.1:{a}",
                f"http://127.0.0.1:{b}",
            }
    finally:
        await fake.stop()


def test_smg_is_found_in_the_test_environment():
    """sglang-router is in the test extra: its binary must be found (next to this
    interpreter, in its scripts folder, via the wheel's RECORD or on PATH). A
    missing smg fails here, loudly, instead of skipping the comparison."""
    assert find_smg() is not None, missing_message()


def test_sglang_router_fronts_two_agents():
    binary = find_smg()
    assert binary is not None, missing_message()
    a, b, p, q = free_port(), free_port(), free_port(), free_port()
    smg = [
        binary,
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(p),
        "--worker-urls",
        f"http://127.0.0.1:{a}",
        f"http://127.0.0.1:{b}",
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(q),
        "--log-level",
        "warn",
    ]
    with (
        Proc(agent_argv(a), ready_url=f"http://127.0.0.1:{a}/health"),
        Proc(agent_argv(b), ready_url=f"http://127.0.0.1:{b}/health"),
        Proc(smg, ready_url=f"http://127.0.0.1:{p}/health", timeout_s=30) as router,
    ):
        with httpx.Client(timeout=10) as c:
            for _ in range(100):  # smg adds workers asynchronously after /health answers
                if len(c.get(f"http://127.0.0.1:{p}/workers").json().get("workers", [])) == 2:
                    break
                time.sleep(0.1)
            prompts = [f"session {i}: " + "the shared context of this session. " * 12 for i in range(4)]
            cached = []
            for _rnd in range(3):
                for text in prompts:
                    r = c.post(
                        f"http://127.0.0.1:{p}/v1/completions",
                        json={"model": "llama-3-8b", "prompt": text, "max_tokens": 2},
                    )
                    assert r.status_code == 200, r.text
                    u = r.json()["usage"]
                    cached.append(u["prompt_tokens_details"]["cached_tokens"])
            s = c.post(
                f"http://127.0.0.1:{p}/v1/chat/completions",
                json={
                    "model": "llama-3-8b",
                    "stream": True,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            assert s.status_code == 200 and s.text.rstrip().endswith("data: [DONE]")
            # cache_aware sends repeats to the worker that holds them: later rounds hit
            assert all(x > 0 for x in cached[len(prompts) :]), cached
            served = [
                float(
                    next(
                        l.split()[-1]
                        for l in c.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
                        if l.startswith("radixfleet_agent_requests_finished_total")
                    )
                )
                for port in (a, b)
            ]
            assert sum(served) == 3 * len(prompts) + 1
        # the probes name no model_path, so smg never tries to fetch a tokenizer off loopback
        log = router.stop()
        assert "huggingface" not in log.lower(), log[-2000:]


async def test_an_agent_with_a_dram_tier_reads_back_and_reports_only_gpu_blocks():
    """A prefix HBM evicted comes back from DRAM (cached again, the read-back counted);
    the router's view holds only what HBM holds: the CPU tier never reaches it."""
    rport, a = free_port(), free_port()
    fake = FakeRouter()
    await fake.start(rport)
    router = f"http://127.0.0.1:{rport}"

    def body(word: str) -> dict:
        text = " ".join(f"{word}{i:04d}" for i in range(420))  # ~1,000 tokens
        return {"model": "llama-3-8b", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}

    argv = [*agent_argv(a, "--router", router, "--worker-id", "wa", "--dram-tokens", "4x")]
    argv[argv.index("50000")] = "1800"  # HBM holds one of the two prompts
    try:
        with Proc(argv, env={"RADIXFLEET_AGENT_TOKEN": "tok"}, ready_url=f"http://127.0.0.1:{a}/health"):
            await until(lambda: "wa" in {r["worker_id"] for r in fake.registrations})
            ka, kb = request_key(Endpoint.CHAT, body("alpha")), request_key(Endpoint.CHAT, body("beta"))
            url = f"http://127.0.0.1:{a}/v1/chat/completions"
            async with httpx.AsyncClient(timeout=10) as c:
                await c.post(url, json=body("alpha"))
                await asyncio.sleep(0.2)  # the write-down lands (ms of PCIe time)
                await c.post(url, json=body("beta"))  # evicts alpha from HBM
                await until(lambda: not set(ka.hashes) & set(fake.held.get("wa", {})))
                await asyncio.sleep(0.2)
                r3 = (await c.post(url, json=body("alpha"))).json()
                metrics = (await c.get(f"http://127.0.0.1:{a}/metrics")).text
            assert "usage" in r3, r3
            assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024  # 4 chunks from DRAM
            read_back = next(
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("radixfleet_agent_dram_cached_tokens")
            )
            assert read_back > 768  # a few template tokens are shared with beta, still in HBM
            # alpha is back on the GPU, beta (in DRAM too) was evicted from HBM: not held
            await until(
                lambda: (
                    set(ka.hashes) <= set(fake.held.get("wa", {}))
                    and not set(kb.hashes) & set(fake.held.get("wa", {}))
                )
            )
    finally:
        await fake.stop()
