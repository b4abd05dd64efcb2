"""``registration:``: agents registering themselves (``POST
/internal/v1/register`` or the bus): rates, epoch churn, grace before an unhealthy
one is removed, and the hosts a registered URL may name (``allow_networks``).
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Annotated

from pydantic import Field

from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings, value_check

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
