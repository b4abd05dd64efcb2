"""Lean HTTP/1.1 endpoints for ``bench proxy``: an upstream and a counting client.

The proxy benchmark compares what a router adds on the wire, so neither end may
be the bottleneck or hide what is measured:

``LeanUpstream``
    An OpenAI-shaped worker on ``asyncio.Protocol`` + httptools (a few µs of CPU
    per request, far below any proxy's), keep-alive, no pipelining. ``POST`` to
    ``/v1/completions`` (or the two other data-plane paths) answers a tiny
    completion; with ``"stream": true`` it answers ``chunks`` SSE events and
    ``data: [DONE]``, chunked transfer encoding, **each event its own
    ``transport.write`` in its own event-loop turn** (one send() each, TCP_NODELAY),
    so a proxy really relays that many separate chunks. ``first_s`` / ``gap_s``
    (default 0) delay the first event and space the later ones, an engine's TTFT
    and inter-token gap (timers, no CPU spent waiting). ``GET /health`` and ``GET
    /v1/models`` answer what routers probe; anything else is a JSON 404.

``LeanClient``
    One keep-alive connection, one request at a time (``await request()``), timed
    from the write of the request to the end of the response. For SSE answers it
    **counts the events that arrive** (blank-line terminated, across read
    boundaries, after de-chunking) and whether ``[DONE]`` ended them — chunks per
    second are counted at the client, not computed.

Both run on the caller's event loop; ``python -m radixfleet_tools.bench.proxy
lean-upstream --port P --chunks N`` serves the upstream in its own process.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Self

import httptools

_DATA_PATHS = (b"/v1/completions", b"/v1/chat/completions", b"/generate")

_COMPLETION = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
_EVENT = (
    b"data: "
    + json.dumps(
        {
            "id": "c",
            "object": "text_completion",
            "model": "tiny",
            "choices": [{"index": 0, "text": "x", "finish_reason": None}],
        }
    ).encode()
    + b"\n\n"
)
_DONE_EVENT = b"data: [DONE]\n\n"
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "lean"}]}
).encode()


def _reply(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + ctype
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


_OK = _reply(b"200 OK", _COMPLETION)
_HEALTH = _reply(b"200 OK", b"ok", b"text/plain")
_MODELS_REPLY = _reply(b"200 OK", _MODELS)
_NOT_FOUND = _reply(b"404 Not Found", b'{"error":{"message":"not found"}}')
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)
_EVENT_CHUNK = _chunk(_EVENT)
_DONE_CHUNK = _chunk(_DONE_EVENT)
_LAST_CHUNK = b"0\r\n\r\n"


class _UpstreamConn(asyncio.Protocol):
    """One client connection of ``LeanUpstream``. Reading pauses while a stream
    is being written (no pipelining), so requests are answered in order."""

    __slots__ = ("server", "transport", "parser", "url", "body", "left", "loop")

    def __init__(self, server: LeanUpstream) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None  # set by connection_made
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.left = 0  # SSE writes still to make for the stream in progress
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None, "data arrives after connection_made"
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        t = self.transport
        assert t is not None, "data arrives after connection_made"
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        body = b"".join(self.body)
        self.body.clear()
        self.server.requests += 1
        if method == b"POST" and path in _DATA_PATHS:
            stream = False
            if b'"stream"' in body:
                try:
                    stream = json.loads(body).get("stream") is True
                except (ValueError, AttributeError):
                    stream = False
            if stream:
                self.server.streams += 1
                t.write(_SSE_HEAD)
                t.pause_reading()
                self.left = self.server.chunks
                self._after(self.server.first_s)
            else:
                t.write(_OK)
        elif method == b"GET" and path == b"/health":
            t.write(_HEALTH)
        elif method == b"GET" and path == b"/v1/models":
            t.write(_MODELS_REPLY)
        else:
            t.write(_NOT_FOUND)

    def _after(self, delay_s: float) -> None:
        if delay_s > 0:
            self.loop.call_later(delay_s, self._next)
        else:
            self.loop.call_soon(self._next)

    def _next(self) -> None:
        """One SSE write per event-loop turn: separate sends, never one blob."""
        t = self.transport
        assert t is not None, "scheduled from on_message_complete"
        if t.is_closing():
            return
        if self.left > 0:
            self.left -= 1
            t.write(_EVENT_CHUNK)
            self.server.chunks_sent += 1
            self._after(self.server.gap_s if self.left > 0 else 0.0)
            return
        elif self.left == 0:
            self.left = -1
            t.write(_DONE_CHUNK)
        else:
            t.write(_LAST_CHUNK)
            t.resume_reading()
            return
        self.loop.call_soon(self._next)


class LeanUpstream:
    """The benchmark's upstream (module docstring). ``await start(port)`` then
    ``close()``; counters say what it served."""

    def __init__(self, chunks: int = 64, *, first_s: float = 0.0, gap_s: float = 0.0) -> None:
        self.chunks = chunks
        self.first_s = first_s  # before the first event (TTFT)
        self.gap_s = gap_s  # between events (inter-token gap)
        self.requests = 0
        self.streams = 0
        self.chunks_sent = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self, port: int, host: str = "127.0.0.1") -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _UpstreamConn(self), host, port, backlog=2048)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


class _Answer:
    """What one request got back."""

    __slots__ = ("status", "latency_s", "events", "done", "bytes")

    def __init__(self) -> None:
        self.status = 0
        self.latency_s = 0.0
        self.events = 0  # SSE events received (blank-line terminated)
        self.done = False  # the last event was data: [DONE]
        self.bytes = 0


class LeanClient(asyncio.Protocol):
    """One keep-alive connection; one request in flight at a time (module docstring).

    Usage::

        c = await LeanClient.connect("127.0.0.1", port)
        ans = await c.request(raw_request_bytes)   # raises ConnectionError if lost
        c.close()
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None  # set by connection_made
        self.parser = httptools.HttpResponseParser(self)
        self._fut: asyncio.Future | None = None
        self._ans: _Answer | None = None
        self._t0 = 0.0
        self._last = b""  # the previous body piece's last byte (a split blank line)
        self._tail = b""  # the end of the body so far, to see [DONE] last

    @classmethod
    async def connect(cls, host: str, port: int) -> Self:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(cls, host, port)
        return proto

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        f = self._fut
        if f is not None and not f.done():
            f.set_exception(ConnectionError(f"connection lost mid-response ({exc or 'eof'})"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            f = self._fut
            if f is not None and not f.done():
                f.set_exception(ConnectionError(f"bad response: {exc}"))
            assert self.transport is not None, "data arrives after connection_made"
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        a = self._ans
        assert a is not None, "an answer arrives for a request() in flight"
        a.bytes += len(body)
        n = body.count(b"\n\n")
        if self._last == b"\n" and body[:1] == b"\n":
            n += 1
        a.events += n
        self._last = body[-1:]
        self._tail = (self._tail + body)[-len(_DONE_EVENT) :]

    def on_message_complete(self) -> None:
        a = self._ans
        assert a is not None, "an answer arrives for a request() in flight"
        a.latency_s = time.perf_counter() - self._t0
        a.status = self.parser.get_status_code()
        a.done = self._tail == _DONE_EVENT
        f = self._fut
        self._fut = None
        if f is not None and not f.done():
            f.set_result(a)

    async def request(self, raw: bytes) -> _Answer:
        if self._fut is not None:
            raise RuntimeError("LeanClient: one request at a time")
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("connection closed")
        self._ans = _Answer()
        self._last = self._tail = b""
        self._fut = asyncio.get_running_loop().create_future()
        self._t0 = time.perf_counter()
        self.transport.write(raw)
        return await self._fut

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def post_request(host: str, port: int, path: str, body: dict) -> bytes:
    """The raw bytes of a keep-alive JSON POST."""
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data
