"""The raw HTTP/1.1 front (radixfleet.server.front.FrontServer) on the wire: keep-alive,
pipelining, chunked request bodies, Expect: 100-continue, HTTP/1.0, malformed
requests, the data port's other routes (probes, 404 / 405) pipelined with the data
plane's, and the admin listener apart. Plus warm-ups and /metrics."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import subprocess
import time
import tracemalloc
import weakref

import httpx
import pytest
from aiohttp import web

from radixfleet.config import parse_config
from radixfleet.keys import Endpoint, request_key
from radixfleet.server import intake
from radixfleet.server.app import Router, RouterServer
from radixfleet.server.front import FrontServer, Route
from radixfleet.server.slow_clients import ClientDropped, SlowClients
from radixfleet_tools.bench.proxy import upstream_app
from radixfleet_tools.harness.procs import free_port, radixfleet_argv
from tests.router.front_fleet import (
    BODY,
    HEALTH,
    fleet,  # noqa: F401  (fixtures)
    post,
    raw,
)

pytestmark = pytest.mark.integration


async def test_keepalive_pipelining_with_a_probe(fleet):
    router, port, _, _ = fleet
    data = (
        post(b"/v1/completions", BODY)
        + post(b"/generate", b'{"text": "hi"}')
        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    out = await raw(port, data, until=b'{"status": "ok"}')
    assert out.count(b"HTTP/1.1 200 OK") == 3, out
    assert out.count(b"x-radixfleet-worker: u") == 2
    assert out.endswith(b'{"status": "ok"}')


async def test_chunked_body_and_expect_continue(fleet):
    router, port, _, _ = fleet
    half = len(BODY) // 2
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Expect: 100-continue\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (half, BODY[:half], len(BODY) - half, BODY[half:])
    )
    out = await raw(port, chunked, until=b'"total_tokens": 2}}')
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK"), out
    big = b'{"model": "m", "prompt": "' + b"y" * 5000 + b'"}'
    out = await raw(port, post(b"/v1/completions", big))
    assert out.startswith(b"HTTP/1.1 413"), out
    assert b"Connection: close" in out and b"exceeds the limit of 4096" in out
    chunked_big = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
        b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
    )
    out = await raw(port, chunked_big)
    assert out.startswith(b"HTTP/1.1 413"), out


async def test_http10_and_malformed_requests(fleet):
    router, port, _, _ = fleet
    out = await raw(port, post(b"/v1/completions", BODY, version=b"HTTP/1.0"))
    assert out.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in out
    stream = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    out = await raw(port, post(b"/v1/completions", stream, version=b"HTTP/1.0"))
    assert b"Transfer-Encoding" not in out and out.endswith(b"data: [DONE]\n\n"), out
    for bad, status in (
        (b"POST /v1/completions\r\n\r\n", b"400"),
        (b"POST /v1/completions HTTP/1.1\r\nBad Header Line\r\n\r\n", b"400"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n", b"400"),
        (
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
            b"400",
        ),
        (b"POST /v1/completions HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", b"431"),
    ):
        out = await raw(port, bad)
        assert out.startswith(b"HTTP/1.1 " + status), (bad[:60], out[:200])
        assert b'"error"' in out
    # unknown paths and methods: JSON 404 / 405, answered by the front itself
    out = await raw(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", until=b"}}")
    assert out.startswith(b"HTTP/1.1 404") and b"unknown path /nope" in out
    out = await raw(port, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", until=b"}}")
    assert out.startswith(b"HTTP/1.1 405")
    # and the router still serves
    async with httpx.AsyncClient() as c:
        r = await c.post(f"http://127.0.0.1:{port}/v1/completions", content=BODY)
        assert r.status_code == 200


async def test_metrics_exposes_the_documented_series(fleet):
    router, port, _, admin_port = fleet
    async with httpx.AsyncClient() as c:
        base = f"http://127.0.0.1:{port}"
        for _ in range(3):
            await c.post(base + "/v1/completions", content=BODY)
        await c.post(base + "/v1/completions", content=b"{")
        text = (await c.get(f"http://127.0.0.1:{admin_port}/metrics")).text
    for name in (
        'radixfleet_requests_total{reason="round_robin",status="200",worker="u"} 3.0',
        'radixfleet_rejected_total{code="malformed_request",status="400"} 1.0',
        "radixfleet_request_seconds_count 3.0",
        'radixfleet_in_flight{worker="u"} 0.0',
        'radixfleet_worker_breaker_state{worker="u"} 0.0',
        'radixfleet_worker_healthy{worker="u"} 1.0',
        "radixfleet_index_nodes",
        "radixfleet_index_bytes",
        "radixfleet_events_applied_total",
        "radixfleet_retries_total",
        "radixfleet_config_reload_failures_total",
        "radixfleet_ttfb_seconds_bucket",
    ):
        assert name in text, name


async def test_warmup_sends_prefill_only_request(fleet):
    router, port, url, _ = fleet
    body = {"model": "m", "prompt": "The shared system prompt. " * 20}
    key = request_key(Endpoint.COMPLETIONS, body, tenant=router.salts.salt("t"))
    router.dataplane.warm.schedule(("u",), Endpoint.COMPLETIONS, body, key, 3, time.monotonic())
    router.dataplane.warm.schedule(("u",), Endpoint.COMPLETIONS, body, key, 3, time.monotonic())
    async with httpx.AsyncClient() as c:
        deadline = time.monotonic() + 3
        while True:
            stats = (await c.get(url + "/stats")).json()
            if stats["requests"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
    assert stats["requests"] == 1  # the second one was within min_interval_s
    assert stats["tenants"] == [router.salts.salt("t")] and stats["paths"] == ["/v1/completions"]
    assert router.metrics.warmups.labels("ok")._value.get() == 1


async def test_graceful_close_finishes_in_flight(fleet):
    _, _, url, _ = fleet
    router = Router(parse_config({"workers": [{"url": url}], "health": HEALTH}))
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 5
    while not router.pool.views(time.monotonic()):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    async with httpx.AsyncClient(timeout=10) as c:
        slow = asyncio.create_task(
            c.post(base + "/v1/completions", json={"model": "m", "prompt": "x", "delay_s": 0.5})
        )
        deadline = time.monotonic() + 5
        while server._front.in_flight() != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(server.aclose())
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.ConnectError):
            await c.post(base + "/v1/completions", content=BODY)  # no longer accepting
        r = await slow
        await closing
    assert r.status_code == 200
    await server.aclose()  # idempotent


async def test_stale_keepalive_upstream_connection_is_replaced_transparently():
    # an upstream that closes idle keep-alive connections after 0.1 s
    seen: list = []  # the router's (client) port of every completion the upstream served

    @web.middleware
    async def peer(request, handler):
        if request.path == "/v1/completions":  # not the health checks
            seen.append(request.transport.get_extra_info("peername")[1])
        return await handler(request)

    app = upstream_app("k", model="m")
    app.middlewares.append(peer)
    up = web.AppRunner(app, access_log=None, keepalive_timeout=0.1)
    await up.setup()
    up_port = free_port()
    await web.TCPSite(up, "127.0.0.1", up_port).start()
    # one slow health check on a loaded CI machine is not what this test is about:
    # HEALTH's failure_threshold 1 turned it into a 503 once
    router = Router(
        parse_config(
            {
                "workers": [{"url": f"http://127.0.0.1:{up_port}"}],
                "health": {**HEALTH, "failure_threshold": 3},
                "retries": {"max_attempts": 1},
            }
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    try:
        deadline = time.monotonic() + 5
        while not router.pool.views(time.monotonic()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        pool = router.upstream
        async with httpx.AsyncClient() as c:
            for i in range(3):
                r = await c.post(f"http://127.0.0.1:{port}/v1/completions", content=BODY)
                assert r.status_code == 200, r.text
                # wait (bounded) until the upstream has dropped the idle connection
                deadline = time.monotonic() + 10
                while not all(conn.closed for q in pool._idle.values() for conn in q):
                    assert time.monotonic() < deadline, "upstream never closed the idle connection"
                    await asyncio.sleep(0.02)
                assert pool.connects == i + 1
        pool.check()
        # every request went out on a fresh connection, none on a dead one
        assert len(seen) == 3 and len(set(seen)) == 3, seen
        assert pool.connects == 3
        assert router.metrics.retries.labels("connect")._value.get() == 0
    finally:
        await server.aclose()
        await up.cleanup()


async def test_a_request_a_worker_drops_unanswered_is_never_sent_again():
    """The race the idle check cannot see (a worker closes a keep-alive connection as
    the next request goes out on it) looks exactly like a worker that read the request
    and hung up: either may have run it, so it is sent once (``NoAnswer``), never
    again on a fresh connection."""
    from radixfleet.server.upstream import NoAnswer, UpstreamPool, build_head

    served: list[tuple[int, int]] = []  # (connection number, request number on it)
    conns = 0

    async def handle(reader, writer):
        nonlocal conns
        conns += 1
        me, n = conns, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                n += 1
                served.append((me, n))
                if me == 1 and n == 2:  # read it (maybe ran it), then closed, no answer
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    up_port = srv.sockets[0].getsockname()[1]
    pool = UpstreamPool()
    head = build_head("/v1/completions", f"127.0.0.1:{up_port}", len(BODY), b"")

    async def send():
        return await pool.request("127.0.0.1", up_port, head, BODY, read_timeout_s=5, total_timeout_s=10)

    try:
        resp = await send()
        assert resp.status == 200 and await resp.read() == b"{}"
        resp.release()
        with pytest.raises(NoAnswer):  # on the reused connection: dropped unanswered
            await send()
        assert served == [(1, 1), (1, 2)]  # run once, not re-sent on a fresh connection
        assert pool.connects == 1 and pool.idle_count() == 0
        pool.check()
    finally:
        await pool.aclose()
        srv.close()
        await srv.wait_closed()


async def test_an_idle_connection_is_reused_only_within_keepalive_s():
    """A connection idle longer than ``keepalive_s`` (below the workers' own keep-alive
    timeout) is closed, not reused: a request is never written onto a connection the
    worker may be closing."""
    from radixfleet.server.upstream import UpstreamPool, build_head

    peers: list[int] = []

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                peers.append(writer.get_extra_info("peername")[1])
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    up_port = srv.sockets[0].getsockname()[1]
    pool = UpstreamPool(keepalive_s=0.2)
    head = build_head("/v1/completions", f"127.0.0.1:{up_port}", len(BODY), b"")
    try:
        for pause in (0.0, 0.05, 0.4, 0.0):
            await asyncio.sleep(pause)
            resp = await pool.request("127.0.0.1", up_port, head, BODY, read_timeout_s=5, total_timeout_s=10)
            assert await resp.read() == b"{}"
            resp.release()
            pool.check()
        # reused after 0.05 s, a fresh one after 0.4 s (the idle one closed), reused again
        assert peers[0] == peers[1] != peers[2] == peers[3] and pool.connects == 2
        assert pool.idle_count() == 1
        off = UpstreamPool(keepalive_s=0)
        for _ in range(2):
            resp = await off.request("127.0.0.1", up_port, head, BODY, read_timeout_s=5, total_timeout_s=10)
            await resp.read()
            resp.release()
        assert off.connects == 2 and off.idle_count() == 0
        await off.aclose()
    finally:
        await pool.aclose()
        srv.close()
        await srv.wait_closed()


async def test_a_pipeline_ending_in_a_probe_split_at_every_size(fleet):
    """Data-plane requests (Content-Length and chunked) pipelined before a probe, read
    in pieces that end anywhere inside them: each answered in order, and every body
    byte taken from the body budget is given back."""
    router, port, _, _ = fleet
    chunked = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'5\r\n{"tex\r\n9\r\nt": "hi"}\r\n0\r\n\r\n'
    )
    data = (
        post(b"/v1/completions", BODY)
        + chunked
        + post(b"/v1/completions", BODY)
        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    for size in (1, 7, 64, len(data) - 3):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        for i in range(0, len(data), size):
            w.write(data[i : i + size])
            await w.drain()
            await asyncio.sleep(0.001)
        out = b""
        deadline = time.monotonic() + 5
        while not out.endswith(b'{"status": "ok"}') and time.monotonic() < deadline:
            out += await asyncio.wait_for(r.read(65536), deadline - time.monotonic())
        w.close()
        assert out.count(b"HTTP/1.1 200 OK") == 4, (size, out)
        assert out.count(b"x-radixfleet-worker: u") == 3, (size, out)
    assert router.body_budget.held == 0
    router.body_budget.check()


async def test_a_chunked_body_with_extensions_and_trailers_then_a_probe_at_every_split(fleet):
    """A chunked data-plane body with chunk extensions, a last-chunk extension,
    trailer fields, and a probe pipelined right behind, read in pieces that end
    anywhere — each answered, in order."""
    router, port, _, _ = fleet
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'7;name=value\r\n{"model\r\n1d\r\n": "m", "prompt": "hi there"}\r\n0;last\r\n'
        b"X-Trailer: one\r\nX-Other: two\r\n\r\n"
    )
    data = chunked + post(b"/v1/completions", BODY) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    for size in (1, 2, 5, 13, len(chunked) - 1, len(chunked), len(chunked) + 1):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        for i in range(0, len(data), size):
            w.write(data[i : i + size])
            await w.drain()
            await asyncio.sleep(0.001)
        out = b""
        deadline = time.monotonic() + 5
        while not out.endswith(b'{"status": "ok"}') and time.monotonic() < deadline:
            out += await asyncio.wait_for(r.read(65536), deadline - time.monotonic())
        w.close()
        assert out.count(b"HTTP/1.1 200 OK") == 3, (size, out)
        assert out.endswith(b'{"status": "ok"}'), (size, out)
    assert router.body_budget.held == 0


async def test_a_chunked_body_is_held_once():
    """An 8 MiB chunked body, sent in 64 KiB chunks, reaches the handler as one buffer
    and is held once while it arrives: the traced peak stays within 1.5x its size
    (the raw bytes kept for finding the next request's start, the chunks in a list
    and their join made it 3x)."""
    size, piece = 8 << 20, b"x" * (64 << 10)
    seen: dict = {}

    async def handler(ex) -> None:
        body = await ex.body(32 << 20)
        seen["peak"] = tracemalloc.get_traced_memory()[1]
        seen["len"] = len(body)
        seen["ok"] = body.count(b"x") == size
        del body
        ex.reply(200, b"{}", "application/json", [])

    front = FrontServer({b"/v1/completions": {b"POST": Route(handler)}}, lambda: 32 << 20)
    port = await front.start("127.0.0.1", 0)
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    tracemalloc.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(size // len(piece)):
            w.write(frame)
            await w.drain()
        w.write(b"0\r\n\r\n")
        out = await asyncio.wait_for(r.readuntil(b"{}"), 30)
        w.close()
    finally:
        tracemalloc.stop()
        await front.aclose(1.0)
    assert out.startswith(b"HTTP/1.1 200"), out
    assert seen["len"] == size and seen["ok"]
    assert seen["peak"] - base < 1.5 * size, f"peak {(seen['peak'] - base) / size:.2f}x the body"


def _never_reads(port: int, requests: bytes) -> socket.socket:
    """A client with a 4 KiB receive buffer that sends ``requests`` and reads nothing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(requests)
    return s


