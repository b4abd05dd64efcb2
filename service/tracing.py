"""OpenTelemetry traces (the ``tracing`` extra), shared by the router and the agent.

Imported only where tracing is configured: a base install, or a router with tracing
off, never imports OpenTelemetry (``tests/repo/test_extras.py``).

A traced request's spans are kept as plain records while it runs and made into the
SDK's ``ReadableSpan`` objects when it ends (``Trace.end``), then handed to the SDK's
``BatchSpanProcessor``, whose own thread encodes and exports them over OTLP::

    event loop (the request)                   export thread (BatchSpanProcessor)
    Tracing.start(headers) -> Trace | None     batch -> _Counted.export -> OTLP
    Trace.add(...)          records            (exported | dropped_export_failed)
    Trace.end()  -> Tracing.emit(span)  ->  bounded queue (dropped_queue_full past it)

Rules:

- Nothing here waits for the collector. ``emit`` is O(1): past ``max_queue_spans``
  spans waiting for the export thread, a span is dropped and counted; an export that
  fails (the endpoint down, slower than ``export_timeout_s``, refusing) drops its
  batch, counted. Requests never wait for either.
- Sampling is decided once, at a trace's root (``start``): a client's valid W3C
  ``traceparent`` joins its trace and, with ``parent_based``, its sampled flag
  decides; otherwise the trace id does, against ``sample_ratio`` (the lower 64 bits,
  as OpenTelemetry's ``TraceIdRatioBased``, so every service keeps the same traces).
  An unsampled request records nothing and forwards no ``traceparent``.
- A malformed ``traceparent`` (or ``tracestate``) is ignored: a new trace starts.
- What a span says is what its caller passes (router.tracing, the agent): counts,
  names of workers and policies' reasons, never prompt text nor a prompt's hash.
- One thread (the event loop) starts, records and emits; the export thread only
  exports. Each counter is written by one of the two.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from protocol.errors import ConfigError, MissingExtra

try:  # the tracing extra's (protocol.extras)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import (
        INVALID_SPAN_CONTEXT,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
        TraceState,
        get_current_span,
    )
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:
    raise MissingExtra("tracing", "tracing", str(exc)) from exc

log = logging.getLogger("radixfleet.tracing")

PROTOCOLS = ("http/protobuf", "grpc")
SERVER, CLIENT, INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL

_MASK64 = (1 << 64) - 1
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_PROPAGATOR = TraceContextTextMapPropagator()


def exporter_class(protocol: str) -> type[SpanExporter]:
    """The OTLP exporter class of ``protocol``: OTLP/HTTP (the extra's) or gRPC (its
    package installed apart). Raises ``ConfigError`` naming what to install."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ConfigError(
                "tracing.protocol",
                "grpc needs the package opentelemetry-exporter-otlp-proto-grpc (the 'tracing' "
                "extra exports over OTLP/HTTP): pip install opentelemetry-exporter-otlp-proto-grpc",
            ) from None
        return GrpcExporter  # type: ignore[no-any-return]
    raise ConfigError("tracing.protocol", f"expected one of {', '.join(PROTOCOLS)}, got {protocol!r}")


def otlp_exporter(endpoint: str, protocol: str, timeout_s: float) -> SpanExporter:
    """The OTLP exporter for ``endpoint`` (an OTLP/HTTP URL without a path gets
    ``/v1/traces``). The collector's credentials and TLS files come from the standard
    ``OTEL_EXPORTER_OTLP_*`` environment variables, never from a config file."""
    cls = exporter_class(protocol)
    if protocol == "http/protobuf":
        _, sep, rest = endpoint.partition("://")
        if sep and "/" not in rest:
            endpoint += "/v1/traces"
    return cls(endpoint=endpoint, timeout=timeout_s)  # type: ignore[call-arg]


