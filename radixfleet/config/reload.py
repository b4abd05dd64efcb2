"""Hot reload of the router's YAML: what changed on disk, and the new pieces built
from it before anything running is touched.

``Router.reload`` (radixfleet.server.app) calls ``prepare``: the whole file is validated and
every object that depends on it (tokens, tenant salts, the policy, the tokenizers
of ``models:``) built first, so
an invalid file raises ``ConfigError`` and leaves the running router as it was;
only then does the router swap them in. ``ConfigWatch`` says when the watcher
reloads (a file unchanged across two polls: ``config_file_version``).

A reload never lowers security silently:

- a file that holds no settings (empty, blank, comments only, ``null``, ``{}``) is
  never applied (``EmptyConfigFile``): it is what every writer that truncates first
  (``cat >``, ``envsubst >``, ``open(path, "w")``, most editors) leaves for a moment,
  and applied it would be every default — no API keys, no tenants, no rate limits;
- a file that turns client authentication off or weakens it, opens the admin or
  agent API, drops a tenant's or API key's rules (class and rate limits) while it can
  still send requests, drops a rate limit, or drops the ``limits`` section to looser
  defaults (``security_downgrades``) is refused (``SecurityDowngrade``) unless the
  operator asks for it for this one reload (``POST /admin/reload`` with
  ``{"allow_security_downgrade": true}``); the router logs it at ERROR either way.
  Starting the router with such a file is not a reload: it applies.

Each refusal has a ``reason`` (``failure_reason``): the label of
``radixfleet_config_reload_failures_total``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixfleet.common.auth import BearerAuth
from radixfleet.common.tenancy import TenantSalts
from radixfleet.config import (
    Config,
    LimitsConfig,
    PolicyConfig,
    build_policy_from,
    load_model_keyers,
    parse_config,
    read_document,
    with_overrides,
)
from radixfleet.server.auth import TenantResolver, check_exposure
from radixfleet.wire.errors import ConfigError


def config_file_version(path: str) -> tuple[int, int, int, int] | None:
    """What the reload watcher compares: (device, inode, mtime ns, size) of the file
    ``path`` resolves to, or None if it cannot be read. ``os.stat`` follows the
    ConfigMap volume's symlinks (``router.yaml -> ..data/router.yaml``, ``..data ->
    ..<timestamp>``), so the kubelet's atomic swap shows as a new inode even when
    the new file's mtime equals the old one's (coarse timestamps, copies that keep
    mtimes)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class ConfigWatch:
    """When the reload watcher reloads the file at ``path``: at a poll that finds its
    version (``config_file_version``) equal to the previous poll's and different from
    the one last loaded. A file being written (truncated, then written in pieces)
    differs from poll to poll and waits until it has stood still for one interval;
    the kubelet's atomic swap applies one poll after it is seen. A missing file is
    never due. ``loaded`` is set by ``loading`` only, which every reload calls
    (watcher, SIGHUP, ``/admin/reload``) before it reads the file."""

    __slots__ = ("path", "loaded", "_seen")

    def __init__(self, path: str) -> None:
        self.path = path
        #: the version the last reload read (at start: the file the router started with)
        self.loaded = config_file_version(path)
        #: the version the previous poll found
        self._seen = self.loaded

    def loading(self) -> None:
        """A reload is about to read the file: its version now is the one loaded."""
        self.loaded = self._seen = config_file_version(self.path)

    def due(self) -> bool:
        """One poll: True when the file should be reloaded now."""
        v = config_file_version(self.path)
        stable = v == self._seen
        self._seen = v
        return stable and v is not None and v != self.loaded


class EmptyConfigFile(ConfigError):
    """A reloaded file holds no settings: never applied (what a writer that truncates
    first leaves for a moment)."""

    reason = "empty"


class SecurityDowngrade(ConfigError):
    """A reloaded file lowers security and the reload did not ask for it.
    ``downgrades``: each one, naming its field (``security_downgrades``)."""

    reason = "downgrade"

    def __init__(self, downgrades: Sequence[str]) -> None:
        super().__init__(
            "",
            "the new file lowers security: "
            + "; ".join(downgrades)
            + '. Refused: to apply it, POST /admin/reload with {"allow_security_downgrade": true} '
            "(admin token), or restart the router with it",
        )
        self.downgrades = tuple(downgrades)


#: every ``reason`` a refused reload is counted under (``failure_reason``)
FAILURE_REASONS = ("invalid", "empty", "downgrade")


