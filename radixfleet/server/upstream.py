"""The data plane's upstream wire: a lean HTTP/1.1 client with keep-alive connection
pools (``UpstreamPool``) that forwards a request to a worker. Its client-facing twin
is ``radixfleet.server.front``.

Why not aiohttp's client (or server) here: profiled behind the router, aiohttp's
client cost about two thirds of each proxied request (request/response objects,
header multidicts, payload wrappers, timers), and plain aiohttp client + server
reached only ~0.65-0.8x the throughput of SGLang's router. The router needs far
less — POST a byte body with a handful of fixed headers, get a status, a few
headers and the body bytes (whole, or as they arrive for SSE) — so this module
does only that, on ``asyncio.Protocol``.

Why httptools: the bytes on both ends are parsed by ``httptools`` (llhttp, Node's
HTTP/1.1 parser, the one uvicorn uses), not by code of ours: request and status
lines, header syntax, ``Content-Length`` / ``Transfer-Encoding`` validation and
chunked decoding, keep-alive rules per version. This module only reacts to its
callbacks. A parser lives as long as what it parses: one per front connection
(llhttp resets itself between keep-alive requests), one per upstream response.

::

    UpstreamPool --acquire(host, port)--> _Conn (idle LIFO per host, or new)
        _Conn.request(head + body) --> Response: status, headers  (await head)
        Response.read()      whole body          Response.readany()  next bytes
        Response.release()   back to the idle list if complete and keep-alive,
                             else the connection is closed (also on cancellation)
    Cancel.cancel(err)       from outside (the worker turned unhealthy): the request
                             fails with err and its connection closes at once

Response framing is llhttp's: ``Content-Length``, ``Transfer-Encoding: chunked``
(decoded: the payload bytes pass through unchanged, the transfer coding is
hop-by-hop; trailers are dropped), or until close (httptools cannot be told of
the EOF, so ``Response`` ends such a body itself when the connection closes).
1xx interim responses are skipped; a 101 (protocol switch) is a broken upstream.

Bounded: a response's body is held only up to ``body_limit`` bytes not yet taken by
its consumer (``ResponseTooLarge`` past it, checked against ``Content-Length`` at
once). A consumer that streams (``readany``) is never buffered for: while more than
``STREAM_HIGH`` bytes wait for it (a slow client), reading from the worker pauses
and TCP pushes back on the worker.

Closing a connection is how a request is cancelled: an engine aborts a generation
whose client left (vLLM and SGLang both do), so a response given up on (a timeout,
``Cancel``, the consumer cancelled) never leaves work running on its worker.

A request is sent once. Failures raise ``UpstreamError`` subclasses with a
``cause`` label, and only ``ConnectFailed`` says the worker never got the request:

    ConnectFailed     nothing sent: cannot connect within the connect timeout (refused,
                      unreachable), or the connection closed before the request was
                      written
    NoAnswer          the request was written and the connection closed before any
                      response byte: the worker may have run it (read the body, then
                      hung up) -- never sent again, here or by the caller, unless the
                      worker is known to be down
    UpstreamTimeout   the first byte or a silence between chunks; its subclass
                      ``DeadlinePassed``: the total deadline
    UpstreamBroken    the connection dropped mid-response or the bytes were not HTTP;
                      its subclass ``ResponseTooLarge``
    Cancelled         ``Cancel.cancel``

Keep-alive. A request written on an idle connection the worker is closing at that
moment (its keep-alive timeout) is lost with it, and is ``NoAnswer`` like any other:
it cannot be told from a worker that read it and hung up. So an idle connection is
reused only within ``keepalive_s`` of its last answer, below the workers' own
keep-alive timeout (uvicorn's 5 s: vLLM, SGLang), and closed past it.

``worker_fault`` says which failures are the worker's, counted by its breaker
(``finish_outcome``): not a cut by the router's own deadline or size limit.

Invariants: a connection is in at most one place — an idle list, or serving one
``Response``; an idle connection has no response and an open, reading (not paused)
transport; a ``Response`` in state DONE holds no waiter; a ``Response`` whose
connection is reused was complete, keep-alive and got no byte past its end; a
``Response`` holds at most its ``limit`` of body bytes.
"""

from __future__ import annotations

import asyncio
import collections
import socket

import httptools

