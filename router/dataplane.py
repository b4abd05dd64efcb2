"""The data plane: one client request from admission to its last byte.

Per data-plane request (``DataPlane.serve``), in this order and with nothing awaited
between the pick and the load count (the body budget and credentials are checked
before, by the listener: ``router.intake``, ``router.front``)::

    admission (concurrency slot or bounded queue, else 429 + Retry-After)
    read body (<= limits.max_body_bytes, else 413) -> json (else 400)
    tenant = TenantResolver(headers)                 (auth.py; 401 if a key is required)
    key    = request_key(endpoint, body, tenant, block_bytes)   (400 naming the field)
    await engines.prepare(...)                        workers keyed through their engine's
                                                      /tokenize: the ids asked for first
                                                      (cached; router.engines.engine_keys)
    verdict = route.decide(ask, now)                  the route core (router.route): views,
                                                      keys and match, tenancy and rate
                                                      limits, shedding, the policy's choice,
                                                      the hint and the load counted at pick
                                                      time; nothing awaited
        Reject -> its 4xx/503 (a shed one counted and logged as offered load)
        Hold   -> the admission queue (tenancy.queue), then route.resume
        Admitted (a disaggregated fleet) -> router.pd picks its two legs
        Route  -> forwarded below; a retry asks the core again, the tried excluded
    forward raw body bytes (x-radixfleet-tenant, x-request-id, x-radixfleet-hop; a
        traced request's traceparent: router.tracing) -> worker
        streaming: SSE bytes pass through as they arrive; a failure after the first
        byte ends the stream with an SSE error event and ``data: [DONE]``
    pool.finish(worker)                               on every path (client gone too)

A generation runs once. A request goes to another worker (retries.max_attempts,
exponential backoff) only when the first provably is not running it: the connection
failed before the request was written to it (``router.upstream``: a worker that
closes the connection after the request, without a byte of answer, may have run it,
and is no exception), the worker answered 429 or 503, the
worker turned unhealthy before the client saw a byte (``Pool.on_unhealthy``: the
request is cancelled there first, by closing its connection, which makes an engine
abort it), or it answered 5xx or broke off its answer before the client saw a byte
and fails a health probe right after (``_went_down``: the engine is going down, and
the generation with it). Everything else is answered once: a timeout (504) cancels the request on
its worker and is not retried; a worker's 5xx becomes a 502. Timeouts per phase
(``timeouts``): connect; the first byte and each silence of a stream; the whole
request (a non-streamed answer, which arrives only when its generation is done, is
bounded by that alone). Answers are bounded (``limits.max_response_bytes``, 502).

What a client gets back from a failure is the OpenAI error shape
(``protocol.errors.error_body``), its body naming no worker (with
``response_headers.worker_id`` on, the ``x-radixfleet-worker`` header gives the id of
the one that answered; off by default, so clients learn no worker id): a
worker's 4xx keeps its message; a 5xx and every broken answer get the router's own;
the details (worker, address, its body) go to the log.

The data plane is written against an *exchange* (one request/response): the raw
HTTP/1.1 front (``router.front.FrontServer``, what ``radixfleet router`` listens
with) and the aiohttp app (``AiohttpExchange``; tests and embedding) both provide
one. An exchange has ``headers`` (lower-case names), ``await body(limit)``,
``reply(status, body, content_type, extra)``, ``await stream_start(content_type,
extra)``, ``await stream_write(data)``, ``await stream_end()`` and ``result`` (what an
aiohttp handler returns).

The ``Router`` (router.app) owns one ``DataPlane`` and hands it, on every reload,
the config, policy and tenant resolver it must use from then on (``configure``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from policies.base import Policy, Reason
from protocol.errors import (
    MalformedRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    error_body,
    retry_after_header,
)
from protocol.identifiers import request_id
from protocol.prefix_keys import Endpoint, PrefixKey, request_key
from router import edge, screen
from router.admission_queue import AdmissionQueue
from router.auth import TenantResolver
from router.config import Config
from router.decisions import DecisionRing, Quality, now_unix, quality
from router.engines.keyspace import KeyedRequest
from router.engines.link import EngineLink
from router.hops import Hops
from router.metrics import Metrics
from router.pd import PrefillDecode
from router.pool import Pool, Worker
from router.prefetch import PrefetchBudget, PrefetchLedger
from router.prefix_index import PrefixIndex
from router.route import Admitted, Ask, Hold, Placement, Reject, Route, RouteCore, RouteParts, uncached_tokens
from router.scaling_signal import DemandMeter
from router.shedding import Shedder
from router.sse import StreamWatch, completion_tokens_of, usage_of
from router.tenancy import Tenancy, Ticket
from router.upstream import (
    Cancel,
    Cancelled,
    ResponseTooLarge,
    UpstreamError,
    UpstreamPool,
    build_head,
    finish_outcome,
)
from router.warmup import WarmupGate, warmup_prefix
from service import jsonbody

if TYPE_CHECKING:
    from router.bus.replica import BusReplica
    from router.engines.manager import Engines
    from router.tracing import RequestTrace
    from router.traffic_log import TrafficLog
    from service.tracing import Tracing

log = logging.getLogger("radixfleet.router")

TENANT_HEADER = "x-radixfleet-tenant"
WORKER_HEADER = "x-radixfleet-worker"
AVAILABLE_HEADER = "x-radixfleet-available-tokens"
PREDICTED_HEADER = "x-radixfleet-predicted-tokens"
REQUEST_ID_HEADER = "x-request-id"

_JSON = "application/json"
_DONE = b"data: [DONE]\n\n"
#: a prefetch as tenancy.admit reads its body: the warm-up it sends generates one token
_WARM_UP: dict[str, Any] = {"max_tokens": 1}


class Admission:
    """A concurrency limit with a bounded FIFO queue.

    ``active`` counts requests holding a slot (<= limit, except briefly after a
    reload lowers the limit); ``_waiters`` holds futures of queued requests. A
    released slot passes directly to the oldest live waiter, so ``active`` is
    unchanged by the hand-over.
    """

    __slots__ = ("limit", "max_queue", "timeout_s", "retry_after_s", "active", "_waiters")

    def __init__(self, limit: int, max_queue: int, timeout_s: float, retry_after_s: int) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def try_enter(self) -> bool:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        return False

    async def enter(self) -> None:
        """Waits for a slot. Raises ``Overloaded`` if the queue is full or the wait
        times out; on cancellation nothing is held and the cancellation propagates
        (a slot handed over as it came is passed on: no ``asyncio.wait_for``, which
        before Python 3.12 may swallow a cancellation that races its result)."""
        if self.try_enter():
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(
                f"router at capacity ({self.limit} in flight, {len(self._waiters)} queued)",
                retry_after_s=self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(self.timeout_s, _expire, fut)
        try:
            got = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.leave()  # the slot arrived as we gave up: pass it on
            else:
                self._forget(fut)
            raise
        finally:
            timer.cancel()
        if not got:
            self._forget(fut)
            raise Overloaded(f"no slot within {self.timeout_s:g}s", retry_after_s=self.retry_after_s)

    def _forget(self, fut: asyncio.Future) -> None:
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    def configure(self, limit: int, max_queue: int, timeout_s: float, retry_after_s: int) -> None:
        """Takes reloaded limits: waiters already queued keep their place."""
        self.limit, self.max_queue = limit, max_queue
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s

    def leave(self) -> None:
        w = self._waiters
        while w:
            f = w.popleft()
            if not f.done():
                if self.active <= self.limit:
                    f.set_result(True)
                    return
                w.appendleft(f)
                break
        self.active -= 1

    def busy(self) -> bool:
        """Whether a request arriving now would wait (or be refused) for a slot."""
        return self.active >= self.limit or bool(self._waiters)

    def check(self) -> None:
        assert self.active >= 0, f"{self.active=}"


def _expire(fut: asyncio.Future) -> None:
    """An admission wait's timeout: the waiter gets False (no slot) unless served."""
    if not fut.done():
        fut.set_result(False)


