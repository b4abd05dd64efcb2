"""Tenant namespaces that nobody outside the deployment can compute.

A request's prefix keys are seeded by its namespace (``prefix_keys.namespace_seed``:
model, tenant salt, adapter). Were the salt the tenant's *name* (not a secret),
anyone could hash a guessed prompt for tenant ``acme`` and look for that hash
wherever the router shows one; with a secret salt the hashes of one tenant's
prompts are unguessable to everyone else, including other tenants::

    salt(tenant) = hex(HMAC-SHA256(secret, "radixfleet-tenant\\0" + tenant))[:32]

``secret`` is per deployment: ``$RADIXFLEET_TENANT_SALT`` (``keys.tenant_salt_env``)
when set; else derived from the agent token (every router replica and agent of a
deployment shares it, so replicas agree on keys without another setting); else —
a tokenless development setup — random per process, with a warning, because then
replicas (and a restarted router) disagree on keys and lose cache affinity.
``shared`` says which: a router on a bus refuses the random one (``radixfleet.config.reload``),
since replicas that key alike are what the bus is for — with per-process secrets
every replica hashes the same prompt differently, the agents cache it once per
replica, and four replicas in round robin hit about 0.4x of one router's rate.

The router forwards the salt, never the name, to workers (``x-radixfleet-tenant``)
with a proof it set it (``x-radixfleet-tenant-sig: hex(HMAC-SHA256(agent token,
"radixfleet-tenant-sig\\0" + salt))[:32]``): an agent keys its cache by the salt it
is given, so it must not take one from a client that reaches it directly
(``verify_signature``; ``radixfleet_tools.agent.server`` refuses unsigned ones).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

from radixfleet.wire.bus_wire import session_key

log = logging.getLogger("radixfleet.tenancy")

TENANT_HEADER = "x-radixfleet-tenant"
SIGNATURE_HEADER = "x-radixfleet-tenant-sig"
DEFAULT_SALT_ENV = "RADIXFLEET_TENANT_SALT"

_SALT_TAG = b"radixfleet-tenant\x00"
_SIG_TAG = b"radixfleet-tenant-sig\x00"
_DERIVE_TAG = b"radixfleet-tenant-secret\x00"
_MAX_CACHED = 10_000  # tenants remembered (header-sourced names are unbounded)

_process_secret: bytes | None = None


def _random_secret() -> bytes:
    """One random secret per process, so reloads keep the same keys."""
    global _process_secret
    if _process_secret is None:
        _process_secret = os.urandom(32)
        log.warning(
            "no tenant salt secret: set $%s (the same value on every router "
            "replica) or an agent token; using a random one, so this process's "
            "prefix keys match no other replica's and change on restart",
            DEFAULT_SALT_ENV,
        )
    return _process_secret


def signature(sign_key: bytes, salt: str) -> str:
    """The router's proof that it set ``salt`` (see module docstring)."""
    return hmac.new(sign_key, _SIG_TAG + salt.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[
        :32
    ]


def verify_signature(sign_key: bytes, salt: str, sig: str | None) -> bool:
    """True when ``sig`` is the router's signature of ``salt``; constant time."""
    if not sig:
        return False
    return hmac.compare_digest(signature(sign_key, salt).encode(), sig.encode("utf-8", "surrogateescape"))


class TenantSalts:
    """Tenant name -> namespace salt, and the header lines that forward it.

    ``secret`` makes the salts; ``sign_key`` (the agent token, b"" if none) signs
    them for the workers. Both are fixed for the object's life; the router builds
    a new one on reload only if they changed. Salts and header lines are cached
    per tenant (at most 10,000, then the cache starts over).
    """

    __slots__ = ("_secret", "_sign_key", "_salts", "_lines", "shared")

    def __init__(self, secret: bytes, sign_key: bytes = b"", shared: bool = True) -> None:
        self._secret = secret
        self._sign_key = sign_key
        #: the secret is the deployment's (env or agent token), not this process's own
        self.shared = shared
        self._salts: dict[str, str] = {}
        self._lines: dict[str, bytes] = {}

    @classmethod
    def from_env(cls, salt_env: str, agent_token: bytes) -> TenantSalts:
        """The deployment's salts: ``$salt_env``, else derived from the agent token,
        else a random per-process secret (see module docstring)."""
        value = os.environ.get(salt_env, "") if salt_env else ""
        if value:
            return cls(value.encode("utf-8", "surrogateescape"), agent_token)
        if agent_token:
            return cls(hmac.new(agent_token, _DERIVE_TAG, hashlib.sha256).digest(), agent_token)
        return cls(_random_secret(), agent_token, shared=False)

    def same_keys(self, other: TenantSalts) -> bool:
        return self._secret == other._secret and self._sign_key == other._sign_key

    def salt(self, tenant: str) -> str:
        """The namespace salt of ``tenant``. O(1) once cached."""
        s = self._salts.get(tenant)
        if s is None:
            if len(self._salts) >= _MAX_CACHED:
                self._salts.clear()
                self._lines.clear()
            s = self._salts[tenant] = hmac.new(
                self._secret, _SALT_TAG + tenant.encode("utf-8", "surrogateescape"), hashlib.sha256
            ).hexdigest()[:32]
        return s

    def session_key(self, session: str) -> str:
        """A client's session id as the router keys it on a bus: a digest under the
        deployment's secret (``radixfleet.wire.bus_wire.session_key``), alike on every
        replica and never the end user's identifier."""
        return session_key(self._secret, session)

    def headers(self, salt: str) -> dict[str, str]:
        """The headers that forward ``salt`` to a worker (warm-ups)."""
        out = {TENANT_HEADER: salt}
        if self._sign_key:
            out[SIGNATURE_HEADER] = signature(self._sign_key, salt)
        return out

    def header_lines(self, salt: str) -> bytes:
        """``headers(salt)`` as raw header lines, each ending in CRLF (the data
        plane's upstream requests)."""
        b = self._lines.get(salt)
        if b is None:
            b = b"".join(f"{k}: {v}\r\n".encode("ascii") for k, v in self.headers(salt).items())
            if len(self._lines) < _MAX_CACHED:
                self._lines[salt] = b
        return b