# Response states: waiting for the (final) head / receiving the body / complete.
_HEAD, _BODY, _DONE = range(3)
MAX_HEAD = 64 * 1024  # bytes of request or response head we accept
#: bytes a streaming consumer may leave untaken before reading from the worker pauses:
#: a slow client costs at most this plus one socket read here (radixfleet.server.front bounds
#: its side of the relay)
STREAM_HIGH = 64 * 1024


class UpstreamError(Exception):
    cause = "payload"
    #: the worker failed (its breaker counts it: ``finish_outcome``); False where the
    #: router's own deadline or limit cut the request
    worker_fault = True


class ConnectFailed(UpstreamError):
    cause = "connect"


class UpstreamTimeout(UpstreamError):
    """No first byte, or a silence between chunks, past the read timeout."""

    cause = "timeout"


class DeadlinePassed(UpstreamTimeout):
    """The request's total deadline (``timeouts.total_s``) passed: the router's budget
    for the request ran out, whether or not the worker was still sending."""

    worker_fault = False


class UpstreamBroken(UpstreamError):
    cause = "payload"


class NoAnswer(UpstreamBroken):
    """The request was written and the connection closed before any response byte:
    the worker may have started it."""

    cause = "no_answer"


class ResponseTooLarge(UpstreamBroken):
    cause = "too_large"
    worker_fault = False  # the router's limit, not a broken worker


class Cancelled(UpstreamError):
    """The request was cancelled from outside (``Cancel``); the message says why."""

    cause = "cancelled"


def finish_outcome(exc: UpstreamError) -> bool | None:
    """What ``Pool.finish`` is told of an attempt that failed with ``exc``: False, a
    worker failure its breaker counts, or None where the router's own deadline or
    size limit cut the request (``worker_fault``), which a healthy worker streaming a
    long answer must not be blamed for. (A client that leaves or is dropped for not
    reading is None too, by the data plane: no ``UpstreamError`` is involved.)"""
    return False if exc.worker_fault else None


class Cancel:
    """A handle to cancel one request while it is in flight, from outside its task
    (the data plane, when the request's worker turns unhealthy). Give it to
    ``UpstreamPool.request``; ``cancel(err)`` then fails the request — whichever
    phase it is in, connecting, waiting or reading — with ``err`` and closes its
    connection. Idempotent; a response already complete is not touched."""

    __slots__ = ("resp", "err")

    def __init__(self) -> None:
        self.resp: Response | None = None  # the response in progress (set by request)
        self.err: UpstreamError | None = None  # set once cancelled

    def cancel(self, err: UpstreamError) -> None:
        if self.err is None:
            self.err = err
        r = self.resp
        if r is not None and r._state != _DONE:
            r._fail(self.err)