def _retry_after(status: int, headers) -> list[tuple[str, str]]:
    """A worker's ``Retry-After`` for a 429 or 503 it answered (1 s if it gave
    none): no client sees either without one."""
    if status != 429 and status != 503:
        return []
    v = headers.get("retry-after", "")
    return [("Retry-After", v if v.isdigit() and len(v) <= 6 else "1")]


class WorkerUnhealthy(Cancelled):
    """The request's worker turned unhealthy while it waited (``Pool.on_unhealthy``)."""

    cause = "unhealthy"


class _UpstreamFailed(Exception):
    """One attempt failed before the client saw a byte. The message is for the log
    (it may name the worker); the client gets ``_client_error``'s or
    ``_status_error``'s body, which name none."""

    def __init__(
        self, cause: str, detail: str, *, retry: bool, status: int | None = None, headers: Any = None
    ) -> None:
        super().__init__(detail)
        #: connect | unhealthy | timeout | payload | too_large | status | rank
        self.cause = cause
        self.retry = retry  # the worker provably is not running it: another may
        self.status = status  # the worker's status, for cause "status"
        self.headers = headers  # the worker's headers, for cause "status"


#: the client's error per failure cause: (status, code, message); no worker named
_CLIENT_ERRORS = {
    "connect": (502, "bad_gateway", "no worker could be reached"),
    "unhealthy": (502, "bad_gateway", "the worker became unavailable"),
    "timeout": (504, "upstream_timeout", "the worker did not answer in time"),
    "payload": (502, "bad_gateway", "the worker's answer was cut off or malformed"),
    "no_answer": (502, "bad_gateway", "the worker closed the connection without answering"),
    "rank": (502, "bad_gateway", "the worker refused the data-parallel rank it was sent"),
    "too_large": (
        502,
        "upstream_response_too_large",
        "the worker's answer is larger than this router passes on (limits.max_response_bytes)",
    ),
}
_MAX_WORKER_MESSAGE = 2000  # characters of a worker's 4xx message passed on


def _client_error(cause: str) -> tuple[int, bytes]:
    status, code, message = _CLIENT_ERRORS.get(cause, _CLIENT_ERRORS["payload"])
    return status, json.dumps(error_body(message, "upstream_error", code)).encode()


def _status_error(status: int, data: bytes) -> bytes:
    """The client's body for a worker's error answer ``status`` (>= 400): a 4xx keeps
    the worker's message, type, code and param when its body says them (OpenAI's
    ``{"error": {...}}``, vLLM's and SGLang's ``{"object": "error", ...}``, FastAPI's
    ``{"detail": "..."}``), re-encoded in the OpenAI shape; anything else gets the
    router's own message."""
    if status == 429:
        return json.dumps(
            error_body("the worker is at capacity; retry later", "rate_limit_error", "upstream_overloaded")
        ).encode()
    if status == 503:
        return json.dumps(
            error_body(
                "the worker is unavailable; retry later", "service_unavailable", "upstream_unavailable"
            )
        ).encode()
    if status >= 500:
        return json.dumps(
            error_body(f"the worker failed to answer (HTTP {status})", "upstream_error", "upstream_error")
        ).encode()
    etype = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
        status, "invalid_request_error"
    )
    message, code, param = f"the worker refused the request (HTTP {status})", None, None
    try:
        obj = json.loads(data) if len(data) <= 1 << 20 else None
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        src = err if isinstance(err, dict) else obj
        m = src.get("message", src.get("detail"))
        if isinstance(m, str) and m:
            message = m[:_MAX_WORKER_MESSAGE]
            t, c, p = src.get("type"), src.get("code"), src.get("param")
            if isinstance(t, str) and t and len(t) <= 64:
                etype = t
            if (isinstance(c, str) and len(c) <= 64) or (type(c) is int):
                code = c
            if isinstance(p, str) and len(p) <= 256:
                param = p
    return json.dumps(error_body(message, etype, code, param)).encode()


@dataclasses.dataclass(slots=True)
class RequestContext:
    """One client request on the data plane: what each of its attempts needs. Made
    by ``serve`` once the body is read and keyed; only ``reason`` and ``route``
    change (a retry's reason is ``fallback``)."""

    ex: Any  # the exchange it came on (module docstring)
    endpoint: Endpoint
    raw: bytes | bytearray  # the client's body, forwarded as it came (one buffer, not copied)
    body: dict  # the same, parsed
    key: PrefixKey  # its routing key (byte space), tenant and model
    stream: bool
    session: str | None  # x-session-id, else the body's "user"; on a bus, its digest
    rid: str  # its request id
    t0: float  # monotonic time it arrived
    reason: str = ""  # why the current attempt's worker was chosen (metrics)
    tenant: str = ""  # its tenant's name (router.auth), for router.tenancy
    api_key: str = ""  # the name of the API key it came with ("" none or unnamed)
    ticket: Ticket | None = None  # its class and rate-limit reservation, once admitted
    route: Route | None = None  # the current attempt's route (its match, its explanation)
    trace: RequestTrace | None = None  # its spans (router.tracing); None: not traced


class _Flight:
    """One attempt's outcome as it unfolds, for its bookkeeping on every path."""

    __slots__ = ("left", "ok", "ttft", "usage", "output", "sent", "head", "status", "broken", "watch")

    def __init__(self, left: int) -> None:
        self.left = left  # prompt tokens still counted on the worker as queued prefill
        self.ok: bool | None = None  # worker success / failure / neither (pool.finish)
        self.ttft: float | None = None  # sent -> first content token (streams)
        self.usage: tuple[int, int] | None = None  # (prompt_tokens, cached_tokens)
        self.output: int | None = None  # completion tokens the worker reported
        self.sent = time.monotonic()
        self.head: float | None = None  # when the worker's response head came
        #: the status of the answer the client got from this attempt (the traffic
        #: log's); None: none (failed before a byte, or the client went away)
        self.status: int | None = None
        self.broken = False  # the worker broke off after the client had its 200
        self.watch: StreamWatch | None = None  # a relayed stream's (what it cost: router.tenancy)


def _named_tenants(cfg: Config) -> list[str]:
    """The tenants the YAML names outside ``tenancy``: metric labels first."""
    t = cfg.keys.tenant
    return [t.default, *(k.tenant for k in t.api_keys)]


def _usage_of_body(data: bytes) -> tuple[tuple[int, int] | None, int | None]:
    """((prompt_tokens, cached_tokens) or None, completion_tokens or None) of a
    non-streamed answer, as far as it reports them."""
    if b'"usage"' not in data and b'"meta_info"' not in data:
        return None, None
    try:
        obj = json.loads(data)
    except ValueError:
        return None, None
    return usage_of(obj), completion_tokens_of(obj)


