"""The data port's wire (``FrontServer``): a raw HTTP/1.1 server, its bytes parsed by
one httptools.HttpRequestParser per connection, that serves every request of the
data port itself — the data-plane POST paths and the few others clients and agents
use (``radixfleet.server.app.RouterServer`` names them). Nothing is handed to another server:
the admin API and ``/metrics`` are another listener's (``admin``), and a path not
served here is a JSON 404 (405 with ``Allow`` for a known path's other methods).

  _FrontConn states:  idle (no task) --request complete--> busy (task running)
                      --reply / stream end--> next queued request | idle | closed
                      a malformed request --> (once idle) 400/431 JSON, closed

The parser runs ahead of the handler: requests a client pipelines behind the one
being served are parsed into ``queue`` and served in order; reading pauses while
the backlog is large. A body is held once: in its request's one buffer
(``_PendingRequest.body``), which the exchange hands on as it is; an unknown path's
body is not kept.

What a client may hold before its request is admitted is bounded here: body bytes
by the shared ``radixfleet.server.intake.BodyBudget`` (429 past it), a head by ``MAX_HEAD``
(its target and header bytes, and every read begun and ended inside it), connections by
``max_connections()`` (the longest-idle one closed to make room, else 429), and a
request of a screened route without valid credentials or whose tenant is over its
rate limit is refused from its headers (``Route.screen``: radixfleet.server.screen), before its
body is read.

A client that closes its connection while its request is served (waiting for a
slot, for its worker, or mid-stream) is an expected event: the request's task is
cancelled (its upstream connection closed, so the engine aborts the generation), the
departure logged at debug and counted (``on_gone(phase)``: ``waiting`` before any
answer byte, ``streaming`` during a stream), never logged as an error.

What a client that does not read holds after: its transport's buffer, where a
writer waits while more than ``radixfleet.server.slow_clients.WRITE_HIGH`` bytes are unsent (at
most one write more: a relayed stream writes at most ``radixfleet.server.upstream.STREAM_HIGH``
at a time, and reads nothing from the worker while it waits), within the deadlines
of ``radixfleet.server.slow_clients`` (``slow``): past them the connection is reset and the
handler's write raises ``ClientDropped``. A reply's unsent bytes are waited for the
same way before the next pipelined request is served, and a connection closed with
bytes unsent is aborted after ``client_idle_s()``.

Why httptools and not aiohttp's server: ``radixfleet.server.upstream``'s docstring.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import socket
import time as _time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import httptools

from radixfleet.server.front_exchange import PHRASES, FrontExchange
from radixfleet.server.intake import BodyBudget, Throttled
from radixfleet.server.slow_clients import WRITE_HIGH, SlowClients, reset
from radixfleet.server.upstream import MAX_HEAD
from radixfleet.wire.errors import NotFound, RequestError, error_body

log = logging.getLogger("radixfleet.front")

_MAX_PIPELINE = 1 << 20  # bytes received while busy before reading pauses
_LINGER_S = 2.0  # how long a connection closing after an answer drains its client


class _Stop(Exception):
    """Raised in a parser callback to stop parsing this connection; what to do next
    is in ``_FrontConn.stop``. Raised as a class (a fresh instance each time: a
    shared one would keep its last traceback, and the connection, alive)."""


class MethodNotAllowed(RequestError):
    """A path served here, asked with a method it does not take (``Allow`` names them)."""

    status = 405
    code = "method_not_allowed"

    def __init__(self, method: str, path: str, allowed: list[str]) -> None:
        super().__init__(f"method {method} not allowed on {path}; allowed: {', '.join(allowed)}")
        self.headers = (("Allow", ", ".join(allowed)),)


class Route(NamedTuple):
    """One method of one path: ``handler(exchange)`` answers it; ``screen(headers)``,
    if any, raises a ``RequestError`` for a request refused whatever its body (no
    credentials, a tenant or key over its rate limit: radixfleet.server.screen), checked before
    its body is read; the handler gets it from ``exchange.body()``. ``hangup(peer)``,
    if any, is told of a client gone before its body arrived (the agent API counts
    those)."""

    handler: Callable[[FrontExchange], Awaitable[None]]
    screen: Callable[[dict], None] | None = None
    hangup: Callable[[str | None], None] | None = None


async def _answer_refusal(ex: FrontExchange) -> None:
    """The handler of a request no route takes: its refusal (404, 405) as JSON."""
    exc = ex.refusal
    assert exc is not None, "set with the handler"
    ex.reply(exc.status, json.dumps(exc.to_json()).encode(), "application/json", exc.headers)


class _PendingRequest:
    """A request being parsed (head, then body), or parsed and waiting its turn."""

    __slots__ = (
        "url",
        "headers",
        "in_head",
        "head_size",
        "head_raw",
        "handler",
        "keepalive",
        "http10",
        "body",
        "size",
        "limit",
        "too_large",
        "expect_continue",
        "since",
        "refusal",
        "held",
        "hangup",
        "head_only",
    )

    def __init__(self) -> None:
        #: monotonic time its first byte arrived, then the time its head was complete:
        #: the start of the head deadline, then of the body deadline (FrontServer._sweep)
        self.since = _time.monotonic()
        self.url = b""
        self.headers: dict[str, str] = {}  # lower-case names, repeats joined by ", "
        self.in_head = True  # headers still arriving (later on_header calls are trailers)
        self.head_size = 0  # bytes of target and complete headers seen
        self.head_raw = 0  # bytes of the reads that ended inside the head
        self.handler: Callable[[FrontExchange], Awaitable[None]] | None = None
        self.keepalive = False
        self.http10 = False
        #: the body so far, one buffer: its first piece as received, then a bytearray
        #: that the later pieces are appended to (never a list joined at the end)
        self.body: bytes | bytearray = b""
        self.size = 0  # len of the body so far
        self.limit = 0  # the body limit when the head arrived
        self.too_large = False  # the body exceeds the limit: parsing stopped
        self.expect_continue = False  # a 100 Continue is owed once it is this one's turn
        self.refusal: RequestError | None = None  # answered instead of served
        self.held = 0  # bytes of the server's BodyBudget this request holds
        self.hangup: Callable[[str | None], None] | None = None  # its Route's
        self.head_only = False  # a HEAD served by its path's GET: the answer without its body


class _FrontConn(asyncio.Protocol):
    """One client connection. The ``on_*`` methods are its parser's callbacks.

    Invariants: ``queue`` is non-empty only while ``task`` runs (an idle connection
    starts a complete request at once); once ``parser`` is None no byte is parsed
    again and ``stop`` says what happens when idle."""

    __slots__ = (
        "server",
        "transport",
        "parser",
        "req",
        "queue",
        "task",
        "stop",
        "backlog",
        "closed",
        "paused",
        "_drain",
        "last_active",
        "reading_paused",
        "ex",
    )

    def __init__(self, server: FrontServer) -> None:
        self.server = server
        # None only until connection_made, which asyncio calls before any other hook
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        # None once parsing stopped
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.req: _PendingRequest | None = None  # the request being parsed
        self.queue: collections.deque[_PendingRequest] = collections.deque()  # parsed, waiting
        self.task: asyncio.Task | None = None  # the request being served
        # Why parsing stopped, acted on once idle: None, ("bad", status, message)
        # or ("served",) (a request that ends the connection).
        self.stop: tuple | None = None
        self.backlog = 0  # bytes received while busy (reading pauses past _MAX_PIPELINE)
        self.closed = False
        self.paused = False  # the transport asked us to stop writing
        self._drain: asyncio.Future | None = None
        self.last_active = _time.monotonic()
        self.reading_paused = False
        self.ex: FrontExchange | None = None  # the exchange ``task`` serves

    # ---------------------------------------------------------- asyncio hooks

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.server._admit(self):
            return
        self.server._conns.add(self)
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        self.last_active = _time.monotonic()
        if self.task is not None:
            self.backlog += len(data)
            if self.backlog > _MAX_PIPELINE and not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()
        parser = self.parser
        if parser is None:
            return  # the connection ends after what is queued; ignore the rest
        req = self.req
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if self.stop is None:  # not our _Stop: a bug in a callback
                raise exc.__context__ or exc  # noqa: B904 (the callback's own error, re-raised)
        except httptools.HttpParserUpgrade:  # on_headers_complete lets no upgrade through
            self._stop_bad(400, "protocol upgrade is not supported")
        except httptools.HttpParserError as exc:
            self._stop_bad(400, f"malformed request: {exc}")
        else:
            if req is not None and req is self.req and req.in_head:
                # a read that began and ended inside one head: all of it is that head's
                req.head_raw += len(data)
                if req.head_raw > MAX_HEAD:
                    self._stop_bad(431, "request head too large")
        if self.task is None and self.stop is not None:
            self._next()

    def connection_lost(self, exc) -> None:
        self.closed = True
        server = self.server
        server._conns.discard(self)
        req = self.req
        if req is not None:
            server._give(req)
            self.req = None
            if req.hangup is not None and not req.in_head:
                remote = self.transport.get_extra_info("peername")
                req.hangup(remote[0] if remote else None)
        for q in self.queue:
            server._give(q)
        self.queue.clear()
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("client disconnected"))
        if self.task is not None:
            self.task.cancel()  # the client left: cancel the upstream request too
            ex = self.ex
            if ex is not None and ex.state in (0, 2):  # (1, 3: it had its whole answer)
                phase = "waiting" if ex.state == 0 else "streaming"
                log.debug("a client left %s (%s)", phase, exc or "eof")
                if server.on_gone is not None:
                    server.on_gone(phase)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)
        self._drain = None

    async def drain(self, deadline: float) -> None:
        """Waits until the client has taken enough of what is buffered for it that
        writing goes on; drops it (``radixfleet.server.slow_clients``: ``ClientDropped``) when it
        takes nothing for ``client_idle_s()``, or the monotonic ``deadline`` passes
        first."""
        if self.closed:
            raise ConnectionResetError("client disconnected")
        if not self.paused:
            return
        wait_s, reason = self.server.slow.wait(deadline, _time.monotonic())
        loop = asyncio.get_running_loop()
        if self._drain is None:
            self._drain = loop.create_future()
        timer = loop.call_later(wait_s, self._stalled, self._drain, reason)
        try:
            await self._drain
        except BaseException:
            # the future holds the exception, whose traceback holds this frame and so
            # this connection: let go of it, or the cycle keeps the stream's buffers
            # until a full collection (rare: radixfleet.index.prefix_index raises the thresholds)
            self._drain = None
            raise
        finally:
            timer.cancel()

    def _stalled(self, d: asyncio.Future, reason: str) -> None:
        """``drain``'s timer: the client took nothing in time; drops the connection."""
        if d.done():
            return
        self.closed = True
        # the waiting handler is woken with this before connection_lost (which the
        # reset schedules after it) could cancel it instead
        d.set_exception(self.server.slow.dropped(self.transport, reason))
        reset(self.transport)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            t = self.transport
            t.close()
            if t.get_write_buffer_size():
                # a closing transport stays open until its buffer is sent: a client
                # that reads nothing would hold it, and the descriptor, for ever
                asyncio.get_running_loop().call_later(self.server.slow.client_idle_s(), t.abort)

    def linger(self) -> None:
        """Closes once the client has had the answer: ends our side (FIN), discards
        whatever it still sends (a refused body), closes at its EOF or after
        ``_LINGER_S``. Closing with its bytes unread would reset the connection, and
        the client could lose the answer before reading it."""
        if self.closed:
            return
        self.parser = None
        self.stop = ("served",)  # data_received discards from now on
        t = self.transport
        try:
            if not t.can_write_eof():
                self.close()
                return
            t.write_eof()
        except (OSError, RuntimeError):
            self.close()
            return
        if self.reading_paused:
            self.reading_paused = False
            t.resume_reading()
        asyncio.get_running_loop().call_later(_LINGER_S, self.close)

    # ------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self.req = _PendingRequest()

    def on_url(self, url: bytes) -> None:
        req = self.req
        assert req is not None, "the parser calls on_message_begin first"
        req.url += url  # may come in pieces
        req.head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.req
        assert req is not None, "the parser calls on_message_begin first"
        if not req.in_head:
            return  # a chunked body's trailer: dropped
        req.head_size += len(name) + len(value)
        if req.head_size > MAX_HEAD:
            self._stop_bad(431, "request head too large")
            raise _Stop
        h = req.headers
        k = name.lower().decode("latin-1")
        v = value.strip().decode("utf-8", "surrogateescape")
        old = h.get(k)
        h[k] = v if old is None else f"{old}, {v}"

    def on_headers_complete(self) -> None:
        req = self.req
        p = self.parser
        assert req is not None and p is not None, "a parser callback, after on_message_begin"
        req.in_head = False
        req.since = _time.monotonic()
        version = p.get_http_version()
        if version != "1.1" and version != "1.0":
            self._stop_bad(400, f"unsupported HTTP version {version}")
            raise _Stop
        if p.should_upgrade():
            self._stop_bad(400, "protocol upgrade is not supported")
            raise _Stop
        server = self.server
        url = path = req.url
        methods = server.routes.get(url)
        if methods is None and (b"?" in url or url[:1] != b"/"):
            try:
                path = httptools.parse_url(url).path or url
            except httptools.HttpParserInvalidURLError:
                pass
            methods = server.routes.get(path)
        method = p.get_method()
        route = methods.get(method) if methods is not None else None
        if method == b"HEAD":  # any answer to it without its body (RFC 9110 9.3.2)
            req.head_only = True
            if route is None and methods is not None:
                route = methods.get(b"GET")  # a GET route serves it
        req.keepalive = p.should_keep_alive() and not server.closing
        req.http10 = version == "1.0"
        req.limit = limit = server.max_body()
        h = req.headers
        cl = h.get("content-length")  # llhttp checked it: digits, no conflict with TE
        has_body = cl != "0" if cl is not None else "transfer-encoding" in h
        if route is None:
            name = path[:200].decode("latin-1")
            if methods is None:
                exc: RequestError = server.not_found(name)
            else:
                allowed = {m.decode() for m in methods} | ({"HEAD"} if b"GET" in methods else set())
                exc = MethodNotAllowed(method.decode("latin-1"), name, sorted(allowed))
            req.handler = _answer_refusal
            if has_body:  # its body is never read: answered now, closed after
                self._refuse(req, exc)
                raise _Stop
            req.refusal = exc
            return
        req.handler, req.hangup = route.handler, route.hangup
        if route.screen is not None:
            try:
                route.screen(h)  # credentials from the head: no body read without
            except RequestError as exc:
                self._refuse(req, exc)
                raise _Stop from None
        if cl is not None and int(cl) > limit:
            self._too_large(req)
            raise _Stop
        if has_body and h.get("expect", "").lower() == "100-continue":
            if self.task is None and not self.queue:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:
                req.expect_continue = True  # sent when the requests before are served

    def on_body(self, body: bytes) -> None:
        req = self.req
        assert req is not None, "the parser calls on_message_begin first"
        n = len(body)
        req.size += n
        if req.size > req.limit:
            self._too_large(req)
            raise _Stop
        if not self.server.budget.take(n):
            self._refuse(req, self.server.budget.full())
            raise _Stop
        req.held += n
        b = req.body
        if not b:
            req.body = body
        elif type(b) is bytes:
            req.body = bytearray(b) + body  # the one buffer the rest is appended to
        else:
            b += body

    def on_message_complete(self) -> None:
        req = self.req
        assert req is not None, "the parser calls on_message_begin first"
        self.req = None
        self._enqueue(req)
        if not req.keepalive:
            self.parser = None  # anything after a closing request is ignored
            self.stop = ("served",)
            raise _Stop

    # ---------------------------------------------------------------- control

    def _enqueue(self, req: _PendingRequest) -> None:
        if self.task is None and not self.queue:
            self._start(req)
        else:
            self.queue.append(req)

    def _start(self, req: _PendingRequest) -> None:
        ex = self.ex = FrontExchange(self, req)
        self.task = asyncio.get_running_loop().create_task(self._run(req.handler, ex))

    def _too_large(self, req: _PendingRequest) -> None:
        """Dispatches ``req`` now (its handler answers 413; the rest of the body is
        never read) and stops parsing."""
        req.too_large = True
        self._refuse(req, None)

    def _refuse(self, req: _PendingRequest, exc: RequestError | None) -> None:
        """Dispatches ``req`` now, to be answered with ``exc`` (its handler raises it
        from ``body()``), drops its body and stops parsing: the rest of the body is
        never read, the connection closes after the answer."""
        req.refusal = exc
        req.keepalive = False
        req.body = b""
        self.server._give(req)
        self.req = None
        self.parser = None
        self.stop = ("served",)
        self._enqueue(req)

    def _stop_bad(self, status: int, message: str) -> None:
        self.parser = None
        if self.req is not None:
            self.server._give(self.req)
        self.req = None
        if self.stop is None:
            self.stop = ("bad", status, message)

    def _next(self) -> None:
        """Called when idle: serves the next queued request, or acts on ``stop``."""
        if self.closed:
            return
        if self.queue:
            self._start(self.queue.popleft())
            return
        self.backlog = 0
        stop = self.stop
        if stop is not None:
            if stop[0] == "bad":
                self._bad(stop[1], stop[2])
            else:
                self.close()
            return
        req = self.req
        if req is not None and req.expect_continue:
            req.expect_continue = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    def _bad(self, status: int, message: str) -> None:
        if self.server.on_bad_http is not None:
            self.server.on_bad_http(status)
        self.transport.write(_answer(status, message, "invalid_request_error", "bad_http"))
        self.linger()

    async def _run(self, handler, ex: FrontExchange) -> None:
        try:
            await handler(ex)
            if self.paused and not self.closed:
                # the reply is not taken yet: the next pipelined request waits for
                # it (the handler's slot is free already), within the same deadlines
                await self.drain(ex.deadline)
        except asyncio.CancelledError:
            self.close()
            raise
        except ConnectionResetError:  # the client left, or was dropped (drain)
            self.close()
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the connection silently
            if self.closed and isinstance(exc, ConnectionError):
                # written to a client already gone (counted by connection_lost)
                log.debug("data-plane handler: the client had left (%s)", exc)
            else:
                log.exception("data-plane handler failed")
                if ex.state == 0 and not self.closed:
                    ex.keepalive = False
                    self.transport.write(
                        _answer(500, "internal router error", "server_error", "internal_error")
                    )
            self.close()
        finally:
            self.task = self.ex = None
            self.last_active = _time.monotonic()
            if ex.held:
                self.server.budget.give(ex.held)
                ex.held = 0
        if ex.state in (0, 2):
            # nothing sent or a stream cut short: the connection is in an unknown state
            if ex.state == 0 and not self.closed:
                log.error("data-plane handler returned without a reply")
            self.close()
            return
        if not ex.keepalive:
            self.linger()  # answered; a refused body may still be arriving
            return
        if self.server.closing:
            self.close()  # pipelined requests not yet served are the client's to retry
            return
        self._next()


