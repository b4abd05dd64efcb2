"""``BusConnection``: one NATS connection kept up, with a clean slate per connection.

    CONNECTING --connected, on_up() done--> UP --connection lost--> DOWN
        ^                                                            |
        '----------------- backoff (doubling, capped, jittered) -----'
    any state --aclose()--> CLOSED (terminal)

nats-py's own reconnection is off: after a loss the owner's ``on_up(nc, js)`` runs
again on a fresh connection (re-creating the stream if the server lost it, and the
subscriptions), so there is exactly one place where "the bus is usable" begins.
``on_down()`` runs at each loss; while DOWN the owner degrades (agents push
directly, routers count locally). Problems are counted per cause
(``radixfleet_bus_outages_total{cause}``) and logged once per cause until the bus
is UP again (``Problems``); a server that refuses our credentials (``auth``) or
whose TLS handshake fails (``tls``) is said so in one line, and retried like an
outage (a rotated secret or a fixed server heals it).

A publication or subscription the server's subject permissions refuse does not
drop the connection: the server answers ``-ERR 'Permissions Violation for Publish
to "<subject>"'`` (nats-py hands it to the error callback) and discards the
message, which ``publish()`` had already returned for. Each is counted in
``radixfleet_bus_permission_violations_total{op,kind}`` (``op``: publish,
subscribe, reply; ``kind``: the subject's, ``Subjects.kind``) and logged at ERROR,
once per op and kind a minute: a server config that lacks a subject this side
publishes (a router's ``limits``...) is one line naming it, not silence.

``BusCredentials``: how the link authenticates to the NATS server (one of user and
password, token, NKey seed file, ``.creds`` file) and its TLS (``tls://`` URL, CA,
client certificate). Secrets are read from environment variables or files when
the connection options are built (``connect_options``: a missing or empty secret,
an unreadable file, a CA or certificate that does not load is a ``ConfigError``
naming the setting, before anything connects), handed to nats-py, never logged or
shown. ``check`` is the static half (``check-config``): which settings go
together and that the files exist.

``check_exposure``: a bus on a non-loopback host without the agent token is
refused (bus messages are signed with it: ``radixfleet.wire.bus_wire.BusKey``), as the
HTTP agent API is.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import re
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge

from radixfleet.common.auth import is_loopback
from radixfleet.common.background import Backoff, Lifecycle
from radixfleet.wire.bus_wire import Subjects
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.extras import require

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

log = logging.getLogger("radixfleet.bus")


class BusState(enum.Enum):
    CONNECTING = "connecting"  # first attempt, or retrying after a loss
    UP = "up"  # connected and on_up() finished
    DOWN = "down"  # an attempt failed or the connection was lost; retrying
    CLOSED = "closed"  # aclose() called; terminal


@dataclass(frozen=True, slots=True)
class BusCredentials:
    """The NATS server's credentials and TLS settings (module docstring). Field names
    are the router's ``bus.auth.*`` keys and, with ``tls_``, ``bus.tls.*``; the
    agent's flags are ``--bus-`` and the name with dashes."""

    user: str = ""  # with a password
    password_env: str = ""  # env var holding the password
    password_file: str = ""  # or a file holding it
    token_env: str = ""  # env var holding the server's auth token
    token_file: str = ""
    nkey_seed_file: str = ""  # an NKey seed (SU...)
    creds_file: str = ""  # a .creds file (user JWT and NKey seed, `nsc generate creds`)
    tls_ca_file: str = ""  # PEM CA bundle that signed the server's certificate
    tls_cert_file: str = ""  # PEM client certificate (mutual TLS), with tls_key_file
    tls_key_file: str = ""

    def check(self, url: str, where: Callable[[str], str]) -> None:
        """The static rules: one method, settings that go together, files that exist.
        ``where(field)`` names a field in errors. Raises ``ConfigError``."""
        methods = [
            m
            for m, on in (
                ("user", bool(self.user or self.password_env or self.password_file)),
                ("token_env", bool(self.token_env or self.token_file)),
                ("nkey_seed_file", bool(self.nkey_seed_file)),
                ("creds_file", bool(self.creds_file)),
            )
            if on
        ]
        if len(methods) > 1:
            raise ConfigError(
                where(methods[1]),
                "one authentication method at a time: "
                f"{' and '.join(where(m) for m in methods)} are both set",
            )
        pairs = (("password_env", "password_file"), ("token_env", "token_file"))
        for a, b in pairs:
            if getattr(self, a) and getattr(self, b):
                raise ConfigError(where(b), f"give the secret once: {where(a)} or {where(b)}")
        if (self.password_env or self.password_file) and not self.user:
            raise ConfigError(where("user"), "required with a password")
        if self.user and not (self.password_env or self.password_file):
            raise ConfigError(
                where("password_env"),
                f"{where('user')} needs a password: {where('password_env')} or {where('password_file')}",
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError(
                where("tls_key_file" if self.tls_cert_file else "tls_cert_file"),
                "a client certificate needs its key, and the key its certificate",
            )
        tls = self.tls_ca_file or self.tls_cert_file
        if tls and urlsplit(url).scheme != "tls":
            raise ConfigError(
                where("tls_ca_file" if self.tls_ca_file else "tls_cert_file"),
                f"TLS settings need a tls:// URL, got {url!r}",
            )
        for f in fields(self):
            if f.name.endswith("_file") and getattr(self, f.name):
                path = getattr(self, f.name)
                if not os.path.isfile(path):
                    raise ConfigError(where(f.name), f"no such file: {path}")
                if not os.access(path, os.R_OK):
                    raise ConfigError(where(f.name), f"file not readable: {path}")

    def connect_options(self, url: str, where: Callable[[str], str]) -> dict[str, Any]:
        """nats-py ``connect`` keyword arguments, secrets read now. Raises
        ``ConfigError`` naming the setting (never showing a secret)."""
        self.check(url, where)
        opts: dict[str, Any] = {}
        if self.user:
            opts["user"] = self.user
            opts["password"] = _secret(
                self.password_env, self.password_file, where("password_env"), where("password_file")
            )
        if self.token_env or self.token_file:
            opts["token"] = _secret(self.token_env, self.token_file, where("token_env"), where("token_file"))
        if self.nkey_seed_file:
            _secret("", self.nkey_seed_file, "", where("nkey_seed_file"))  # readable, not empty
            opts["nkeys_seed"] = self.nkey_seed_file
        if self.creds_file:
            _secret("", self.creds_file, "", where("creds_file"))
            opts["user_credentials"] = self.creds_file
        if urlsplit(url).scheme == "tls":
            opts["tls"] = self._tls_context(where)
            opts["tls_hostname"] = urlsplit(url).hostname
        return opts

    def _tls_context(self, where: Callable[[str], str]) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca_file or None)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                where("tls_ca_file"), f"cannot load the CA bundle {self.tls_ca_file}: {exc}"
            ) from None
        if self.tls_cert_file:
            try:
                ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(
                    where("tls_cert_file"),
                    f"cannot load the client certificate {self.tls_cert_file} with its key: {exc}",
                ) from None
        return ctx