class AiohttpExchange:
    """The data plane's exchange over an aiohttp request (see ``Router.serve``)."""

    __slots__ = ("request", "headers", "result")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.headers = request.headers  # case-insensitive
        self.result: web.StreamResponse | None = None

    async def body(self, limit: int) -> bytes | bytearray:
        request = self.request
        cl = request.content_length
        if cl is not None:
            if cl > limit:
                raise PayloadTooLarge(f"request body of {cl} bytes exceeds the limit of {limit} bytes")
            return await request.read()
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return buf  # the one buffer, not a copy

    def reply(self, status: int, body: bytes, content_type: str, extra) -> None:
        h = {"Content-Type": content_type}
        h.update(extra)
        self.result = web.Response(body=body, status=status, headers=h)

    async def stream_start(self, content_type: str, extra) -> None:
        h = {"Content-Type": content_type}
        h.update(extra)
        sr = self.result = web.StreamResponse(status=200, headers=h)
        await sr.prepare(self.request)

    async def stream_write(self, data: bytes) -> None:
        sr = self.result
        assert isinstance(sr, web.StreamResponse), "stream_write before stream_start"
        await sr.write(data)

    async def stream_end(self) -> None:
        sr = self.result
        assert isinstance(sr, web.StreamResponse), "stream_end before stream_start"
        await sr.write_eof()


