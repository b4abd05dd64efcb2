"""A data-plane request's trace (``tracing`` in the YAML; the ``tracing`` extra).

Imported by the data plane only when tracing is on; with it off no request touches
OpenTelemetry. One sampled request's spans (``radixfleet.common.tracing`` samples, records and
exports them)::

    radixfleet.request (SERVER; the client's traceparent its parent)   status, model,
    │                                                                   stream, class
    ├── radixfleet.admission      waiting for a concurrency slot (limits.max_concurrency)
    ├── radixfleet.keying         body read, parsed, tenant, byte key (blocks, bytes)
    ├── radixfleet.route          RouteCore.decide: verdict, worker, the policy's reason,
    │                             tokens (prompt, matched on the pick, available: the best
    │                             match on any worker, uncached, ahead), shed, class, and
    │                             each stage's time (radixfleet.route.<stage>_us: match,
    │                             admit, choose, place: the core's ``Marks``)
    ├── radixfleet.admission_queue  held by the shedder until a worker had room (tenancy.queue)
    ├── radixfleet.upstream (CLIENT; one per attempt, its id the worker's traceparent
    │   │                    parent: a vLLM's or agent's span is its child)
    │   │                   worker, attempt, leg (prefill | decode), the worker's status,
    │   │                   usage tokens (cached: what the engine reported), error.type
    │   │                   = the failure's cause; event first_byte (its response head)
    │   ├── radixfleet.first_token   sent -> the first content token (streams)
    │   └── radixfleet.stream        the first content token -> the stream's end
    └── (a retry: radixfleet.route, radixfleet.upstream again)

Never on a span: prompt or answer text, a prefix hash, a session id, an API key or
tenant name (the tenant's priority class only).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from radixfleet.common.tracing import CLIENT, SERVER, Trace, Tracing
from radixfleet.keys import Endpoint
from radixfleet.route.core import Admitted, Ask, Hold, Reject, Route, RouteCore, Verdict

if TYPE_CHECKING:
    from radixfleet.config import TracingConfig

#: the route core's stages (``radixfleet.route.core.Marks``) -> their attribute
_STAGES = {s: f"radixfleet.route.{s}_us" for s in ("match", "admit", "choose", "place")}


def from_config(cfg: TracingConfig) -> Tracing:
    """The router's ``Tracing`` for its YAML section (``ConfigError`` for a protocol
    whose exporter is missing)."""
    return Tracing(
        service_name=cfg.service_name,
        endpoint=cfg.endpoint,
        protocol=cfg.protocol,
        sample_ratio=cfg.sample_ratio,
        parent_based=cfg.parent_based,
        max_queue_spans=cfg.max_queue_spans,
        export_timeout_s=cfg.export_timeout_s,
    )


def start(tracing: Tracing, headers, endpoint: Endpoint) -> RequestTrace | None:
    """The trace of a request arriving now, or None when it is not sampled."""
    t = tracing.start(headers, "radixfleet.request", SERVER)
    return None if t is None else RequestTrace(t, endpoint)


class RequestTrace:
    """One sampled data-plane request's spans (module docstring). It is the route
    core's ``Marks`` while a decision runs. Only the request's own task uses it."""

    __slots__ = ("trace", "attempts", "_lap", "_route", "_attempt", "_routes")

    def __init__(self, trace: Trace, endpoint: Endpoint) -> None:
        self.trace = trace
        trace.attrs["http.request.method"] = "POST"
        trace.attrs["url.path"] = endpoint.value
        self.attempts = 0  # upstream attempts so far
        self._lap = trace.start  # the end of the last stage recorded
        self._route: dict[str, Any] = {}  # the decision being made's attributes
        self._attempt: list | None = None  # the last attempt's record
        #: each route span's record with its verdict: described at ``end``, off the
        #: routing work (a verdict's fields never change)
        self._routes: list[tuple[list, Verdict]] = []

    def exchange(self, ex: Any) -> TracedExchange:
        return TracedExchange(ex, self.trace)

    def _since_lap(self, name: str, attrs: dict[str, Any] | None = None, error: str | None = None) -> None:
        now = time.time_ns()
        self.trace.add(name, self._lap, now, attrs, error=error)
        self._lap = now

    # ----------------------------------------------------------------- stages

    def admitted(self, waited: bool) -> None:
        """The admission slot is held (``waited``: it queued for it)."""
        self._since_lap("radixfleet.admission", {"radixfleet.admission.waited": waited})

    def keyed(self, model: str, stream: bool, body_bytes: int, blocks: int) -> None:
        self.trace.attrs["gen_ai.request.model"] = model
        self.trace.attrs["radixfleet.stream"] = stream
        self._since_lap(
            "radixfleet.keying", {"radixfleet.body_bytes": body_bytes, "radixfleet.blocks": blocks}
        )

    def mark(self, stage: str) -> None:
        """``radixfleet.route.core.Marks``: ``stage`` of the decision running now ended."""
        now = time.time_ns()
        self._route[_STAGES[stage]] = (now - self._lap) / 1000
        self._lap = now

    def decide(self, core: RouteCore, ask: Ask, now: float) -> Verdict:
        """``core.decide(ask, now)`` in a ``radixfleet.route`` span."""
        self._lap = start = time.time_ns()
        self._route = {}
        v = core.decide(ask, now, self)
        self._routed(start, v)
        return v

    def resume(self, core: RouteCore, hold: Hold, waited: bool, now: float) -> Reject | Admitted | Route:
        """``core.resume`` (after the admission queue) in a ``radixfleet.route`` span."""
        self._lap = start = time.time_ns()
        self._route = {}
        v = core.resume(hold, waited, now, self)
        self._routed(start, v)
        return v

    def _routed(self, start: int, v: Verdict) -> None:
        now = time.time_ns()
        self._routes.append((self.trace.add("radixfleet.route", start, now, self._route), v))
        self._lap = now

    def _describe(self, rec: list, v: Verdict) -> None:
        """A route span's attributes and error, from its verdict."""
        a = rec[6]
        ticket = v.ticket
        if isinstance(v, Route):
            a["radixfleet.verdict"] = "route"
            a["radixfleet.worker"] = v.worker.id
            a["radixfleet.reason"] = v.decision.reason.value
            req = v.keyed.route_request
            a["radixfleet.tokens.prompt"] = req.prompt_tokens
            a["radixfleet.tokens.available"] = v.keyed.match.best * req.block_tokens
            p = v.placement
            if p is not None:
                a["radixfleet.tokens.matched"] = p.blocks * p.key.block_tokens
                a["radixfleet.tokens.uncached"] = p.own
                a["radixfleet.tokens.ahead"] = p.ahead
                if p.rank is not None:
                    a["radixfleet.data_parallel_rank"] = p.rank
        elif isinstance(v, Reject):
            a["radixfleet.verdict"] = "reject"
            a["radixfleet.shed"] = v.shed
            a["http.response.status_code"] = v.error.status
            rec[7] = v.error.code
        elif isinstance(v, Hold):
            a["radixfleet.verdict"] = "hold"
            a["radixfleet.shed"] = True
        else:
            assert isinstance(v, Admitted), f"{v=}"
            a["radixfleet.verdict"] = "admitted"  # a disaggregated fleet's legs follow
        if ticket is not None:
            a["radixfleet.priority"] = ticket.priority
            self.trace.attrs["radixfleet.priority"] = ticket.priority

    def held(self, since: float, shed: bool) -> None:
        """The admission queue's wait from ``since`` (monotonic) ended: let in, or
        ``shed`` (its 429)."""
        t = self.trace
        t.add(
            "radixfleet.admission_queue",
            t.at(since),
            time.time_ns(),
            {"radixfleet.shed": shed},
            error="shed" if shed else None,
        )

    # --------------------------------------------------------------- upstream

    def attempt(self) -> tuple[int, bytes]:
        """A new attempt's span id and the header lines naming it to the worker."""
        sid = self.trace.tracing.new_id()
        return sid, self.trace.header_lines(sid)

    def attempt_end(
        self,
        span_id: int,
        worker: str,
        sent: float,
        head: float | None,
        ttft: float | None,
        status: int | None,
        ok: bool | None,
        usage: tuple[int, int] | None,
        output: int | None,
        *,
        leg: str = "",
        broken: bool = False,
    ) -> None:
        """The attempt ``span_id`` on ``worker`` ended now: sent at ``sent``, its
        head at ``head``, its first content token ``ttft`` s after it was sent
        (monotonic times; None: not seen); ``status`` the worker's."""
        t = self.trace
        self.attempts += 1
        end = time.time_ns()
        s = t.at(sent)
        a: dict[str, Any] = {"radixfleet.worker": worker, "radixfleet.attempt": self.attempts}
        if leg:
            a["radixfleet.leg"] = leg
        if status is not None:
            a["http.response.status_code"] = status
        if usage is not None:
            a["gen_ai.usage.prompt_tokens"] = usage[0]
            a["radixfleet.tokens.cached"] = usage[1]
        if output is not None:
            a["gen_ai.usage.completion_tokens"] = output
        error = "upstream_broken" if broken else ("upstream_failed" if ok is False else None)
        events = [("first_byte", t.at(head))] if head is not None else None
        self._attempt = t.add(
            "radixfleet.upstream", s, end, a, span_id=span_id, kind=CLIENT, error=error, events=events
        )
        if ttft is not None:
            first = t.at(sent + ttft)
            t.add("radixfleet.first_token", s, first, parent=span_id)
            t.add("radixfleet.stream", first, end, parent=span_id)

    def failed(self, cause: str) -> None:
        """The last attempt failed before the client saw a byte, for ``cause``."""
        if self._attempt is not None:
            self._attempt[7] = cause

    def gone(self) -> None:
        """The client went away before its answer ended."""
        self.trace.error = "client_gone"

    def end(self) -> None:
        """Ends the request's root span and emits every span (radixfleet.common.tracing)."""
        for rec, v in self._routes:
            self._describe(rec, v)
        self._routes.clear()
        self.trace.end()


class TracedExchange:
    """An exchange (radixfleet.server.dataplane's module docstring) that tells the trace what
    the client got: its status, and an error type for 5xx."""

    __slots__ = ("ex", "trace", "headers")

    def __init__(self, ex: Any, trace: Trace) -> None:
        self.ex = ex
        self.trace = trace
        self.headers = ex.headers

    async def body(self, limit: int) -> bytes | bytearray:
        return await self.ex.body(limit)

    def reply(self, status: int, body: bytes, content_type: str, extra) -> None:
        self.trace.attrs["http.response.status_code"] = status
        if status >= 500:
            self.trace.error = str(status)
        self.ex.reply(status, body, content_type, extra)

    async def stream_start(self, content_type: str, extra) -> None:
        self.trace.attrs["http.response.status_code"] = 200
        await self.ex.stream_start(content_type, extra)

    async def stream_write(self, data: bytes) -> None:
        await self.ex.stream_write(data)

    async def stream_end(self) -> None:
        await self.ex.stream_end()

    @property
    def result(self) -> Any:
        return self.ex.result
