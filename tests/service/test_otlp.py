"""radixfleet/common/otlp.py: the hand encoder writes what the SDK's own OTLP encoder writes,
parsed back with opentelemetry-proto (a message equal field by field); and
radixfleet.common.tracing's OTLP/HTTP sender reads its settings from the standard variables."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: E402

from radixfleet.common import otlp  # noqa: E402
from radixfleet.common.tracing import CLIENT, OtlpHttp, Tracing  # noqa: E402

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list = []

    def export(self, spans):
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def _traces(tracing: Tracing) -> list:
    """Two ended traces covering every field the router and the agent write: a
    client's parent and tracestate, kinds, events, errors, each attribute type."""
    out = []
    a = tracing.start({"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}, "radixfleet.request")
    b = tracing.start({}, "radixfleet.request")
    assert a is not None and b is not None
    for tr in (a, b):
        s = tr.start
        tr.attrs.update({"url.path": "/v1/chat/completions", "radixfleet.stream": True, "n": 3})
        tr.add("radixfleet.keying", s, s + 10, {"radixfleet.blocks": 5, "radixfleet.body_bytes": 1 << 40})
        up = tr.add(
            "radixfleet.upstream",
            s + 10,
            s + 900,
            {"radixfleet.worker": "w0", "radixfleet.route.match_us": 3.25, "neg": -7, "other": (1, 2)},
            kind=CLIENT,
            error="upstream_broken",
            events=[("first_byte", s + 50)],
        )
        tr.add("radixfleet.first_token", s + 10, s + 60, parent=up[0])
        tr.add("radixfleet.stream", s + 60, s + 5, parent=up[0])  # an end before its start
        out.append(tr)
    a.error = "client_gone"
    for tr in out:
        tr.end()
    return out


def test_the_hand_encoding_is_the_sdks():
    keep = Keep()
    t = Tracing(service_name="rf", exporter=keep, schedule_delay_s=60, attributes={"host.name": "h"})
    traces = _traces(t)
    t.flush()
    theirs = ExportTraceServiceRequest.FromString(encode_spans(keep.spans).SerializeToString())
    ours = ExportTraceServiceRequest.FromString(
        otlp.request(t._resource_msg, t._scope_msg, [s for tr in traces for s in tr.encoded()])
    )
    # the SDK groups by resource and scope objects too: one of each here
    assert len(theirs.resource_spans) == len(ours.resource_spans) == 1
    rs_t, rs_o = theirs.resource_spans[0], ours.resource_spans[0]
    assert rs_o.resource == rs_t.resource
    assert rs_o.scope_spans[0].scope.name == rs_t.scope_spans[0].scope.name == "radixfleet"
    spans_t, spans_o = rs_t.scope_spans[0].spans, rs_o.scope_spans[0].spans
    assert len(spans_o) == len(spans_t) == 10
    for o, th in zip(spans_o, spans_t, strict=True):
        th.ClearField("flags")  # the SDK's remote-parent bits; no collector needs them
        assert o == th, (o, th)
    asyncio_close(t)


def test_repeated_pairs_are_cached_and_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(otlp, "_CACHE_MAX", 4)
    otlp._pairs.clear()
    first = otlp.key_value("radixfleet.worker", "w0")
    assert otlp.key_value("radixfleet.worker", "w0") == first
    for i in range(10):
        otlp.key_value("k", f"v{i}")
        assert len(otlp._pairs) <= 4
    assert otlp.varint(300) == b"\xac\x02" and otlp.varint(1) == b"\x01"


def test_the_http_sender_reads_the_standard_variables():
    env = {
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20x,team=a",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "team=b",  # the traces' own wins
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": "/etc/ca.pem",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/etc/c.pem",
        "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/etc/k.pem",
    }
    h = OtlpHttp("http://collector:4318", 1.0, env)
    assert h.endpoint == "http://collector:4318/v1/traces"
    assert h.headers["team"] == "b" and "authorization" not in h.headers  # one variable, not both
    assert h.gzip and h.headers["Content-Encoding"] == "gzip"
    assert h._session.verify == "/etc/ca.pem" and h._session.cert == ("/etc/c.pem", "/etc/k.pem")
    plain = OtlpHttp("https://c:4318/custom", 1.0, {})
    assert plain.endpoint == "https://c:4318/custom" and not plain.gzip
    assert plain.headers == {"Content-Type": "application/x-protobuf"}


def asyncio_close(t: Tracing) -> None:
    import asyncio

    asyncio.run(t.aclose())
