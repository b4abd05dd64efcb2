"""One client request's attempts on its workers: ``Attempts`` (the data plane's).

``forward`` runs the request on its route's worker and, where the first provably is
not running it, on others (the route core asked again; radixfleet.server.dataplane's module
docstring has the rules); each try (``_attempt``) is::

    RequestLedger(parts, w, pick, route)          what the pick counted (radixfleet.server.ledger)
    upstream.request(head, payload)               radixfleet.server.upstream; w's health watched
      5xx / 429            -> ledger.end(ok: 429 busy, no status); UpstreamFailed
      a refused rank (400) -> UpstreamFailed (the rank map is asked again)
      not streamed         -> usage, reply, ledger.end(True, status)
      a 200 stream         -> relayed: ledger.stream, first_token at the first content
                              token, usage and end(True, 200) at its end; a worker
                              failing mid-stream: an SSE error event, end(broken)
    on every path          -> ledger.cancel (the client gone), the decision ring's
                              entry, the trace's span

Raises nothing a client caused; a failure before the client saw a byte is
``UpstreamFailed`` (``retry``: whether another worker may run it), answered by
``_failed`` once no attempt is left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp

from radixfleet.policies.base import Reason
from radixfleet.route.core import Route
from radixfleet.route.decisions import now_unix, quality
from radixfleet.server import edge
from radixfleet.server.answers import (
    AVAILABLE_HEADER,
    CLIENT_ERRORS,
    DONE,
    JSON,
    PREDICTED_HEADER,
    REQUEST_ID_HEADER,
    WORKER_HEADER,
    client_error,
    retry_after,
    status_error,
    usage_of_body,
)
from radixfleet.server.ledger import RequestLedger
from radixfleet.server.sse import StreamWatch
from radixfleet.server.upstream import (
    Cancel,
    Cancelled,
    ResponseTooLarge,
    UpstreamError,
    build_head,
    finish_outcome,
)
from radixfleet.wire.errors import error_body

if TYPE_CHECKING:
    from radixfleet.fleet.pool import Worker
    from radixfleet.route.core import Ask, Placement
    from radixfleet.server.context import RequestContext

log = logging.getLogger("radixfleet.router")


class WorkerUnhealthy(Cancelled):
    """The request's worker turned unhealthy while it waited (``Pool.on_unhealthy``)."""

    cause = "unhealthy"


class UpstreamFailed(Exception):
    """One attempt failed before the client saw a byte. The message is for the log
    (it may name the worker); the client gets ``client_error``'s or
    ``status_error``'s body, which name none."""

    def __init__(
        self, cause: str, detail: str, *, retry: bool, status: int | None = None, headers: Any = None
    ) -> None:
        super().__init__(detail)
        #: connect | unhealthy | timeout | payload | too_large | status | rank
        self.cause = cause
        self.retry = retry  # the worker provably is not running it: another may
        self.status = status  # the worker's status, for cause "status"
        self.headers = headers  # the worker's headers, for cause "status"


