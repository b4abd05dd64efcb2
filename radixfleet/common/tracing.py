"""OpenTelemetry traces (the ``tracing`` extra), shared by the router and the agent.

Imported only where tracing is configured: a base install, or a router with tracing
off, never imports OpenTelemetry (``tests/repo/test_extras.py``).

A traced request's spans are kept as plain records while it runs; its end queues
them, and the export thread encodes and exports them (``Tracing``'s docstring)::

    event loop (the request)                   export thread (Tracing._run)
    Tracing.start(headers) -> Trace | None     batch -> radixfleet.common.otlp -> OTLP/HTTP
    Trace.add(...)          records                  (or ReadableSpan -> an exporter)
    Trace.end()  -> Tracing.emit(trace)  ->  bounded queue (dropped_queue_full past it)
                                               exported | dropped_export_failed

Rules:

- Nothing here waits for the collector. ``emit`` is O(1): a trace whose spans would
  put more than ``max_queue_spans`` in wait for the export thread is dropped, its
  spans counted; an export that
  fails (the endpoint down, slower than ``export_timeout_s``, refusing) drops its
  batch, counted. Requests never wait for either.
- Sampling is decided once, at a trace's root (``start``): a client's valid W3C
  ``traceparent`` joins its trace and, with ``parent_based``, its sampled flag
  decides; otherwise the trace id does, against ``sample_ratio`` (the lower 64 bits,
  as OpenTelemetry's ``TraceIdRatioBased``, so every service keeps the same traces).
  An unsampled request records nothing and forwards no ``traceparent``.
- A malformed ``traceparent`` (or ``tracestate``) is ignored: a new trace starts.
- What a span says is what its caller passes (radixfleet.server.tracing, the agent): counts,
  names of workers and policies' reasons, never prompt text nor a prompt's hash.
- One thread (the event loop) starts, records and emits; the export thread (or
  ``flush``, under the same lock) only reads an ended trace and exports. Each counter
  is written by one of the two.
"""

from __future__ import annotations

import asyncio
import collections
import gzip
import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

from radixfleet.common import otlp
from radixfleet.wire.errors import ConfigError, MissingExtra

try:  # the tracing extra's (radixfleet.wire.extras)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
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


class OtlpHttp:
    """Sends encoded ``ExportTraceServiceRequest`` bodies (``radixfleet.common.otlp``) to an
    OTLP/HTTP collector, one POST a batch, on a kept-alive connection.

    The collector's headers, TLS files and compression come from the standard
    environment variables (``OTEL_EXPORTER_OTLP_TRACES_*`` before
    ``OTEL_EXPORTER_OTLP_*``: ``HEADERS``, ``CERTIFICATE``, ``CLIENT_CERTIFICATE``,
    ``CLIENT_KEY``, ``COMPRESSION`` ``gzip``), never from a config file. A batch is
    sent once: any answer but a 2xx, or no answer within ``timeout_s``, fails it."""

    def __init__(self, endpoint: str, timeout_s: float, env: Mapping[str, str] | None = None) -> None:
        import requests  # the OTLP/HTTP exporter's dependency (the tracing extra)
        from opentelemetry.util.re import parse_env_headers

        env = os.environ if env is None else env

        def setting(name: str) -> str:
            return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}", "")

        _, sep, rest = endpoint.partition("://")
        self.endpoint = endpoint + "/v1/traces" if sep and "/" not in rest else endpoint
        self.timeout_s = timeout_s
        self.gzip = setting("COMPRESSION").strip().lower() == "gzip"
        extra = parse_env_headers(setting("HEADERS"), liberal=True)
        self.headers = {"Content-Type": "application/x-protobuf", **extra}
        if self.gzip:
            self.headers["Content-Encoding"] = "gzip"
        self._session = requests.Session()
        ca, cert, key = setting("CERTIFICATE"), setting("CLIENT_CERTIFICATE"), setting("CLIENT_KEY")
        if ca:
            self._session.verify = ca
        if cert:
            self._session.cert = (cert, key) if key else cert
        self._errors = (requests.RequestException, OSError)

    def send(self, body: bytes) -> bool:
        """Posts one batch; True when the collector took it."""
        if self.gzip:
            body = gzip.compress(body)
        try:
            r = self._session.post(self.endpoint, data=body, headers=self.headers, timeout=self.timeout_s)
        except self._errors as exc:
            log.debug("tracing: POST %s: %s", self.endpoint, exc)
            return False
        return 200 <= r.status_code < 300

    def close(self) -> None:
        self._session.close()


