"""The data plane: one client request from admission to its last byte.

Per data-plane request (``DataPlane.serve``), in this order and with nothing awaited
between the pick and the load count (the body budget and credentials are checked
before, by the listener: ``radixfleet.server.intake``, ``radixfleet.server.front``)::

    admission (concurrency slot or bounded queue, else 429 + Retry-After)
    read body (<= limits.max_body_bytes, else 413) -> json (else 400)
    tenant = TenantResolver(headers)                 (auth.py; 401 if a key is required)
    key    = request_key(endpoint, body, tenant, block_bytes)   (400 naming the field)
    await engines.prepare(...)                        workers keyed through their engine's
                                                      /tokenize: the ids asked for first
                                                      (cached; radixfleet.engines.engine_keys)
    verdict = route.decide(ask, now)                  the route core (radixfleet.route.core): views,
                                                      keys and match, tenancy and rate
                                                      limits, shedding, the policy's choice,
                                                      the hint and the load counted at pick
                                                      time; nothing awaited
        Reject -> its 4xx/503 (a shed one counted and logged as offered load)
        Hold   -> the admission queue (tenancy.queue), then route.resume
        Admitted (a disaggregated fleet) -> radixfleet.route.pd picks its two legs
        Route  -> forwarded below; a retry asks the core again, the tried excluded
    radixfleet.server.attempts, each try told to its RequestLedger (radixfleet.server.ledger):
    forward raw body bytes (x-radixfleet-tenant, x-request-id, x-radixfleet-hop; a
        traced request's traceparent: radixfleet.server.tracing) -> worker
        streaming: SSE bytes pass through as they arrive; a failure after the first
        byte ends the stream with an SSE error event and ``data: [DONE]``
    ledger end or cancel                              on every path (client gone too):
                                                      the pick's load released once

A generation runs once. A request goes to another worker (retries.max_attempts,
exponential backoff) only when the first provably is not running it: the connection
failed before the request was written to it (``radixfleet.server.upstream``: a worker that
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
(``radixfleet.wire.errors.error_body``), its body naming no worker (with
``response_headers.worker_id`` on, the ``x-radixfleet-worker`` header gives the id of
the one that answered; off by default, so clients learn no worker id): a
worker's 4xx keeps its message; a 5xx and every broken answer get the router's own;
the details (worker, address, its body) go to the log.

The data plane is written against an *exchange* (one request/response): the raw
HTTP/1.1 front (``radixfleet.server.front.FrontServer``, what ``radixfleet router`` listens
with) and the aiohttp app (``radixfleet.server.aiohttp_exchange``; tests and embedding) both provide
one. An exchange has ``headers`` (lower-case names), ``await body(limit)``,
``reply(status, body, content_type, extra)``, ``await stream_start(content_type,
extra)``, ``await stream_write(data)``, ``await stream_end()`` and ``result`` (what an
aiohttp handler returns).

The ``Router`` (radixfleet.server.app) owns one ``DataPlane`` and hands it, on every reload,
the config, policy and tenant resolver it must use from then on (``configure``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from radixfleet.common import jsonbody
from radixfleet.config import Config
from radixfleet.engines.keyspace import KeyedRequest
from radixfleet.fleet.pool import Pool
from radixfleet.fleet.scaling_signal import DemandMeter
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import Endpoint, PrefixKey, request_key
from radixfleet.policies.base import Policy
from radixfleet.route.admission_queue import AdmissionQueue
from radixfleet.route.core import Admitted, Ask, Hold, Reject, Route, RouteCore, RouteParts
from radixfleet.route.decisions import DecisionRing
from radixfleet.route.pd import PrefillDecode
from radixfleet.route.shedding import Shedder
from radixfleet.route.tenancy import Tenancy
from radixfleet.server import edge, screen
from radixfleet.server.admission import Admission
from radixfleet.server.answers import (
    AVAILABLE_HEADER,
    JSON,
    PREDICTED_HEADER,
    REQUEST_ID_HEADER,
    TENANT_HEADER,
    WORKER_HEADER,
)
from radixfleet.server.attempts import Attempts, WorkerUnhealthy
from radixfleet.server.auth import TenantResolver
from radixfleet.server.context import RequestContext
from radixfleet.server.hops import Hops
from radixfleet.server.ledger import LedgerParts
from radixfleet.server.metrics import Metrics
from radixfleet.server.prefetch import PrefetchBudget, PrefetchLedger
from radixfleet.server.upstream import UpstreamPool
from radixfleet.server.warm import Warmer
from radixfleet.wire.errors import MalformedRequest, Overloaded, RequestError, retry_after_header
from radixfleet.wire.identifiers import request_id

if TYPE_CHECKING:
    from radixfleet.bus.replica import BusReplica
    from radixfleet.common.tracing import Tracing
    from radixfleet.engines.manager import Engines
    from radixfleet.server.tracing import RequestTrace
    from radixfleet.server.traffic_log import TrafficLog

#: what importers of the data plane read from here (defined in radixfleet.server.answers, ...)
__all__ = [
    "AVAILABLE_HEADER",
    "PREDICTED_HEADER",
    "REQUEST_ID_HEADER",
    "TENANT_HEADER",
    "WORKER_HEADER",
    "Admission",
    "DataPlane",
    "RequestContext",
    "WorkerUnhealthy",
]

log = logging.getLogger("radixfleet.router")


def _named_tenants(cfg: Config) -> list[str]:
    """The tenants the YAML names outside ``tenancy``: metric labels first."""
    t = cfg.keys.tenant
    return [t.default, *(k.tenant for k in t.api_keys)]


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
        #: priority classes and rate limits (radixfleet.route.tenancy)
        self.tenancy = Tenancy(cfg.tenancy, _named_tenants(cfg), metrics, time.monotonic())
        #: at saturation, requests wait for room by class and fair share (off by default)
        self.queue = AdmissionQueue(cfg.tenancy.queue, metrics)
        self.session: aiohttp.ClientSession | None = None  # warm-ups
        self.upstream: UpstreamPool | None = None  # the data plane's connections
        self._bus: BusReplica | None = None  # the ``bus`` property
        #: OpenTelemetry traces (radixfleet.server.tracing); None: off, and no request touches them
        self.tracing: Tracing | None = None
        self._rid_prefix = os.urandom(4).hex()
        self._rid = itertools.count(1)
        #: prefetch prefill spent (radixfleet.server.prefetch) and prefetches awaiting their request
        self.prefetch_budget = PrefetchBudget(cfg.tenancy.queue.weights)
        self.prefetched = PrefetchLedger(cfg.prefetch.max_tracked)
        #: what each attempt's ledger settles with (radixfleet.server.ledger)
        self.parts = LedgerParts(pool, metrics, self.tenancy, self.queue, traffic)
        #: a client request's attempts on its workers (radixfleet.server.attempts)
        self.attempts = Attempts(self)
        pool.on_unhealthy.append(self.attempts.worker_unhealthy)
        #: hot-root warm-ups and prefetches (radixfleet.server.warm)
        self.warm = Warmer(self)
        #: disaggregated prefill/decode: the two legs of a request (radixfleet.route.pd)
        self.pd = PrefillDecode(self)
        #: this router's mark on what it sends (radixfleet.server.hops; checked on arrival by the
        #: listeners, radixfleet.server.app; the client session carries it on every other request)
        self.hops = Hops()
        #: the last decisions with their candidates (GET /admin/decisions)
        self.decisions = DecisionRing(cfg.decisions.size)
        #: every decision: views, keys, admission, choice, placement (radixfleet.route.core)
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

    def _reject(self, ex, exc: RequestError, rid: str) -> None:
        self.metrics.rejected.labels(str(exc.status), exc.code).inc()
        extra = [(REQUEST_ID_HEADER, rid)]
        if exc.retry_after_s is not None:
            extra.append(("Retry-After", retry_after_header(exc.retry_after_s)))
        extra += exc.headers
        ex.reply(exc.status, json.dumps(exc.to_json()).encode(), JSON, extra)

    def screen_head(self, headers: Mapping[str, str]) -> None:
        """Raises the refusal a data-plane request gets from its head whatever its
        body (radixfleet.server.screen): no valid credentials (401), or its tenant or API key
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
        (radixfleet.server.tracing), its spans ended on every path."""
        tr = self.tracing
        if tr is not None:
            from radixfleet.server import tracing

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
        app, the gateway's endpoint picker: radixfleet.gateway)."""
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
            # its hints carry (radixfleet.wire.bus_wire: never the client's id)
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
        if isinstance(verdict, Admitted):  # a disaggregated fleet: its legs (radixfleet.route.pd)
            await self.pd.serve(ctx, verdict.keyed, verdict.views, now)
            return
        self.routed(ctx, verdict, now)
        await self.attempts.forward(ctx, verdict, ask, now)

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
            self.attempts.decided(ctx, "", verdict.error.status, reason=verdict.error.code, shed=verdict.shed)
        if verdict.shed and self.traffic is not None:  # offered load: analyze sees what was shed
            self.traffic.record(
                ctx.key,
                arrival_s=time.time() - (time.monotonic() - ctx.t0),
                worker="",
                matched_tokens=0,
                status=verdict.error.status,
                session=ctx.session,
            )

    def routed(self, ctx: RequestContext, route: Route, now: float) -> None:
        """What a client request's first pick tells, once per request (not per try):
        a prefetch used, the matched tokens, the demand meter, hot-root warm-ups."""
        d, w, pick = route.decision, route.worker, route.placement
        assert pick is not None, "a routed request is placed"
        ctx.reason = d.reason.value
        if self.prefetched:
            self.warm.used(w, pick, now)
        self.metrics.observe_matched(pick.blocks * pick.key.block_tokens)
        self.demand.observe(now, pick.own, pick.key.prompt_tokens)
        if d.warm and self.cfg.warmup.enabled:
            self.warm.schedule(d.warm, ctx.endpoint, ctx.body, ctx.key, route.keyed.match.depth, now)

    async def _admission(self, ctx: RequestContext, hold: Hold) -> tuple[Overloaded | None, bool]:
        """The admission queue's verdict on a held request (radixfleet.route.admission_queue):
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

    async def prefetch(self, ex) -> None:
        """``POST /v1/prefetch`` (radixfleet.server.prefetch; ``Warmer.prefetch``)."""
        await self.warm.prefetch(ex)
