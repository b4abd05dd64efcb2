"""A router process in front of fake upstreams (the ``fleet`` fixture) and raw HTTP/1.1
requests to it, for the front-door wire tests."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from radixfleet.config import parse_config
from radixfleet.server.app import Router, RouterServer
from radixfleet_tools.bench.proxy import upstream_app
from radixfleet_tools.harness.procs import free_port

HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1, "success_threshold": 1}


@pytest.fixture
async def fleet():
    up = web.AppRunner(upstream_app("u", chunks=3, model="m"), access_log=None)
    await up.setup()
    up_port = free_port()
    await web.TCPSite(up, "127.0.0.1", up_port).start()
    url = f"http://127.0.0.1:{up_port}"
    router = Router(
        parse_config(
            {
                "workers": [{"url": url, "id": "u"}],
                "health": HEALTH,
                "limits": {"max_body_bytes": 4096},
                "policy": {"name": "round_robin"},
                "response_headers": {"worker_id": True},  # the tests count answers by it
            }
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    deadline = time.monotonic() + 5
    while not router.pool.views(time.monotonic()):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    yield router, port, url, server.admin_port
    await server.aclose()
    await up.cleanup()


async def raw(port: int, data: bytes, *, until: bytes = b"", read_s: float = 1.0) -> bytes:
    """Sends ``data`` on one connection; reads until ``until`` is seen (or EOF/timeout)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    out = b""
    deadline = time.monotonic() + read_s
    try:
        while time.monotonic() < deadline and not (until and out.count(until) and until in out):
            try:
                chunk = await asyncio.wait_for(r.read(65536), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        w.close()
    return out


def post(path: str, body: bytes, extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return b"POST %s %s\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        path,
        version,
        len(body),
        extra,
        body,
    )


BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()
