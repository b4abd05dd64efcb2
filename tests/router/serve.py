"""In-process routers and upstream agent processes on loopback, started and awaited until ready."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
from aiohttp import web

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet_tools.harness.procs import Proc, free_port

FAST_HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1, "success_threshold": 1}


async def start_app(app: web.Application, *, cancel: bool = True) -> tuple[web.AppRunner, str]:
    port = free_port()
    runner = web.AppRunner(app, access_log=None, handler_cancellation=cancel, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def start_router(raw: dict, *, front: bool = True, worker_header: bool = True):
    """A router on a free port: through the raw front (what ``radixfleet router``
    runs) or, with ``front=False``, the aiohttp app alone. ``worker_header``: answers
    name their worker (``response_headers.worker_id``, which the tests read); False
    leaves the key at its default."""
    raw = {
        "health": FAST_HEALTH,
        **({"response_headers": {"worker_id": True}} if worker_header else {}),
        **raw,
    }
    router = Router(parse_config(raw))
    if front:
        server = RouterServer(router, port=free_port(), admin_port=0)
        port = await server.start()
        base = f"http://127.0.0.1:{port}"
    else:
        server, base = await start_app(router.app)
    await wait_ready(base)
    return router, server, base


def admin_base(server, base: str) -> str:
    """Where ``start_router``'s router serves /admin/* and /metrics: its admin
    listener behind the raw front, ``base`` itself for the aiohttp app alone."""
    port = getattr(server, "admin_port", None)
    return base if port is None else f"http://127.0.0.1:{port}"


async def wait_ready(base: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            try:
                if (await c.get(base + "/readiness")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{base} not ready")


def upstream_proc(name: str, **flags) -> tuple[Proc, str]:
    flags.setdefault("model", "m")
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "radixfleet_tools.bench.proxy",
        "upstream",
        "--port",
        str(port),
        "--name",
        name,
    ]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    url = f"http://127.0.0.1:{port}"
    return Proc(argv, ready_url=url + "/health"), url
