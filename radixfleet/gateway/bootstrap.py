"""The Envoy bootstrap of ``radixfleet gateway``, made from the router's config; and
the workers' endpoints as Envoy reads them. Pure: no process, no file but the one
``write_endpoints`` writes.

::

    listener gateway.host:port
      http_connection_manager
        header_mutation   the client's own x-gateway-destination-endpoint removed (the
                          picker names the upstream, never a client)
        ext_proc          the picker (gRPC, cluster radixfleet_picker): request headers
                          and body (gateway.body_mode), response headers and body
                          (STREAMED); upstream.address with the response;
                          the subset hint forwarded; fail-closed (503) or fail-open
        router            route timeout timeouts.total_s, idle timeouts.first_byte_s;
                          retries only where the worker provably did not run it
                          (connect failure, refused stream, reset before the request
                          was sent): retries.max_attempts in all, on the list's next
                          endpoint
    cluster radixfleet_picker   HTTP/2 to gateway.picker_host:picker_port
    cluster radixfleet_workers  gateway.cluster:
        endpoints      EDS from a file the gateway rewrites as workers come and go
                       (atomically, Envoy watches its directory), load balancing by
                       the override-host policy on the header and the metadata (the
                       picker's list in order), round robin when neither names a host
                       (fail-open)
        original_dst   the address in x-gateway-destination-endpoint, one per request

Timeouts and limits come from ``timeouts``, ``retries`` and ``limits``; Envoy's own
circuit breakers are raised to ``limits.max_concurrency`` (Envoy's default of 1,024
would refuse before the router does).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from typing import Any

from radixfleet.config import Config
from radixfleet.gateway.protocol import DESTINATION, LB_NAMESPACE, SUBSET_NAMESPACE, UPSTREAM_ADDRESS

PICKER_CLUSTER = "radixfleet_picker"
WORKERS_CLUSTER = "radixfleet_workers"
ENDPOINTS_FILE = "workers.json"

_T = "type.googleapis.com/"
_ROUND_ROBIN = _T + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"


def _seconds(s: float) -> str:
    return f"{s:.3f}s"


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _mode(cfg: Config) -> dict:
    body = "BUFFERED" if cfg.gateway.body_mode == "buffered" else "FULL_DUPLEX_STREAMED"
    return {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": body,
        # STREAMED: each chunk answered (replaced only where the picker changes it), and
        # a non-streamed answer's body skipped when nothing needs it (a mode override,
        # which Envoy refuses for a FULL_DUPLEX_STREAMED response)
        "response_body_mode": "STREAMED",
        # full duplex needs the trailers sent (Envoy refuses the mode otherwise)
        "request_trailer_mode": "SEND" if body == "FULL_DUPLEX_STREAMED" else "SKIP",
        "response_trailer_mode": "SKIP",
    }


def _ext_proc(cfg: Config) -> dict:
    g = cfg.gateway
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": PICKER_CLUSTER},
                "timeout": _seconds(g.message_timeout_s),
            },
            "failure_mode_allow": g.failure_mode == "fail_open",
            "status_on_error": {"code": "ServiceUnavailable"},
            "message_timeout": _seconds(g.message_timeout_s),
            "processing_mode": _mode(cfg),
            # the picker skips a non-streamed answer's body when it needs nothing from it
            "allow_mode_override": True,
            "response_attributes": [UPSTREAM_ADDRESS],
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, LB_NAMESPACE]},
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
            },
            "mutation_rules": {"allow_all_routing": True},
        },
    }


def _strip_destination() -> dict:
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION}]},
        },
    }


def _route(cfg: Config) -> dict:
    r, t = cfg.retries, cfg.timeouts
    route: dict[str, Any] = {
        "cluster": WORKERS_CLUSTER,
        "timeout": _seconds(t.total_s),
        "idle_timeout": _seconds(t.first_byte_s),
    }
    if r.max_attempts > 1:
        route["retry_policy"] = {
            # never where the worker may have run it: nothing runs twice
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": r.max_attempts - 1,
            "retry_back_off": {
                "base_interval": _seconds(max(r.backoff_s, 0.001)),
                "max_interval": _seconds(max(r.backoff_max_s, r.backoff_s, 0.001)),
            },
        }
    return {"match": {"prefix": "/"}, "route": route}


def _limits(cfg: Config) -> dict:
    n = max(cfg.limits.max_concurrency, cfg.limits.max_connections)
    return {
        "thresholds": [{"max_connections": n, "max_pending_requests": n, "max_requests": n, "max_retries": n}]
    }


def _workers_cluster(cfg: Config, endpoints_path: str) -> dict:
    t = cfg.timeouts
    c: dict[str, Any] = {
        "name": WORKERS_CLUSTER,
        "connect_timeout": _seconds(t.connect_s),
        "circuit_breakers": _limits(cfg),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                # an idle connection reused only within keepalive_s (the workers close theirs)
                "common_http_protocol_options": {"idle_timeout": _seconds(max(t.keepalive_s, 0.001))},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
    }
    if cfg.gateway.cluster == "original_dst":
        c.update(
            type="ORIGINAL_DST",
            lb_policy="CLUSTER_PROVIDED",
            original_dst_lb_config={"use_http_header": True, "http_header_name": DESTINATION},
        )
        return c
    directory = os.path.dirname(os.path.abspath(endpoints_path))
    c.update(
        type="EDS",
        eds_cluster_config={
            "eds_config": {
                "resource_api_version": "V3",
                "path_config_source": {"path": endpoints_path, "watched_directory": {"path": directory}},
            }
        },
        load_balancing_policy={
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": _T
                            + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            "override_host_sources": [
                                {"header": DESTINATION},
                                {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}},
                            ],
                            "fallback_policy": {
                                "policies": [
                                    {
                                        "typed_extension_config": {
                                            "name": "envoy.load_balancing_policies.round_robin",
                                            "typed_config": {"@type": _ROUND_ROBIN},
                                        }
                                    }
                                ]
                            },
                        },
                    }
                }
            ]
        },
    )
    return c


def bootstrap(cfg: Config, *, admin_port: int, endpoints_path: str) -> dict:
    """The bootstrap document (module docstring), as JSON-ready data."""
    g = cfg.gateway
    t, lim = cfg.timeouts, cfg.limits
    hcm = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": _seconds(t.first_byte_s),
        "request_headers_timeout": _seconds(lim.header_timeout_s),
        "common_http_protocol_options": {"max_headers_count": 200},
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": [_route(cfg)]}],
        },
        "http_filters": [
            _strip_destination(),
            _ext_proc(cfg),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    listener: dict[str, Any] = {
        "name": "gateway",
        "address": _address(g.host, g.port),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }
    if g.body_mode == "buffered":  # Envoy holds the whole body for the picker: up to the limit
        listener["per_connection_buffer_limit_bytes"] = lim.max_body_bytes + 65536
    picker = {
        "name": PICKER_CLUSTER,
        "type": "STATIC",
        "connect_timeout": _seconds(t.connect_s),
        "circuit_breakers": _limits(cfg),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": PICKER_CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(g.picker_host, g.picker_port)}}]}
            ],
        },
    }
    return {
        "node": {"id": "radixfleet-gateway", "cluster": "radixfleet"},
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [listener],
            "clusters": [picker, _workers_cluster(cfg, endpoints_path)],
        },
    }


def endpoints_document(endpoints: Iterable[str]) -> dict:
    """The ``ClusterLoadAssignment`` of the workers' ``ip:port`` endpoints."""
    lb = []
    for ep in sorted(endpoints):
        host, _, port = ep.rpartition(":")
        lb.append({"endpoint": {"address": _address(host.strip("[]"), int(port))}})
    return {
        "resources": [
            {
                "@type": _T + "envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": WORKERS_CLUSTER,
                "endpoints": [{"lb_endpoints": lb}] if lb else [],
            }
        ]
    }


def write_endpoints(path: str, endpoints: Iterable[str]) -> None:
    """Writes the endpoints file atomically (a rename in its directory, which Envoy
    watches: it never reads a half-written file)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".workers-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(endpoints_document(endpoints), f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
