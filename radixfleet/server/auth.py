"""Identities: the admin and agent APIs' exposure rule, who may read ``/metrics``,
tenants for the data plane (bearer tokens themselves: ``radixfleet.common.auth``).

The tenant selects the prefix-key namespace (radixfleet.keys; its salt is a
secret per deployment, radixfleet.common.tenancy), so it must come from an authenticated
identity — an API key the YAML maps to a tenant, or a header only when the config
says a trusted gateway sets it — never from the request body, so no client can
claim another tenant's namespace and probe its cache by timing.

Secrets are compared in constant time: bearer tokens with ``hmac.compare_digest``;
API keys by looking up the SHA-256 digest of the presented key (the lookup's
timing depends on the digest, which reveals nothing about stored keys).

Admin and agent APIs without a token are open on a loopback address (local
development) and refused on any other address (``check_exposure``): the admin API
on the admin listener's (``admin.host``), the agent API on the data port's.

``GET /metrics`` names workers (``host:port`` ids), tenants and the fleet's load: not
a client's business. ``check_metrics`` lets in the metrics token
(``auth.metrics_token_env``) or the admin token; without a metrics token set, also
any peer on a loopback address (the quick start, a sidecar, ``kubectl
port-forward``); everyone else gets 401. A router whose admin listener is off loopback
without a metrics token says so at start (``metrics_exposure``).
"""

from __future__ import annotations

import hashlib
import os

from radixfleet.common.auth import BearerAuth, is_loopback
from radixfleet.common.tenancy import TenantSalts
from radixfleet.config import Config, TenantConfig
from radixfleet.wire.errors import ConfigError, MalformedRequest, RequestError, Unauthorized
from radixfleet.wire.identifiers import tenant_problem


def check_exposure(cfg: Config, admin: BearerAuth, agent: BearerAuth) -> None:
    """Refuses a tokenless API on a non-loopback address: the admin API on the admin
    listener's (``admin.host``), the agent API on the data port's (``listen.host``)."""
    for a, key, host in (
        (admin, "auth.admin_token_env", cfg.admin.host),
        (agent, "auth.agent_token_env", cfg.listen.host),
    ):
        if not a.token and not is_loopback(host):
            raise ConfigError(
                key,
                f"listening on {host} (not loopback) needs the {a.what} "
                f"token: set ${a.env} (or listen on 127.0.0.1)",
            )


def check_metrics(metrics: BearerAuth, admin: BearerAuth, header: str | None, peer: str | None) -> None:
    """Raises ``Unauthorized`` unless ``GET /metrics`` may be answered to a request
    with Authorization ``header`` from ``peer`` (its IP address; None: unknown):
    the metrics or the admin token presented, or — no metrics token set — a loopback
    peer (module docstring)."""
    if metrics.accepts(header) or admin.accepts(header):
        return
    if not metrics.token and peer is not None and is_loopback(peer):
        return
    raise _metrics_refusal(metrics, header)


def _metrics_refusal(metrics: BearerAuth, header: str | None) -> RequestError:
    if metrics.token:
        if header and header.startswith("Bearer "):
            return Unauthorized(f"invalid {metrics.what} token")
        return Unauthorized("GET /metrics requires 'Authorization: Bearer <token>' (the metrics token)")
    return Unauthorized(
        f"GET /metrics answers loopback peers only until ${metrics.env} is set on the router; "
        "then present it as 'Authorization: Bearer <token>'"
    )


def metrics_exposure(cfg: Config, metrics: BearerAuth) -> str | None:
    """A warning for a router whose ``/metrics`` no remote scraper can read (the admin
    listener off loopback, no metrics token), or None."""
    if metrics.token or is_loopback(cfg.admin.host):
        return None
    return (
        f"admin listener on {cfg.admin.host} without ${metrics.env}: GET /metrics answers only "
        "loopback peers and the admin token; set it and give it to the scraper (a bearer token)"
    )


class TenantResolver:
    """Maps a request's headers to its tenant. Raises ``Unauthorized`` (api_key source
    with ``require_key``) when no valid key is presented.

    ``namespace(headers)`` is what the data plane keys with: the tenant's secret salt
    from ``salts`` (radixfleet.common.tenancy), or — without ``salts``, for tools that key like
    the simulator — the tenant name itself."""

    __slots__ = ("source", "default", "header", "require", "_digests", "salts")

    def __init__(
        self, t: TenantConfig, path: str = "keys.tenant", *, salts: TenantSalts | None = None
    ) -> None:
        self.salts = salts
        self.source = t.source
        self.default = t.default
        self.header = t.header.lower()  # exchanges use lower-case names
        self.require = t.require_key
        #: SHA-256 of a key -> (its tenant, its name: tenancy.keys)
        self._digests: dict[bytes, tuple[str, str]] = {}
        for i, spec in enumerate(t.api_keys):
            key = spec.key
            if spec.key_env:
                key = os.environ.get(spec.key_env, "")
                if not key:
                    raise ConfigError(
                        f"{path}.api_keys[{i}].key_env", f"environment variable {spec.key_env} is not set"
                    )
            self._digests[hashlib.sha256(key.encode()).digest()] = (spec.tenant, spec.name)

    def tenant(self, headers) -> str:
        """``headers``: a mapping with lower-case names (or case-insensitive)."""
        return self.identify(headers)[0]

    def identify(self, headers) -> tuple[str, str]:
        """(tenant, the name of the API key presented: "" when none or unnamed)."""
        src = self.source
        if src == "none":
            return self.default, ""
        if src == "header":
            name = headers.get(self.header)
            if not name:
                return self.default, ""
            problem = tenant_problem(name)
            if problem:
                raise MalformedRequest(problem)
            return name, ""
        auth = headers.get("authorization")
        key = None
        if auth and auth.startswith("Bearer "):
            key = auth[7:].strip()
        else:
            key = headers.get("x-api-key")
        if key:
            t = self._digests.get(hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest())
            if t is not None:
                return t
            if self.require:
                raise Unauthorized("invalid API key")
        elif self.require:
            raise Unauthorized("an API key is required ('Authorization: Bearer <key>')")
        return self.default, ""

    def anonymous(self, tenant: str) -> bool:
        """Whether ``tenant`` holds clients no credential tells apart: the default
        tenant where requests without an identity fall (every request with source
        ``none``; one without the header with ``header``; one without a valid key
        where keys are optional). Its clients share one cache without having been
        put together by the configuration, so answers to one must not reveal what
        another sent (radixfleet.server.prefetch)."""
        return tenant == self.default and not (self.source == "api_key" and self.require)

    def namespace(self, headers) -> str:
        """The request's key namespace salt (see the class docstring)."""
        return self.namespace_of(self.identify(headers)[0])

    def namespace_of(self, tenant: str) -> str:
        """Tenant ``tenant``'s key namespace salt."""
        return tenant if self.salts is None else self.salts.salt(tenant)

    def forward_lines(self, namespace: str) -> bytes:
        """Header lines (CRLF-terminated) that forward ``namespace`` to a worker."""
        if self.salts is None:
            return b"x-radixfleet-tenant: " + namespace.encode("utf-8", "surrogateescape") + b"\r\n"
        return self.salts.header_lines(namespace)

    def forward_headers(self, namespace: str) -> dict[str, str]:
        """``forward_lines`` as a header dict (warm-ups)."""
        if self.salts is None:
            return {"x-radixfleet-tenant": namespace}
        return self.salts.headers(namespace)