async def _until(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.02)


async def test_a_reply_the_client_never_takes_holds_its_pipeline_then_is_dropped():
    """A 16 MiB reply to a client that pipelined a second request and reads nothing:
    the second is not served while the first is unsent (a buffer per reply, not per
    request pipelined), and the connection is reset once the client took nothing for
    client_idle_s, counted as ``idle``."""
    served: list[float] = []
    drops: list[str] = []

    async def handler(ex) -> None:
        await ex.body(1 << 20)
        served.append(time.monotonic())
        ex.reply(200, b"x" * (16 << 20), "application/octet-stream", [])

    front = FrontServer(
        {b"/v1/completions": {b"POST": Route(handler)}},
        lambda: 1 << 20,
        slow=SlowClients(lambda: 0.3, on_dropped=drops.append),
    )
    port = await front.start("127.0.0.1", 0)
    s = _never_reads(port, post(b"/v1/completions", b"{}") * 2)
    try:
        t0 = time.monotonic()
        await _until(lambda: drops, 5.0)
        assert drops == ["idle"] and len(served) == 1
        assert time.monotonic() - t0 >= 0.3
        await _until(lambda: not front._conns, 2.0)
        s.setblocking(False)
        with pytest.raises(ConnectionResetError):  # what it had buffered, then the reset
            while s.recv(1 << 20):
                pass
    finally:
        s.close()
        await front.aclose(1.0)


