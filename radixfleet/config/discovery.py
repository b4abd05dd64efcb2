"""``workers.discovery``: workers found in Kubernetes EndpointSlices, a Gateway API
Inference Extension InferencePool's pods, or DNS A/AAAA records
(``radixfleet.fleet.discovery``); each selector, pool or service gives what it finds a
kind, a model, a role and engine settings (``EngineSettings``). Read at start.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

from pydantic import Field

from radixfleet.config.engines import EngineSettings, check_engine_fields
from radixfleet.config.kinds import ROLE_DOC, EngineKind, Role
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import section as _section
from radixfleet.wire.settings import setting as _opt

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@settings
class K8sSelectorSpec(EngineSettings):
    """One selector; it may give its workers engine settings (``EngineSettings``)."""

    label_selector: str = _opt(
        "",
        "EndpointSlice label selector (slices carry their Service's labels and kubernetes.io/service-name)",
    )
    port_name: str = _opt("", 'the slice port workers listen on, by name ("": the only port)')
    kind: EngineKind = _opt("agent", "engine kind of these workers")
    namespace: str = _opt("", 'namespace ("": kubernetes.namespace)')
    model: str = _opt("", 'the model these workers serve ("": from each one\'s /v1/models)')
    role: Role = _opt("both", ROLE_DOC)

    @document_check
    def _check(self) -> None:
        if not self.label_selector:
            # an empty selector would take every slice, the router's own Service's too
            raise ConfigError("label_selector", "required: a non-empty label selector")
        check_engine_fields(self, "", per_worker=False)


@settings
class InferencePoolSpec(EngineSettings):
    """``workers.discovery.kubernetes.inference_pool``: the ready pods of one
    InferencePool (``inference.networking.k8s.io/v1``: its selector and target ports,
    ``radixfleet.fleet.discovery.inference_pool``), each a worker of ``kind`` with these
    engine settings. ``name`` "" is none; ``radixfleet gateway --inference-pool``
    sets it from the command line."""

    name: str = _opt("", 'the InferencePool whose pods are the workers ("": none)')
    namespace: str = _opt("", 'its namespace ("": kubernetes.namespace, else the pod\'s own)')
    kind: EngineKind = _opt("openai", "engine kind of its pods (vllm or sglang for their events and metrics)")
    model: str = _opt("", 'the model its pods serve ("": from each one\'s /v1/models)')
    role: Role = _opt("both", ROLE_DOC)

    @document_check
    def _check(self) -> None:
        check_engine_fields(self, "", per_worker=False)

    def selector(self) -> K8sSelectorSpec:
        """The selector entry its pods are found with (the label selector is the
        pool's own, read when the source starts)."""
        engine = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineSettings)}
        return K8sSelectorSpec(
            label_selector="(the InferencePool's)",
            kind=self.kind,
            namespace=self.namespace,
            model=self.model,
            role=self.role,
            **engine,
        )


@settings
class K8sDiscoveryConfig:
    """``workers.discovery.kubernetes``: EndpointSlice watches (``radixfleet.fleet.discovery.k8s``);
    ``api_server``, when given, is an http(s) URL with a host."""

    api_server: str = _opt(
        "", 'API server URL ("": in-cluster, from KUBERNETES_SERVICE_HOST and the service account)'
    )
    token_file: str = _opt(f"{SERVICE_ACCOUNT_DIR}/token", "bearer token file, with api_server")
    namespace: str = _opt("", 'namespace of the selectors ("": the router pod\'s own)')
    watch_timeout_s: float = _opt(
        300.0, "server-side timeout of one watch (it then resumes from its resourceVersion)", lo=1
    )
    page_size: int = _opt(500, "list page size (limit/continue)", lo=1)
    selectors: tuple[K8sSelectorSpec, ...] = Field(
        (), description=("EndpointSlice selectors, each with a models: entry's settings for what it finds")
    )
    inference_pool: InferencePoolSpec = _section(InferencePoolSpec, "an InferencePool's pods")

    @document_check
    def _check(self) -> None:
        if self.api_server:
            parts = urlsplit(self.api_server)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(
                    "api_server", f"expected an http(s):// URL with a host, got {self.api_server!r}"
                )


@settings
class DnsServiceSpec(EngineSettings):
    """One headless Service; it may give its workers engine settings."""

    name: str = _opt("", "DNS name of a headless Service: its A/AAAA records are the workers")
    port: int = _opt(0, "the workers' port", lo=0, hi=65535)
    kind: EngineKind = _opt("agent", "engine kind of these workers")
    model: str = _opt("", 'the model these workers serve ("": from each one\'s /v1/models)')
    role: Role = _opt("both", ROLE_DOC)

    @document_check
    def _check(self) -> None:
        if not self.name:
            raise ConfigError("name", "required: the headless Service's DNS name")
        if not self.port:
            raise ConfigError("port", "required: the workers' port (1-65535)")
        check_engine_fields(self, "", per_worker=False)


@settings
class DnsDiscoveryConfig:
    """``workers.discovery.dns``: headless Services re-resolved on an interval
    (``radixfleet.fleet.discovery.dns``)."""

    nameserver: str = _opt("", 'resolver host or host:port ("": /etc/resolv.conf)')
    interval_s: float = _opt(5.0, "re-resolve interval", lo=0, lo_open=True)
    timeout_s: float = _opt(2.0, "timeout of one resolution", lo=0, lo_open=True)
    services: tuple[DnsServiceSpec, ...] = Field(
        (), description=("headless Services, each with a models: entry's settings for what it finds")
    )


@settings
class DiscoveryConfig:
    """``workers.discovery``: its sources and the bounds common to them. Invariant:
    ``backoff_s <= backoff_max_s``."""

    max_workers: int = _opt(4096, "most discovered workers kept (more: logged, counted, cut)", lo=1)
    backoff_s: float = _opt(
        1.0, "first retry delay of a failing source, doubled per failure", lo=0, lo_open=True
    )
    backoff_max_s: float = _opt(30.0, "largest retry delay of a failing source", lo=0, lo_open=True)
    kubernetes: K8sDiscoveryConfig = _section(K8sDiscoveryConfig, "Kubernetes EndpointSlices")
    dns: DnsDiscoveryConfig = _section(DnsDiscoveryConfig, "DNS A/AAAA records")

    @document_check
    def _check(self) -> None:
        if self.backoff_max_s < self.backoff_s:
            raise ConfigError(
                "backoff_max_s", f"expected a number >= workers.discovery.backoff_s ({self.backoff_s})"
            )

    def enabled(self) -> bool:
        k = self.kubernetes
        return bool(k.selectors or k.inference_pool.name or self.dns.services)