class Attempts:
    """The attempts of the data plane that owns it (module docstring)."""

    __slots__ = ("dp", "_waiting", "_addrs")

    def __init__(self, dp: Any) -> None:
        #: the ``radixfleet.server.dataplane.DataPlane`` that owns it (not imported: it imports this)
        self.dp = dp
        #: per worker, the cancel handles of the requests in flight on it
        self._waiting: dict[Worker, set[Cancel]] = {}
        self._addrs: dict[str, tuple[str, int, str]] = {}  # worker URL -> host, port, netloc

    def ids(self, worker: str, ctx: RequestContext) -> list[tuple[str, str]]:
        """The headers naming an answer: its request id, the worker's id only where
        ``response_headers.worker_id`` allows (off by default: worker ids and the
        fleet's size are not a client's business), and the ``x-ratelimit-*`` of a
        request under rate limits (``Ticket.headers``)."""
        dp = self.dp
        out = [(REQUEST_ID_HEADER, ctx.rid)]
        rh = dp.cfg.response_headers
        if rh.worker_id:
            out.insert(0, (WORKER_HEADER, worker))
        if rh.match_tokens and ctx.route is not None and ctx.route.placement is not None:
            q = quality(ctx.route, ctx.route.placement, None)
            out += [(AVAILABLE_HEADER, str(q.available)), (PREDICTED_HEADER, str(q.predicted))]
        if ctx.ticket is not None and ctx.ticket.limits:
            out += ctx.ticket.headers()
        return out

    def decided(
        self,
        ctx: RequestContext,
        worker: str,
        status: int,
        led: RequestLedger | None = None,
        *,
        reason: str | None = None,
        shed: bool = False,
    ) -> None:
        """The decision ring's entry for ``ctx``'s outcome (radixfleet.route.decisions): its
        current route (none when refused or failed before one), the ``worker`` that
        answered (or was tried last; "" refused), the status the client got, and the
        answering attempt's ledger (its quality, TTFT, whether it broke off)."""
        dp = self.dp
        route = ctx.route if worker else None
        dp.decisions.record(
            ctx.key,
            arrival_s=now_unix(ctx.t0),
            request_id=ctx.rid,
            tenant=ctx.tenant,
            session=ctx.session,
            policy=dp.route.parts.policy.name,
            route=route if route is not None and route.worker.id == worker else None,
            reason=ctx.reason if reason is None else reason,
            worker=worker,
            quality=led.quality if led is not None else None,
            status=status,
            ttft_s=led.ttft if led is not None else None,
            broken=led.broken if led is not None else False,
            shed=shed,
        )

    def watch(self, w: Worker, cancel: Cancel) -> None:
        """``cancel`` fires if ``w`` turns unhealthy while its request waits
        (``worker_unhealthy``); ``unwatch`` it on every path."""
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

    def worker_unhealthy(self, w: Worker) -> None:
        """``Pool.on_unhealthy``: every request waiting on ``w`` is cancelled there
        (its connection closed, so the engine aborts it); one whose client has seen
        nothing moves to another worker, a stream already begun ends with an error."""
        for c in list(self._waiting.get(w, ())):
            c.cancel(WorkerUnhealthy(f"worker {w.id} turned unhealthy"))

    def addr(self, url: str) -> tuple[str, int, str]:
        a = self._addrs.get(url)
        if a is None:
            parts = urlsplit(url)
            port = parts.port or 80
            host = parts.hostname
            assert host, f"worker URL {url!r} without a host (refused by the config's checks)"
            a = self._addrs[url] = (host, port, parts.netloc)
        return a

    async def forward(self, ctx: RequestContext, route: Route, ask: Ask, now: float) -> None:
        """Runs the request on ``route``'s worker, and on another (the route core asked
        again, the workers tried excluded) only where the first provably is not
        running it (module docstring); replies the failure when every attempt failed.
        A retry's ask keeps the first's candidates and chooser (a P/D decode leg's).
        The caller has told ``DataPlane.routed`` of the first pick."""
        dp = self.dp
        w, pick = route.worker, route.placement
        assert pick is not None, "a forwarded route is placed"
        tried: list[str] = []
        excluded: set[str] = set()  # workers a retry must not go to
        retries = dp.cfg.retries
        last: UpstreamFailed | None = None
        ctx.route = route
        while True:
            tried.append(w.id)
            try:
                await self._attempt(ctx, w, pick)
                return
            except UpstreamFailed as exc:
                last = exc
                if not exc.retry and await self._went_down(ctx, w, exc):
                    exc.retry = True
                if exc.cause != "rank":  # a rejected rank is not the worker's failure:
                    excluded.add(w.id)  # it may take the retry (its rank map re-read)
                if ctx.trace is not None:
                    ctx.trace.failed(exc.cause)
                dp.metrics.attempt(w.id, exc.status or exc.cause)  # not a client outcome
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
                or time.monotonic() - ctx.t0 >= dp.cfg.timeouts.total_s
            ):
                break
            delay = min(retries.backoff_s * (2 ** (len(tried) - 1)), retries.backoff_max_s)
            if delay:
                await asyncio.sleep(delay)
            retry = ask.admit(ctx.ticket, exclude=frozenset(excluded), split=False)
            now = time.monotonic()
            trace = ctx.trace
            again = dp.route.decide(retry, now) if trace is None else trace.decide(dp.route, retry, now)
            if not isinstance(again, Route):
                break
            w, pick = again.worker, again.placement
            assert pick is not None, "a retry's route is placed"
            ctx.reason, ctx.route = Reason.FALLBACK.value, again
            dp.metrics.retries.labels(last.cause).inc()
        self._failed(ctx, last, tried[-1])

    async def _went_down(self, ctx: RequestContext, w: Worker, exc: UpstreamFailed) -> bool:
        """Whether a worker that answered 5xx, or dropped the connection after the
        request was sent (before any answer, or mid-answer), before the client saw a
        byte, is going down: its health probe fails now. Then its generation died with
        it (and the router closed the connection, which makes a surviving engine abort
        it), so another worker may run the request without running it twice; an engine
        stopped mid-request (a restart, a rollout) costs the client nothing. A worker
        that still answers its probe keeps the rule: it may have run the request, so a
        5xx or a hang-up becomes a 502, not retried."""
        dp = self.dp
        if exc.cause not in ("status", "payload", "no_answer") or (
            exc.status is not None and exc.status < 500
        ):
            return False
        if await dp.pool.probe(w):
            return False
        dp.pool.check_soon(w)
        log.warning(
            "request %s: worker %s fails its health probe: its generation died with it", ctx.rid, w.id
        )
        return True

    def _failed(self, ctx: RequestContext, last: UpstreamFailed, worker: str) -> None:
        """Every attempt failed before the client saw anything (``worker`` the last
        tried): one error in the OpenAI shape, naming no worker (the log has them)."""
        dp = self.dp
        if last.retry and ctx.ticket is not None:  # no worker ran it: its tokens back
            dp.tenancy.refused(ctx.ticket, time.monotonic())
        if last.cause == "status":
            # a 429 or 503 keeps its status (and Retry-After); another 5xx is a 502
            assert last.status is not None  # cause "status": the worker answered one
            status = last.status if last.status in (429, 503) else 502
            dp.metrics.outcome(worker, status, ctx.reason)
            self._log_failed(ctx, worker, status)
            ctx.ex.reply(
                status,
                status_error(last.status, b""),
                JSON,
                [*self.ids(worker, ctx), *retry_after(last.status, last.headers)],
            )
            return
        status, body = client_error(last.cause)
        self._log_failed(ctx, worker, status)
        dp.metrics.rejected.labels(
            str(status), CLIENT_ERRORS.get(last.cause, CLIENT_ERRORS["payload"])[1]
        ).inc()
        ctx.ex.reply(status, body, JSON, [(REQUEST_ID_HEADER, ctx.rid)])

    def _log_failed(self, ctx: RequestContext, worker: str, status: int) -> None:
        """The traffic log's line for a request every attempt failed (offered load,
        served by no worker: nothing matched, cached or timed; ``worker`` the last tried),
        and the decision ring's."""
        dp = self.dp
        if dp.decisions.on:
            self.decided(ctx, worker, status)
        if dp.traffic is not None:
            dp.traffic.record(
                ctx.key,
                arrival_s=time.time() - (time.monotonic() - ctx.t0),
                worker=worker,
                matched_tokens=0,
                status=status,
                session=ctx.session,
            )

    def answer_error(self, ctx: RequestContext, worker: str, status: int, data: bytes, extra) -> None:
        """Answers the client a worker's error ``status`` (its body, for a 4xx) in the
        OpenAI shape, naming no worker; counted and logged as ``_failed`` does."""
        dp = self.dp
        if 400 <= status < 500 and ctx.ticket is not None:  # refused before any work
            dp.tenancy.refused(ctx.ticket, time.monotonic())
        dp.metrics.outcome(worker, status, ctx.reason)
        self._log_failed(ctx, worker, status)
        ctx.ex.reply(status, status_error(status, data), JSON, [*self.ids(worker, ctx), *extra])

    async def _attempt(self, ctx: RequestContext, w: Worker, pick: Placement) -> None:
        """One try on worker ``w`` (its load already counted), told to its ledger: the
        load released on every path, a streaming request's prompt no longer queued
        prefill at its first *content* token (radixfleet.server.sse), never at the headers or a
        role chunk. Raises ``UpstreamFailed`` if it failed before the client saw a
        byte (``retry`` says whether another worker may run it); after that, failures
        end the stream with an SSE error event. While it waits, ``w`` turning
        unhealthy cancels it (``DataPlane._worker_unhealthy``)."""
        dp = self.dp
        host, port, hostport = self.addr(w.url)
        led = RequestLedger(dp.parts, w, pick, ctx, route=ctx.route)
        t = dp.cfg.timeouts
        ticket = ctx.ticket
        payload, strip = dp.engines.forward_body(
            led.link,
            ctx.endpoint,
            ctx.body,
            ctx.raw,
            ctx.stream,
            ticket.rank if ticket is not None else None,
        )
        fwd = (
            dp.tenants.forward_lines(ctx.key.tenant)
            + b"x-request-id: "
            + ctx.rid.encode("utf-8", "surrogateescape")
            + b"\r\n"
        )
        if pick.rank is not None:
            fwd += b"x-data-parallel-rank: %d\r\n" % pick.rank  # vLLM's rank header
        fwd += dp.hops.lines(ctx.ex.headers)  # a request that comes back is refused
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
                assert dp.upstream is not None, "the data plane serves only once started"
                resp = await dp.upstream.request(
                    host,
                    port,
                    head,
                    payload,
                    read_timeout_s=t.first_byte_s if ctx.stream else float("inf"),
                    total_timeout_s=t.total_s - (time.monotonic() - ctx.t0),
                    cancel=cancel,
                )
                first = await self._answer(ctx, w, led, resp)
            except UpstreamError as exc:
                if exc.cause == "connect":
                    dp.pool.check_soon(w)
                # the router's own deadline or limit: not w's fault
                led.end(finish_outcome(exc), None, time.monotonic())
                # nothing reached the client; the connection is closed (the worker
                # aborts). Retried only where the worker provably is not running it.
                raise UpstreamFailed(
                    exc.cause, f"worker {w.id} ({w.url}): {exc}", retry=exc.cause in ("connect", "unhealthy")
                ) from None
            if first is not None:  # from here on the client has bytes: never retry
                await self._relay(ctx, w, led, resp, first, strip)
        finally:
            self.unwatch(w, cancel)
            if resp is not None:
                resp.release()
            if not led.ended:  # the client left, or a rank was refused
                led.cancel(time.monotonic())
            if led.status is not None and dp.decisions.on:
                self.decided(ctx, w.id, led.status, led)
            if trace is not None:
                trace.attempt_end(
                    span,
                    w.id,
                    led.sent,
                    led.head,
                    led.ttft,
                    resp.status if resp is not None else None,
                    led.ok,
                    led.prompt_cached,
                    led.output,
                    broken=led.broken,
                )

    async def _answer(self, ctx: RequestContext, w: Worker, led: RequestLedger, resp) -> bytes | None:
        """The worker's answer before the client sees a byte of it: a 200 stream's first
        body bytes (returned, for ``_relay``), or the whole answer, replied here and
        its ledger ended (None). Raises ``UpstreamFailed`` for a 5xx or 429 and for a
        refused rank."""
        dp = self.dp
        status = resp.status
        pick, link = led.pick, led.link
        if status >= 500 or status == 429:
            led.first_byte(time.monotonic(), counted=False)
            data = await resp.read()
            led.end(status == 429, None, time.monotonic())  # busy, not broken
            log.warning(
                "request %s: worker %s (%s) answered %d: %r", ctx.rid, w.id, w.url, status, data[:500]
            )
            # 429 and 503 say the request was not taken: another worker may
            raise UpstreamFailed(
                "status",
                f"worker {w.id} answered {status}",
                retry=status in (429, 503),
                status=status,
                headers=resp.headers,
            )
        led.first_byte(time.monotonic())
        if ctx.stream and status == 200:
            return await resp.readany()
        data = await resp.read()
        if status == 400 and pick.rank is not None and b"data_parallel_rank" in data:
            # the engine has fewer ranks than the router's map: not the worker's
            # failure, nor the client's; the map is asked again
            assert link is not None  # a rank is picked only through an engine link
            link.rank_rejected(pick.rank, data.decode("utf-8", "replace"))
            raise UpstreamFailed(
                "rank",
                f"worker {w.id} rejected data-parallel rank {pick.rank}",
                retry=True,
                status=status,
                headers=resp.headers,
            )
        ctype = resp.headers.get("content-type", JSON)
        if status == 200 and (
            link is not None or dp.traffic is not None or (ctx.ticket is not None and ctx.ticket.limits)
        ):
            led.usage(*usage_of_body(data))
        if status >= 400:
            log.info("request %s: worker %s answered %d: %r", ctx.rid, w.id, status, data[:500])
            data, ctype = status_error(status, data), JSON
        else:
            data = edge.scrub_answer(data)  # no P/D hand-off fields back to the client
        ctx.ex.reply(
            status,
            data,
            ctype,
            [*self.ids(w.id, ctx), *retry_after(status, resp.headers)],
        )
        led.end(True, status, time.monotonic())
        return None

    async def _relay(
        self, ctx: RequestContext, w: Worker, led: RequestLedger, resp, first: bytes, strip: bool
    ) -> None:
        """Passes a stream to the client as it arrives, from its first body bytes
        ``first``, telling ``led`` (left to the attempt's cancel when the client goes
        away, whether by an error or a cancellation, or is dropped by the front for
        reading nothing: ``timeouts.client_idle_s``). A worker failing mid-stream
        (broken, silent past ``first_byte_s``, unhealthy, an event past the size limit)
        or the total deadline passing ends the stream with a well-formed SSE error
        event and ``data: [DONE]``; only the worker's own failures count against its
        breaker (``finish_outcome``)."""
        dp = self.dp
        ex = ctx.ex
        extra = [("Cache-Control", "no-cache"), *self.ids(w.id, ctx)]
        watch = StreamWatch(strip)
        led.stream(watch)
        limit = dp.cfg.limits.max_response_bytes
        try:
            await ex.stream_start(resp.headers.get("content-type", "text/event-stream"), extra)
            chunk = first
            while chunk:  # b"": the end of the stream
                out = watch.feed(chunk)
                if led.ttft is None and watch.first_token:
                    led.first_token(time.monotonic())  # the prompt is prefilled
                if out:
                    await ex.stream_write(out)
                try:
                    if watch.pending > limit:
                        raise ResponseTooLarge(f"a stream event exceeds {limit} bytes")
                    chunk = await resp.readany()
                except UpstreamError as exc:
                    await self._stream_broke(ctx, w, led, watch, exc)
                    return
            tail = watch.flush()
            if tail:
                await ex.stream_write(tail)
            await ex.stream_end()
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            # the client went away (not the worker's fault; counted by the listener:
            # radixfleet.server.front); releasing the response closes the worker's connection,
            # so the engine aborts the generation
            log.debug("request %s: the client left during its stream from %s", ctx.rid, w.id)
            return
        led.usage(watch.usage, watch.output_tokens)
        led.end(True, 200, time.monotonic())

    async def _stream_broke(
        self, ctx: RequestContext, w: Worker, led: RequestLedger, watch: StreamWatch, exc: UpstreamError
    ) -> None:
        """The worker failed mid-stream: the client's stream ends with an SSE error
        event and ``data: [DONE]`` (the unfinished event dropped)."""
        log.warning(
            "request %s: worker %s (%s) failed mid-stream (%s: %s)", ctx.rid, w.id, w.url, exc.cause, exc
        )
        message = CLIENT_ERRORS.get(exc.cause, CLIENT_ERRORS["payload"])[2]
        err = error_body(f"{message}; the answer is incomplete", "upstream_error", "upstream_failed")
        # the unfinished event is dropped: the error starts on a fresh line
        await ctx.ex.stream_write(
            watch.flush(complete=False) + b"data: " + json.dumps(err).encode() + b"\n\n" + DONE
        )
        led.end(finish_outcome(exc), 200, time.monotonic(), broken=True)  # counted a 502
        await ctx.ex.stream_end()