class _Chunk(bytearray):
    """A piece of a stream that a weak reference can follow."""


async def test_a_stream_the_client_never_reads_ends_at_the_total_deadline():
    """A stream to a client that reads nothing, with client_idle_s longer than the
    request's total deadline: the handler's write fails with ``ClientDropped`` at the
    deadline, counted as ``deadline``, and no reference cycle keeps what it wrote (the
    router's collector runs seldom: radixfleet.index.prefix_index); a client that reads gets the
    same stream whole."""
    ended: list = []
    drops: list[str] = []
    written: list[weakref.ref] = []

    async def handler(ex) -> None:
        await ex.body(1 << 20)
        await ex.stream_start("text/event-stream", [])
        t0 = time.monotonic()
        try:
            for _ in range(256):  # 16 MiB: more than any socket buffer holds
                chunk = _Chunk(64 << 10)
                written.append(weakref.ref(chunk))
                await ex.stream_write(chunk)
                del chunk
            await ex.stream_end()
            ended.append(("done", time.monotonic() - t0))
        except ClientDropped:
            ended.append(("dropped", time.monotonic() - t0))
            raise

    front = FrontServer(
        {b"/v1/completions": {b"POST": Route(handler)}},
        lambda: 1 << 20,
        slow=SlowClients(lambda: 60.0, lambda: 0.5, drops.append),
    )
    port = await front.start("127.0.0.1", 0)
    s = _never_reads(port, post(b"/v1/completions", b"{}"))
    gc.disable()
    try:
        await _until(lambda: ended, 5.0)
        assert ended[0][0] == "dropped" and 0.3 < ended[0][1] < 2.0, ended
        assert drops == ["deadline"]
        await _until(lambda: not front._conns, 2.0)
        await asyncio.sleep(0.05)
        assert [r for r in written if r() is not None] == [], "a cycle holds the dropped stream's writes"
        gc.enable()
        front.slow.total_s = lambda: 30.0
        out = await raw(port, post(b"/v1/completions", b"{}"), until=b"0\r\n\r\n", read_s=20.0)
        assert out.endswith(b"0\r\n\r\n") and ended[1][0] == "done", ended
    finally:
        gc.enable()
        s.close()
        await front.aclose(1.0)


