"""Calls to router replicas on a bus, for the bus tests: a chat request, a tenant's paced load, a
metric read, a bounded wait."""

from __future__ import annotations

import asyncio
import functools
import time

import httpx

from radixfleet.server.app import Router

SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 8


def bounded(timeout_s: float = 120.0):
    """Every async test here is bounded: a lost wake-up (a server that never comes
    back, a close that never returns) fails the test instead of stalling the run."""

    def deco(fn):
        @functools.wraps(fn)
        async def run(*args, **kwargs):
            await asyncio.wait_for(fn(*args, **kwargs), timeout_s)

        return run

    return deco


async def wait_for(pred, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def metric(router: Router, name: str, **labels) -> float:
    v = router.metrics.registry.get_sample_value(name, labels or None)
    return v or 0.0


async def chat(
    c: httpx.AsyncClient, base: str, text: str, max_tokens: int = 4, system: str = SYSTEM
) -> httpx.Response:
    return await c.post(
        base + "/v1/chat/completions",
        json={
            "model": "llama-3-8b",
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
        },
    )


async def tenant_load(bases: list[str], tenant: str, per_s: float, seconds: float) -> list[int]:
    """Completions from ``tenant`` (``x-tenant-id``) at ``per_s`` a second for
    ``seconds``, in turn to each of ``bases``; their status codes."""
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=30) as c:

        async def one(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            r = await c.post(
                bases[i % len(bases)] + "/v1/completions",
                json={"model": "llama-3-8b", "prompt": f"request {i}", "max_tokens": 1},
                headers={"x-tenant-id": tenant},
            )
            statuses.append(r.status_code)

        t0 = time.monotonic()
        await asyncio.gather(*(one(i, t0 + i / per_s) for i in range(int(per_s * seconds))))
    return statuses
