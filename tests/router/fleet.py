"""A router in front of in-process fake agents on loopback (the ``fleet`` fixture), for the
router's front-door tests."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet_tools.agent.server import AgentConfig, create_app
from radixfleet_tools.bench.proxy import upstream_app
from radixfleet_tools.harness.procs import free_port

HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1, "success_threshold": 1}


PROMPT = "The shared system prompt of tenant acme, long enough for blocks. " * 6


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def until(pred, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


class Fleet:
    """A router (raw front) and what it fronts; ``aclose`` stops everything."""

    def __init__(self) -> None:
        self.closers: list = []
        self.router: Router | None = None
        self.base = ""
        self.port = 0
        self.admin = ""  # the admin listener's base URL: /admin/*, /metrics
        self.admin_port = 0

    async def upstream(self, name: str, model: str = "m", **kw) -> str:
        runner, url = await serve_app(upstream_app(name, model=model, **kw))
        self.closers.append(runner.cleanup)
        return url

    async def agent(self, served: str, *, register: bool = True, tracing=None, **kw) -> tuple[str, object]:
        """An in-process agent (simulated engine) serving ``served``; registered
        with the router (its reporter) unless ``register`` is False; its spans to
        ``tracing`` (radixfleet.common.tracing), if given."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cfg = AgentConfig(
            kv_tokens=kw.pop("kv_tokens", 200_000),
            served_model_name=served,
            worker_id=kw.pop("worker_id", served),
            **kw,
        )
        app = create_app(cfg, routers=[self.base] if register else None, advertise_url=url, tracing=tracing)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.closers.append(runner.cleanup)
        return url, app

    async def start(self, raw: dict, *, tracing=None) -> Fleet:
        """The router for ``raw`` (its spans to ``tracing``, if given) listening."""
        # answers name their worker: the tests check where requests went
        self.router = Router(parse_config({"health": HEALTH, "response_headers": {"worker_id": True}, **raw}))
        self.router.dataplane.use_tracing(tracing)
        server = RouterServer(self.router, port=free_port(), admin_port=0)
        self.port = await server.start()
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin_port = server.admin_port
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.closers.insert(0, server.aclose)
        return self

    def past_grace(self) -> None:
        """Unknown models answer 404 from now on (not 503 + Retry-After)."""
        self.router.pool.started = time.monotonic() - 3600

    async def routable(self, n: int) -> None:
        await until(lambda: len(self.router.pool.views(time.monotonic())) >= n, what=f"{n} routable workers")

    async def aclose(self) -> None:
        for c in self.closers:
            await c()


@pytest.fixture
async def fleet():
    f = Fleet()
    yield f
    await f.aclose()