async def test_a_stream_behind_a_probe_is_dropped_too():
    """GET /health, then a streamed completion the client never reads, on one
    connection: served under client_idle_s, so the client is dropped, counted, and
    its slot and upstream request freed."""
    up = web.AppRunner(upstream_app("u", model="m"), access_log=None)
    await up.setup()
    up_port = free_port()
    await web.TCPSite(up, "127.0.0.1", up_port).start()
    router = Router(
        parse_config(
            {
                "workers": [{"url": f"http://127.0.0.1:{up_port}", "id": "u"}],
                "health": HEALTH,
                "timeouts": {"client_idle_s": 0.3},
            }
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    port = await server.start()
    body = json.dumps(
        {"model": "m", "prompt": "hi", "stream": True, "chunks": 10**9, "events_per_write": 64}
    ).encode()
    s = None
    try:
        await _until(lambda: router.pool.views(time.monotonic()), 5.0)
        s = _never_reads(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post(b"/v1/completions", body))
        dropped = router.metrics.slow_clients_dropped.labels("idle")
        await _until(lambda: dropped._value.get() == 1, 10.0)
        await _until(lambda: router.dataplane.admission.active == 0, 2.0)
        assert router.pool.get("u").in_flight == 0
    finally:
        if s is not None:
            s.close()
        await server.aclose()
        await up.cleanup()


async def test_a_chunked_body_read_by_aiohttp_is_held_once():
    """The aiohttp side (the admin listener, an embedded app) reads a body the
    same way: an 8 MiB chunked body comes back from ``intake.read_body`` as one
    buffer, its traced peak within 1.5x its size (a list of chunks and their join
    made it 2x), and its bytes are taken from the body budget."""
    size, piece = 8 << 20, b"x" * (64 << 10)
    budget = intake.BodyBudget(64 << 20)
    seen: dict = {}

    async def handler(request: web.Request) -> web.Response:
        body = await intake.read_body(request, 32 << 20, 30.0, budget)
        seen["peak"] = tracemalloc.get_traced_memory()[1]
        seen["len"], seen["held"] = len(body), budget.held
        budget.give(len(body))
        del body
        return web.Response(text="{}")

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    tracemalloc.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(size // len(piece)):
            w.write(frame)
            await w.drain()
        w.write(b"0\r\n\r\n")
        out = await asyncio.wait_for(r.readuntil(b"{}"), 30)
        w.close()
    finally:
        tracemalloc.stop()
        await runner.cleanup()
    assert out.startswith(b"HTTP/1.1 200"), out
    assert seen["len"] == size and seen["held"] == size and budget.held == 0
    assert seen["peak"] - base < 1.5 * size, f"peak {(seen['peak'] - base) / size:.2f}x the body"


async def test_a_body_past_the_budget_is_refused_and_the_budget_given_back(fleet):
    """A body that would take the bytes held past ``limits.max_buffered_body_bytes``
    gets 429 + Retry-After (and the connection closes after the answer); a smaller
    one is served, and nothing stays held."""
    router, port, _, _ = fleet
    router.body_budget.limit = 64
    try:
        out = await raw(port, post(b"/v1/completions", BODY + b" " * 80), until=b"}}")
        assert out.startswith(b"HTTP/1.1 429"), out
        assert b"Retry-After: 1" in out and b"body_budget_exhausted" in out
        out = await raw(port, post(b"/v1/completions", BODY), until=b'"total_tokens": 2}}')
        assert out.startswith(b"HTTP/1.1 200"), out
    finally:
        router.body_budget.limit = 1 << 30
    assert router.body_budget.held == 0


async def test_the_admin_api_and_metrics_are_the_admin_listeners_alone(fleet):
    """The data port serves the data plane, /v1/models, the probes and the agent API;
    an admin path there is a JSON 404 saying an admin listener serves it (without its
    address); the admin listener serves /admin/*, /metrics, /openapi.json and the
    probes, and a data-port path there is a JSON 404 naming the data port."""
    router, port, _, admin_port = fleet
    data, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    assert admin_port not in (0, port)
    async with httpx.AsyncClient() as c:
        for path in ("/admin/workers", "/admin/index", "/metrics", "/openapi.json", "/admin"):
            r = await c.get(data + path)
            assert r.status_code == 404, (path, r.text)
            msg = r.json()["error"]["message"]
            assert "admin listener" in msg and str(admin_port) not in msg, msg
            assert (await c.get(admin + path)).status_code == (404 if path == "/admin" else 200), path
        r = await c.post(data + "/admin/workers", json={"url": "http://127.0.0.1:9"})
        assert r.status_code == 404 and "admin listener" in r.json()["error"]["message"]
        for path in ("/health", "/readiness"):
            assert (await c.get(data + path)).status_code == 200, path
            assert (await c.get(admin + path)).status_code == 200, path
        assert (await c.get(data + "/v1/models")).json()["data"][0]["id"] == "m"
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/internal/v1/register"),
        ):
            r = await c.request(method, admin + path, content=BODY)
            assert r.status_code == 404 and "data port" in r.json()["error"]["message"], (path, r.text)
        r = await c.request("DELETE", data + "/health")
        assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD", r.text
        # HEAD: a GET route's status and headers, no body, the connection kept
        for path in ("/health", "/readiness", "/v1/models"):
            head, get = await c.head(data + path), await c.get(data + path)
            assert head.status_code == get.status_code == 200 and head.content == b"", path
            assert head.headers["content-length"] == get.headers["content-length"], path
        head = await c.head(data + "/nope")
        assert head.status_code == 404 and head.content == b""
        assert (await c.get(data + "/health")).status_code == 200  # the connection still in step
    assert router.body_budget.held == 0


def test_an_admin_port_taken_is_one_line_and_exit_2():
    """Starting with the admin port (or the data port) taken: one line naming the
    key, exit 2, nothing left listening."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        for flags, key in (
            (["--port", str(free_port()), "--admin-port", str(busy)], "admin"),
            (["--port", str(busy), "--admin-port", str(free_port())], "listen"),
        ):
            p = subprocess.run(
                radixfleet_argv("router", "--worker", "http://127.0.0.1:9", *flags),
                capture_output=True,
                text=True,
                timeout=60,
            )
            lines = [ln for ln in p.stderr.splitlines() if " WARNING " not in ln and " INFO " not in ln]
            assert p.returncode == 2, (p.returncode, p.stderr)
            assert lines == [
                f"radixfleet router: error: {key}: cannot listen on 127.0.0.1:{busy}: "
                + lines[0].split(f"{busy}: ", 1)[1]
            ], lines
            assert "Traceback" not in p.stderr
