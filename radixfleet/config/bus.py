"""``bus:``: the NATS JetStream bus router replicas and agents share (read at
start): stream limits, reconnects, what is shared (hints, counts, rate limits),
credentials (at most one method) and TLS.
"""

from __future__ import annotations

from typing import Literal

from radixfleet.common.bus_connection import BusCredentials
from radixfleet.wire import bus_wire
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import section as _section
from radixfleet.wire.settings import setting as _opt


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
    """``bus:``: the shared bus (read at start). Invariants: ``backoff_s <=
    backoff_max_s``, ``heartbeat_s < replica_ttl_s``; names are NATS tokens; with a
    ``url``, at most one authentication method (``credentials``)."""

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
