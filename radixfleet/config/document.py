"""The whole document (``Config``: every section, ``workers`` and ``models``) and
its parsing (``parse_config``): the rules across sections (tenancy's key names,
tokenizers for events, roles that make a fleet), ``workers: {static, discovery}``
folded in, every error of a document reported in one ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, field_validator

from radixfleet.config.auth import AuthConfig
from radixfleet.config.autoscale import AutoscaleConfig
from radixfleet.config.bus import BusConfig
from radixfleet.config.decisions import DecisionsConfig, ResponseHeadersConfig
from radixfleet.config.disagg import DisaggConfig
from radixfleet.config.discovery import DiscoveryConfig
from radixfleet.config.engines import EngineSettings, TokenizersConfig
from radixfleet.config.gateway import GatewayConfig
from radixfleet.config.health import BreakerConfig, HealthConfig, LoadConfig
from radixfleet.config.index import IndexConfig
from radixfleet.config.keys import KeysConfig
from radixfleet.config.limits import LimitsConfig
from radixfleet.config.policy import PolicyConfig
from radixfleet.config.prefetch import PrefetchConfig, WarmupConfig
from radixfleet.config.registration import RegistrationConfig
from radixfleet.config.server import AdminListenConfig, ListenConfig, ReloadConfig
from radixfleet.config.timeouts import RetriesConfig, TimeoutsConfig
from radixfleet.config.tracing import TracingConfig
from radixfleet.config.traffic_log import TrafficLogConfig
from radixfleet.config.workers import WorkerSpec, unique_workers
from radixfleet.route.tenancy import TenancyConfig, check_key_names
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.identifiers import name_problem
from radixfleet.wire.settings import (
    document_check,
    internal,
    join,
    keys_of,
    raise_all,
    settings,
    validate,
    value_check,
)
from radixfleet.wire.settings import section as _section


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
    workers: Annotated[tuple[WorkerSpec, ...], value_check(unique_workers)] = Field(
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


def parse_section(cls: type, raw: Any, path: str) -> Any:
    """Validates one mapping against section ``cls``'s types and bounds, without the
    document's rules across fields (the admin API reuses it for ``POST
    /admin/workers``). Raises ``ConfigError`` naming ``path.key``."""
    return validate(cls, raw, path, checks=False)


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
        check_tokenizers(dataclasses.replace(cfg, discovery=discovery), found)
        _check_roles(cfg, discovery, "workers.static" if isinstance(sections, Mapping) else "workers", found)
    raise_all(found)
    assert cfg is not None, "cfg is None only after an error, which raise_all raised"
    return dataclasses.replace(cfg, path=path, discovery=discovery)


def _check_roles(cfg: Config, discovery: DiscoveryConfig, static: str, found: list[ConfigError]) -> None:
    """Per served model (a worker's or selector's ``model``; "" for those that learn
    it from /v1/models), the roles must make a fleet: prefill workers need a decode
    worker and the other way round (``radixfleet.policies.disagg.validate_roles``). The error
    names the first prefill or decode entry of the model."""
    from radixfleet.policies.disagg import BOTH, validate_roles

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


def check_tokenizers(cfg: Config, found: list[ConfigError]) -> None:
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