class DataPlane:
    """Admission, keying, the policy's pick, load at pick time, forwarding, retries
    and warm-ups. One event loop owns it; nothing here blocks.

    ``session`` (warm-ups) and ``upstream`` (the data plane's connections) are set by
    the owner's lifecycle before the first request and closed by it.
    """

    def __init__(
        self,
        cfg: Config,
        policy: Policy,
        tenants: TenantResolver,
        pool: Pool,
        index: PrefixIndex,
        metrics: Metrics,
        engines: Engines,
        spawn: Callable[[Any], asyncio.Task],
        traffic: TrafficLog | None = None,
    ) -> None:
        self.pool = pool
        self.traffic = traffic  # None: off
        #: decayed demand (prompt and uncached tokens/s): the autoscaling signal's input
        self.demand = DemandMeter(cfg.autoscale.half_life_s)
        self.engines = engines  # keys, links, usage
        self.index = index
        self.metrics = metrics
        self._spawn = spawn  # the owner's task set: warm-ups are cancelled at shutdown
        lim = cfg.limits
        self.admission = Admission(lim.max_concurrency, lim.max_queue, lim.queue_timeout_s, lim.retry_after_s)
        # (a refusal may wait in the admission queue; shed_total counts the 429s)
        shedder = Shedder(lim.worker_queue_requests, lim.worker_queue_min_s, self.pool.refused)
        self.cfg = cfg
        self.tenants = tenants
        #: priority classes and rate limits (router.tenancy)
        self.tenancy = Tenancy(cfg.tenancy, _named_tenants(cfg), metrics, time.monotonic())
        #: at saturation, requests wait for room by class and fair share (off by default)
        self.queue = AdmissionQueue(cfg.tenancy.queue, metrics)
        self.session: aiohttp.ClientSession | None = None  # warm-ups
        self.upstream: UpstreamPool | None = None  # the data plane's connections
        self._bus: BusReplica | None = None  # the ``bus`` property
        #: OpenTelemetry traces (router.tracing); None: off, and no request touches them
        self.tracing: Tracing | None = None
        self._addrs: dict[str, tuple[str, int, str]] = {}
        self._rid_prefix = os.urandom(4).hex()
        self._rid = itertools.count(1)
        self._warmed = WarmupGate()  # hot-root warm-ups sent (router.warmup)
        #: prefetch prefill spent (router.prefetch) and prefetches awaiting their request
        self.prefetch_budget = PrefetchBudget(cfg.tenancy.queue.weights)
        self.prefetched = PrefetchLedger(cfg.prefetch.max_tracked)
        #: per worker, the cancel handles of the requests in flight on it
        self._waiting: dict[Worker, set[Cancel]] = {}
        pool.on_unhealthy.append(self._worker_unhealthy)
        #: disaggregated prefill/decode: the two legs of a request (router.pd)
        self.pd = PrefillDecode(self)
        #: this router's mark on what it sends (router.hops; checked on arrival by the
        #: listeners, router.app; the client session carries it on every other request)
        self.hops = Hops()
        #: the last decisions with their candidates (GET /admin/decisions)
        self.decisions = DecisionRing(cfg.decisions.size)
        #: every decision: views, keys, admission, choice, placement (router.route)
        self.route = RouteCore(
            RouteParts(
                pool,
                index,
                policy,
                shedder,
                self.tenancy,
                self.queue,
                self.prefetched,
                busy=self.admission.busy,
                disaggregated=self.pd.disaggregated,
                explain=self.decisions.on,
            )
        )

    @property
    def policy(self) -> Policy:
        return self.route.policy

    @property
    def shedder(self) -> Shedder:
        s = self.route.parts.shedder
        assert s is not None  # the data plane always sheds
        return s

    @property
    def bus(self) -> BusReplica | None:
        """The bus replica told of each hint (set by the owner while it runs one)."""
        return self._bus

    @bus.setter
    def bus(self, bus: BusReplica | None) -> None:
        self._bus = bus
        self.route.attach_hints(bus)

    def use_tracing(self, tracing: Tracing | None) -> None:
        """Traces sampled requests with ``tracing`` from now on (None: none; its
        owner closes it)."""
        self.tracing = tracing

    def configure(self, cfg: Config, policy: Policy, tenants: TenantResolver) -> None:
        """Takes a reloaded config: in-flight requests finish under the old one."""
        self.cfg = cfg
        self.route.configure(policy)
        self.tenants = tenants
        lim = cfg.limits
        self.admission.configure(lim.max_concurrency, lim.max_queue, lim.queue_timeout_s, lim.retry_after_s)
        self.shedder.configure(lim)
        self.tenancy.configure(cfg.tenancy, _named_tenants(cfg), time.monotonic())
        self.queue.configure(cfg.tenancy.queue)
        self.prefetched.configure(cfg.prefetch)
        self.decisions.resize(cfg.decisions.size)
        self.route.explain_routes(self.decisions.on)
        self.prefetch_budget.configure(cfg.tenancy.queue)
        if self.upstream is not None:
            self.upstream.configure(cfg.timeouts.connect_s, cfg.timeouts.keepalive_s, lim.max_response_bytes)

    def _ids(self, worker: str, ctx: RequestContext) -> list[tuple[str, str]]:
        """The headers naming an answer: its request id, the worker's id only where
        ``response_headers.worker_id`` allows (off by default: worker ids and the
        fleet's size are not a client's business), and the ``x-ratelimit-*`` of a
        request under rate limits (``Ticket.headers``)."""
        out = [(REQUEST_ID_HEADER, ctx.rid)]
        rh = self.cfg.response_headers
        if rh.worker_id:
            out.insert(0, (WORKER_HEADER, worker))
        if rh.match_tokens and ctx.route is not None and ctx.route.placement is not None:
            q = quality(ctx.route, ctx.route.placement, None)
            out += [(AVAILABLE_HEADER, str(q.available)), (PREDICTED_HEADER, str(q.predicted))]
        if ctx.ticket is not None and ctx.ticket.limits:
            out += ctx.ticket.headers()
        return out

    def _reject(self, ex, exc: RequestError, rid: str) -> None:
        self.metrics.rejected.labels(str(exc.status), exc.code).inc()
        extra = [(REQUEST_ID_HEADER, rid)]
        if exc.retry_after_s is not None:
            extra.append(("Retry-After", retry_after_header(exc.retry_after_s)))
        extra += exc.headers
        ex.reply(exc.status, json.dumps(exc.to_json()).encode(), _JSON, extra)

    def screen_head(self, headers: Mapping[str, str]) -> None:
        """Raises the refusal a data-plane request gets from its head whatever its
        body (router.screen): no valid credentials (401), or its tenant or API key
        over its rate limit (429 + x-ratelimit-*: ``Tenancy.over_limit``). Called
        before the body is read; takes nothing."""
        tenant, api_key = self.tenants.identify(headers)
        exc = self.tenancy.over_limit(tenant, api_key, time.monotonic())
        if exc is not None:
            raise exc

    async def serve(self, ex, endpoint: Endpoint) -> None:
        """Serves one data-plane request on exchange ``ex``. Never raises for bad
        input (it becomes a JSON error reply); cancellation (client gone) propagates
        after every resource is released. A sampled request is traced
        (router.tracing), its spans ended on every path."""
        tr = self.tracing
        if tr is not None:
            from router import tracing

            trace = tracing.start(tr, ex.headers, endpoint)
            if trace is not None:
                try:
                    await self._serve(trace.exchange(ex), endpoint, trace)
                except asyncio.CancelledError:
                    trace.gone()  # the client left
                    raise
                finally:
                    trace.end()
                return
        await self._serve(ex, endpoint, None)

    async def _serve(self, ex, endpoint: Endpoint, trace: RequestTrace | None) -> None:
        t0 = time.monotonic()
        headers = ex.headers
        rid = self.request_id(headers)
        adm = self.admission
        waited = not adm.try_enter()
        if waited:
            try:
                await adm.enter()
            except Overloaded as exc:
                self._reject(ex, exc, rid)
                return
        try:
            if trace is not None:
                trace.admitted(waited)
            try:
                raw = await ex.body(self.cfg.limits.max_body_bytes)
                ctx = self.context_of(ex, endpoint, raw, rid, t0, trace)
            except RequestError as exc:
                self._reject(ex, exc, rid)
                return
            if trace is not None:
                trace.keyed(ctx.key.model, ctx.stream, len(raw), len(ctx.key.hashes))
            await self._route_and_forward(ctx)
        finally:
            adm.leave()

    def context_of(
        self, ex, endpoint: Endpoint, raw: bytes | bytearray, rid: str, t0: float, trace=None
    ) -> RequestContext:
        """The request read from its body ``raw`` and headers (``ex.headers``): parsed,
        checked, its tenant identified and its routing key made. Raises
        ``RequestError`` (400 naming the field, 401) for what the client got wrong.
        Every carrier of a data-plane request reads it here (the raw front, the aiohttp
        app, the gateway's endpoint picker: router.epp)."""
        headers = ex.headers
        screen.check_raw(self.pool, raw, time.monotonic())  # an unserved leading model: unparsed
        body = jsonbody.loads(raw)  # bounded depth, finite numbers, UTF-8
        edge.check_request(body)  # the P/D legs and ranks are the router's
        tenant, api_key = self.tenants.identify(headers)
        screen.check_parsed(self.pool, endpoint, body, time.monotonic())  # unserved: not keyed
        key = request_key(
            endpoint,
            body,
            tenant=self.tenants.namespace_of(tenant),
            block_bytes=self.cfg.keys.block_bytes,
        )
        stream = body.get("stream", False)
        if stream is not True and stream is not False:
            raise MalformedRequest("'stream' must be a boolean", param="stream")
        session = headers.get("x-session-id")
        if session is None:
            user = body.get("user")
            session = user if isinstance(user, str) else None
        salts = self.tenants.salts
        if session is not None and self.bus is not None and salts is not None:
            # on a bus, every replica keys the session by one digest, which
            # its hints carry (protocol.bus_wire: never the client's id)
            session = salts.session_key(session)
        return RequestContext(
            ex,
            endpoint,
            raw,
            body,
            key,
            stream,
            session,
            rid,
            t0,
            tenant=tenant,
            api_key=api_key,
            trace=trace,
        )

    def request_id(self, headers: Mapping[str, str]) -> str:
        """The request's id: the client's ``x-request-id`` if short and plain, else ours."""
        return request_id(headers.get(REQUEST_ID_HEADER)) or f"{self._rid_prefix}-{next(self._rid)}"

    def ask_for(self, ctx: RequestContext) -> Ask:
        """The route core's question for ``ctx``."""
        return self.ask_of(
            ctx.endpoint, ctx.body, ctx.key, ctx.session, ctx.tenant, ctx.api_key, ctx.ex.headers
        )

    async def _prepare_keys(self, endpoint: Endpoint, body: dict, key: PrefixKey) -> None:
        """Before the route core keys the request: workers keyed through their engine's
        /tokenize are asked for its ids first (``Engines.prepare``; cached), the one
        await before the pick (the core then reads the views again)."""
        views = self.pool.views(time.monotonic(), key.model, key.adapter)
        if views:
            await self.engines.prepare(endpoint, body, views)

    def ask_of(
        self,
        endpoint: Endpoint,
        body: dict,
        key: PrefixKey,
        session: str | None,
        tenant: str,
        api_key: str,
        headers: Mapping[str, str],
    ) -> Ask:
        """The route core's question for a parsed request: its keyer keys the body in
        every space the views use (``Engines.key``)."""
        engines = self.engines

        def keyer(views, now: float) -> KeyedRequest:
            return engines.key(endpoint, body, key, session, views, now)

        return Ask(keyer, key.model, key.adapter, tenant, api_key, headers, body, endpoint)

    async def _route_and_forward(self, ctx: RequestContext) -> None:
        core = self.route
        ask = self.ask_for(ctx)
        trace = ctx.trace
        await self._prepare_keys(ctx.endpoint, ctx.body, ctx.key)
        now = time.monotonic()
        verdict = core.decide(ask, now) if trace is None else trace.decide(core, ask, now)
        if isinstance(verdict, Hold):
            ctx.ticket = verdict.ticket
            held = time.monotonic()
            shed, waited = await self._admission(ctx, verdict)
            if trace is not None:
                trace.held(held, shed is not None)
            if shed is not None:
                verdict = Reject(shed, verdict.ticket, shed=True)
            else:
                now = time.monotonic()
                verdict = (
                    core.resume(verdict, waited, now)
                    if trace is None
                    else trace.resume(core, verdict, waited, now)
                )
        if isinstance(verdict, Reject):
            self._refused(ctx, verdict)
            return
        ctx.ticket = verdict.ticket
        now = time.monotonic()
        if verdict.ticket is not None:
            self.tenancy.admitted(verdict.ticket, now)
        if isinstance(verdict, Admitted):  # a disaggregated fleet: its legs (router.pd)
            await self.pd.serve(ctx, verdict.keyed, verdict.views, now)
            return
        await self.forward(ctx, verdict, ask, now)

    def _refused(self, ctx: RequestContext, verdict: Reject) -> None:
        """Answers a refusal of the route core: a shed request counted as shed (and in
        the traffic log, as offered load), any reservation given back."""
        now = time.monotonic()
        ticket = verdict.ticket
        if verdict.shed:
            self.metrics.shed.inc()
            if ticket is not None:
                self.tenancy.shed(ticket, now)
        elif ticket is not None:
            self.tenancy.refund(ticket, now)
        self._reject(ctx.ex, verdict.error, ctx.rid)
        if self.decisions.on:
            self._decided(ctx, "", None, verdict.error.status, reason=verdict.error.code, shed=verdict.shed)
        if verdict.shed and self.traffic is not None:  # offered load: analyze sees what was shed
            self.traffic.record(
                ctx.key,
                arrival_s=time.time() - (time.monotonic() - ctx.t0),
                worker="",
                matched_tokens=0,
                status=verdict.error.status,
                session=ctx.session,
            )

    async def forward(self, ctx: RequestContext, route: Route, ask: Ask, now: float) -> None:
        """Runs the request on ``route``'s worker, and on another (the route core asked
        again, the workers tried excluded) only where the first provably is not
        running it (module docstring); replies the failure when every attempt failed.
        A retry's ask keeps the first's candidates and chooser (a P/D decode leg's)."""
        w, pick = route.worker, route.placement
        assert pick is not None, "a forwarded route is placed"
        tried: list[str] = []
        excluded: set[str] = set()  # workers a retry must not go to
        retries = self.cfg.retries
        last: _UpstreamFailed | None = None
        ctx.route = route
        self.routed(ctx, route, now)
        while True:
            tried.append(w.id)
            try:
                await self._attempt(ctx, w, pick)
                return
            except _UpstreamFailed as exc:
                last = exc
                if not exc.retry and await self._went_down(ctx, w, exc):
                    exc.retry = True
                if exc.cause != "rank":  # a rejected rank is not the worker's failure:
                    excluded.add(w.id)  # it may take the retry (its rank map re-read)
                if ctx.trace is not None:
                    ctx.trace.failed(exc.cause)
                self.metrics.attempt(w.id, exc.status or exc.cause)  # not a client outcome
                log.warning(
                    "request %s: worker %s (%s) failed (%s: %s), attempt %d/%d%s",
                    ctx.rid,
                    w.id,
                    w.url,
                    exc.cause,
                    exc,
                    len(tried),
                    retries.max_attempts,
                    "" if exc.retry else ", not retried",
                )
            if (
                not last.retry
                or len(tried) >= retries.max_attempts
                or time.monotonic() - ctx.t0 >= self.cfg.timeouts.total_s
            ):
                break
            delay = min(retries.backoff_s * (2 ** (len(tried) - 1)), retries.backoff_max_s)
            if delay:
                await asyncio.sleep(delay)
            retry = ask.admit(ctx.ticket, exclude=frozenset(excluded), split=False)
            now = time.monotonic()
            trace = ctx.trace
            again = self.route.decide(retry, now) if trace is None else trace.decide(self.route, retry, now)
            if not isinstance(again, Route):
                break
            w, pick = again.worker, again.placement
            assert pick is not None, "a retry's route is placed"
            ctx.reason, ctx.route = Reason.FALLBACK.value, again
            self.metrics.retries.labels(last.cause).inc()
        self._failed(ctx, last, tried[-1])

    def routed(self, ctx: RequestContext, route: Route, now: float) -> None:
        """What a client request's first pick tells, once per request (not per try):
        a prefetch used, the matched tokens, the demand meter, hot-root warm-ups."""
        d, w, pick = route.decision, route.worker, route.placement
        assert pick is not None, "a routed request is placed"
        ctx.reason = d.reason.value
        if self.prefetched:
            self._prefetch_used(w, pick, now)
        self.metrics.observe_matched(pick.blocks * pick.key.block_tokens)
        self.demand.observe(now, pick.own, pick.key.prompt_tokens)
        if d.warm and self.cfg.warmup.enabled:
            self._schedule_warmups(d.warm, ctx.endpoint, ctx.body, ctx.key, route.keyed.match.depth, now)

    async def _admission(self, ctx: RequestContext, hold: Hold) -> tuple[Overloaded | None, bool]:
        """The admission queue's verdict on a held request (router.admission_queue):
        (None once the request may go to a worker, else its 429; whether it waited).
        A client gone while it waits: its reservation is given back and the
        cancellation propagates."""
        ticket = hold.ticket
        try:
            return await self.queue.admit(
                ctx.tenant, ticket.rank, ticket.reserved, hold.probe, time.monotonic()
            )
        except asyncio.CancelledError:
            self.tenancy.refund(ticket, time.monotonic())
            raise

    async def _went_down(self, ctx: RequestContext, w: Worker, exc: _UpstreamFailed) -> bool:
        """Whether a worker that answered 5xx, or dropped the connection after the
        request was sent (before any answer, or mid-answer), before the client saw a
        byte, is going down: its health probe fails now. Then its generation died with
        it (and the router closed the connection, which makes a surviving engine abort
        it), so another worker may run the request without running it twice; an engine
        stopped mid-request (a restart, a rollout) costs the client nothing. A worker
        that still answers its probe keeps the rule: it may have run the request, so a
        5xx or a hang-up becomes a 502, not retried."""
        if exc.cause not in ("status", "payload", "no_answer") or (
            exc.status is not None and exc.status < 500
        ):
            return False
        if await self.pool.probe(w):
            return False
        self.pool.check_soon(w)
        log.warning(
            "request %s: worker %s fails its health probe: its generation died with it", ctx.rid, w.id
        )
        return True

    def _failed(self, ctx: RequestContext, last: _UpstreamFailed, worker: str) -> None:
        """Every attempt failed before the client saw anything (``worker`` the last
        tried): one error in the OpenAI shape, naming no worker (the log has them)."""
        if last.retry and ctx.ticket is not None:  # no worker ran it: its tokens back
            self.tenancy.refused(ctx.ticket, time.monotonic())
        if last.cause == "status":
            # a 429 or 503 keeps its status (and Retry-After); another 5xx is a 502
            assert last.status is not None  # cause "status": the worker answered one
            status = last.status if last.status in (429, 503) else 502
            self.metrics.outcome(worker, status, ctx.reason)
            self._log_failed(ctx, worker, status)
            ctx.ex.reply(
                status,
                _status_error(last.status, b""),
                _JSON,
                [*self._ids(worker, ctx), *_retry_after(last.status, last.headers)],
            )
            return
        status, body = _client_error(last.cause)
        self._log_failed(ctx, worker, status)
        self.metrics.rejected.labels(
            str(status), _CLIENT_ERRORS.get(last.cause, _CLIENT_ERRORS["payload"])[1]
        ).inc()
        ctx.ex.reply(status, body, _JSON, [(REQUEST_ID_HEADER, ctx.rid)])

    def _log_failed(self, ctx: RequestContext, worker: str, status: int) -> None:
        """The traffic log's line for a request every attempt failed (offered load,
        served by no worker: nothing matched, cached or timed; ``worker`` the last tried),
        and the decision ring's."""
        if self.decisions.on:
            self._decided(ctx, worker, None, status)
        if self.traffic is not None:
            self.traffic.record(
                ctx.key,
                arrival_s=time.time() - (time.monotonic() - ctx.t0),
                worker=worker,
                matched_tokens=0,
                status=status,
                session=ctx.session,
            )

    async def _attempt(self, ctx: RequestContext, w: Worker, pick: Placement) -> None:
        """One try on worker ``w`` (its load already counted). Releases the load on
        every path (``_settle``): a streaming request's prompt stops counting as queued
        prefill at its first *content* token (router.sse), never at the headers or a
        role chunk. Raises ``_UpstreamFailed`` if it failed before the client saw a
        byte (``retry`` says whether another worker may run it); after that, failures
        end the stream with an SSE error event. While it waits, ``w`` turning
        unhealthy cancels it (``_worker_unhealthy``)."""
        link = w.engine  # the link the pick counted on (a reload may replace w's)
        f = _Flight(pick.own)
        host, port, hostport = self._addr(w.url)
        t = self.cfg.timeouts
        ticket = ctx.ticket
        payload, strip = self.engines.forward_body(
            link,
            ctx.endpoint,
            ctx.body,
            ctx.raw,
            ctx.stream,
            ticket.rank if ticket is not None else None,
        )
        fwd = (
            self.tenants.forward_lines(ctx.key.tenant)
            + b"x-request-id: "
            + ctx.rid.encode("utf-8", "surrogateescape")
            + b"\r\n"
        )
        if pick.rank is not None:
            fwd += b"x-data-parallel-rank: %d\r\n" % pick.rank  # vLLM's rank header
        fwd += self.hops.lines(ctx.ex.headers)  # a request that comes back is refused
        trace, span = ctx.trace, 0
        if trace is not None:  # the worker's spans join this attempt's (W3C traceparent)
            span, lines = trace.attempt()
            fwd += lines
        head = build_head(ctx.endpoint.value, hostport, len(payload), fwd)
        resp = None
        cancel = Cancel()
        self.watch(w, cancel)
        try:
            try:
                # a non-streamed answer comes when its generation is done: only the
                # total deadline bounds it (and w's health, through ``cancel``)
                assert self.upstream is not None, "the data plane serves only once started"
                resp = await self.upstream.request(
                    host,
                    port,
                    head,
                    payload,
                    read_timeout_s=t.first_byte_s if ctx.stream else float("inf"),
                    total_timeout_s=t.total_s - (time.monotonic() - ctx.t0),
                    cancel=cancel,
                )
                first = await self._answer(ctx, w, link, pick, f, resp)
            except UpstreamError as exc:
                f.ok = finish_outcome(exc)  # the router's own deadline or limit: not w's fault
                if exc.cause == "connect":
                    self.pool.check_soon(w)
                # nothing reached the client; the connection is closed (the worker
                # aborts). Retried only where the worker provably is not running it.
                raise _UpstreamFailed(
                    exc.cause, f"worker {w.id} ({w.url}): {exc}", retry=exc.cause in ("connect", "unhealthy")
                ) from None
            if first is not None:  # from here on the client has bytes: never retry
                await self._relay(ctx, w, f, resp, first, strip)
        finally:
            self.unwatch(w, cancel)
            if resp is not None:
                resp.release()
            self._settle(ctx, w, link, pick, f)
            if trace is not None:
                trace.attempt_end(
                    span,
                    w.id,
                    f.sent,
                    f.head,
                    f.ttft,
                    resp.status if resp is not None else None,
                    f.ok,
                    f.usage,
                    f.output,
                    broken=f.broken,
                )

    async def _answer(
        self, ctx: RequestContext, w: Worker, link: EngineLink | None, pick: Placement, f: _Flight, resp
    ) -> bytes | None:
        """The worker's answer before the client sees a byte of it: a 200 stream's first
        body bytes (returned, for ``_relay``), or the whole answer, replied here
        (None). Raises ``_UpstreamFailed`` for a 5xx or 429 and for a refused rank."""
        m = self.metrics
        head = f.head = time.monotonic()
        status = resp.status
        if status >= 500 or status == 429:
            data = await resp.read()
            f.ok = status == 429  # busy, not broken
            log.warning(
                "request %s: worker %s (%s) answered %d: %r", ctx.rid, w.id, w.url, status, data[:500]
            )
            # 429 and 503 say the request was not taken: another worker may
            raise _UpstreamFailed(
                "status",
                f"worker {w.id} answered {status}",
                retry=status in (429, 503),
                status=status,
                headers=resp.headers,
            )
        m.observe_ttfb(head - ctx.t0)
        if ctx.stream and status == 200:
            return await resp.readany()
        data = await resp.read()
        if status == 400 and pick.rank is not None and b"data_parallel_rank" in data:
            # the engine has fewer ranks than the router's map: not the worker's
            # failure, nor the client's; the map is asked again
            assert link is not None  # a rank is picked only through an engine link
            link.rank_rejected(pick.rank, data.decode("utf-8", "replace"))
            raise _UpstreamFailed(
                "rank",
                f"worker {w.id} rejected data-parallel rank {pick.rank}",
                retry=True,
                status=status,
                headers=resp.headers,
            )
        f.ok, f.status = True, status
        ctype = resp.headers.get("content-type", _JSON)
        if status == 200 and (
            link is not None or self.traffic is not None or (ctx.ticket is not None and ctx.ticket.limits)
        ):
            f.usage, f.output = _usage_of_body(data)
        if status >= 400:
            log.info("request %s: worker %s answered %d: %r", ctx.rid, w.id, status, data[:500])
            data, ctype = _status_error(status, data), _JSON
        else:
            data = edge.scrub_answer(data)  # no P/D hand-off fields back to the client
        ctx.ex.reply(
            status,
            data,
            ctype,
            [*self._ids(w.id, ctx), *_retry_after(status, resp.headers)],
        )
        m.request_done(w.id, status, ctx.reason)
        m.observe_latency(time.monotonic() - ctx.t0)
        return None

    def _settle(
        self, ctx: RequestContext, w: Worker, link: EngineLink | None, pick: Placement, f: _Flight
    ) -> None:
        """An attempt's bookkeeping, on every path: the load released, the outcome
        counted and, for an answer, the traffic log and what the engine link learns."""
        self.pool.finish(w, f.left, f.ok, pick.key.prompt_tokens)
        self.queue.kick(time.monotonic())  # w may have room
        if pick.rank is not None:
            assert link is not None  # a rank is picked only through an engine link
            link.rank_finished(pick.rank)
        usage = f.usage
        q = quality(ctx.route, pick, usage)
        self.metrics.answered(w.id, ctx.key.model, f.ok, usage, q)
        if f.status is not None and self.decisions.on:
            self._decided(ctx, w.id, q, f.status, f.ttft, f.broken)
        if self.traffic is not None and f.status is not None:  # the client got this answer
            self.traffic.record(
                ctx.key,
                arrival_s=time.time() - (time.monotonic() - ctx.t0),
                worker=w.id,
                matched_tokens=pick.blocks * pick.key.block_tokens,
                available_tokens=q.available,
                prompt_tokens=usage[0] if usage else None,
                output_tokens=f.output,
                cached_tokens=usage[1] if usage else None,
                ttft_s=f.ttft,
                status=f.status,
                broken=f.broken,
                session=ctx.session,
            )
        if ctx.ticket is not None:  # the limits charged what the engine did
            self.tenancy.charge(ctx.ticket, f.status, usage, f.output, f.watch, time.monotonic())
        if not f.ok:
            return
        if link is not None:
            try:
                link.observe(pick, usage, f.ttft, time.monotonic())
            except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
                log.exception("request %s: bookkeeping for worker %s failed", ctx.rid, w.id)
            self.pool.rate_moved(w)

    def _decided(
        self,
        ctx: RequestContext,
        worker: str,
        q: Quality | None,
        status: int,
        ttft_s: float | None = None,
        broken: bool = False,
        *,
        reason: str | None = None,
        shed: bool = False,
    ) -> None:
        """The decision ring's entry for ``ctx``'s outcome (router.decisions): its
        current route (none when refused or failed before one), the ``worker`` that
        answered (or was tried last; "" refused), the status the client got."""
        route = ctx.route if worker else None
        self.decisions.record(
            ctx.key,
            arrival_s=now_unix(ctx.t0),
            request_id=ctx.rid,
            tenant=ctx.tenant,
            session=ctx.session,
            policy=self.policy.name,
            route=route if route is not None and route.worker.id == worker else None,
            reason=ctx.reason if reason is None else reason,
            worker=worker,
            quality=q,
            status=status,
            ttft_s=ttft_s,
            broken=broken,
            shed=shed,
        )

    async def _relay(
        self, ctx: RequestContext, w: Worker, f: _Flight, resp, first: bytes, strip: bool
    ) -> None:
        """Passes a stream to the client as it arrives, from its first body bytes
        ``first``, keeping ``f`` up to date (``f.ok`` stays None when the client goes
        away, whether by an error or a cancellation, or is dropped by the front for
        reading nothing: ``timeouts.client_idle_s``). A worker failing mid-stream
        (broken, silent past ``first_byte_s``, unhealthy, an event past the size limit)
        or the total deadline passing ends the stream with a well-formed SSE error
        event and ``data: [DONE]``; only the worker's own failures count against its
        breaker (``finish_outcome``)."""
        m = self.metrics
        ex = ctx.ex
        watch = f.watch = StreamWatch(strip)
        limit = self.cfg.limits.max_response_bytes
        try:
            await ex.stream_start(
                resp.headers.get("content-type", "text/event-stream"),
                [("Cache-Control", "no-cache"), *self._ids(w.id, ctx)],
            )
            chunk = first
            while chunk:  # b"": the end of the stream
                out = watch.feed(chunk)
                if f.ttft is None and watch.first_token:
                    # the prompt is prefilled: no longer queued work on w
                    f.ttft = time.monotonic() - f.sent
                    m.observe_ttft(time.monotonic() - ctx.t0)
                    self.pool.prefilled(w, f.left)
                    f.left = 0
                    self.queue.kick(time.monotonic())  # w may have room
                if out:
                    await ex.stream_write(out)
                try:
                    if watch.pending > limit:
                        raise ResponseTooLarge(f"a stream event exceeds {limit} bytes")
                    chunk = await resp.readany()
                except UpstreamError as exc:
                    await self._stream_broke(ctx, w, f, watch, exc)
                    return
            tail = watch.flush()
            if tail:
                await ex.stream_write(tail)
            await ex.stream_end()
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            # the client went away (not the worker's fault; counted by the listener:
            # router.front); releasing the response closes the worker's connection,
            # so the engine aborts the generation
            log.debug("request %s: the client left during its stream from %s", ctx.rid, w.id)
            f.ok = None
            return
        f.ok, f.status = True, 200
        f.usage, f.output = watch.usage, watch.output_tokens
        m.request_done(w.id, 200, ctx.reason)
        m.observe_latency(time.monotonic() - ctx.t0)

    async def _stream_broke(
        self, ctx: RequestContext, w: Worker, f: _Flight, watch: StreamWatch, exc: UpstreamError
    ) -> None:
        """The worker failed mid-stream: the client's stream ends with an SSE error
        event and ``data: [DONE]`` (the unfinished event dropped)."""
        log.warning(
            "request %s: worker %s (%s) failed mid-stream (%s: %s)", ctx.rid, w.id, w.url, exc.cause, exc
        )
        self.metrics.request_done(w.id, 502, ctx.reason)
        message = _CLIENT_ERRORS.get(exc.cause, _CLIENT_ERRORS["payload"])[2]
        err = error_body(f"{message}; the answer is incomplete", "upstream_error", "upstream_failed")
        # the unfinished event is dropped: the error starts on a fresh line
        await ctx.ex.stream_write(
            watch.flush(complete=False) + b"data: " + json.dumps(err).encode() + b"\n\n" + _DONE
        )
        f.ok = finish_outcome(exc)
        f.status, f.broken = 200, True
        await ctx.ex.stream_end()

    def watch(self, w: Worker, cancel: Cancel) -> None:
        """``cancel`` fires if ``w`` turns unhealthy while its request waits
        (``_worker_unhealthy``); ``unwatch`` it on every path."""
        waiting = self._waiting.get(w)
        if waiting is None:
            waiting = self._waiting[w] = set()
        waiting.add(cancel)

    def unwatch(self, w: Worker, cancel: Cancel) -> None:
        waiting = self._waiting.get(w)
        if waiting is not None:
            waiting.discard(cancel)
            if not waiting:
                del self._waiting[w]

    def answer_error(self, ctx: RequestContext, worker: str, status: int, data: bytes, extra) -> None:
        """Answers the client a worker's error ``status`` (its body, for a 4xx) in the
        OpenAI shape, naming no worker; counted and logged as ``_failed`` does."""
        if 400 <= status < 500 and ctx.ticket is not None:  # refused before any work
            self.tenancy.refused(ctx.ticket, time.monotonic())
        self.metrics.outcome(worker, status, ctx.reason)
        self._log_failed(ctx, worker, status)
        ctx.ex.reply(status, _status_error(status, data), _JSON, [*self._ids(worker, ctx), *extra])

    def _worker_unhealthy(self, w: Worker) -> None:
        """``Pool.on_unhealthy``: every request waiting on ``w`` is cancelled there
        (its connection closed, so the engine aborts it); one whose client has seen
        nothing moves to another worker, a stream already begun ends with an error."""
        for c in list(self._waiting.get(w, ())):
            c.cancel(WorkerUnhealthy(f"worker {w.id} turned unhealthy"))

    def _addr(self, url: str) -> tuple[str, int, str]:
        a = self._addrs.get(url)
        if a is None:
            parts = urlsplit(url)
            port = parts.port or 80
            host = parts.hostname
            assert host, f"worker URL {url!r} without a host (refused by the config's checks)"
            a = self._addrs[url] = (host, port, parts.netloc)
        return a

    # -------------------------------------------------------------- warm-ups

    def _schedule_warmups(self, workers, endpoint, body, key, depth, now) -> None:
        """Prefill-only warm-ups of a hot root's new replicas (byte space: the routing
        bytes of the matched prefix), at most one per (worker, prefix) per
        ``warmup.min_interval_s`` (router.warmup, the simulator's gate too)."""
        bb = key.block_bytes
        prefix = warmup_prefix(key.hashes, depth)
        if prefix is None:
            return
        blocks, h = prefix
        prompt: Any
        p = body.get("prompt") if endpoint is Endpoint.COMPLETIONS else None
        if isinstance(p, list) and p and type(p[0]) is int:
            prompt = p[: blocks * key.block_tokens]
        else:
            try:
                prompt = key.data[: blocks * bb].decode("utf-8")
            except UnicodeDecodeError:
                log.debug("warm-up skipped: prefix cut inside a UTF-8 sequence")
                return
        interval = self.cfg.warmup.min_interval_s
        payload = None
        for wid in workers:
            w = self.pool.get(wid)
            if w is None or not self._warmed.admit(wid, h, now, interval):
                continue
            if payload is None:
                warm = {"model": key.model, "prompt": prompt, "max_tokens": 1, "stream": False}
                for f in ("lora_path", "lora_adapter"):  # the adapter's cache, not the base's
                    if body.get(f) is not None:
                        warm[f] = body[f]
                payload = json.dumps(warm).encode()
            self._spawn(self._warmup(w, payload, key.tenant))

    async def _warmup(self, w: Worker, payload: bytes, tenant: str) -> None:
        rid = f"{self._rid_prefix}-warm-{next(self._rid)}"
        status = await self._prefill_only(
            w,
            Endpoint.COMPLETIONS,
            payload,
            self.tenants.forward_headers(tenant),
            rid,
            self.cfg.warmup.timeout_s,
        )
        self.metrics.warmups.labels("ok" if status is not None and status < 400 else "error").inc()

    async def _prefill_only(
        self, w: Worker, endpoint: Endpoint, payload: bytes, headers: dict, rid: str, timeout_s: float
    ) -> int | None:
        """Sends ``w`` a prefill-only request (``max_tokens: 1``, not streamed: a
        hot-root warm-up or a prefetch) and drops its answer. Returns the worker's
        status, or None when it did not answer (logged)."""
        assert self.session is not None, "warm-ups and prefetches run only once started"
        try:
            async with self.session.post(
                w.url + endpoint.value,
                data=payload,
                headers={"Content-Type": _JSON, **headers, REQUEST_ID_HEADER: rid},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                await resp.read()
                if resp.status >= 400:
                    log.debug("prefill-only request %s on %s: HTTP %d", rid, w.id, resp.status)
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.debug("prefill-only request %s on %s failed: %r", rid, w.id, exc)
            return None

    # ------------------------------------------------------------- prefetch

    async def prefetch(self, ex) -> None:
        """``POST /v1/prefetch`` (router.prefetch): the body of a chat or completion
        request (or its prefix) is keyed and routed like the real one, its worker
        hinted and sent the prompt with ``max_tokens: 1``; the client gets 202 at
        once. Refused, nothing warmed: 400 malformed, 404/503 no worker serves the
        model, 429 (+ Retry-After) when the router or fleet is loaded or the budget
        is spent or the tenant (or key) is over its rate limit. Takes no admission
        slot; charged to the tenant's and key's limits as the warm-up request it
        sends (router.prefetch, "Tenant limits")."""
        t0 = time.monotonic()
        headers = ex.headers
        rid = request_id(headers.get(REQUEST_ID_HEADER)) or f"{self._rid_prefix}-pf-{next(self._rid)}"
        pcfg = self.cfg.prefetch
        try:
            if not pcfg.enabled:
                raise NotFound("prefetch is turned off on this router (prefetch.enabled)")
            raw = await ex.body(self.cfg.limits.max_body_bytes)
            screen.check_raw(self.pool, raw, time.monotonic())  # router.screen
            body = jsonbody.loads(raw)
            if not isinstance(body, dict):
                raise MalformedRequest("the body must be a JSON object")
            edge.check_request(body)
            if "messages" in body:
                endpoint = Endpoint.CHAT
            elif "prompt" in body:
                endpoint = Endpoint.COMPLETIONS
            else:
                raise MalformedRequest(
                    "a prefetch is the body of a chat ('messages') or completion ('prompt') request",
                    param="messages",
                )
            tenant, api_key = self.tenants.identify(headers)
            screen.check_parsed(self.pool, endpoint, body, time.monotonic())
            ns = self.tenants.namespace_of(tenant)
            key = request_key(endpoint, body, tenant=ns, block_bytes=self.cfg.keys.block_bytes)
            session = headers.get("x-session-id")
            if session is None and isinstance(body.get("user"), str):
                session = body["user"]
            now = time.monotonic()
            self._prefetch_sweep(now)
            await self._prepare_keys(endpoint, body, key)
            now = time.monotonic()
            # charged as the request it sends: one, and its prompt plus the one token
            # it generates (router.prefetch, "Tenant limits"); 429 when over; dropped
            # first when a real request would wait or be shed (router.route)
            # (tenancy reads the warm-up's body, the keyer the client's)
            ask = self.ask_of(endpoint, body, key, session, tenant, api_key, headers).again(
                body=_WARM_UP, endpoint=Endpoint.CHAT, split=False, prefetch=True, place=False
            )
            routed = self.route.decide(ask, now)
            if isinstance(routed, Reject):
                if routed.ticket is not None:
                    self.tenancy.refund(routed.ticket, now)
                if routed.shed:
                    self.metrics.prefetch_dropped.labels("load").inc()
                raise routed.error
            assert isinstance(routed, Route)  # a prefetch is never held nor split
            ticket = routed.ticket
            assert ticket is not None  # the data plane always has its tenancy stage
            w, kr = routed.worker, routed.keyed
            sk = kr.key_for(w.id)
            held = kr.blocks_for(w.id)
            dedup = not sk.hashes or held >= len(sk.hashes)
            tokens = 0
            if not dedup:
                tokens = uncached_tokens(sk.prompt_tokens, held, sk.block_tokens)
                rate = pcfg.share * sum(x.prefill_rate(now) for x in self.pool.routable_workers(now))
                wait = self.prefetch_budget.take(tenant, tokens, rate, pcfg.burst_s, now)
                if wait is not None:  # nothing warmed, the reservation given back
                    self.tenancy.refund(ticket, now)
                    self.metrics.prefetch_dropped.labels("budget").inc()
                    raise Overloaded(
                        f"the prefetch budget ({pcfg.share:g} of the fleet's prefill) is spent",
                        retry_after_s=max(1.0, min(wait, 60.0)),
                    )
        except RequestError as exc:
            self._reject(ex, exc, rid)
            return
        m = self.metrics
        self.tenancy.admitted(ticket, now)
        # the answer tells a client without an identity nothing of what others sent
        # (router.prefetch, "What the answer says"): charged alike, no flag
        told = not self.tenants.anonymous(tenant)
        if dedup:
            m.prefetch.labels("deduplicated").inc()
            if told:
                self.tenancy.settle(ticket, 0, now)  # nothing sent: its tokens given back
        else:
            pick = self.route.place(w, kr, now)  # the hint the real request follows; its load
            link = w.engine
            holder = w.id if pick.rank is None or link is None else link.holder(pick.rank)
            # its last full block may hold the chat template's closing tokens, which the
            # real request (its message goes on) does not share: the one before marks it
            mark = sk.hashes[-2] if len(sk.hashes) > 1 else sk.hashes[-1]
            wasted = self.prefetched.warmed(w.id, mark, now, holder)
            if wasted:
                m.prefetch.labels("unused").inc(wasted)
            m.prefetch.labels("warmed").inc()
            m.prefetch_tokens.inc(tokens)
            self._spawn(self._prefetch_send(w, pick, endpoint, body, key.tenant, rid, ticket.rank))
        out: dict[str, Any] = {"object": "prefetch", "accepted": True}
        if told:
            out["deduplicated"] = dedup
        extra = [(REQUEST_ID_HEADER, rid), *ticket.headers()]
        if self.cfg.response_headers.worker_id:
            out["worker"] = w.id
            extra.insert(0, (WORKER_HEADER, w.id))
        ex.reply(202, json.dumps(out).encode(), _JSON, extra)
        m.observe_latency(time.monotonic() - t0)

    async def _prefetch_send(
        self, w: Worker, pick: Placement, endpoint: Endpoint, body: dict, tenant: str, rid: str, rank: int
    ) -> None:
        """The prefetch's prefill on ``w``: the client's body with ``max_tokens: 1``,
        not streamed, its ``priority`` the class's (``rank``) as any request's, its
        answer discarded; the load counted at the pick released on every path."""
        warm = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
        warm.update(max_tokens=1, stream=False, n=1)
        headers = self.tenants.forward_headers(tenant)
        if pick.rank is not None:
            headers = {**headers, "x-data-parallel-rank": str(pick.rank)}
        link = w.engine
        ok: bool | None = None  # cancelled (shutdown): neither
        try:
            payload, _ = self.engines.forward_body(
                link, endpoint, warm, json.dumps(warm).encode(), False, rank
            )
            status = await self._prefill_only(
                w, endpoint, bytes(payload), headers, rid, self.cfg.prefetch.timeout_s
            )
            if status is not None and status < 400:
                ok = True
            elif status != 429:  # busy is not broken
                ok = False
        finally:
            self.pool.finish(w, pick.own, ok, pick.key.prompt_tokens)
            self.queue.kick(time.monotonic())
            if pick.rank is not None and link is not None:
                link.rank_finished(pick.rank)
            if ok is not True:
                self.metrics.prefetch.labels("failed").inc()

    def _prefetch_used(self, w: Worker, pick: Placement, now: float) -> None:
        """A real request picked ``w``: the prefetches of a prefix it matched there
        were used."""
        used = self.prefetched.observe(w.id, pick.key.hashes[: pick.blocks])
        if used:
            self.metrics.prefetch.labels("used").inc(used)
        self._prefetch_sweep(now)

    def _prefetch_sweep(self, now: float) -> None:
        """Counts the prefetches past ``prefetch.window_s`` as wasted."""
        tt = self.index.touch_time
        evicted, unused = self.prefetched.sweep(
            now, self.cfg.prefetch.window_s, lambda holder, h: tt(holder, h) is not None
        )
        if evicted:
            self.metrics.prefetch.labels("evicted").inc(evicted)
        if unused:
            self.metrics.prefetch.labels("unused").inc(unused)

    # ------------------------------------------------------------ small GETs
