"""Hot reload of the router's YAML: what changed on disk, and the new pieces built
from it before anything running is touched.

``Router.reload`` (router.app) calls ``prepare``: the whole file is validated and
every object that depends on it (tokens, tenant salts, the policy, the tokenizers
of ``models:``) built first, so
an invalid file raises ``ConfigError`` and leaves the running router as it was;
only then does the router swap them in. ``config_file_version`` is what the watcher
compares between polls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from protocol.errors import ConfigError
from router.auth import TenantResolver, check_exposure
from router.config import (
    Config,
    PolicyConfig,
    build_policy_from,
    load_config,
    load_model_keyers,
    with_overrides,
)
from service.auth import BearerAuth
from service.tenancy import TenantSalts


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
    return Prepared(cfg, admin, agent, tenants, policy, load_model_keyers(cfg, keyers))


def check_shared_keys(cfg: Config, salts: TenantSalts) -> None:
    """Refuses a bus without a deployment-wide salt secret. Replicas on a bus share
    hints, counts and the agents' caches only if every replica keys a prompt alike;
    with each process's own random secret (no ``$RADIXFLEET_TENANT_SALT``, no agent
    token) they key it differently, the agents hold one copy per replica and every
    replica routes blind to the others' sessions (service.tenancy)."""
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
    its pieces (``build``). Raises ``ConfigError`` for anything invalid, having changed
    nothing. Blocks for seconds (tokenizers): the router calls it off its loop."""
    return build(
        with_overrides(load_config(path), **overrides),
        salts=salts,
        policy_cfg=policy_cfg,
        policy=policy,
        keyers=keyers,
    )