class _Counted(SpanExporter):
    """The exporter, counted: what it was handed (``taken``) and how it went. Written
    by the export thread only."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self.inner = inner
        self.endpoint = endpoint
        self.taken = 0  # spans handed to export (no longer queued)
        self.exported = 0
        self.failed = 0  # spans of batches whose export failed (dropped)
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.taken += len(spans)
        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - an exporter's failure drops its batch, never more
            log.exception("tracing: exporting %d spans raised", len(spans))
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            if self._failing:
                self._failing = False
                log.info("tracing: spans reach %s again", self.endpoint)
        else:
            self.failed += len(spans)
            if not self._failing:  # once per outage, not once per batch
                self._failing = True
                log.warning(
                    "tracing: export to %s failed: its spans are dropped and counted "
                    '(radixfleet_tracing_spans_total{outcome="dropped_export_failed"})',
                    self.endpoint,
                )
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Tracing:
    """One process's traces: sampling, the bounded queue, the exporter, the counters.

    ``exporter``: where spans go (tests: the SDK's ``InMemorySpanExporter``); by
    default the OTLP exporter of ``endpoint`` and ``protocol``. Lifecycle: made
    ready to use (the export thread starts here); ``await aclose()`` once, bounded by
    ``close_timeout_s`` however the collector behaves."""

    def __init__(
        self,
        *,
        service_name: str,
        endpoint: str = "",
        protocol: str = "http/protobuf",
        sample_ratio: float = 1.0,
        parent_based: bool = True,
        max_queue_spans: int = 2048,
        export_timeout_s: float = 5.0,
        schedule_delay_s: float = 1.0,
        exporter: SpanExporter | None = None,
        attributes: Mapping[str, str] | None = None,
    ) -> None:
        assert 0.0 <= sample_ratio <= 1.0, f"{sample_ratio=}"
        assert max_queue_spans >= 1, f"{max_queue_spans=}"
        inner = exporter if exporter is not None else otlp_exporter(endpoint, protocol, export_timeout_s)
        self.endpoint = endpoint or type(inner).__name__
        self._exporter = _Counted(inner, self.endpoint)
        self.max_queue = max_queue_spans
        self._processor = BatchSpanProcessor(
            self._exporter,
            max_queue_size=max_queue_spans,
            schedule_delay_millis=schedule_delay_s * 1000,
            max_export_batch_size=min(512, max_queue_spans),
            export_timeout_millis=export_timeout_s * 1000,
        )
        self.resource = Resource.create({"service.name": service_name, **(attributes or {})})
        self.scope = InstrumentationScope("radixfleet")
        self.parent_based = parent_based
        #: a trace id's lower 64 bits below this: sampled (TraceIdRatioBased's bound)
        self._bound = round(sample_ratio * (1 << 64))
        self._rng = random.Random(os.urandom(16))
        self.emitted = 0  # spans queued for the export thread (event loop only)
        self.dropped = 0  # spans that found the queue full (event loop only)
        self._closed = False

    # ------------------------------------------------------------------ traces

    def new_id(self) -> int:
        """A random non-zero 64-bit span id."""
        return self._rng.getrandbits(64) or 1

    def start(
        self, headers: Mapping[str, str], name: str, kind: SpanKind = SERVER, start_ns: int | None = None
    ) -> Trace | None:
        """The trace of a request that arrived with ``headers`` (lower-case names), or
        None when it is not sampled (module docstring). Its root span is ``name``."""
        parent = None
        if "traceparent" in headers:
            sc = get_current_span(_PROPAGATOR.extract(headers)).get_span_context()
            if sc is not INVALID_SPAN_CONTEXT and sc.is_valid:
                parent = sc
        if parent is not None:
            if self.parent_based and not parent.trace_flags.sampled:
                return None
            trace_id, state = parent.trace_id, parent.trace_state
            if not self.parent_based and (trace_id & _MASK64) >= self._bound:
                return None
        else:  # the lower half first: most requests are not sampled
            low = self._rng.getrandbits(64)
            if low >= self._bound:
                return None
            trace_id, state = (self._rng.getrandbits(64) << 64) | low or 1, None
        start = time.time_ns() if start_ns is None else start_ns
        return Trace(self, trace_id, parent, state, name, kind, start)

    def emit(self, span: ReadableSpan) -> None:
        """Queues a finished span for export, or drops and counts it when the queue
        is full (never waits)."""
        if self.emitted - self._exporter.taken >= self.max_queue or self._closed:
            self.dropped += 1
            return
        self.emitted += 1
        self._processor.on_end(span)

    # ---------------------------------------------------------------- counters

    def stats(self) -> dict[str, int]:
        """Spans by outcome so far, and those waiting for the export thread."""
        e = self._exporter
        return {
            "exported": e.exported,
            "dropped_queue_full": self.dropped,
            "dropped_export_failed": e.failed,
            "queued": max(0, self.emitted - e.taken),
        }

    def flush(self) -> None:
        """Exports what is queued now, in this thread (tests; blocks on the exporter)."""
        self._processor.force_flush()

    async def aclose(self, close_timeout_s: float = 2.0) -> None:
        """Stops taking spans and exports what is queued, waiting at most
        ``close_timeout_s`` (a collector that is down cannot hold the process).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        done = threading.Event()

        def shut() -> None:
            try:
                self._processor.shutdown()  # type: ignore[no-untyped-call]
            finally:
                done.set()

        threading.Thread(target=shut, name="radixfleet-tracing-close", daemon=True).start()
        deadline = time.monotonic() + close_timeout_s
        while not done.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not done.is_set():
            log.warning(
                "tracing: %s did not take the last spans within %gs; left behind",
                self.endpoint,
                close_timeout_s,
            )


class Trace:
    """One sampled request's spans under one root, recorded until ``end``.

    Times are wall-clock nanoseconds; ``at(t)`` converts the event loop's
    ``time.monotonic()`` readings. A span's parent is the root unless named. Made by
    ``Tracing.start``; ended once."""

    __slots__ = ("tracing", "trace_id", "parent", "state", "root", "name", "kind", "start", "attrs",
                 "spans", "error", "_offset", "_ended")  # fmt: skip

    def __init__(
        self,
        tracing: Tracing,
        trace_id: int,
        parent: SpanContext | None,
        state: TraceState | None,
        name: str,
        kind: SpanKind,
        start_ns: int,
    ) -> None:
        self.tracing = tracing
        self.trace_id = trace_id
        self.parent = parent  # the client's span (remote), or None: a new trace
        self.state = state  # the client's tracestate, passed on
        self.root = tracing.new_id()
        self.name = name
        self.kind = kind
        self.start = start_ns
        self.attrs: dict[str, Any] = {}  # the root span's
        #: [span_id, parent_id, name, kind, start_ns, end_ns, attrs, error, events]
        self.spans: list[list[Any]] = []
        self.error: str | None = None  # the root's error type, if it failed
        self._offset = time.time_ns() - time.monotonic_ns()
        self._ended = False

    def at(self, monotonic_s: float) -> int:
        """A ``time.monotonic()`` reading as wall-clock nanoseconds."""
        return int(monotonic_s * 1e9) + self._offset

    def add(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attrs: dict[str, Any] | None = None,
        *,
        parent: int = 0,
        span_id: int = 0,
        kind: SpanKind = INTERNAL,
        error: str | None = None,
        events: list[tuple[str, int]] | None = None,
    ) -> list[Any]:
        """Records a finished span (``parent`` 0: the root); returns its record, which
        may be amended (its error: index 7) until ``end``."""
        rec = [span_id or self.tracing.new_id(), parent or self.root, name, kind, start_ns, end_ns,
               attrs or {}, error, events]  # fmt: skip
        self.spans.append(rec)
        return rec

    def traceparent(self, span_id: int) -> str:
        """The W3C ``traceparent`` naming ``span_id`` of this trace (sampled)."""
        return f"00-{self.trace_id:032x}-{span_id:016x}-01"

    def header_lines(self, span_id: int) -> bytes:
        """``traceparent`` (and the client's ``tracestate``) as raw header lines."""
        out = b"traceparent: " + self.traceparent(span_id).encode("ascii") + b"\r\n"
        if self.state:
            out += b"tracestate: " + self.state.to_header().encode("ascii") + b"\r\n"
        return out

    def end(self, end_ns: int | None = None) -> None:
        """Ends the root and emits every span. Idempotent."""
        if self._ended:
            return
        self._ended = True
        t = self.tracing
        end = time.time_ns() if end_ns is None else end_ns
        tid, state, res, scope = self.trace_id, self.state, t.resource, t.scope
        root = SpanContext(tid, self.root, False, _SAMPLED, state)
        t.emit(_span(self.name, root, self.parent, self.kind, self.start, end, self.attrs, self.error,
                     None, res, scope))  # fmt: skip
        parents = {self.root: root}
        for rec in self.spans:
            parents[rec[0]] = SpanContext(tid, rec[0], False, _SAMPLED, state)
        for sid, pid, name, kind, s, e, attrs, error, events in self.spans:
            t.emit(_span(name, parents[sid], parents.get(pid, root), kind, s, e, attrs, error, events,
                         res, scope))  # fmt: skip


def _span(
    name: str,
    context: SpanContext,
    parent: SpanContext | None,
    kind: SpanKind,
    start: int,
    end: int,
    attrs: dict[str, Any],
    error: str | None,
    events: list[tuple[str, int]] | None,
    resource: Resource,
    scope: InstrumentationScope,
) -> ReadableSpan:
    if error is not None:
        attrs["error.type"] = error
    return ReadableSpan(
        name=name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=attrs,
        events=tuple(Event(n, timestamp=ts) for n, ts in events) if events else (),
        kind=kind,
        status=Status(StatusCode.ERROR, error) if error is not None else _UNSET,
        start_time=start,
        end_time=max(start, end),
        instrumentation_scope=scope,
    )