def failure_reason(exc: ConfigError) -> str:
    """The metric label of a refused reload: empty, downgrade, or invalid (any other
    ``ConfigError``)."""
    return getattr(exc, "reason", "invalid")


#: ``limits`` fields where a larger value lets a client hold more (bytes, requests,
#: connections, seconds)
_LIMIT_CAPS = (
    "max_body_bytes",
    "max_response_bytes",
    "max_concurrency",
    "max_queue",
    "queue_timeout_s",
    "header_timeout_s",
    "body_timeout_s",
    "max_buffered_body_bytes",
    "max_connections",
)
#: ``keys.tenant.source`` from weakest to strongest client identity
_SOURCE_RANK = {"none": 0, "header": 1, "api_key": 2}
#: the rate limits of a ``tenancy`` rule (0: none)
_RATE_FIELDS = ("requests_per_s", "tokens_per_min")


def security_downgrades(
    old: Config,
    new: Config,
    old_auth: Sequence[BearerAuth] = (),
    new_auth: Sequence[BearerAuth] = (),
) -> list[str]:
    """What going from the running ``old`` to ``new`` lowers, one line each naming
    its field; empty when nothing is (an upgrade or a neutral change). ``old_auth``
    and ``new_auth``: the (admin, agent, metrics) tokens each config resolves to.

    Counted: ``keys.tenant.source`` to a weaker one (api_key > header > none);
    ``require_key`` turned off; the admin or agent API opened (its token unset), or
    ``/metrics`` opened to loopback peers (the metrics token unset); a
    ``tenancy.tenants`` or ``tenancy.keys`` entry removed unless its tenant or key is
    revoked too (no required API key identifies it any more); a rule's
    ``requests_per_s`` or ``tokens_per_min`` dropped to none; the ``limits`` section
    gone (every field at its default) where a default is looser than the running
    value. Not counted: a limit raised, keys added,
    rotated or revoked."""
    out: list[str] = []
    ot, nt = old.keys.tenant, new.keys.tenant
    if _SOURCE_RANK[nt.source] < _SOURCE_RANK[ot.source]:
        what = {
            "none": "every request is served as one tenant, no API key asked",
            "header": "the tenant is whatever the request's header claims",
        }[nt.source]
        out.append(f"keys.tenant.source: {ot.source} -> {nt.source} ({what})")
    elif ot.source == nt.source == "api_key" and ot.require_key and not nt.require_key:
        out.append("keys.tenant.require_key: true -> false (requests without a valid API key are served)")
    for o, n in zip(old_auth, new_auth):
        if o.token and not n.token:
            who = "to loopback peers" if n.what == "metrics" else ""
            out.append(
                f"auth.{n.what}_token_env: the {n.what} API opens{' ' + who if who else ''} "
                f"(${n.env} is unset or empty)"
            )
    for section in ("tenants", "keys"):
        before, after = getattr(old.tenancy, section), getattr(new.tenancy, section)
        gone = sorted(name for name in before if name not in after and not _revoked(new, section, name))
        if gone:
            out.append(f"tenancy.{section}: {', '.join(gone)} removed (their class and rate limits)")
        for name in sorted(before.keys() & after.keys()):
            for f in _RATE_FIELDS:
                was, now = getattr(before[name], f), getattr(after[name], f)
                if was and not now:
                    out.append(f"tenancy.{section}.{name}.{f}: {was:g} -> none")
    defaults = LimitsConfig()
    if new.limits == defaults != old.limits:
        looser = [
            f"{f} {getattr(old.limits, f)} -> {getattr(defaults, f)}"
            for f in _LIMIT_CAPS
            if getattr(defaults, f) > getattr(old.limits, f)
        ]
        if looser:
            out.append(f"limits: the section is gone, back to looser defaults ({', '.join(looser)})")
    return out


def _revoked(cfg: Config, section: str, name: str) -> bool:
    """Whether ``cfg`` refuses every request of tenant (``section`` "tenants") or API
    key name ("keys") ``name``: only API keys identify (required), and none has that
    tenant or name. A tenant or key that is not revoked still sends, unlimited or as
    someone else, once its rules are gone."""
    t = cfg.keys.tenant
    if t.source != "api_key" or not t.require_key:
        return False
    field = "tenant" if section == "tenants" else "name"
    return all(getattr(k, field) != name for k in t.api_keys)


