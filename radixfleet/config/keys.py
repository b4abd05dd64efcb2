"""``keys:``: the routing block size and where a request's tenant comes from (none,
an API key, a trusted gateway's header), and the tenant salt's secret.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from radixfleet.keys import BYTES_PER_TOKEN, DEFAULT_BLOCK_BYTES
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import section as _section
from radixfleet.wire.settings import setting as _opt


@settings
class ApiKeySpec:
    """One API key: exactly one of ``key``, ``key_env``, and a tenant."""

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
    """``keys.tenant``: where a request's tenant comes from. ``source: api_key``
    needs a key; ``source: header`` needs a header name."""

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
    """``keys:``: routing blocks (a multiple of ``BYTES_PER_TOKEN`` bytes) and tenants."""

    block_bytes: int = _opt(DEFAULT_BLOCK_BYTES, "routing block size in bytes", lo=BYTES_PER_TOKEN)
    tenant: TenantConfig = _section(TenantConfig, "tenant identity")
    tenant_salt_env: str = _opt(
        "RADIXFLEET_TENANT_SALT",
        "env var with the deployment's secret tenant salt (the "
        "same on every replica); unset: derived from the agent token (radixfleet.common.tenancy)",
    )

    @document_check
    def _check(self) -> None:
        if self.block_bytes % BYTES_PER_TOKEN:
            raise ConfigError(
                "block_bytes", f"expected a multiple of {BYTES_PER_TOKEN}, got {self.block_bytes}"
            )
