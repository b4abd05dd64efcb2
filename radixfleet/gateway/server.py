"""The endpoint picker: Envoy's ``ext_proc`` ``Process`` stream, one per HTTP request,
answered by the router's own route core.

The picker is the route core's second caller beside the data plane
(``radixfleet.server.dataplane``); it carries no byte itself, Envoy does. Per stream::

    request_headers   :path names a data-plane endpoint (else 404; GET /v1/models
                      goes to a routable worker, uncounted); the head's own checks
                      (Router.admit_head: 401, a hop loop's 508); BUFFERED: answered at
                      once; FULL_DUPLEX_STREAMED: held until the body has ended
    request_body      gathered up to limits.max_body_bytes (413 past it, nothing
                      more held); at its end:
                        admission slot   DataPlane.admission (429 when full)
                        read             DataPlane.context_of: the same 400/401 as
                                         the standalone router
                        decide           RouteCore.decide on DataPlane.ask_for, the
                                         subset hint as the ask's eligible views
                          Reject   -> ImmediateResponse (DataPlane._refused: the
                                      shed counted, the ticket given back)
                          Hold     -> the admission queue, then RouteCore.resume
                          Admitted -> 501: disaggregated P/D is not served through
                                      the gateway (its two legs need the router's
                                      own data plane)
                          Route    -> the pick and the fallbacks (below) in the
                                      header and metadata, the body as the worker
                                      is to get it (Engines.forward_body); a
                                      RequestLedger holds what the pick counted
    response_headers  :status and the endpoint that served (metadata, else Envoy's
                      upstream.address): first byte; a fallback that served takes
                      the count (the pick's attempt ended as failed, the fallback
                      placed through RouteCore.place)
    response_body     echoed through radixfleet.server.sse.StreamWatch (first content token,
                      usage, the usage event the router asked for hidden); at its
                      end the ledger ends. A non-streamed answer whose usage nothing
                      needs (an engine in sync by its events, no token limits, no
                      traffic log) ends at its headers, its body not sent to the
                      picker (full duplex: a mode override with the answer to the
                      request headers; two messages fewer each way)
    the stream ends before that (Envoy broke it: the client left, a reset)
                      -> the ledger is cancelled, the slot and ticket given back

The fallbacks are where Envoy may retry when it cannot connect to the pick
(``retries.max_attempts - 1`` of them): the other eligible views by their matched
prefix, then their queued prefill. They are not policy decisions (a policy's choice
records footprints and cursors); a fallback is placed, hint and count, only when
Envoy reports that it served.

Invariants: a stream counts load only through its ``RequestLedger``, which is ended
exactly once on every path (``close`` cancels one still open); the admission slot
is held from the decision to the stream's end and released once; a ticket that
never reached a worker is given back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from radixfleet.gateway import protocol as P
from radixfleet.keys import Endpoint
from radixfleet.route.core import Admitted, Hold, Reject, Route
from radixfleet.route.tenancy import PRIORITIES
from radixfleet.server.dataplane import REQUEST_ID_HEADER, RequestContext
from radixfleet.server.ledger import LedgerParts, RequestLedger
from radixfleet.server.sse import StreamWatch, completion_tokens_of, usage_of
from radixfleet.wire.errors import (
    NotFound,
    NoWorkerAvailable,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    error_body,
    retry_after_header,
)

if TYPE_CHECKING:
    from radixfleet.fleet.pool import Worker
    from radixfleet.gateway.endpoints import Endpoints
    from radixfleet.server.app import Router

log = logging.getLogger("radixfleet.gateway.envoy")

_PATHS = {e.value: e for e in Endpoint}
_JSON = "application/json"
#: credentials are the router's business, never a worker's
_DROPPED = ("authorization", "x-api-key")


class _Answer:
    """The data plane's exchange for a refusal: ``reply`` becomes the stream's
    ``ImmediateResponse`` (``radixfleet.server.dataplane``'s exchange protocol, reply only)."""

    __slots__ = ("headers", "response")

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.headers = headers
        self.response: Any = None

    def reply(self, status: int, body: bytes, content_type: str, extra) -> None:
        self.response = P.immediate(
            status, body, [("content-type", content_type), *extra], f"radixfleet_{status}"
        )


def _error(exc: RequestError, rid: str) -> Any:
    extra = [("content-type", _JSON), (REQUEST_ID_HEADER, rid)]
    if exc.retry_after_s is not None:
        extra.append(("retry-after", retry_after_header(exc.retry_after_s)))
    extra += list(exc.headers)
    return P.immediate(exc.status, json.dumps(exc.to_json()).encode(), extra, f"radixfleet_{exc.code}")


class Picker:
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over a ``Router``
    (module docstring). ``buffered``: the request body mode Envoy runs with
    (``gateway.body_mode``); the first message's ``protocol_config`` overrides it."""

    def __init__(self, router: Router, endpoints: Endpoints, *, buffered: bool, header_list: bool) -> None:
        self.router = router
        self.endpoints = endpoints
        self.buffered = buffered
        self.header_list = header_list  # the header carries the whole list (not ORIGINAL_DST)
        #: streams open now, and ledgers not yet ended (tests read them)
        self.streams = 0
        self.open: set[RequestLedger] = set()

    def ledger_parts(self) -> LedgerParts:
        dp = self.router.dataplane
        return LedgerParts(dp.pool, dp.metrics, dp.tenancy, dp.queue, dp.traffic)

    async def Process(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        s = _Stream(self)
        self.streams += 1
        try:
            async for req in request_iterator:
                for out in await s.on(req):
                    yield out
        finally:
            self.streams -= 1
            s.close()


class _Stream:
    """One ``Process`` stream: one HTTP request through Envoy."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.dp = picker.router.dataplane
        self.buffered = picker.buffered
        self.headers: dict[str, str] = {}
        self.endpoint: Endpoint | None = None
        self.body = bytearray()
        self.subset: frozenset[str] | None = None
        self.rid = ""
        self.t0 = time.monotonic()
        self.ctx: RequestContext | None = None
        self.route: Route | None = None
        self.ledger: RequestLedger | None = None
        self.ticket: Any = None  # held while queued (given back on a cancel)
        self.slot = False  # holds an admission slot
        self.done = False  # answered: nothing more to decide
        self.endpoints: list[str] = []  # the pick and its fallbacks, as sent
        self.fallbacks: list[Worker] = []
        # response side
        self.status: int | None = None
        self.watch: StreamWatch | None = None
        self.strip = False
        self.answer: bytearray | None = None  # a non-streamed answer's copy, for its usage
        self.passthrough = False  # a response the picker only echoes
        self.skip_body = False  # Envoy does not send this answer's body to the picker
        #: the answer's body comes in full duplex (every byte echoed back), else STREAMED
        #: (each chunk answered, replaced only where the picker changes it)
        self.echo = False

    # ------------------------------------------------------------------ dispatch

    async def on(self, req: Any) -> list[Any]:
        kind = req.WhichOneof("request")
        if req.HasField("protocol_config"):  # the modes Envoy runs with (BodySendMode)
            self.buffered = req.protocol_config.request_body_mode == P.BUFFERED
            self.echo = req.protocol_config.response_body_mode == P.FULL_DUPLEX
        if kind == "request_headers":
            return await self._request_headers(req)
        if kind == "request_body":
            return await self._request_body(req)
        if kind == "response_headers":
            return self._response_headers(req)
        if kind == "response_body":
            return self._response_body(req)
        if kind == "request_trailers":
            return [P.continue_trailers(request=True)]
        if kind == "response_trailers":
            self._finish(time.monotonic())
            return [P.continue_trailers(request=False)]
        return []

    # ------------------------------------------------------------------- request

    async def _request_headers(self, req: Any) -> list[Any]:
        h = self.headers = P.headers_of(req.request_headers)
        self.rid = self.dp.request_id(h)
        self.subset = P.subset_of(req)
        path = h.get(":path", "").split("?", 1)[0]
        method = h.get(":method", "")
        self.endpoint = _PATHS.get(path) if method == "POST" else None
        if self.endpoint is None:
            self.done = self.passthrough = True
            if method == "GET" and path == "/v1/models":
                return self._models()
            allowed = ", ".join(f"POST {p}" for p in _PATHS) + ", GET /v1/models"
            return [_error(NotFound(f"unknown path {path[:200]} (this gateway serves {allowed})"), self.rid)]
        try:  # what the head alone decides, before a body byte is held (the router's rule)
            self.picker.router.admit_head(h)
        except RequestError as exc:
            self.done = True
            self.dp.metrics.rejected.labels(str(exc.status), exc.code).inc()
            return [_error(exc, self.rid)]
        if req.request_headers.end_of_stream:  # no body at all: the 400 of an empty body
            return await self._decide(headers_phase=True)
        return [P.continue_headers(request=True)] if self.buffered else []

    async def _request_body(self, req: Any) -> list[Any]:
        if self.done:  # an answer went already: echo what still comes
            return (
                []
                if self.buffered
                else list(P.streamed(req.request_body.body, req.request_body.end_of_stream, request=True))
            )
        b = req.request_body
        self.body += b.body
        limit = self.dp.cfg.limits.max_body_bytes
        if len(self.body) > limit:
            self.done = True
            self.body = bytearray()
            self.dp.metrics.rejected.labels("413", "payload_too_large").inc()
            return [_error(PayloadTooLarge(f"request body exceeds the limit of {limit} bytes"), self.rid)]
        if not b.end_of_stream:
            return [P.continue_body(request=True)] if self.buffered else []
        return await self._decide(headers_phase=False)

    async def _decide(self, *, headers_phase: bool) -> list[Any]:
        self.done = True
        dp, now = self.dp, time.monotonic()
        adm = dp.admission
        if not adm.try_enter():
            try:
                await adm.enter()
            except Overloaded as exc:
                dp.metrics.rejected.labels(str(exc.status), exc.code).inc()
                return [_error(exc, self.rid)]
        self.slot = True
        answer = _Answer(self._ask_headers())
        raw = bytes(self.body)
        self.body = bytearray()
        assert self.endpoint is not None
        try:
            ctx = self.ctx = dp.context_of(answer, self.endpoint, raw, self.rid, self.t0)
        except RequestError as exc:
            dp._reject(answer, exc, self.rid)
            return [answer.response]
        ask = dp.ask_for(ctx)
        subset = self.subset
        if subset is not None:
            eps = self.picker.endpoints
            pool = dp.pool
            ask = ask.again(
                eligible=lambda v: (w := pool.get(v.id)) is not None and eps.endpoint(w.id, w.url) in subset
            )
        core = dp.route
        verdict = core.decide(ask, now)
        if isinstance(verdict, Hold):
            self.ticket = ctx.ticket = verdict.ticket
            try:
                shed, waited = await dp.queue.admit(
                    ctx.tenant, verdict.ticket.rank, verdict.ticket.reserved, verdict.probe, time.monotonic()
                )
            except asyncio.CancelledError:
                dp.tenancy.refund(verdict.ticket, time.monotonic())
                self.ticket = None
                raise
            self.ticket = None
            if shed is not None:
                verdict = Reject(shed, verdict.ticket, shed=True)
            else:
                verdict = core.resume(verdict, waited, time.monotonic())
        if isinstance(verdict, Reject):
            if subset is not None and verdict.error.status in (404, 503) and not verdict.shed:
                served = [
                    w for w in dp.pool.routable_workers(now) if w.serves(ctx.key.model, ctx.key.adapter)
                ]
                if served:
                    verdict = verdict._replace(
                        error=NoWorkerAvailable(
                            "no endpoint of the subset hint can serve this request",
                            retry_after_s=dp.cfg.health.interval_s,
                        )
                    )
            dp._refused(ctx, verdict)
            return [answer.response]
        ctx.ticket = verdict.ticket
        now = time.monotonic()
        if verdict.ticket is not None:
            dp.tenancy.admitted(verdict.ticket, now)
        if isinstance(verdict, Admitted):
            if verdict.ticket is not None:
                dp.tenancy.refund(verdict.ticket, now)
            body = error_body(
                "disaggregated prefill/decode is not served through the gateway; "
                "use the router's own data plane (radixfleet router)",
                "invalid_request_error",
                "not_implemented",
            )
            return [P.immediate(501, json.dumps(body).encode(), [("content-type", _JSON)], "radixfleet_pd")]
        return self._routed(verdict, ctx, now, headers_phase)

    def _ask_headers(self) -> dict[str, str]:
        """The headers the route core reads, with the gateway's objective as the
        priority class claim (``gateway.objectives``; a class name stands for itself)."""
        h = self.headers
        objective = h.get(P.OBJECTIVE)
        cfg = self.dp.cfg
        header = cfg.tenancy.priority_header
        if objective and header:
            cls: str | None = cfg.gateway.objectives.get(objective)
            if cls is None and objective.strip().lower() in PRIORITIES:
                cls = objective.strip().lower()
            if cls is not None:
                h = {**h, header: cls}
        return h

    def _routed(self, route: Route, ctx: RequestContext, now: float, headers_phase: bool) -> list[Any]:
        dp = self.dp
        w, pick = route.worker, route.placement
        assert pick is not None, "a route to send is placed"
        self.route = route
        dp.routed(ctx, route, now)
        eps = self.picker.endpoints
        first = eps.endpoint(w.id, w.url)
        self.ledger = RequestLedger(self.picker.ledger_parts(), w, pick, ctx)
        self.picker.open.add(self.ledger)
        if first is None:  # its name does not resolve yet: nothing to send it to
            self._end_ledger(None, None, now)
            exc = NoWorkerAvailable("the chosen worker has no address yet", retry_after_s=1)
            dp.metrics.rejected.labels("503", exc.code).inc()
            return [_error(exc, self.rid)]
        self.endpoints = [first, *self._fallbacks(route, ctx, now)]
        ticket = ctx.ticket
        payload, self.strip = dp.engines.forward_body(
            w.engine, ctx.endpoint, ctx.body, ctx.raw, ctx.stream, ticket.rank if ticket is not None else None
        )
        hdrs = [
            *dp.tenants.forward_headers(ctx.key.tenant).items(),
            (REQUEST_ID_HEADER, ctx.rid),
            *dp.hops.headers(self.headers).items(),  # a request that comes back is refused
        ]
        if pick.rank is not None:
            hdrs.append(("x-data-parallel-rank", str(pick.rank)))
        body: bytes | None = None
        if not headers_phase:
            body = bytes(payload) if (payload is not ctx.raw or not self.buffered) else None
        # a non-streamed answer whose usage nothing needs: its body is not sent to the
        # picker (a mode override with the answer to the response headers)
        self.skip_body = not ctx.stream and not self._needs_usage(w, ctx)
        out = P.picked(
            self.endpoints,
            body=body,
            buffered=self.buffered and not headers_phase,
            headers=hdrs,
            header_list=self.picker.header_list,
            remove=_DROPPED,
        )
        return out

    def _needs_usage(self, w: Worker, ctx: RequestContext) -> bool:
        """Whether a non-streamed answer's usage is needed: its cached tokens correct
        the index (approximate mode), its tokens are charged, or it is logged."""
        link = w.engine
        return (
            (link is not None and link.corrects)
            or self.dp.traffic is not None
            or (ctx.ticket is not None and bool(ctx.ticket.limits))
        )

    def _fallbacks(self, route: Route, ctx: RequestContext, now: float) -> list[str]:
        """Where Envoy may retry when it cannot connect to the pick (module docstring)."""
        n = self.dp.cfg.retries.max_attempts - 1
        if n <= 0:
            return []
        dp, eps, w = self.dp, self.picker.endpoints, route.worker
        views = dp.route.views(dp.ask_for(ctx), now)
        blocks = route.keyed.match.blocks
        pool = dp.pool
        ranked = sorted(
            (
                v
                for v in views
                if v.id != w.id and (self.subset is None or eps.by_worker.get(v.id) in self.subset)
            ),
            key=lambda v: (-blocks.get(v.id, 0), v.in_flight_tokens),
        )
        out = []
        for v in ranked:
            fw = pool.get(v.id)
            ep = eps.endpoint(fw.id, fw.url) if fw is not None else None
            if ep is not None:
                assert fw is not None
                self.fallbacks.append(fw)
                out.append(ep)
                if len(out) >= n:
                    break
        return out

    def _models(self) -> list[Any]:
        """GET /v1/models: any routable worker answers it (no load counted)."""
        now = time.monotonic()
        eps = self.picker.endpoints
        for w in sorted(self.dp.pool.routable_workers(now), key=lambda w: w.in_flight):
            ep = eps.endpoint(w.id, w.url)
            if ep is not None:
                return P.picked([ep], body=None, buffered=False, header_list=self.picker.header_list)
        return [_error(NoWorkerAvailable("no healthy worker available", retry_after_s=1), self.rid)]

    # ------------------------------------------------------------------ response

    def _response_headers(self, req: Any) -> list[Any]:
        now = time.monotonic()
        h = P.headers_of(req.response_headers)
        try:
            self.status = int(h.get(":status", "0"))
        except ValueError:
            self.status = 0
        led = self.ledger
        if led is not None and not led.ended:
            self._served(P.served_of(req), now)
            led = self.ledger
            assert led is not None
            led.first_byte(now)
            ctx = self.ctx
            assert ctx is not None
            if ctx.stream and self.status == 200:
                self.watch = StreamWatch(self.strip)
                led.stream(self.watch)
            elif self.status == 200 and not self.skip_body:
                self.answer = bytearray()  # its usage corrects the index or is charged
        if req.response_headers.end_of_stream or self.skip_body:
            # (a non-streamed answer's head comes when its generation is done)
            self._finish(now)
        answer = P.continue_headers(request=False)
        if self.skip_body and not req.response_headers.end_of_stream:
            P.skip_response_body(answer, buffered=self.buffered)
        return [answer]

    def _served(self, served: str | None, now: float) -> None:
        """Moves the count to the fallback that served, when it is not the pick."""
        led = self.ledger
        assert led is not None and self.route is not None
        if served is None or not self.endpoints or served == self.endpoints[0]:
            if served is None and self.status is not None and self.status >= 500:
                # Envoy's own answer (no upstream answered): the pick failed
                self.dp.pool.check_soon(led.worker)
            return
        eps, dp = self.picker.endpoints, self.dp
        wid = eps.worker(served)
        w = dp.pool.get(wid) if wid is not None else None
        self._end_ledger(False, None, now)  # Envoy could not use the pick: retried elsewhere
        dp.metrics.attempt(led.worker.id, "connect")
        dp.pool.check_soon(led.worker)
        if w is None:
            log.warning("request %s: served by %s, which names no worker", self.rid, served)
            return
        pick = dp.route.place(w, self.route.keyed, now)
        ctx = self.ctx
        assert ctx is not None
        dp.metrics.retries.labels("connect").inc()
        self.ledger = RequestLedger(self.picker.ledger_parts(), w, pick, ctx, reason="fallback")
        self.picker.open.add(self.ledger)

    def _response_body(self, req: Any) -> list[Any]:
        b = req.response_body
        now = time.monotonic()
        data, end = b.body, b.end_of_stream
        came = data
        watch, led = self.watch, self.ledger
        if watch is not None and led is not None and not led.ended:
            out = watch.feed(data)
            if watch.first_token and led.ttft is None:
                led.first_token(now)
            if end:
                out += watch.flush()
            data = out
        elif self.answer is not None:
            if len(self.answer) + len(data) <= self.dp.cfg.limits.max_response_bytes:
                self.answer += data
            else:
                self.answer = None
        if end:
            self._finish(now)
        if not self.echo:
            return [P.body_answer(None if data is came else data)]
        return list(P.streamed(data, end, request=False))

    def _finish(self, now: float) -> None:
        """The answer ended: the ledger told what it got."""
        led = self.ledger
        if led is None or led.ended:
            return
        status = self.status
        watch = self.watch
        if watch is not None:
            led.usage(watch.usage, watch.output_tokens)
        elif self.answer is not None:
            data = bytes(self.answer)
            self.answer = None
            if b'"usage"' in data or b'"meta_info"' in data:
                try:
                    obj = json.loads(data)
                except ValueError:
                    obj = None
                led.usage(usage_of(obj), completion_tokens_of(obj))
        if status is None or status == 0:
            ok = None
        elif status >= 500:
            ok = False
        else:
            ok = True  # answered (a 429 is busy, a 4xx the client's)
        self._end_ledger(ok, status or None, now)

    def _end_ledger(self, ok: bool | None, status: int | None, now: float) -> None:
        led = self.ledger
        if led is not None and led.end(ok, status, now):
            self.picker.open.discard(led)

    # -------------------------------------------------------------------- close

    def close(self) -> None:
        """The stream ended (answered, or broken by Envoy): nothing counted stays."""
        now = time.monotonic()
        led = self.ledger
        if led is not None and self.watch is not None:
            led.usage(self.watch.usage)  # what the stream reported before it ended
        if led is not None and led.cancel(now):
            self.picker.open.discard(led)
            log.debug("request %s: the gateway's stream ended before its answer did", self.rid)
        if self.ticket is not None:
            self.dp.tenancy.refund(self.ticket, now)
            self.ticket = None
        if self.slot:
            self.slot = False
            self.dp.admission.leave()


#: the services gRPC health answers for (the protocol's, and the whole server's "")
HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


class PickerServer:
    """The picker's gRPC server: ``ExternalProcessor`` and gRPC health. ``liveness``
    and the service are SERVING while it runs; ``readiness`` follows the router's
    (``set_ready``). Lifecycle: ``await start()`` -> port; ``await aclose()``
    (idempotent)."""

    def __init__(self, picker: Picker, host: str, port: int) -> None:
        from radixfleet.wire.extras import require

        feature = "the gateway's endpoint picker (gRPC)"
        self._grpc = require("grpc", "gateway", feature)
        self._health = require("grpc_health.v1.health", "gateway", feature)
        self._health_pb = require("grpc_health.v1.health_pb2", "gateway", feature)
        self._health_grpc = require("grpc_health.v1.health_pb2_grpc", "gateway", feature)
        self.picker = picker
        self.host, self.port = host, port
        self.server: Any = None
        self.health: Any = None
        self._ready: bool | None = None

    async def start(self) -> int:
        grpc = self._grpc
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 16 << 20),
                ("grpc.max_send_message_length", 16 << 20),
                ("grpc.max_concurrent_streams", 1 << 20),
            ]
        )
        P.pb().grpc.add_ExternalProcessorServicer_to_server(self.picker, self.server)
        self.health = self._health.aio.HealthServicer()
        self._health_grpc.add_HealthServicer_to_server(self.health, self.server)
        serving = self._health_pb.HealthCheckResponse.SERVING
        for name in HEALTH_SERVICES:
            if name != "readiness":
                await self.health.set(name, serving)
        await self.set_ready(False)
        port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if port == 0:
            from radixfleet.wire.errors import ConfigError

            raise ConfigError("gateway.picker_port", f"cannot listen on {self.host}:{self.port}")
        self.port = port
        await self.server.start()
        return port

    async def set_ready(self, ready: bool) -> None:
        if ready is self._ready or self.health is None:
            return
        self._ready = ready
        pb = self._health_pb.HealthCheckResponse
        await self.health.set("readiness", pb.SERVING if ready else pb.NOT_SERVING)

    async def aclose(self, grace_s: float = 5.0) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        await server.stop(grace_s)
