"""Who may register a worker, and which addresses a registration may aim the router at.

A registered worker URL is where the router sends client traffic, so naming one is
naming where the router connects: the router's own port made every request recurse
into itself until its admission slots were gone, and any other address it can reach
was an open relay. The rule (deploy/README, "Security: who may register a worker")::

    who                 agent token set: whoever presents it (``radixfleet.server.http_api``)
                        no agent token: a loopback peer on a loopback listener only
                        (the local fleet of ``radixfleet up``), else 403
                        agent_token_required (the agent API's events too)
    the URL's host      resolved (an IP literal as written; a name within
                        RESOLVE_TIMEOUT_S), then:
      - one of its addresses at a listening port of this router (the address
        listened on, or any address of this host under a wildcard listener):
        400 worker_url_is_router
      - with ``registration.allow``: every address inside one of its networks, or
        the host one that ``workers.discovery`` found; a name that does not
        resolve is not inside: else 403 worker_host_not_allowed
      - without it: any host with the agent token; without the token, loopback
        addresses only (403 worker_host_not_allowed)

Both the agent API (``radixfleet.server.agent_api``) and the bus (``radixfleet.bus.replica``) ask
``RegistrationGuard.check_url`` before ``Pool.register``; the pool itself bounds how
fast new workers and new epochs of one worker arrive. Every refusal is counted in
``radixfleet_registrations_refused_total{reason}`` and logged: one line per refusal,
at most one per reason per second (the skipped ones counted into the next line), so
a flood of refusals cannot flood the log.

What registration cannot see (a NAT or load balancer in front of the router, a name
re-pointed after it was checked, two routers registered at each other) the hop mark
catches on the request path (``radixfleet.server.hops``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from radixfleet.config import RegistrationConfig, allow_networks, in_networks
from radixfleet.fleet.pool import Pool, Source
from radixfleet.server.intake import Throttled
from radixfleet.wire.errors import Forbidden, MalformedRequest
from radixfleet.wire.identifiers import ip_of

log = logging.getLogger("radixfleet.registration")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

#: a worker host name resolves within this, or counts as not resolving
RESOLVE_TIMEOUT_S = 2.0

#: refusal reasons (the metric's label values and the answers' codes)
AGENT_TOKEN_REQUIRED = "agent_token_required"
WORKER_URL_IS_ROUTER = "worker_url_is_router"
WORKER_HOST_NOT_ALLOWED = "worker_host_not_allowed"


def _loopback(host: str) -> bool:
    a = ip_of(host)
    return a.is_loopback if a is not None else host == "localhost"


def is_local(a: Address) -> bool:
    """Whether ``a`` is an address of this host: loopback, or one a socket can bind."""
    if a.is_loopback:
        return True
    family = socket.AF_INET if a.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(a), 0))
    except OSError:
        return False
    return True


class UrlIsRouter(MalformedRequest):
    """A registered URL that leads to the router itself (400)."""

    code = WORKER_URL_IS_ROUTER


class RegistrationGuard:
    """The registration rule of the module docstring, for one router.

    State: the addresses the router listens on (``listening``, told by
    ``radixfleet.server.app.RouterServer`` once it listens; an embedded app's are learned from
    the connections registrations arrive on) and one log throttle per refusal
    reason. The config is read per call (a reload may change ``registration``)."""

    __slots__ = ("pool", "metrics", "resolver", "_listeners", "_logs")

    def __init__(self, pool: Pool, metrics, resolver=None) -> None:
        self.pool = pool  # the hosts discovery found
        self.metrics = metrics  # radixfleet.server.metrics.Metrics
        #: ``await resolver(host, port)`` -> address strings (OSError: none)
        self.resolver = resolver or getaddrinfo
        #: (address listened on, port): the router's own listeners
        self._listeners: set[tuple[Address, int]] = set()
        self._logs: dict[str, Throttled] = {}

    def listening(self, socknames: Iterable[tuple]) -> None:
        """The router listens on ``socknames`` (``socket.getsockname()`` tuples)."""
        for s in socknames:
            a = ip_of(str(s[0]))
            if a is not None:
                self._listeners.add((a, int(s[1])))

    def refused(self, reason: str, msg: str, *args) -> None:
        """Counts and logs one refusal (throttled per reason: module docstring)."""
        self.metrics.registrations_refused.labels(reason=reason).inc()
        t = self._logs.get(reason)
        if t is None:
            t = self._logs[reason] = Throttled(1.0, log)
        t.warning(msg, *args)

    def check_peer(self, tokenless: bool, peer: str | None, local: tuple | None, what: str) -> None:
        """Raises ``Forbidden`` when the agent API has no token and the request is
        not from a loopback peer to a loopback listener. ``what``: the path, logged."""
        if not tokenless:
            return
        on = str(local[0]) if local else ""
        if _loopback(peer or "") and _loopback(on):
            return
        self.refused(
            AGENT_TOKEN_REQUIRED,
            "refused %s from %s to %s: this router has no agent token (its agent API answers loopback only)",
            what,
            peer,
            on,
        )
        raise Forbidden(
            "this router has no agent token: its agent API answers only loopback peers "
            "on a loopback address; set the agent token (auth.agent_token_env) on the "
            "router and the agents",
            code=AGENT_TOKEN_REQUIRED,
        )

    async def check_url(
        self, wid: str, url: str, cfg: RegistrationConfig, *, tokenless: bool, local: tuple | None = None
    ) -> None:
        """Raises ``MalformedRequest`` (400) for a canonical worker ``url``
        (``radixfleet.config.parse_worker_url``) that reaches this router, ``Forbidden``
        (403) for one outside what may be registered (module docstring). ``local``:
        the sockname the registration arrived on (one of the router's listeners)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or 80
        addrs, resolved = await self._resolve(host, port)
        if local:
            self.listening((local,))
        for a in addrs:
            if self._reaches_router(a, port):
                self.refused(
                    WORKER_URL_IS_ROUTER,
                    "refused registration: %s at %s: %s:%d is this router's own listener",
                    wid,
                    url,
                    a,
                    port,
                )
                raise UrlIsRouter(
                    f"worker URL {url} leads to this router itself ({a} port {port}); "
                    "register the worker's own address",
                    param="url",
                )
        problem = self._host_problem(host, addrs, resolved, cfg, tokenless)
        if problem:
            self.refused(WORKER_HOST_NOT_ALLOWED, "refused registration: %s at %s: %s", wid, url, problem)
            raise Forbidden(f"worker URL {url}: {problem}", code=WORKER_HOST_NOT_ALLOWED, param="url")

    def _host_problem(
        self, host: str, addrs: list[Address], resolved: bool, cfg: RegistrationConfig, tokenless: bool
    ) -> str | None:
        """Why ``host`` (resolved to ``addrs``) may not be registered, or None."""
        if cfg.allow:
            nets, discovery = allow_networks(cfg.allow)
            if discovery and self._discovered(host, addrs):
                return None
            if not resolved:
                return f"host {host} does not resolve, so it is not inside registration.allow"
            outside = [a for a in addrs if not in_networks(a, nets)]
            if not outside:
                return None
            return f"address {outside[0]} is not inside registration.allow ({', '.join(cfg.allow)})"
        if tokenless:
            if not resolved:
                return f"host {host} does not resolve (without the agent token only loopback hosts register)"
            if not all(a.is_loopback for a in addrs):
                return (
                    "without the agent token only loopback workers register; set the "
                    "agent token, or registration.allow"
                )
        return None

    def _discovered(self, host: str, addrs: list[Address]) -> bool:
        """Whether ``host`` (or one of ``addrs``) is a host ``workers.discovery`` found."""
        found = {urlsplit(w.url).hostname for w in self.pool if w.source is Source.DISCOVERY}
        if host in found:
            return True
        ips = {ip_of(h) for h in found if h}
        return bool(addrs) and all(a in ips for a in addrs)

    def _reaches_router(self, a: Address, port: int) -> bool:
        for la, lport in self._listeners:
            if lport != port:
                continue
            if a == la:
                return True
            # a wildcard listener takes every address of this host (an IPv6 one
            # the IPv4 ones too: dual stack)
            if la.is_unspecified and (la.version == 6 or a.version == 4) and is_local(a):
                return True
        return False

    async def _resolve(self, host: str, port: int) -> tuple[list[Address], bool]:
        """(the addresses ``host`` names, whether it resolved)."""
        a = ip_of(host)
        if a is not None:
            return [a], True
        try:
            names = await asyncio.wait_for(self.resolver(host, port), RESOLVE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, UnicodeError):
            return [], False
        out: list[Address] = []
        for n in names:
            b = ip_of(n)
            if b is not None and b not in out:
                out.append(b)
        return out, bool(out)


async def getaddrinfo(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (the system resolver, off the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(i[4][0]) for i in infos]
