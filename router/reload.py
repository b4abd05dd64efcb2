"""Hot reload of the router's YAML: what changed on disk, and the new pieces built
from it before anything running is touched.

``Router.reload`` (router.app) calls ``prepare``: the whole file is validated and
every object that depends on it (tokens, tenant salts, the policy) built first, so
an invalid file raises ``ConfigError`` and leaves the running router as it was;
only then does the router swap them in. ``config_file_version`` is what the watcher
compares between polls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from router.auth import TenantResolver, check_exposure
from router.config import Config, PolicyConfig, build_policy_from, load_config, with_overrides
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


def prepare(path: str, overrides: dict[str, Any], *, salts: TenantSalts,
            policy_cfg: PolicyConfig, policy: Any) -> Prepared:
    """Loads ``path`` with ``overrides`` (command-line options keep winning) and builds
    its pieces. Raises ``ConfigError`` for anything invalid, having changed nothing."""
    new = with_overrides(load_config(path), **overrides)
    admin = BearerAuth(new.auth.admin_token_env, "admin")
    agent = BearerAuth(new.auth.agent_token_env, "agent")
    check_exposure(new, admin, agent)
    fresh = TenantSalts.from_env(new.keys.tenant_salt_env, agent.token)
    if fresh.same_keys(salts):
        fresh = salts  # keep its caches
    tenants = TenantResolver(new.keys.tenant, salts=fresh)
    if new.policy != policy_cfg:
        policy = build_policy_from(new.policy)
    return Prepared(new, admin, agent, tenants, policy)
