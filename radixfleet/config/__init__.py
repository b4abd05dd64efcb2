"""The router's YAML configuration: one declared schema, validated into frozen dataclasses.

Every section and key is optional. Each section is declared once, in its own module
(on ``radixfleet.wire.settings``): its keys' types, defaults, bounds, choices and a doc per
key, and its rules across fields (``document_check``); ``deploy/README.md``'s key
tables are generated from these declarations (``radixfleet.config.reference``). On a
reload, a component that reads one section is handed that section whole
(``configure(section)``), never its values one by one.

Validation errors name the dotted path, what was expected and, for names, the
valid ones::

    policy.name: 'cache-aware' is not one of cache_aware, consistent_hash, ...
    limits.max_queue: expected an integer >= 0, got -1
    health.intervall_s: unknown key; valid: failure_threshold, interval_s, ...

A key written twice in one mapping is an error. Every error is reported in one
run (``ConfigError.errors``). Absent keys keep their defaults; a key present with
``null`` is an error (``null`` never means "the default"). Command-line overrides
are merged with ``MISSING`` (``with_overrides``), never with ``None``.

The modules, by section (this package re-exports what callers import):

- ``document``: ``Config`` (the whole document, ``models:``) and ``parse_config``
  (the rules across sections);
- ``yaml_loader``: reading a file (the bounded YAML loader, duplicate keys);
- ``overrides``: command-line overrides (``MISSING``, ``with_overrides``);
- ``check``: ``radixfleet check-config FILE`` (exit 0, or 2 with every error);
- ``kinds``: the engine kinds and worker roles (the one list of kinds);
- ``workers``: ``workers:`` entries, the worker URL rules, ``resolve_engine``;
- ``discovery``: ``workers.discovery`` (Kubernetes EndpointSlices, DNS);
- ``engines``: engine settings (``models:``, events, scraping, ``tokenizers:``)
  and their rules;
- ``runtime``: the checks of a parsed config against this host (tokenizers that
  load, events endpoints the router can bind);
- ``server``: ``listen:``, ``admin:`` and ``reload:``;
- ``keys``: ``keys:`` (block size, tenant identity);
- ``auth``: ``auth:`` (bearer tokens);
- ``policy``: ``policy:``; ``index``: ``index:``;
- ``health``: ``health:``, ``breaker:``, ``load:``;
- ``registration``: ``registration:`` (agents registering themselves);
- ``timeouts``: ``retries:``, ``timeouts:``; ``limits``: ``limits:`` (shedding too);
- ``prefetch``: ``warmup:``, ``prefetch:``;
- ``bus``: ``bus:``; ``traffic_log``: ``traffic_log:``; ``tracing``: ``tracing:``;
- ``decisions``: ``response_headers:``, ``decisions:``;
- ``autoscale``: ``autoscale:``; ``disagg``: ``disagg:``; ``gateway``: ``gateway:``.

``tenancy:`` is declared with its rules in ``radixfleet.route.tenancy``.
"""

from radixfleet.config.auth import AuthConfig, resolve_token
from radixfleet.config.autoscale import AutoscaleConfig
from radixfleet.config.bus import BusAuthConfig, BusConfig, BusTlsConfig, bus_setting
from radixfleet.config.check import configure, run
from radixfleet.config.decisions import DecisionsConfig, ResponseHeadersConfig
from radixfleet.config.disagg import DisaggConfig
from radixfleet.config.discovery import (
    SERVICE_ACCOUNT_DIR,
    DiscoveryConfig,
    DnsDiscoveryConfig,
    DnsServiceSpec,
    K8sDiscoveryConfig,
    K8sSelectorSpec,
)
from radixfleet.config.document import Config, ModelName, config_warnings, parse_config, parse_section
from radixfleet.config.engines import (
    ENGINE_FIELDS,
    EngineScrapeSpec,
    EngineSettings,
    EventsSpec,
    TokenizersConfig,
    check_engine_fields,
    check_event_sides,
    check_events_endpoint,
    check_tokenizer_source,
)
from radixfleet.config.gateway import GatewayConfig
from radixfleet.config.health import BreakerConfig, HealthConfig, LoadConfig
from radixfleet.config.index import TIER_MODES, IndexConfig
from radixfleet.config.keys import ApiKeySpec, KeysConfig, TenantConfig
from radixfleet.config.kinds import WORKER_KINDS
from radixfleet.config.limits import LimitsConfig
from radixfleet.config.overrides import MISSING, with_overrides
from radixfleet.config.policy import PolicyConfig, build_policy_from
from radixfleet.config.prefetch import PrefetchConfig, WarmupConfig
from radixfleet.config.registration import (
    ALLOW_DISCOVERY,
    Network,
    RegistrationConfig,
    allow_networks,
    in_networks,
)
from radixfleet.config.runtime import check_event_binds, load_model_keyers
from radixfleet.config.server import AdminListenConfig, ListenConfig, ReloadConfig
from radixfleet.config.timeouts import RetriesConfig, TimeoutsConfig
from radixfleet.config.tracing import TracingConfig
from radixfleet.config.traffic_log import TrafficLogConfig
from radixfleet.config.workers import (
    WorkerSpec,
    default_worker_id,
    parse_worker_url,
    resolve_engine,
    selector_template,
)
from radixfleet.config.yaml_loader import MAX_YAML_NODES, load_config, load_yaml, read_document
from radixfleet.wire.errors import ConfigError

__all__ = [
    "ALLOW_DISCOVERY",
    "ENGINE_FIELDS",
    "MAX_YAML_NODES",
    "MISSING",
    "SERVICE_ACCOUNT_DIR",
    "TIER_MODES",
    "WORKER_KINDS",
    "ApiKeySpec",
    "AuthConfig",
    "AutoscaleConfig",
    "BreakerConfig",
    "BusAuthConfig",
    "BusConfig",
    "BusTlsConfig",
    "Config",
    "ConfigError",
    "DecisionsConfig",
    "DisaggConfig",
    "DiscoveryConfig",
    "DnsDiscoveryConfig",
    "DnsServiceSpec",
    "EngineScrapeSpec",
    "EngineSettings",
    "EventsSpec",
    "GatewayConfig",
    "HealthConfig",
    "IndexConfig",
    "K8sDiscoveryConfig",
    "K8sSelectorSpec",
    "KeysConfig",
    "LimitsConfig",
    "AdminListenConfig",
    "ListenConfig",
    "LoadConfig",
    "ModelName",
    "Network",
    "PolicyConfig",
    "PrefetchConfig",
    "RegistrationConfig",
    "ReloadConfig",
    "ResponseHeadersConfig",
    "RetriesConfig",
    "TenantConfig",
    "TimeoutsConfig",
    "TokenizersConfig",
    "TracingConfig",
    "TrafficLogConfig",
    "WarmupConfig",
    "WorkerSpec",
    "allow_networks",
    "build_policy_from",
    "bus_setting",
    "check_engine_fields",
    "check_event_binds",
    "check_event_sides",
    "check_events_endpoint",
    "check_tokenizer_source",
    "config_warnings",
    "configure",
    "default_worker_id",
    "in_networks",
    "load_config",
    "load_model_keyers",
    "load_yaml",
    "parse_config",
    "parse_section",
    "parse_worker_url",
    "read_document",
    "resolve_engine",
    "resolve_token",
    "run",
    "selector_template",
    "with_overrides",
]