def check_downgrade(old: Config, old_auth: Sequence[BearerAuth], new: Prepared, *, allow: bool) -> list[str]:
    """The downgrades of applying ``new`` over the running ``old``
    (``security_downgrades``). Raises ``SecurityDowngrade`` when there are some and
    ``allow`` is False; returns them (for the router to log) when it is True."""
    found = security_downgrades(old, new.cfg, old_auth, (new.admin_auth, new.agent_auth, new.metrics_auth))
    if found and not allow:
        raise SecurityDowngrade(found)
    return found


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated config and what is built from it, not yet applied."""

    cfg: Config
    admin_auth: BearerAuth
    agent_auth: BearerAuth
    #: resolves tenants with ``tenants.salts`` (the running salts when their keys
    #: did not change, so their caches survive)
    tenants: TenantResolver
    #: the running policy object when the policy section did not change (its state —
    #: hot roots, rates — survives), else a new one
    policy: Any
    #: the tokenizers of ``models:``, loaded: {(tokenizer, chat_template): TokenKeyer}
    #: (the running ones reused)
    keyers: dict
    #: the bearer token of ``GET /metrics`` (radixfleet.server.auth ``check_metrics``)
    metrics_auth: BearerAuth


def build(
    cfg: Config,
    *,
    salts: TenantSalts | None = None,
    policy_cfg: PolicyConfig | None = None,
    policy: Any = None,
    keyers: dict | None = None,
) -> Prepared:
    """What the router builds from ``cfg``: tokens (``check_exposure`` refuses tokenless
    APIs off loopback), tenant salts and resolver (``check_shared_keys``: replicas on a
    bus key alike), the policy, the ``models:`` tokenizers (a second or two each).
    ``salts``, ``policy`` (built from ``policy_cfg``) and ``keyers`` are reused when
    ``cfg`` did not change them. Raises ``ConfigError``, having changed nothing."""
    admin = BearerAuth(cfg.auth.admin_token_env, "admin")
    agent = BearerAuth(cfg.auth.agent_token_env, "agent")
    check_exposure(cfg, admin, agent)
    fresh = TenantSalts.from_env(cfg.keys.tenant_salt_env, agent.token)
    check_shared_keys(cfg, fresh)
    if salts is not None and fresh.same_keys(salts):
        fresh = salts  # keep its caches
    tenants = TenantResolver(cfg.keys.tenant, salts=fresh)
    if policy is None or cfg.policy != policy_cfg:
        policy = build_policy_from(cfg.policy)
    metrics = BearerAuth(cfg.auth.metrics_token_env, "metrics")
    return Prepared(cfg, admin, agent, tenants, policy, load_model_keyers(cfg, keyers), metrics)


def check_shared_keys(cfg: Config, salts: TenantSalts) -> None:
    """Refuses a bus without a deployment-wide salt secret. Replicas on a bus share
    hints, counts and the agents' caches only if every replica keys a prompt alike;
    with each process's own random secret (no ``$RADIXFLEET_TENANT_SALT``, no agent
    token) they key it differently, the agents hold one copy per replica and every
    replica routes blind to the others' sessions (radixfleet.common.tenancy)."""
    if cfg.bus.enabled() and not salts.shared:
        env = cfg.keys.tenant_salt_env
        salt = (
            f"${env} to one secret on every replica"
            if env
            else "keys.tenant_salt_env to a variable holding one secret on every replica"
        )
        raise ConfigError(
            "bus.url",
            f"router replicas on a bus must key prompts alike: set "
            f"{salt}, or the agent token (${cfg.auth.agent_token_env})",
        )


def prepare(
    path: str,
    overrides: dict[str, Any],
    *,
    salts: TenantSalts | None,
    policy_cfg: PolicyConfig,
    policy: Any,
    keyers: dict | None = None,
) -> Prepared:
    """Loads ``path`` with ``overrides`` (command-line options keep winning) and builds
    its pieces (``build``). Raises ``EmptyConfigFile`` for a file that holds no
    settings, ``ConfigError`` for anything invalid, having changed nothing. Blocks
    for seconds (tokenizers): the router calls it off its loop."""
    raw, dups = read_document(path)
    if not raw:
        raise EmptyConfigFile(
            "",
            f"{path} holds no settings: a reload never applies an empty file (what a "
            "writer that truncates first leaves for a moment: it would turn every setting, "
            "API keys and limits included, back to its default)",
        )
    return build(
        with_overrides(parse_config(raw, path, errors=dups), **overrides),
        salts=salts,
        policy_cfg=policy_cfg,
        policy=policy,
        keyers=keyers,
    )
