"""``auth:``: the environment variables holding the admin, agent and metrics
bearer tokens (``resolve_token``). A reload that unsets one is a security
downgrade (``radixfleet.config.reload``).
"""

from __future__ import annotations

import os

from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings


@settings
class AuthConfig:
    """``auth:``: the variables the bearer tokens are read from (``resolve_token``).
    A router listening off loopback needs the admin and agent tokens
    (``radixfleet.server.auth.check_exposure``); ``/metrics`` without its token answers loopback
    peers only."""

    admin_token_env: str = _opt("RADIXFLEET_ADMIN_TOKEN", "env var with the admin bearer token")
    agent_token_env: str = _opt("RADIXFLEET_AGENT_TOKEN", "env var with the agent bearer token")
    metrics_token_env: str = _opt(
        "RADIXFLEET_METRICS_TOKEN",
        "env var with the bearer token of GET /metrics (the admin token works too); unset: "
        "loopback peers only",
    )


def resolve_token(env_name: str) -> str:
    """The bearer token an env var holds ("" when unset or empty)."""
    return os.environ.get(env_name, "") if env_name else ""
