"""One request's exchange on a raw front connection (``radixfleet.server.front``): its head and
body as parsed, and its answer written to the client — a reply with its length, or
a stream (chunked; for HTTP/1.0 ended by the close) whose writes wait while the
client is slow to take them (``_FrontConn.drain``, within ``radixfleet.server.slow_clients``).

Invariant: ``state`` only moves forward (0 nothing sent, 1 replied, 2 streaming,
3 stream ended); a write to a connection already closed raises
``ConnectionResetError`` (a client gone), never writes.
"""

from __future__ import annotations

import http
import time as _time

from radixfleet.wire.errors import PayloadTooLarge

#: the reason phrase of every status code
PHRASES = {s.value: s.phrase.encode() for s in http.HTTPStatus}


class FrontExchange:
    """One request on a raw front connection (see ``Router.serve``); ``peer()`` its
    client's address and the listener's."""

    __slots__ = (
        "conn",
        "headers",
        "_body",
        "keepalive",
        "http10",
        "state",
        "too_large",
        "result",
        "refusal",
        "held",
        "deadline",
        "head_only",
    )

    def __init__(self, conn, req) -> None:
        self.conn = conn
        self.headers = req.headers  # lower-case names
        self._body = req.body  # handed on as it is: no copy
        req.body = b""
        self.keepalive = req.keepalive
        self.http10 = req.http10
        self.state = 0  # 0 nothing sent, 1 replied, 2 streaming, 3 stream ended
        self.too_large = req.too_large
        self.refusal = req.refusal
        self.held = req.held  # given back to the budget when the exchange ends
        req.held = 0
        self.result = None
        #: monotonic time the exchange must be over by, waits for its client included
        self.deadline = _time.monotonic() + conn.server.slow.total_s()
        #: a HEAD: its GET's answer is written without the body (its length kept)
        self.head_only = req.head_only

    def peer(self) -> tuple[str | None, tuple | None]:
        """(the client's IP address, the listener's sockname); None where unknown."""
        t = self.conn.transport
        remote = t.get_extra_info("peername")
        return (remote[0] if remote else None), t.get_extra_info("sockname")

    async def body(self, limit: int) -> bytes | bytearray:
        if self.refusal is not None:
            self.keepalive = False  # the rest of the body is never read
            raise self.refusal
        if self.too_large or len(self._body) > limit:
            self.keepalive = False  # the rest of the body is never read
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return self._body

    def _head(self, status: int, content_type: str, extra, framing: bytes) -> bytes:
        parts = [
            b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s"
            % (status, PHRASES.get(status, b"Unknown"), content_type.encode("latin-1"), framing)
        ]
        for k, v in extra:
            parts.append(k.encode("latin-1") + b": " + v.encode("utf-8", "surrogateescape") + b"\r\n")
        if not self.keepalive:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def reply(self, status: int, body: bytes, content_type: str, extra) -> None:
        conn = self.conn
        self.state = 1
        if conn.closed:
            return
        conn.transport.write(
            self._head(status, content_type, extra, b"Content-Length: %d\r\n" % len(body))
            + (b"" if self.head_only else body)
        )

    async def stream_start(self, content_type: str, extra) -> None:
        conn = self.conn
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        self.state = 2
        if self.http10:
            self.keepalive = False  # no chunked coding: the end of stream is the close
            framing = b""
        else:
            framing = b"Transfer-Encoding: chunked\r\n"
        conn.transport.write(self._head(200, content_type, extra, framing))

    async def stream_write(self, data: bytes) -> None:
        conn = self.conn
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        if not data or self.head_only:
            return
        if self.http10:
            conn.transport.write(data)
        else:
            conn.transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        if conn.paused:
            await conn.drain(self.deadline)

    async def stream_end(self) -> None:
        conn = self.conn
        self.state = 3
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        if not self.http10 and not self.head_only:
            conn.transport.write(b"0\r\n\r\n")
