"""radixfleet/common/tracing.py: sampling at the root, W3C traceparent in and out, the span tree a
Trace emits, and the bounded queue and export failures, counted — with the SDK's
in-memory exporter or a stand-in, no collector and no server."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from radixfleet.common.tracing import CLIENT, Tracing, exporter_class, otlp_exporter  # noqa: E402
from radixfleet.wire.errors import ConfigError  # noqa: E402

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
SAMPLED = f"00-{TRACE}-{PARENT}-01"


def tracing(**kw) -> tuple[Tracing, InMemorySpanExporter]:
    mem = InMemorySpanExporter()
    return Tracing(service_name="t", exporter=mem, **kw), mem


def test_a_client_trace_is_joined_and_its_state_passed_on():
    t, mem = tracing(sample_ratio=0.0)  # the client's sampled flag decides, not the ratio
    tr = t.start({"traceparent": SAMPLED, "tracestate": "vendor=abc"}, "req")
    assert tr is not None and f"{tr.trace_id:032x}" == TRACE
    rec = tr.add(
        "child", tr.start, tr.start + 1000, {"n": 1}, kind=CLIENT, events=[("first_byte", tr.start + 5)]
    )
    lines = tr.header_lines(rec[0]).decode()
    assert lines == f"traceparent: 00-{TRACE}-{rec[0]:016x}-01\r\ntracestate: vendor=abc\r\n"
    tr.add("grandchild", tr.start, tr.start + 10, parent=rec[0], error="boom")
    tr.end()
    tr.end()  # once
    t.flush()
    spans = {s.name: s for s in mem.get_finished_spans()}
    assert sorted(spans) == ["child", "grandchild", "req"]
    root, child, grand = spans["req"], spans["child"], spans["grandchild"]
    assert root.kind is SpanKind.SERVER and root.parent is not None and root.parent.is_remote
    assert f"{root.parent.span_id:016x}" == PARENT
    assert child.parent.span_id == root.context.span_id and child.kind is SpanKind.CLIENT
    assert [e.name for e in child.events] == ["first_byte"]
    assert grand.parent.span_id == child.context.span_id
    assert grand.status.status_code is StatusCode.ERROR and grand.attributes["error.type"] == "boom"
    assert {s.context.trace_id for s in spans.values()} == {int(TRACE, 16)}
    assert t.stats() == {"exported": 3, "dropped_queue_full": 0, "dropped_export_failed": 0, "queued": 0}


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        f"00-{'0' * 32}-{PARENT}-01",  # an all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # an all-zero parent
        f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
        f"00-{TRACE.upper()}-{PARENT}-01",  # upper case hex
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE}-{PARENT}",
        "00-" + "a" * 5000,
        "",
    ],
)
def test_a_malformed_traceparent_is_ignored_and_a_new_trace_started(header):
    t, _ = tracing(sample_ratio=1.0)
    tr = t.start({"traceparent": header, "tracestate": "x=1"}, "req")
    assert tr is not None and tr.parent is None and tr.state is None
    assert f"{tr.trace_id:032x}" != TRACE and tr.trace_id != 0
    assert tr.header_lines(5).startswith(f"traceparent: 00-{tr.trace_id:032x}-0000000000000005-01".encode())


def test_sampling_follows_the_client_or_the_ratio():
    unsampled = {"traceparent": f"00-{TRACE}-{PARENT}-00"}
    t, _ = tracing(sample_ratio=1.0)
    assert t.start(unsampled, "req") is None  # parent-based: the client said no
    assert t.start({}, "req") is not None
    t, _ = tracing(sample_ratio=0.0)
    assert t.start({}, "req") is None
    assert t.start({"traceparent": SAMPLED}, "req") is not None
    t, _ = tracing(sample_ratio=1.0, parent_based=False)
    tr = t.start(unsampled, "req")  # the ratio decides, the client's trace still joined
    assert tr is not None and f"{tr.trace_id:032x}" == TRACE
    t, _ = tracing(sample_ratio=0.25)
    n = sum(t.start({}, "req") is not None for _ in range(4000))
    assert 800 < n < 1200, n


class Stuck(SpanExporter):
    """An exporter blocked like a collector that never answers, until released."""

    def __init__(self, result=SpanExportResult.SUCCESS) -> None:
        self.release = threading.Event()
        self.result = result
        self.got = 0

    def export(self, spans):
        self.release.wait(10)
        self.got += len(spans)
        return self.result

    def shutdown(self) -> None:
        self.release.set()


def test_a_full_queue_drops_and_counts_without_waiting():
    stuck = Stuck()
    t = Tracing(service_name="t", exporter=stuck, max_queue_spans=8, schedule_delay_s=0.01)
    t0 = time.perf_counter()
    for _ in range(100):
        tr = t.start({}, "req")
        assert tr is not None
        tr.add("child", tr.start, tr.start + 1)
        tr.end()
    assert time.perf_counter() - t0 < 2.0  # nothing waited for the stuck exporter
    st = t.stats()
    assert st["dropped_queue_full"] >= 200 - 16  # at most the queue and one batch taken
    assert st["queued"] <= 8 and st["exported"] == 0
    stuck.release.set()
    asyncio.run(t.aclose())
    assert stuck.got + t.stats()["dropped_queue_full"] == 200


def test_a_failed_export_drops_its_batch_and_counts_it():
    failing = Stuck(SpanExportResult.FAILURE)
    failing.release.set()
    t = Tracing(service_name="t", exporter=failing)
    tr = t.start({}, "req")
    assert tr is not None
    tr.add("child", tr.start, tr.start + 1)
    tr.end()
    t.flush()
    assert t.stats() == {"exported": 0, "dropped_queue_full": 0, "dropped_export_failed": 2, "queued": 0}


def test_closing_is_bounded_whatever_the_collector_does():
    stuck = Stuck()
    stuck.shutdown = lambda: None  # a collector that never lets go
    t = Tracing(service_name="t", exporter=stuck, schedule_delay_s=0.01)
    tr = t.start({}, "req")
    assert tr is not None
    tr.end()
    time.sleep(0.1)  # the export thread is now stuck in export
    t0 = time.perf_counter()
    asyncio.run(t.aclose(close_timeout_s=0.3))
    assert time.perf_counter() - t0 < 1.5
    tr = t.start({}, "req")  # closed: spans are dropped, counted
    assert tr is not None
    tr.end()
    assert t.stats()["dropped_queue_full"] == 1
    stuck.release.set()


def test_the_otlp_exporters():
    exp = otlp_exporter("http://collector:4318", "http/protobuf", 1.0)
    assert exp._endpoint == "http://collector:4318/v1/traces"  # a base URL gets the signal path
    assert otlp_exporter("http://c:4318/custom", "http/protobuf", 1.0)._endpoint == "http://c:4318/custom"
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
            exporter_class("grpc")
    with pytest.raises(ConfigError):
        exporter_class("zipkin")
