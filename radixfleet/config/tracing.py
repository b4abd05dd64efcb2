"""``tracing:``: OpenTelemetry traces (``radixfleet.server.tracing``; the ``tracing`` extra).
Read at start.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import setting as _opt


@settings
class TracingConfig:
    """OpenTelemetry traces (radixfleet.server.tracing; the ``tracing`` extra). Read at start."""

    enabled: bool = _opt(
        False, "export a span tree per sampled request over OTLP (needs pip install 'radixfleet[tracing]')"
    )
    endpoint: str = _opt(
        "http://127.0.0.1:4318/v1/traces",
        "the collector's OTLP traces URL (http/protobuf: a URL without a path gets /v1/traces; "
        "grpc: http://HOST:4317); its credentials and TLS files come from the OTEL_EXPORTER_OTLP_* "
        "environment variables",
    )
    protocol: Literal["http/protobuf", "grpc"] = _opt(
        "http/protobuf",
        "OTLP over HTTP (the extra's exporter) or gRPC (needs opentelemetry-exporter-otlp-proto-grpc)",
    )
    sample_ratio: float = _opt(
        0.01,
        "share of requests traced (by trace id, as OpenTelemetry's TraceIdRatioBased) when the "
        "client's traceparent does not decide",
        lo=0,
        hi=1,
    )
    parent_based: bool = _opt(
        True,
        "a client's valid traceparent decides by its sampled flag (OpenTelemetry's parent-based "
        "sampling); false: sample_ratio decides every request, a client's trace is still joined",
    )
    service_name: str = _opt("radixfleet-router", "the service.name resource attribute of every span")
    max_queue_spans: int = _opt(
        2048,
        "spans waiting for the export thread; beyond it spans are dropped and counted, never waited for",
        lo=1,
        hi=1 << 20,
    )
    export_timeout_s: float = _opt(
        5.0,
        "one export's deadline (retries included); a failed batch is dropped and counted",
        lo=0,
        lo_open=True,
        hi=120,
    )

    @document_check
    def _check(self) -> None:
        try:
            u = urlsplit(self.endpoint)
            ok = u.scheme in ("http", "https") and bool(u.hostname) and (u.port or 1) > 0
        except ValueError:  # a bad port or IPv6 literal
            ok = False
        if not ok or not self.endpoint.isascii() or any(c <= " " for c in self.endpoint):
            raise ConfigError("endpoint", f"expected an http:// or https:// URL, got {self.endpoint[:200]!r}")
        if not self.service_name or len(self.service_name) > 255:
            raise ConfigError("service_name", "expected a name of 1 to 255 characters")