def _answer(status: int, message: str, etype: str, code: str, extra: bytes = b"") -> bytes:
    """A whole JSON error answer that closes its connection (``extra``: header lines)."""
    body = json.dumps(error_body(message, etype, code)).encode()
    head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n" % (status, PHRASES[status])
    return head + extra + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body


class FrontServer:
    """The raw HTTP/1.1 listener. ``routes`` maps a path (bytes) to its methods
    (bytes) and their ``Route``; ``not_found(path)`` is the ``RequestError`` (a 404)
    answered for any other path; ``max_body()`` the current body limit.

    ``budget`` bounds the request body bytes held (shared with the admin listener);
    ``max_connections()`` caps the client connections;
    ``on_refused(reason)`` counts a connection closed or refused at the cap
    (``idle_closed`` | ``at_capacity``); ``on_gone(phase)`` a client that left while
    its request was served (``waiting`` | ``streaming``: the module docstring);
    ``on_bad_http(status)`` counts a malformed request answered (400, 408, 431);
    ``slow`` bounds the waits for a client to take its answer
    (``radixfleet.server.slow_clients``; shared with the admin listener).

    Lifecycle: ``await start(host, port)`` -> listening; ``await aclose(timeout)``
    stops accepting, closes idle connections, lets in-flight requests finish for
    up to ``timeout`` seconds, then cancels the rest. Idempotent."""

    def __init__(
        self,
        routes: dict[bytes, dict[bytes, Route]],
        max_body,
        *,
        idle_timeout_s: float = 75.0,
        head_timeout_s=lambda: 10.0,
        body_timeout_s=lambda: 30.0,
        budget: BodyBudget | None = None,
        max_connections=lambda: 8192,
        on_refused=None,
        on_gone=None,
        on_bad_http=None,
        slow: SlowClients | None = None,
        not_found: Callable[[str], RequestError] = lambda path: NotFound(f"unknown path {path}"),
    ) -> None:
        self.routes = routes
        self.not_found = not_found
        self.max_body = max_body
        self.budget = budget if budget is not None else BodyBudget(1 << 30)
        self.max_connections = max_connections
        self.on_refused = on_refused
        self.on_gone = on_gone
        self.on_bad_http = on_bad_http
        self._refusals = Throttled()
        self.idle_timeout_s = idle_timeout_s
        #: callables -> seconds: a request's head must arrive within head_timeout_s()
        #: of its first byte, its body within body_timeout_s() of its head, else 408
        #: (one byte every few seconds must not hold a connection forever)
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        #: the deadlines of the waits for a client to take its answer
        self.slow = slow if slow is not None else SlowClients()
        self.closing = False
        self._conns: set[_FrontConn] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int, *, backlog: int = 2048) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _FrontConn(self), host, port, backlog=backlog, reuse_address=True
        )
        self._sweeper = loop.create_task(self._sweep())
        return self._server.sockets[0].getsockname()[1]

    def socknames(self) -> list[tuple]:
        """The addresses it listens on (``getsockname()`` of each socket; [] before
        ``start``)."""
        server = self._server
        return [s.getsockname() for s in server.sockets] if isinstance(server, asyncio.Server) else []

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout_s))
            self.sweep(_time.monotonic())

    def sweep(self, now: float) -> None:
        """Closes idle connections and answers 408 to requests past their head or
        body deadline. O(connections); runs every second."""
        cutoff = now - self.idle_timeout_s
        head_s, body_s = self.head_timeout_s(), self.body_timeout_s()
        for c in list(self._conns):
            req = c.req
            if req is not None and c.parser is not None:
                limit = head_s if req.in_head else body_s
                if now - req.since > limit:
                    part = "head" if req.in_head else "body"
                    log.info("request %s not received within %gs: 408", part, limit)
                    c._stop_bad(408, f"request {part} not received within {limit:g}s")
                    if c.task is None:
                        c._next()
            elif c.task is None and c.last_active < cutoff:
                c.close()

    def _admit(self, conn: _FrontConn) -> bool:
        """Makes room for a new connection at the cap: closes the longest-idle one
        (no request in progress or queued), or refuses ``conn`` with a 429 if none
        is. O(connections), only at the cap."""
        cap = self.max_connections()
        if len(self._conns) < cap:
            return True
        idle = [
            c
            for c in self._conns
            if c.task is None and c.req is None and c.parser is not None and not c.queue
        ]
        if idle:
            victim = min(idle, key=lambda c: c.last_active)
            victim.close()
            self._conns.discard(victim)
            reason = "idle_closed"
            self._refusals.warning("client connections at the cap of %d: closed the longest-idle one", cap)
        else:
            reason = "at_capacity"
            self._refusals.warning(
                "client connections at the cap of %d, none idle: refused a new one (429)", cap
            )
            msg = f"the router holds {cap} client connections; retry shortly"
            conn.closed = True
            conn.parser = None
            conn.transport.write(
                _answer(429, msg, "rate_limit_error", "too_many_connections", b"Retry-After: 1\r\n")
            )
            conn.transport.close()
        if self.on_refused is not None:
            self.on_refused(reason)
        return reason == "idle_closed"

    def _give(self, req: _PendingRequest) -> None:
        """Gives back the body bytes ``req`` holds of the budget."""
        if req.held:
            self.budget.give(req.held)
            req.held = 0

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
