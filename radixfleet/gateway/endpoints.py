"""Workers as the data plane names them: ``ip:port`` endpoints, both ways.

The endpoint-picker protocol names upstreams by address (``10.0.0.5:8000``,
``[fd00::5]:8000``), the pool by worker id and URL. ``Endpoints`` keeps the mapping:
a worker whose URL's host is an IP literal maps at once; a host name is resolved
(``refresh``, off the request path) and mapped from then on. A worker with no
address yet cannot be picked through the gateway (it is not eligible) and is logged
once.

Invariants: ``by_worker`` and ``by_endpoint`` are inverse maps (one endpoint per
worker, one worker per endpoint; a second worker resolving to a taken endpoint is
left out and logged); only ``refresh`` and ``endpoint`` change them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from radixfleet.gateway.protocol import endpoint_of, ip_literal

log = logging.getLogger("radixfleet.gateway.envoy")


class Endpoints:
    """worker id <-> ``ip:port`` (module docstring). One event loop owns it."""

    __slots__ = ("by_worker", "by_endpoint", "_urls", "_names", "_warned")

    def __init__(self) -> None:
        self.by_worker: dict[str, str] = {}
        self.by_endpoint: dict[str, str] = {}
        self._urls: dict[str, str] = {}  # worker id -> the URL its endpoint is of
        self._names: dict[tuple[str, int], str] = {}  # (host name, port) -> resolved endpoint
        self._warned: set[str] = set()

    def endpoint(self, wid: str, url: str) -> str | None:
        """``wid``'s endpoint (mapped now if its URL's host is an IP literal), or None."""
        if self._urls.get(wid) == url:
            return self.by_worker.get(wid)
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        ip = ip_literal(host)
        ep = endpoint_of(ip, port) if ip is not None else self._names.get((host, port))
        if ep is None:
            return None
        self._map(wid, url, ep)
        return self.by_worker.get(wid)

    def worker(self, endpoint: str) -> str | None:
        """The worker id an endpoint names, or None."""
        return self.by_endpoint.get(endpoint)

    def _map(self, wid: str, url: str, ep: str) -> None:
        old = self.by_worker.pop(wid, None)
        if old is not None and self.by_endpoint.get(old) == wid:
            del self.by_endpoint[old]
        holder = self.by_endpoint.get(ep)
        if holder is not None and holder != wid:
            if wid not in self._warned:
                self._warned.add(wid)
                log.warning(
                    "worker %s (%s) has the address %s of worker %s: not pickable", wid, url, ep, holder
                )
            self._urls[wid] = url
            return
        self.by_worker[wid] = ep
        self.by_endpoint[ep] = wid
        self._urls[wid] = url

    async def refresh(self, workers: Iterable[tuple[str, str]]) -> bool:
        """Maps ``(worker id, url)`` pairs, resolving host names; forgets workers no
        longer listed. Returns whether the endpoint set changed."""
        before = set(self.by_endpoint)
        listed = dict(workers)
        for wid in [w for w in self.by_worker if w not in listed]:
            ep = self.by_worker.pop(wid)
            if self.by_endpoint.get(ep) == wid:
                del self.by_endpoint[ep]
        for wid in [w for w in self._urls if w not in listed]:
            del self._urls[wid]
        loop = asyncio.get_running_loop()
        for wid, url in listed.items():
            if self.endpoint(wid, url) is not None:
                continue
            parts = urlsplit(url)
            host, port = parts.hostname or "", parts.port or 80
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                if wid not in self._warned:
                    self._warned.add(wid)
                    log.warning("worker %s: %s does not resolve (%s): not pickable yet", wid, host, exc)
                continue
            addr = str(infos[0][4][0])
            self._names[(host, port)] = endpoint_of(addr, port)
            self.endpoint(wid, url)
        return set(self.by_endpoint) != before

    def check(self) -> None:
        for wid, ep in self.by_worker.items():
            assert self.by_endpoint.get(ep) == wid, f"{wid=} {ep=} {self.by_endpoint.get(ep)=}"
        assert len(self.by_worker) == len(self.by_endpoint), (self.by_worker, self.by_endpoint)
