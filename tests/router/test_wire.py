"""Edge cases of the front server's HTTP/1.1 parsing (httptools) on the wire:
requests split byte by byte, chunked bodies with trailers, a bad request behind a
good one, upgrades, oversize heads, and 413 in the middle of a chunked body."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.router.front_fleet import BODY, fleet, post, raw  # noqa: F401  (fleet: fixture)

pytestmark = pytest.mark.integration


async def test_requests_split_byte_by_byte_are_parsed_and_handed_over(fleet):
    _, port, _, _ = fleet
    data = (
        post(b"/v1/completions", BODY)
        + post(b"/generate", b'{"text": "hi"}')
        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i in range(len(data)):
            w.write(data[i : i + 1])
            await w.drain()
        out = b""
        while b'{"status": "ok"}' not in out:
            out += await asyncio.wait_for(r.read(65536), 3)
    finally:
        w.close()
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert out.endswith(b'{"status": "ok"}')


async def test_chunked_body_with_trailer_and_query_string(fleet):
    _, port, _, _ = fleet
    half = len(BODY) // 2
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n"
        % (half, BODY[:half], len(BODY) - half, BODY[half:])
    )
    out = await raw(
        port,
        chunked + post(b"/v1/completions?x=1", BODY) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        until=b'{"status": "ok"}',
        read_s=3,
    )
    assert out.count(b"HTTP/1.1 200 OK") == 3, out[:300]


async def test_a_bad_request_behind_a_good_one_gets_400_after_the_200(fleet):
    _, port, _, _ = fleet
    out = await raw(
        port,
        post(b"/v1/completions", BODY) + b"POST /v1/completions HTTP/1.1\r\nBad Header\r\n\r\n",
        read_s=2,
    )
    assert b"HTTP/1.1 200 OK" in out and b"HTTP/1.1 400" in out
    assert out.index(b"200 OK") < out.index(b"HTTP/1.1 400")
    body = out[out.rindex(b"\r\n\r\n") + 4 :]
    assert "error" in json.loads(body)


async def test_upgrade_and_http2_on_the_data_plane_are_400(fleet):
    _, port, _, _ = fleet
    out = await raw(
        port,
        b"POST /v1/completions HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: 0\r\n\r\n",
    )
    assert out.startswith(b"HTTP/1.1 400")
    out = await raw(port, b"POST /v1/completions HTTP/2.0\r\nContent-Length: 0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400")


async def test_oversize_head_is_431_and_a_60k_head_passes(fleet):
    _, port, _, _ = fleet
    out = await raw(port, b"POST /v1/completions HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431")
    head = (
        b"POST /v1/completions HTTP/1.1\r\nX-A: "
        + b"a" * 30000
        + b"\r\nX-B: "
        + b"b" * 30000
        + b"\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    )
    out = await raw(port, head + BODY, read_s=2)
    assert out.startswith(b"HTTP/1.1 200")


async def test_chunked_body_over_the_limit_is_413(fleet):
    _, port, _, _ = fleet  # the fixture's limit is 4096 bytes
    out = await raw(
        port,
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"1000\r\n" + b"a" * 4096 + b"\r\n10\r\n" + b"b" * 16 + b"\r\n0\r\n\r\n",
        read_s=2,
    )
    assert out.startswith(b"HTTP/1.1 413")


async def test_connection_close_ends_the_connection_after_the_reply(fleet):
    _, port, _, _ = fleet
    out = await raw(
        port,
        post(b"/v1/completions", BODY, extra=b"Connection: close\r\n") + post(b"/v1/completions", BODY),
        read_s=2,
    )
    assert out.count(b"HTTP/1.1 200 OK") == 1
