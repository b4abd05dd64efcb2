"""radixfleet.common.tracing's OTLP/HTTP export against a collector on loopback: one POST a
batch, the standard variables' headers and gzip, a body opentelemetry-proto parses;
a collector answering 503 drops the batch, counted."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import threading

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from radixfleet.common.tracing import Tracing  # noqa: E402

pytestmark = pytest.mark.integration


class Collector(http.server.ThreadingHTTPServer):
    def __init__(self, status: int) -> None:
        self.status = status
        self.posts: list[tuple[dict, bytes]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.posts.append((dict(self.headers), body))
                self.send_response(outer.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def collector(request):
    c = Collector(getattr(request, "param", 200))
    yield c
    c.shutdown()
    c.server_close()


def _emit(t: Tracing, n: int) -> None:
    for i in range(n):
        tr = t.start({}, "radixfleet.request")
        assert tr is not None
        tr.attrs["i"] = i
        tr.add("radixfleet.route", tr.start, tr.start + 5, {"radixfleet.worker": "w0"})
        tr.end()


def test_a_batch_is_one_post_with_the_standard_headers_and_gzip(collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-team=routing")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    t = Tracing(service_name="rf", endpoint=collector.url, schedule_delay_s=60)
    _emit(t, 3)
    t.flush()
    assert t.stats() == {"exported": 6, "dropped_queue_full": 0, "dropped_export_failed": 0, "queued": 0}
    [(headers, body)] = collector.posts
    assert headers["x-team"] == "routing" and headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"] == "application/x-protobuf"
    req = ExportTraceServiceRequest.FromString(gzip.decompress(body))
    spans = req.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans] == ["radixfleet.request", "radixfleet.route"] * 3
    resource = {a.key: a.value.string_value for a in req.resource_spans[0].resource.attributes}
    assert resource["service.name"] == "rf"
    asyncio.run(t.aclose())


@pytest.mark.parametrize("collector", [503], indirect=True)
def test_a_refusing_collector_drops_the_batch_counted(collector):
    t = Tracing(service_name="rf", endpoint=collector.url + "/v1/traces", schedule_delay_s=0.01)
    _emit(t, 2)
    asyncio.run(t.aclose())
    assert t.stats()["dropped_export_failed"] == 4 and t.stats()["exported"] == 0
    assert len(collector.posts) >= 1