class Response:
    """One upstream response, parsed incrementally (by its own
    ``httptools.HttpResponseParser``) as ``_Conn`` feeds it bytes.

    The ``on_*`` methods are the parser's callbacks, called only from inside
    ``_feed``; consumers use ``wait_head``, ``read``, ``readany``, ``release``."""

    __slots__ = (
        "status",
        "headers",
        "_conn",
        "_parser",
        "_state",
        "_chunks",
        "_waiter",
        "_err",
        "_keepalive",
        "_eof_framed",
        "_head",
        "_got",
        "_head_bytes",
        "_timer",
        "_loop",
        "_read_timeout",
        "_deadline",
        "_limit",
        "_held",
        "_streaming",
        "_paused",
        "_whole",
    )

    def __init__(
        self, conn: _Conn, loop, read_timeout: float, deadline: float, limit: float = float("inf")
    ) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-case names; the final head's only
        self._conn: _Conn | None = conn  # None once released
        self._parser = httptools.HttpResponseParser(self)
        self._state = _HEAD  # only the parser callbacks and _lost move it forward
        self._chunks: list[bytes] = []  # body bytes not yet handed out
        self._waiter: asyncio.Future | None = None  # someone awaits head or bytes
        self._err: UpstreamError | None = None
        self._keepalive = True  # llhttp's verdict, cleared by anything unexpected
        self._eof_framed = False  # no length, not chunked: the body ends at close
        self._head = loop.create_future()
        self._got = False  # any response byte received
        self._head_bytes = 0  # bytes fed while the head was incomplete
        self._timer: asyncio.TimerHandle | None = None
        self._loop = loop
        self._read_timeout = read_timeout
        self._deadline = deadline  # loop time the whole request must end by
        self._limit = limit  # most body bytes held for the consumer (ResponseTooLarge)
        self._held = 0  # body bytes in _chunks
        self._streaming = False  # the consumer called readany: pause instead of holding
        self._paused = False  # reading from the connection is paused (flow control)
        #: read() was called: the body grows here, one buffer rather than many chunks
        self._whole: bytearray | None = None

    # ------------------------------------------------------------ consumer side

    async def wait_head(self) -> None:
        await self._wait(self._head)

    async def _wait(self, fut: asyncio.Future) -> None:
        loop = self._loop
        left = self._deadline - loop.time()
        if left <= 0:
            self._fail(DeadlinePassed("total request deadline passed"))
        # which bound the timer is, decided here: a timer may fire a clock tick early
        total = left <= self._read_timeout
        timeout = left if total else self._read_timeout
        self._timer = timer = loop.call_later(max(timeout, 0), self._on_timeout, fut, total)
        try:
            await fut
        finally:
            timer.cancel()
            self._timer = None

    def _on_timeout(self, fut: asyncio.Future, total: bool) -> None:
        if not fut.done():
            if total:
                self._fail(DeadlinePassed("total request deadline passed"))
                return
            what = "first byte" if fut is self._head else "next bytes"
            self._fail(UpstreamTimeout(f"no {what} within {self._read_timeout:g}s"))

    async def readany(self) -> bytes:
        """The body bytes received since the last call, at most ``STREAM_HIGH`` of them
        (the rest wait for the next call); ``b""`` at the end. From the first call on,
        the connection pauses while more than ``STREAM_HIGH`` bytes wait here: a
        consumer that writes each piece to a slow client before the next call holds
        at most ``STREAM_HIGH`` plus one socket read here and ``STREAM_HIGH`` there."""
        self._streaming = True
        while True:
            if self._chunks:
                c = self._chunks
                out = c[0] if len(c) == 1 else b"".join(c)
                c.clear()
                if len(out) > STREAM_HIGH:  # a burst (one socket read may be 256 KiB)
                    c.append(out[STREAM_HIGH:])
                    out = out[:STREAM_HIGH]
                    self._held = len(c[0])
                else:
                    self._held = 0
                if self._paused and self._held <= STREAM_HIGH:
                    self._resume()
                return out
            if self._err is not None:
                raise self._err
            if self._state == _DONE:
                return b""
            fut = self._waiter = self._loop.create_future()
            await self._wait(fut)

    async def read(self) -> bytes | bytearray:
        """The whole body (at most the pool's ``body_limit``: ``ResponseTooLarge``,
        at once when ``Content-Length`` says so)."""
        cl = self.headers.get("content-length", "")
        if cl.isdigit() and int(cl) > self._limit and self._state != _DONE:
            self._fail(ResponseTooLarge(f"answer of {cl} bytes exceeds the limit of {self._limit:.0f} bytes"))
        if self._state != _DONE and self._whole is None and self._err is None:
            # no local name for the buffer: an error raised here keeps this frame
            # (in its traceback, which the response holds) and must not keep the body
            self._whole = bytearray().join(self._chunks)
            self._chunks.clear()
        while self._state != _DONE:
            if self._err is not None:
                raise self._err
            fut = self._waiter = self._loop.create_future()
            await self._wait(fut)
        if self._err is not None:
            raise self._err
        self._held = 0
        out: bytes | bytearray
        if self._whole is not None:
            out, self._whole = self._whole, None
            return out
        c = self._chunks
        out = c[0] if len(c) == 1 else b"".join(c)
        c.clear()
        return out

    def release(self) -> None:
        """Returns the connection to its pool if reusable, else closes it. Idempotent."""
        self._chunks.clear()  # whatever was not taken goes now, not with the next gc
        self._whole = None
        if self._err is not None:
            # raised from here, it carries its consumer's frames, which hold this
            # response: a cycle the collector takes only at a full collection
            self._err.__traceback__ = None
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        conn.resp = None
        if self._state == _DONE and self._err is None and self._keepalive:
            if self._paused:  # the end arrived past the high-water mark
                self._paused = False
                assert conn.transport is not None, "a connection that answered is connected"
                conn.transport.resume_reading()
            conn.pool._put(conn)
        else:
            conn.close()

    def _resume(self) -> None:
        self._paused = False
        conn = self._conn
        if conn is not None and not conn.closed:
            assert conn.transport is not None, "a connection that answered is connected"
            conn.transport.resume_reading()

    # ------------------------------------------------------------ protocol side

    def _fail(self, err: UpstreamError) -> None:
        if self._err is None and self._state != _DONE:
            self._err = err
            self._whole = None  # nobody will read it
        self._keepalive = False
        for f in (self._head, self._waiter):
            if f is not None and not f.done():
                f.set_exception(err)
        self._waiter = None
        if self._conn is not None:
            self._conn.close()

    def _lost(self, exc: BaseException | None) -> None:
        if self._state == _BODY and self._eof_framed:
            self._state = _DONE  # the close is the end of this body
            self._keepalive = False
            self._wake()
            return
        if self._state != _DONE:
            if not self._got:  # (the request was written: ``request`` checks before)
                self._fail(
                    NoAnswer(f"connection closed after the request, before any answer ({exc or 'eof'})")
                )
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
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBroken("upstream switched protocols (101)"))
            return
        except httptools.HttpParserError as exc:
            if isinstance(exc, httptools.HttpParserCallbackError) and not isinstance(
                exc.__context__, UpstreamBroken
            ):
                raise exc.__context__ or exc  # noqa: B904 (a bug in a callback, not the upstream's)
            if isinstance(exc.__context__, ResponseTooLarge):
                self._fail(exc.__context__)
                return
            st = self._state
            if st == _DONE:  # bytes past the end of the response: not reusable
                self._keepalive = False
            elif st == _HEAD:
                self._fail(UpstreamBroken(f"not an HTTP response: {exc}"))
                return
            elif "chunked" in self.headers.get("transfer-encoding", "").lower():
                self._fail(UpstreamBroken(f"bad chunk size or chunk framing: {exc}"))
                return
            else:
                self._fail(UpstreamBroken(f"malformed response body: {exc}"))
                return
        if self._state == _HEAD:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._fail(UpstreamBroken("response head too large"))
                return
        if (
            self._streaming
            and not self._paused
            and self._state == _BODY
            and self._held > STREAM_HIGH
            and self._conn is not None
        ):
            self._paused = True  # the consumer is behind: let TCP push back
            assert self._conn.transport is not None, "a connection that answered is connected"
            self._conn.transport.pause_reading()
        if self._chunks or self._state == _DONE:
            self._wake()

    # httptools callbacks (from inside _feed only)

    def on_message_begin(self) -> None:
        if self._state == _DONE:
            self._keepalive = False
            raise UpstreamBroken("bytes after the end of the response")  # stops the parser

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._state == _HEAD:  # not trailers
            self.headers[name.lower().decode("latin-1")] = value.strip().decode("latin-1")

    def on_headers_complete(self) -> None:
        p = self._parser
        status = p.get_status_code()
        if status < 200:
            self.headers = {}  # an interim response: its message completes at once
            return
        self.status = status
        self._keepalive = p.should_keep_alive()
        self._state = _BODY
        h = self.headers
        if (
            status != 204
            and status != 304
            and "content-length" not in h
            and "chunked" not in h.get("transfer-encoding", "").lower()
        ):
            self._eof_framed = True
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._whole is not None:
            self._whole += body
        else:
            self._chunks.append(body)
        self._held += len(body)
        if self._held > self._limit:
            raise ResponseTooLarge(
                f"answer exceeds the limit of {self._limit:.0f} bytes not yet passed on"
            )  # stops the parser

    def on_message_complete(self) -> None:
        if self._state == _BODY:  # not an interim response
            self._state = _DONE
            self._keepalive = self._keepalive and self._parser.should_keep_alive()


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an upstream."""

    __slots__ = ("pool", "key", "transport", "resp", "closed", "idle_since")

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.resp: Response | None = None  # the response being received, if any
        self.closed = False
        self.idle_since = 0.0  # loop time it last went idle (set by the pool's _put)

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


def _cancelling() -> bool:
    """Whether the running task has been asked to cancel (Python 3.11+; False before)."""
    me = asyncio.current_task()
    n = getattr(me, "cancelling", None)
    return bool(n()) if n is not None else False


class UpstreamPool:
    """Keep-alive connections per (host, port); idle ones reused most-recent first,
    and only within ``keepalive_s`` of going idle (module docstring): an idle
    connection whose close was seen, or idle longer, is closed instead.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        keepalive_s: float = 4.0,
        max_idle_per_host: int = 512,
        body_limit: float = float("inf"),
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        #: an idle connection is reused only this long after its last answer (0: never)
        self.keepalive_s = keepalive_s
        #: most body bytes a response holds for its consumer (``ResponseTooLarge``)
        self.body_limit = body_limit
        self.max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = {}
        self._closed = False
        self.connects = 0  # connections opened

    def configure(self, connect_timeout_s: float, keepalive_s: float, body_limit: float) -> None:
        """Takes reloaded timeouts and the response bound (new requests use them)."""
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.body_limit = body_limit

    def _put(self, conn: _Conn) -> None:
        if self._closed or conn.closed or self.keepalive_s <= 0:
            conn.close()
            return
        q = self._idle.get(conn.key)
        if q is None:
            q = self._idle[conn.key] = collections.deque()
        now = conn.idle_since = asyncio.get_running_loop().time()
        cutoff = now - self.keepalive_s
        while q and (q[0].closed or q[0].idle_since < cutoff):  # the oldest idle ones go first
            q.popleft().close()
        if len(q) >= self.max_idle:
            conn.close()
        else:
            q.append(conn)

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        """A new connection to ``key``, or ``ConnectFailed`` (nothing sent). A
        cancellation always propagates, a connection made as it came closed
        (``asyncio.wait_for`` before 3.12 may swallow one that races the result)."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.create_connection(lambda: _Conn(self, key), key[0], key[1]))
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = loop.call_later(self.connect_timeout_s, expire)
        try:
            _, conn = await task
        except asyncio.CancelledError:
            if not expired or _cancelling():
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[0].close()  # made as the caller gave up
                raise
            # nothing was sent: as retryable as a refusal
            raise ConnectFailed(
                f"connect to {key[0]}:{key[1]} timed out after {self.connect_timeout_s:g}s"
            ) from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from None
        finally:
            timer.cancel()
        self.connects += 1
        return conn

    async def request(
        self,
        host: str,
        port: int,
        head: bytes,
        body: bytes | bytearray,
        *,
        read_timeout_s: float,
        total_timeout_s: float,
        cancel: Cancel | None = None,
    ) -> Response:
        """Sends ``head`` (request line and headers, ending in a blank line) and
        ``body``; returns once the response head arrived. ``read_timeout_s`` bounds
        each wait for bytes (``inf``: only the total deadline does); ``cancel``, if
        given, can fail the request from outside. The caller must ``release()`` the
        response on every path."""
        if self._closed:
            raise RuntimeError("UpstreamPool.request() after aclose()")
        loop = asyncio.get_running_loop()
        key = (host, port)
        deadline = loop.time() + total_timeout_s
        conn = None
        q = self._idle.get(key)
        if q:
            cutoff = loop.time() - self.keepalive_s
            while q:
                c = q.pop()
                if not c.closed and c.idle_since >= cutoff:
                    conn = c
                    break
                c.close()  # closed by the worker, or idle past keepalive_s
        if conn is None:
            conn = await self._connect(key)
        resp = Response(conn, loop, read_timeout_s, deadline, self.body_limit)
        conn.resp = resp
        if cancel is not None:
            cancel.resp = resp
            if cancel.err is not None:  # cancelled while connecting: nothing sent
                resp.release()
                raise cancel.err
        if conn.closed:  # died between accept and now: nothing sent
            resp.release()
            raise ConnectFailed(f"connection to {host}:{port} closed at once")
        t = conn.transport
        assert t is not None, "an open connection has its transport"
        if len(body) < 16384:
            t.write(head + body)
        else:
            t.writelines((head, body))
        if t.is_closing():  # the send failed at once (a reset connection): nothing went out
            resp.release()
            raise ConnectFailed(f"connection to {host}:{port} was reset before the request went out")
        try:
            await resp.wait_head()
        except BaseException:  # NoAnswer among them: never sent again (module docstring)
            resp.release()
            raise
        return resp

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
    return (
        (
            f"POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_len}\r\n"
        ).encode("latin-1")
        + extra
        + b"\r\n"
    )
