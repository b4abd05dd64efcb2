"""The data plane's wire, both ends: a lean HTTP/1.1 upstream client with keep-alive
connection pools (``UpstreamPool``), and a raw HTTP/1.1 front for clients
(``FrontServer``, at the end of this module) that hands every non-data-plane
request to the aiohttp app on the same port.

Why not aiohttp's client: profiled behind the router it cost about two thirds of
each proxied request (request/response objects, header multidicts, payload
wrappers, timers). The router needs far less — POST a byte body with a handful
of fixed headers, get a status, a few headers and the body bytes (whole, or as
they arrive for SSE) — so this module does only that, on ``asyncio.Protocol``.

::

    UpstreamPool --acquire(host, port)--> _Conn (idle LIFO per host, or new)
        _Conn.request(head + body) --> Response: status, headers  (await head)
        Response.read()      whole body          Response.readany()  next bytes
        Response.release()   back to the idle list if complete and keep-alive,
                             else the connection is closed (also on cancellation)

Response framing: ``Content-Length``, ``Transfer-Encoding: chunked`` (decoded: the
payload bytes pass through unchanged, the transfer coding is hop-by-hop), or
until close. 1xx interim responses are skipped.

Failures raise ``UpstreamError`` subclasses with a ``cause`` label:
``ConnectFailed`` (cannot connect, or a reused idle connection died before any
byte — retried once on a fresh connection inside ``request``), ``UpstreamTimeout``
(connect, first byte, a silence between chunks, or the total deadline) and
``UpstreamBroken`` (the connection dropped or the bytes were not HTTP).

Invariants: a connection is in at most one place — an idle list, or serving one
``Response``; an idle connection has no response and an open transport; a
``Response`` in state DONE holds no waiter.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
import socket
import time as _time

from router.errors import PayloadTooLarge

_HEAD, _LEN, _CSIZE, _CDATA, _CCRLF, _TRAILER, _EOF, _DONE = range(8)
_MAX_HEAD = 64 * 1024


class UpstreamError(Exception):
    cause = "payload"


class ConnectFailed(UpstreamError):
    cause = "connect"


class UpstreamTimeout(UpstreamError):
    cause = "timeout"


class UpstreamBroken(UpstreamError):
    cause = "payload"


class Response:
    """One upstream response, parsed incrementally as bytes arrive."""

    __slots__ = ("status", "headers", "_conn", "_buf", "_state", "_remaining", "_chunks",
                 "_waiter", "_err", "_keepalive", "_head", "_got", "_timer", "_loop",
                 "_read_timeout", "_deadline")

    def __init__(self, conn: "_Conn", loop, read_timeout: float, deadline: float) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn = conn
        self._buf = bytearray()
        self._state = _HEAD
        self._remaining = 0
        self._chunks: list[bytes] = []  # body bytes not yet handed out
        self._waiter: asyncio.Future | None = None  # someone awaits head or bytes
        self._err: UpstreamError | None = None
        self._keepalive = True
        self._head = loop.create_future()
        self._got = False  # any response byte received
        self._timer = None
        self._loop = loop
        self._read_timeout = read_timeout
        self._deadline = deadline  # loop time the whole request must end by

    # ------------------------------------------------------------ consumer side

    async def wait_head(self) -> None:
        await self._wait(self._head)

    async def _wait(self, fut: asyncio.Future) -> None:
        loop = self._loop
        timeout = min(self._read_timeout, self._deadline - loop.time())
        if timeout <= 0:
            self._fail(UpstreamTimeout("total request deadline passed"))
        self._timer = loop.call_later(max(timeout, 0), self._on_timeout, fut)
        try:
            await fut
        finally:
            self._timer.cancel()
            self._timer = None

    def _on_timeout(self, fut: asyncio.Future) -> None:
        if not fut.done():
            what = "first byte" if fut is self._head else "next bytes"
            self._fail(UpstreamTimeout(f"no {what} within {self._read_timeout:g}s"
                                       if self._loop.time() < self._deadline
                                       else "total request deadline passed"))

    async def readany(self) -> bytes:
        """The body bytes received since the last call; ``b""`` at the end."""
        while True:
            if self._chunks:
                c = self._chunks
                out = c[0] if len(c) == 1 else b"".join(c)
                c.clear()
                return out
            if self._err is not None:
                raise self._err
            if self._state == _DONE:
                return b""
            fut = self._waiter = self._loop.create_future()
            await self._wait(fut)

    async def read(self) -> bytes:
        """The whole body."""
        while self._state != _DONE:
            if self._err is not None:
                raise self._err
            fut = self._waiter = self._loop.create_future()
            await self._wait(fut)
        if self._err is not None:
            raise self._err
        c = self._chunks
        out = c[0] if len(c) == 1 else b"".join(c)
        c.clear()
        return out

    def release(self) -> None:
        """Returns the connection to its pool if reusable, else closes it. Idempotent."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        conn.resp = None
        if self._state == _DONE and self._err is None and self._keepalive and not self._buf:
            conn.pool._put(conn)
        else:
            conn.close()

    # ------------------------------------------------------------ protocol side

    def _fail(self, err: UpstreamError) -> None:
        if self._err is None and self._state != _DONE:
            self._err = err
        self._keepalive = False
        for f in (self._head, self._waiter):
            if f is not None and not f.done():
                f.set_exception(err)
        self._waiter = None
        if self._conn is not None:
            self._conn.close()

    def _lost(self, exc: BaseException | None) -> None:
        if self._state == _EOF:
            self._state = _DONE
            self._keepalive = False
            self._wake()
            return
        if self._state != _DONE:
            if not self._got:
                self._fail(ConnectFailed(f"connection closed before a response ({exc or 'eof'})"))
            else:
                self._fail(UpstreamBroken(f"connection closed mid-response ({exc or 'eof'})"))

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._got = True
        buf = self._buf
        buf += data
        if self._state == _HEAD:
            if not self._parse_head():
                return
        self._parse_body()
        if self._chunks or self._state == _DONE:
            self._wake()

    def _parse_head(self) -> bool:
        buf = self._buf
        while True:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                if len(buf) > _MAX_HEAD:
                    self._fail(UpstreamBroken("response head too large"))
                return False
            lines = bytes(buf[:i]).split(b"\r\n")
            del buf[: i + 4]
            parts = lines[0].split(b" ", 2)
            try:
                status = int(parts[1])
                if not parts[0].startswith(b"HTTP/1."):
                    raise ValueError(parts[0])
            except (ValueError, IndexError):
                self._fail(UpstreamBroken(f"not an HTTP response: {lines[0][:80]!r}"))
                return False
            if 100 <= status < 200:
                continue  # interim response
            headers = {}
            for line in lines[1:]:
                k, sep, v = line.partition(b":")
                if sep:
                    headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
            self.status = status
            self.headers = headers
            if parts[0] == b"HTTP/1.0":
                self._keepalive = headers.get("connection", "").lower() == "keep-alive"
            elif headers.get("connection", "").lower() == "close":
                self._keepalive = False
            te = headers.get("transfer-encoding")
            cl = headers.get("content-length")
            if status in (204, 304):
                self._state = _DONE
            elif te is not None and "chunked" in te.lower():
                self._state = _CSIZE
            elif cl is not None:
                try:
                    self._remaining = int(cl)
                except ValueError:
                    self._fail(UpstreamBroken(f"bad Content-Length {cl!r}"))
                    return False
                self._state = _LEN if self._remaining else _DONE
            else:
                self._state = _EOF
                self._keepalive = False
            if not self._head.done():
                self._head.set_result(None)
            return True

    def _parse_body(self) -> None:
        buf = self._buf
        chunks = self._chunks
        while buf:
            st = self._state
            if st == _LEN or st == _CDATA:
                n = self._remaining
                if len(buf) <= n:
                    chunks.append(bytes(buf))
                    self._remaining = n - len(buf)
                    buf.clear()
                else:
                    chunks.append(bytes(buf[:n]))
                    del buf[:n]
                    self._remaining = 0
                if self._remaining == 0:
                    self._state = _DONE if st == _LEN else _CCRLF
            elif st == _CSIZE:
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                line = bytes(buf[:i]).split(b";", 1)[0].strip()
                del buf[: i + 2]
                try:
                    size = int(line, 16)
                except ValueError:
                    self._fail(UpstreamBroken(f"bad chunk size {line[:20]!r}"))
                    return
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._remaining = size
                    self._state = _CDATA
            elif st == _CCRLF:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    self._fail(UpstreamBroken("chunk not followed by CRLF"))
                    return
                del buf[:2]
                self._state = _CSIZE
            elif st == _TRAILER:
                if buf[:2] == b"\r\n":
                    del buf[:2]
                    self._state = _DONE
                else:
                    i = buf.find(b"\r\n\r\n")
                    if i < 0:
                        return
                    del buf[: i + 4]
                    self._state = _DONE
            elif st == _EOF:
                chunks.append(bytes(buf))
                buf.clear()
            else:  # _DONE with bytes left: the upstream sent more than it framed
                self._keepalive = False
                buf.clear()
                return


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an upstream."""

    __slots__ = ("pool", "key", "transport", "resp", "closed")

    def __init__(self, pool: "UpstreamPool", key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.resp: Response | None = None  # the response being received, if any
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:
            self.close()  # bytes nobody asked for: the connection is unusable
            return
        r._feed(data)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        r = self.resp
        if r is not None:
            r._lost(exc)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class UpstreamPool:
    """Keep-alive connections per (host, port); idle ones reused most-recent first."""

    def __init__(self, *, connect_timeout_s: float = 2.0, max_idle_per_host: int = 512) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = {}
        self._closed = False

    def _put(self, conn: _Conn) -> None:
        if self._closed or conn.closed:
            conn.close()
            return
        q = self._idle.get(conn.key)
        if q is None:
            q = self._idle[conn.key] = collections.deque()
        while q and q[0].closed:  # the oldest idle ones die first (upstream keep-alive)
            q.popleft()
        if len(q) >= self.max_idle:
            conn.close()
        else:
            q.append(conn)

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self, key), key[0], key[1]),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"connect to {key[0]}:{key[1]} timed out after "
                                  f"{self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: "
                                f"{exc.strerror or exc}") from None
        return conn

    async def request(self, host: str, port: int, head: bytes, body: bytes, *,
                      read_timeout_s: float, total_timeout_s: float) -> Response:
        """Sends ``head`` (request line and headers, ending in a blank line) and
        ``body``; returns once the response head arrived. The caller must
        ``release()`` the response on every path."""
        if self._closed:
            raise RuntimeError("UpstreamPool.request() after aclose()")
        loop = asyncio.get_running_loop()
        key = (host, port)
        deadline = loop.time() + total_timeout_s
        q = self._idle.get(key)
        for _ in range(2):
            conn = None
            reused = False
            while q:
                c = q.pop()
                if not c.closed:
                    conn, reused = c, True
                    break
            if conn is None:
                conn = await self._connect(key)
            resp = Response(conn, loop, read_timeout_s, deadline)
            conn.resp = resp
            if conn.closed:  # died between accept and now
                resp.release()
                if reused:
                    continue
                raise ConnectFailed(f"connection to {host}:{port} closed at once")
            t = conn.transport
            if len(body) < 16384:
                t.write(head + body)
            else:
                t.writelines((head, body))
            try:
                await resp.wait_head()
            except ConnectFailed:
                resp.release()
                if reused:
                    continue  # a stale keep-alive connection: once more, fresh
                raise
            except BaseException:
                resp.release()
                raise
            return resp
        raise ConnectFailed(f"connection to {host}:{port} failed twice")  # pragma: no cover

    def idle_count(self) -> int:
        return sum(len(q) for q in self._idle.values())

    async def aclose(self) -> None:
        """Closes idle connections; busy ones close when released. Idempotent."""
        self._closed = True
        for q in self._idle.values():
            while q:
                q.pop().close()
        self._idle.clear()

    def check(self) -> None:
        for key, q in self._idle.items():
            for c in q:
                assert c.key == key and c.resp is None, f"{c.key=} {key=}"


def build_head(path: str, hostport: str, body_len: int, extra: bytes) -> bytes:
    """The request line and headers of a JSON POST (``extra``: more header lines,
    each ending in CRLF)."""
    return (f"POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_len}\r\n").encode("latin-1") + extra + b"\r\n"


# ======================================================================= front
#
# The client-facing side of the data plane: a raw HTTP/1.1 server for the proxied
# POST paths. Everything else (admin, agents, metrics, probes, 404/405) is handed,
# at a request boundary, to the aiohttp application by swapping the transport's
# protocol — so one port serves both and the hot path skips aiohttp's request
# machinery.
#
#   _FrontConn states:  idle (no task) --head+body parsed--> busy (task running)
#                       --reply / stream end--> idle (keep-alive) | closed
#                       any state --non-data-plane request--> handed to aiohttp

log = logging.getLogger("radixfleet.front")

_PHRASES = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_MAX_PIPELINE = 1 << 20  # bytes buffered while a request is being served


class _PendingRequest:
    """A request whose head is parsed and whose body is still arriving."""

    __slots__ = ("handler", "headers", "keepalive", "http10", "need", "chunked", "body",
                 "cstate", "too_large")

    def __init__(self, handler, headers, keepalive, http10) -> None:
        self.handler = handler
        self.headers = headers
        self.keepalive = keepalive
        self.http10 = http10
        self.need = 0  # Content-Length still to read (or current chunk's remainder)
        self.chunked = False
        self.body = bytearray()
        self.cstate = _CSIZE  # chunked decoding state
        self.too_large = False


class FrontExchange:
    """One data-plane request on a raw front connection (see ``Router.serve``)."""

    __slots__ = ("conn", "headers", "_body", "keepalive", "http10", "state", "too_large",
                 "result")

    def __init__(self, conn: "_FrontConn", req: _PendingRequest) -> None:
        self.conn = conn
        self.headers = req.headers  # lower-case names
        self._body = bytes(req.body)
        self.keepalive = req.keepalive
        self.http10 = req.http10
        self.state = 0  # 0 nothing sent, 1 replied, 2 streaming, 3 stream ended
        self.too_large = req.too_large
        self.result = None

    async def body(self, limit: int) -> bytes:
        if self.too_large or len(self._body) > limit:
            self.keepalive = False  # the rest of the body is never read
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return self._body

    def _head(self, status: int, content_type: str, extra, framing: bytes) -> bytes:
        parts = [b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s" % (
            status, _PHRASES.get(status, b"Unknown"), content_type.encode("latin-1"), framing)]
        for k, v in extra:
            parts.append(k.encode("latin-1") + b": " + v.encode("utf-8", "surrogateescape")
                         + b"\r\n")
        if not self.keepalive:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def reply(self, status: int, body: bytes, content_type: str, extra) -> None:
        conn = self.conn
        self.state = 1
        if conn.closed:
            return
        conn.transport.write(self._head(status, content_type, extra,
                                        b"Content-Length: %d\r\n" % len(body)) + body)

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
        if not data:
            return
        if self.http10:
            conn.transport.write(data)
        else:
            conn.transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        if conn.paused:
            await conn.drain()

    async def stream_end(self) -> None:
        conn = self.conn
        self.state = 3
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        if not self.http10:
            conn.transport.write(b"0\r\n\r\n")


class _FrontConn(asyncio.Protocol):
    __slots__ = ("server", "transport", "buf", "task", "req", "closed", "paused", "_drain",
                 "last_active", "reading_paused", "handed")

    def __init__(self, server: "FrontServer") -> None:
        self.server = server
        self.transport = None
        self.buf = bytearray()
        self.task: asyncio.Task | None = None  # the request being served
        self.req: _PendingRequest | None = None  # head parsed, body arriving
        self.closed = False
        self.paused = False  # the transport asked us to stop writing
        self._drain: asyncio.Future | None = None
        self.last_active = _time.monotonic()
        self.reading_paused = False
        self.handed = False  # given to aiohttp

    # ---------------------------------------------------------- asyncio hooks

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server._conns.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.last_active = _time.monotonic()
        if self.task is None:
            self._advance()
        elif len(self.buf) > _MAX_PIPELINE and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server._conns.discard(self)
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("client disconnected"))
        if self.task is not None:
            self.task.cancel()  # the client left: cancel the upstream request too

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client disconnected")
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_future()
        await self._drain

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    # ---------------------------------------------------------------- parsing

    def _advance(self) -> None:
        """Parses and dispatches buffered requests while idle."""
        while self.task is None and not self.closed and not self.handed:
            if self.req is None:
                if not self._parse_head():
                    return
            if not self._read_body():
                return
            req, self.req = self.req, None
            ex = FrontExchange(self, req)
            self.task = asyncio.get_running_loop().create_task(self._run(req.handler, ex))

    def _bad(self, status: int, message: str) -> None:
        body = (b'{"error": {"message": "%s", "type": "invalid_request_error", '
                b'"code": "bad_http", "param": null}}' % message.encode())
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (
                                 status, _PHRASES[status], len(body), body))
        self.close()

    def _parse_head(self) -> bool:
        buf = self.buf
        while buf[:2] == b"\r\n":  # tolerated between requests
            del buf[:2]
        i = buf.find(b"\r\n\r\n", 0, _MAX_HEAD + 4)
        if i < 0 or i > _MAX_HEAD:
            if len(buf) > _MAX_HEAD:
                self._bad(431, "request head too large")
            return False
        line_end = buf.find(b"\r\n")
        parts = bytes(buf[:line_end]).split(b" ")
        if len(parts) != 3:
            self._bad(400, "malformed request line")
            return False
        method, target, version = parts
        path = target.split(b"?", 1)[0]
        handler = self.server.routes.get(path) if method == b"POST" else None
        if handler is None or version not in (b"HTTP/1.1", b"HTTP/1.0"):
            self._handover()
            return False
        headers: dict[str, str] = {}
        for line in bytes(buf[line_end + 2:i]).split(b"\r\n"):
            k, sep, v = line.partition(b":")
            if not sep or not k or k[-1:] in (b" ", b"\t"):
                self._bad(400, "malformed header line")
                return False
            name = k.lower().decode("latin-1")
            value = v.strip().decode("utf-8", "surrogateescape")
            old = headers.get(name)
            headers[name] = value if old is None else f"{old}, {value}"
        del buf[: i + 4]
        http10 = version == b"HTTP/1.0"
        conn_hdr = headers.get("connection", "").lower()
        keepalive = "keep-alive" in conn_hdr if http10 else "close" not in conn_hdr
        req = _PendingRequest(handler, headers, keepalive and not self.server.closing, http10)
        te = headers.get("transfer-encoding")
        cl = headers.get("content-length")
        limit = self.server.max_body()
        if te is not None:
            if cl is not None or te.lower() != "chunked":
                self._bad(400, "unsupported Transfer-Encoding / Content-Length combination")
                return False
            req.chunked = True
        elif cl is not None:
            if not cl.isdigit():
                self._bad(400, "invalid Content-Length")
                return False
            req.need = int(cl)
            if req.need > limit:
                req.too_large = True
                req.need = 0
                req.keepalive = False
        if (req.chunked or req.need > len(buf)) and not req.too_large and \
                headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.req = req
        return True

    def _read_body(self) -> bool:
        req = self.req
        buf = self.buf
        if not req.chunked:
            n = req.need
            if len(buf) < n:
                return False
            req.body = buf[:n]
            del buf[:n]
            return True
        limit = self.server.max_body()
        body = req.body
        while True:
            st = req.cstate
            if st == _CSIZE:
                j = buf.find(b"\r\n")
                if j < 0:
                    return False
                try:
                    size = int(bytes(buf[:j]).split(b";", 1)[0].strip(), 16)
                except ValueError:
                    self._bad(400, "bad chunk size")
                    return False
                del buf[: j + 2]
                if size == 0:
                    req.cstate = _TRAILER
                else:
                    req.need = size
                    req.cstate = _CDATA
            elif st == _CDATA:
                if not buf:
                    return False
                n = min(req.need, len(buf))
                if len(body) + n > limit:
                    req.too_large = True
                    req.keepalive = False
                    body.clear()
                    return True  # dispatch now: the handler answers 413 and we close
                body += buf[:n]
                del buf[:n]
                req.need -= n
                if req.need == 0:
                    req.cstate = _CCRLF
            elif st == _CCRLF:
                if len(buf) < 2:
                    return False
                if buf[:2] != b"\r\n":
                    self._bad(400, "chunk not followed by CRLF")
                    return False
                del buf[:2]
                req.cstate = _CSIZE
            else:  # trailer
                if buf[:2] == b"\r\n":
                    del buf[:2]
                    return True
                j = buf.find(b"\r\n\r\n")
                if j < 0:
                    return False
                del buf[: j + 4]
                return True

    def _handover(self) -> None:
        """Gives this connection, from the current request on, to aiohttp."""
        self.handed = True
        self.server._conns.discard(self)
        t = self.transport
        proto = self.server.fallback()
        t.set_protocol(proto)
        proto.connection_made(t)
        data = bytes(self.buf)
        self.buf.clear()
        if self.reading_paused:
            self.reading_paused = False
            t.resume_reading()
        if data:
            proto.data_received(data)

    async def _run(self, handler, ex: FrontExchange) -> None:
        try:
            await handler(ex)
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception:  # noqa: BLE001 - a bug must not kill the connection silently
            log.exception("data-plane handler failed")
            if ex.state == 0 and not self.closed:
                ex.keepalive = False
                ex.reply(500, b'{"error": {"message": "internal router error", "type": '
                         b'"server_error", "code": "internal_error", "param": null}}',
                         "application/json", ())
            self.close()
        finally:
            self.task = None
            self.last_active = _time.monotonic()
        if ex.state in (0, 2) or not ex.keepalive:
            # nothing sent or a stream cut short: the connection is in an unknown state
            if ex.state == 0 and not self.closed:
                log.error("data-plane handler returned without a reply")
            self.close()
            return
        if self.reading_paused and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buf and not self.closed:
            self._advance()


class FrontServer:
    """The raw HTTP/1.1 listener. ``routes`` maps POST paths (bytes) to coroutine
    functions ``handler(exchange)``; ``fallback`` is a protocol factory (aiohttp's
    ``web.Server``) for everything else; ``max_body()`` the current body limit.

    Lifecycle: ``await start(host, port)`` -> listening; ``await aclose(timeout)``
    stops accepting, closes idle connections, lets in-flight requests finish for
    up to ``timeout`` seconds, then cancels the rest. Idempotent."""

    def __init__(self, routes: dict, fallback, max_body, *, idle_timeout_s: float = 75.0) -> None:
        self.routes = routes
        self.fallback = fallback
        self.max_body = max_body
        self.idle_timeout_s = idle_timeout_s
        self.closing = False
        self._conns: set[_FrontConn] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int, *, backlog: int = 2048) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _FrontConn(self), host, port,
                                                backlog=backlog, reuse_address=True)
        self._sweeper = loop.create_task(self._sweep())
        return self._server.sockets[0].getsockname()[1]

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(10.0, self.idle_timeout_s))
            cutoff = _time.monotonic() - self.idle_timeout_s
            for c in list(self._conns):
                if c.task is None and c.last_active < cutoff:
                    c.close()

    def in_flight(self) -> int:
        return sum(1 for c in self._conns if c.task is not None)

    async def aclose(self, timeout_s: float = 30.0) -> None:
        if self.closing:
            return
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            if c.task is None:
                c.close()
        tasks = [c.task for c in self._conns if c.task is not None]
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        for c in list(self._conns):
            c.close()
        if self._server is not None:
            await self._server.wait_closed()