def _secret(env: str, path: str, env_key: str, file_key: str) -> str:
    """The secret in env var ``env`` or file ``path`` (trailing newline dropped)."""
    if env:
        value = os.environ.get(env, "")
        if not value:
            raise ConfigError(env_key, f"environment variable {env} is not set or empty")
        return value
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(file_key, f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not value:
        raise ConfigError(file_key, f"{path} is empty")
    return value


def check_exposure(url: str, agent_token: bytes | str, key: str) -> None:
    """Refuses an unsigned bus (no agent token) on a non-loopback NATS server: anyone
    who reaches it could register workers. Raises ``ConfigError`` at ``key``."""
    host = urlsplit(url).hostname or ""
    if not agent_token and not is_loopback(host):
        raise ConfigError(
            key,
            f"a bus on {host} (not loopback) needs the agent token, "
            "which signs every bus message: set $RADIXFLEET_AGENT_TOKEN "
            "(the same on routers and agents)",
        )


def failure_cause(exc: BaseException) -> str | None:
    """``auth`` or ``tls`` when ``exc`` says the server refused us or the TLS
    handshake failed (retrying the same will not help), else None."""
    # nats-py not imported yet: exc cannot be one of its errors (the bus is an extra)
    nats_errors = sys.modules.get("nats.errors")
    if (
        nats_errors is not None and isinstance(exc, nats_errors.AuthorizationError)
    ) or "authorization violation" in str(exc).lower():
        return "auth"
    if isinstance(exc, ssl.SSLError):
        return "tls"
    return None


#: the server's refusal, as nats-py reports it (lowercased): the operation, the subject
_VIOLATION = re.compile(r'permissions violation for (publish|subscription)( with reply of| to) "([^"]*)"')


def permission_violation(exc: BaseException) -> tuple[str, str] | None:
    """(op, subject) when ``exc`` is the server refusing a publication
    (``publish``), a reply subject (``reply``) or a subscription (``subscribe``)
    by its permissions; ("other", "") for a violation it does not spell out; else
    None."""
    text = str(exc).lower()
    if "permissions violation" not in text:
        return None
    m = _VIOLATION.search(text)
    if m is None:
        return "other", ""
    op = "subscribe" if m.group(1) == "subscription" else "reply" if "reply" in m.group(2) else "publish"
    return op, m.group(3)


class BusMetrics:
    """The bus's metrics, registered in its owner's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge("radixfleet_bus_up", "1 while the event bus connection is usable", registry=registry)
        self.outages = Counter(
            "radixfleet_bus_outages",
            "Bus problems by cause (the bus degrades to direct push and local counts)",
            ["cause"],
            registry=registry,
        )
        self.received = Counter(
            "radixfleet_bus_messages_received", "Bus messages applied, by kind", ["kind"], registry=registry
        )
        self.published = Counter(
            "radixfleet_bus_messages_published", "Bus messages sent, by kind", ["kind"], registry=registry
        )
        self.bad = Counter(
            "radixfleet_bus_bad_messages",
            "Malformed or foreign bus messages ignored, by cause",
            ["cause"],
            registry=registry,
        )
        self.violations = Counter(
            "radixfleet_bus_permission_violations",
            "Publications and subscriptions the NATS server refused by its subject permissions "
            "(the message is lost), by op and message kind",
            ["op", "kind"],
            registry=registry,
        )
        self.replicas = Gauge(
            "radixfleet_bus_replicas",
            "Other router replicas heard on the bus within replica_ttl_s",
            registry=registry,
        )
        self.lag = Gauge(
            "radixfleet_bus_catchup_remaining",
            "Stream messages still to apply before this replica has caught up (0 once ready)",
            registry=registry,
        )


class Problems:
    """Counts problems per cause; logs a cause (its word in brackets) when it first
    occurs, then at most once per ``every_s`` while it recurs, saying how many were
    not logged, until ``ok()``: a flood of bad messages is one line a minute."""

    __slots__ = ("counter", "_logged", "what", "every_s", "clock")

    def __init__(
        self, counter: Counter, what: str, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.counter = counter
        self.what = what
        self.every_s = every_s
        self.clock = clock
        #: cause -> [when it was last logged, reports not logged since]
        self._logged: dict[str, list[Any]] = {}

    def report(
        self,
        cause: str,
        message: str,
        *args: object,
        level: int = logging.WARNING,
        labels: tuple[str, ...] | None = None,
    ) -> None:
        """Counts one (``labels``: the counter's labels, default ``(cause,)``) and
        logs it unless ``cause`` was logged within ``every_s``."""
        self.counter.labels(*(labels or (cause,))).inc()
        now = self.clock()
        seen = self._logged.get(cause)
        if seen is not None and now - seen[0] < self.every_s:
            seen[1] += 1
            log.debug("%s: " + message + " [%s]", self.what, *args, cause)
            return
        more = f" ({seen[1]} more since the last line)" if seen is not None and seen[1] else ""
        self._logged[cause] = [now, 0]
        log.log(level, "%s: " + message + " [%s]%s", self.what, *args, cause, more)

    def ok(self) -> None:
        if self._logged:
            log.info("%s: bus usable again", self.what)
            self._logged.clear()


class BusConnection(Lifecycle):
    """Lifecycle: ``await start()`` (returns at once; connecting goes on in a task),
    ``await aclose()`` (idempotent); ``async with`` does both."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        metrics: BusMetrics,
        on_up: Callable[[NATS, object], Awaitable[None]],
        on_down: Callable[[], None] | None = None,
        connect_timeout_s: float = 1.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 5.0,
        options: dict[str, Any] | None = None,
        subjects: Subjects | None = None,
    ) -> None:
        #: nats-py's client class (the 'bus' extra: MissingExtra here, before any task)
        self._client: type[NATS] = require("nats.aio.client", "bus", "the bus").Client
        self.url = url
        #: BusCredentials.connect_options(): credentials and TLS (secrets: never logged)
        self._options = dict(options or {})
        self.name = name
        self.metrics = metrics
        self.problems = Problems(metrics.outages, f"bus {url}")
        #: the owner's subjects (message kinds of refused subjects; None: all "other")
        self.subjects = subjects
        #: refusals by the server's permissions, logged per op and kind (never cleared:
        #: a server config is not fixed by reconnecting)
        self.refused = Problems(metrics.violations, f"bus {url}")
        self.on_up = on_up
        self.on_down = on_down
        self.connect_timeout_s = connect_timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.state = BusState.CONNECTING
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        #: connection attempts finished (either way): readiness waits for the first
        self.attempts = 0
        self._lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: the last error nats-py reported through error_cb (it may say why a connect
        #: failed more precisely than what connect() raised)
        self._last_error: BaseException | None = None

    @property
    def up(self) -> bool:
        return self.state is BusState.UP

    async def start(self) -> None:
        if self._task is not None or self.state is BusState.CLOSED:
            raise RuntimeError("BusConnection.start() twice or after aclose()")
        self._task = asyncio.create_task(self._run(), name=f"radixfleet-bus-{self.name}")

    def report(self, cause: str, message: str, *args: object) -> None:
        """A problem the owner met while UP (a failed publish...): counted, logged
        once per cause."""
        self.problems.report(cause, message, *args)

    def lost(self, cause: str, message: str, *args: object) -> None:
        """The owner found the connection unusable: drop it and reconnect."""
        self.problems.report(cause, message, *args)
        self._lost.set()

    async def _run(self) -> None:
        backoff = Backoff(self.backoff_s, self.backoff_max_s)
        while True:
            self._lost.clear()
            nc = self._client()
            try:
                await nc.connect(
                    self.url,
                    name=self.name,
                    allow_reconnect=False,
                    # nats-py retries the first connect forever with 0; 1 = give up
                    # after a second try, our own backoff takes it from there
                    # nats-py annotates these int; it uses them as float seconds
                    connect_timeout=self.connect_timeout_s,  # type: ignore[arg-type]
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0.05,  # type: ignore[arg-type]
                    closed_cb=self._on_closed,
                    disconnected_cb=self._on_closed,
                    error_cb=self._on_error,
                    **self._options,
                )
                self.nc, self.js = nc, nc.jetstream(timeout=max(self.connect_timeout_s, 2.0))
                await self.on_up(nc, self.js)
            except asyncio.CancelledError:
                await self._close_nc(nc)
                raise
            except Exception as exc:  # noqa: BLE001 - every failure means "retry later"
                self.attempts += 1
                refused = failure_cause(exc) or failure_cause(self._last_error or exc)
                cause = refused or ("connect" if not nc.is_connected else "setup")
                if refused == "auth":
                    self.problems.report(
                        cause,
                        "the server refused this side's credentials "
                        "(%s); check bus.auth / the --bus-* flags; retrying "
                        "in %.1f s",
                        str(exc) or type(exc).__name__,
                        backoff.delay_s,
                        level=logging.ERROR,
                    )
                elif refused == "tls":
                    self.problems.report(
                        cause,
                        "TLS handshake failed (%s); check the CA, the "
                        "client certificate and the host name; retrying in "
                        "%.1f s",
                        exc,
                        backoff.delay_s,
                        level=logging.ERROR,
                    )
                else:
                    self.problems.report(
                        cause,
                        "%s failed (%s: %s); retrying in %.1f s",
                        cause,
                        type(exc).__name__,
                        exc,
                        backoff.delay_s,
                    )
                self._last_error = None
                await self._went_down(nc)
                await backoff.sleep()
                continue
            self.attempts += 1
            self.state = BusState.UP
            self.metrics.up.set(1)
            self.problems.ok()
            log.info("bus %s up (%s)", self.url, self.name)
            backoff.reset()
            await self._lost.wait()
            if not self.problems._logged:
                self.problems.report("lost", "connection lost; degrading until it is back")
            await self._went_down(nc)
            await backoff.sleep()

    async def _went_down(self, nc: NATS) -> None:
        was_up = self.state is BusState.UP
        self.state = BusState.DOWN
        self.metrics.up.set(0)
        self.nc = self.js = None
        await self._close_nc(nc)
        if was_up and self.on_down is not None:
            self.on_down()

    async def _close_nc(self, nc: NATS) -> None:
        if nc.is_closed:
            return
        try:
            await asyncio.wait_for(nc.close(), 1.0)
        except Exception:  # noqa: BLE001 - closing a broken connection may fail; moot
            pass

    async def _on_closed(self) -> None:
        self._lost.set()

    async def _on_error(self, exc: Exception) -> None:
        violation = permission_violation(exc)
        if violation is not None:
            self._refused(*violation)
            return
        self._last_error = exc
        log.debug("bus %s: client error %s: %s", self.url, type(exc).__name__, exc)

    def _refused(self, op: str, subject: str) -> None:
        kind = self.subjects.kind(subject) if self.subjects is not None and subject else "other"
        self.refused.report(
            f"{op} {kind}",
            "the server's permissions refused to let this side (%s) %s %s (%s messages, lost): "
            "allow it in the server's authorization block (deploy/bus/nats-server.conf)",
            self.name,
            op,
            repr(subject) if subject else "a subject",
            kind,
            level=logging.ERROR,
            labels=(op, kind),
        )

    async def aclose(self) -> None:
        if self.state is BusState.CLOSED:
            return
        self.state = BusState.CLOSED
        self.metrics.up.set(0)
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass
        nc, self.nc, self.js = self.nc, None, None
        if nc is not None:
            await self._close_nc(nc)