class Tracing:
    """One process's traces: sampling, the bounded queue, the export thread, the
    counters.

    Spans travel as the plain records a ``Trace`` keeps: the event loop only queues
    an ended trace (``emit``); the export thread takes batches of at most
    ``max_export_batch`` spans every ``schedule_delay_s`` (sooner when that many
    wait) and encodes them itself (``radixfleet.common.otlp``) for OTLP/HTTP, or makes the
    SDK's ``ReadableSpan`` objects for an ``exporter`` (tests: the SDK's
    ``InMemorySpanExporter``) or OTLP over gRPC. Lifecycle: made ready to use (the
    export thread starts here); ``await aclose()`` once, bounded by
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
        self._http: OtlpHttp | None = None
        self._sdk: SpanExporter | None = None
        if exporter is not None:
            self._sdk = exporter
        elif protocol == "http/protobuf":
            self._http = OtlpHttp(endpoint, export_timeout_s)
        else:
            self._sdk = otlp_exporter(endpoint, protocol, export_timeout_s)
        self.endpoint = endpoint or type(exporter).__name__
        self.max_queue = max_queue_spans
        self.max_batch = min(512, max_queue_spans)
        self.schedule_delay_s = schedule_delay_s
        attrs = {"service.name": service_name, **(attributes or {})}
        self.resource = Resource.create(attrs)
        self.scope = InstrumentationScope("radixfleet")
        self._resource_msg = otlp.resource(self.resource.attributes)
        self._scope_msg = otlp.scope("radixfleet")
        self.parent_based = parent_based
        #: a trace id's lower 64 bits below this: sampled (TraceIdRatioBased's bound)
        self._bound = round(sample_ratio * (1 << 64))
        self._rng = random.Random(os.urandom(16))
        self._queue: collections.deque[Trace] = collections.deque()
        self.emitted = 0  # spans queued for the export thread (event loop only)
        self.dropped = 0  # spans that found the queue full (event loop only)
        self.taken = 0  # spans the export thread took from the queue (export only)
        self.exported = 0  # (export only)
        self.failed = 0  # spans of batches whose export failed, dropped (export only)
        self._failing = False
        self._closed = False
        self._wake = threading.Event()
        self._export_lock = threading.Lock()  # one batch exported at a time
        self._thread = threading.Thread(target=self._run, name="radixfleet-tracing", daemon=True)
        self._thread.start()

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

    def emit(self, trace: Trace) -> None:
        """Queues an ended trace's spans for export, or drops and counts them when
        the queue has no room for them all (never waits)."""
        n = trace.size
        if self.emitted - self.taken + n > self.max_queue or self._closed:
            self.dropped += n
            return
        self.emitted += n
        self._queue.append(trace)
        if self.emitted - self.taken >= self.max_batch:
            self._wake.set()

    # ------------------------------------------------------------------ export

    def _run(self) -> None:
        """The export thread: a batch every ``schedule_delay_s`` or when one is full."""
        while not self._closed:
            self._wake.wait(self.schedule_delay_s)
            self._wake.clear()
            while self._export_batch():
                pass

    def _export_batch(self) -> bool:
        """Takes and exports one batch; False when there was none."""
        with self._export_lock:
            batch: list[Trace] = []
            n = 0
            while self._queue and n < self.max_batch:
                t = self._queue.popleft()
                batch.append(t)
                n += t.size
            if not batch:
                return False
            self.taken += n
            try:
                ok = self._send(batch)
            except Exception:  # noqa: BLE001 - an exporter's failure drops its batch, never more
                log.exception("tracing: exporting %d spans raised", n)
                ok = False
            if ok:
                self.exported += n
                if self._failing:
                    self._failing = False
                    log.info("tracing: spans reach %s again", self.endpoint)
            else:
                self.failed += n
                if not self._failing:  # once per outage, not once per batch
                    self._failing = True
                    log.warning(
                        "tracing: export to %s failed: its spans are dropped and counted "
                        '(radixfleet_tracing_spans_total{outcome="dropped_export_failed"})',
                        self.endpoint,
                    )
            return True

    def _send(self, batch: list[Trace]) -> bool:
        if self._http is not None:
            body = otlp.request(self._resource_msg, self._scope_msg, (s for t in batch for s in t.encoded()))
            return self._http.send(body)
        assert self._sdk is not None
        spans = [s for t in batch for s in t.readable()]
        return self._sdk.export(spans) is SpanExportResult.SUCCESS

    # ---------------------------------------------------------------- counters

    def stats(self) -> dict[str, int]:
        """Spans by outcome so far, and those waiting for the export thread."""
        return {
            "exported": self.exported,
            "dropped_queue_full": self.dropped,
            "dropped_export_failed": self.failed,
            "queued": max(0, self.emitted - self.taken),
        }

    def flush(self) -> None:
        """Exports what is queued now, in this thread (tests; blocks on the exporter)."""
        while self._export_batch():
            pass

    async def aclose(self, close_timeout_s: float = 2.0) -> None:
        """Stops taking spans and exports what is queued, waiting at most
        ``close_timeout_s`` (a collector that is down cannot hold the process).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        done = threading.Event()

        def shut() -> None:
            try:
                self._thread.join()
                self.flush()
                if self._sdk is not None:
                    self._sdk.shutdown()
                if self._http is not None:
                    self._http.close()
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
                 "spans", "error", "finish", "_offset", "_ended")  # fmt: skip

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
        self.finish = 0  # the root's end (ns), once ended
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

    @property
    def size(self) -> int:
        """Its spans: the root and each recorded one."""
        return 1 + len(self.spans)

    def end(self, end_ns: int | None = None) -> None:
        """Ends the root and queues every span for export. Idempotent; nothing
        records on it afterwards (the export thread reads it)."""
        if self._ended:
            return
        self._ended = True
        self.finish = time.time_ns() if end_ns is None else end_ns
        self.tracing.emit(self)

    def encoded(self) -> list[bytes]:
        """Its spans as OTLP ``Span`` messages (the export thread's)."""
        tid = self.trace_id.to_bytes(16, "big")
        state = self.state.to_header() if self.state else ""
        parent = self.parent.span_id if self.parent is not None else None
        out = [otlp.span(tid, self.root, parent, state, self.name, self.kind.value, self.start, self.finish,
                         self.attrs, self.error, None)]  # fmt: skip
        for sid, pid, name, kind, s, e, attrs, error, events in self.spans:
            out.append(otlp.span(tid, sid, pid, state, name, kind.value, s, e, attrs, error, events))
        return out

    def readable(self) -> list[ReadableSpan]:
        """Its spans as the SDK's ``ReadableSpan`` objects (the export thread's)."""
        t = self.tracing
        tid, state, res, scope = self.trace_id, self.state, t.resource, t.scope
        root = SpanContext(tid, self.root, False, _SAMPLED, state)
        out = [_span(self.name, root, self.parent, self.kind, self.start, self.finish, self.attrs, self.error,
                     None, res, scope)]  # fmt: skip
        parents = {self.root: root}
        for rec in self.spans:
            parents[rec[0]] = SpanContext(tid, rec[0], False, _SAMPLED, state)
        for sid, pid, name, kind, s, e, attrs, error, events in self.spans:
            out.append(_span(name, parents[sid], parents.get(pid, root), kind, s, e, attrs, error, events,
                             res, scope))  # fmt: skip
        return out


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
        attrs = {**attrs, "error.type": error}
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
