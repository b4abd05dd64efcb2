"""DNS discovery: the A and AAAA records of headless Services, re-resolved every
``interval_s``.

A headless Service (``clusterIP: None``) answers its name with one record per
ready pod, so the record set *is* the worker set. Resolution uses dnspython's
asyncio resolver: pure Python (nothing to compile into the image), reads
``/etc/resolv.conf`` with its search list and ``ndots`` as a pod's libc does, falls
back to TCP for answers too large for UDP (thousands of records), and can be
pointed at one resolver ``host:port``.

NXDOMAIN and NODATA are answers (no workers of that type); a timeout, SERVFAIL or
a malformed answer is not: ``SourceError`` is raised and the manager keeps the set
last seen. A worker's id is ``ip:port`` (as for a static worker), its URL
``http://ip:port``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncGenerator

from radixfleet.config import DnsDiscoveryConfig, DnsServiceSpec, selector_template
from radixfleet.fleet.discovery.base import DiscoveryMetrics, Endpoint, Problems, SourceError, url_for

log = logging.getLogger("radixfleet.discovery")


def _resolver(cfg: DnsDiscoveryConfig):
    import dns.asyncresolver

    if not cfg.nameserver:
        r = dns.asyncresolver.Resolver()
    else:
        host, port = _host_port(cfg.nameserver)
        r = dns.asyncresolver.Resolver(configure=False)
        r.nameservers = [host]
        r.port = port
    r.timeout = cfg.timeout_s
    r.lifetime = cfg.timeout_s
    r.cache = None  # re-resolution must ask, not remember
    return r


def _host_port(s: str) -> tuple[str, int]:
    """``1.2.3.4``, ``1.2.3.4:5353``, ``::1`` or ``[::1]:5353``."""
    if s.startswith("["):
        host, _, port = s[1:].partition("]:")
        return host, int(port or 53)
    if s.count(":") == 1:
        host, port = s.split(":")
        return host, int(port)
    return s, 53


class DnsSource:
    """Workers from the A/AAAA records of ``cfg.services``."""

    name = "dns"

    def __init__(self, cfg: DnsDiscoveryConfig, metrics: DiscoveryMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.problems = Problems(self.name, metrics)

    async def snapshots(self) -> AsyncGenerator[frozenset[Endpoint], None]:
        try:
            r = _resolver(self.cfg)
        except (ValueError, OSError) as exc:
            raise SourceError("config", f"resolver setup failed: {exc}") from None
        last: frozenset[Endpoint] | None = None
        while True:
            found = await asyncio.gather(*(self._service(r, s) for s in self.cfg.services))
            snap = frozenset(ep for eps in found for ep in eps)
            if snap != last:
                last = snap
                yield snap
            await asyncio.sleep(self.cfg.interval_s)

    async def _service(self, r, spec: DnsServiceSpec) -> list[Endpoint]:
        a, aaaa = await asyncio.gather(self._records(r, spec.name, "A"), self._records(r, spec.name, "AAAA"))
        out = []
        template = selector_template(spec)
        for ip in (*a, *aaaa):
            url = url_for(ip, spec.port)
            out.append(Endpoint(url.removeprefix("http://"), url, spec.kind, template))
        return out

    async def _records(self, r, name: str, rdtype: str) -> list[str]:
        import dns.exception
        import dns.resolver

        try:
            answer = await r.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []  # an answer: no workers (yet)
        except dns.resolver.LifetimeTimeout:
            raise SourceError(
                "timeout", f"{name} {rdtype}: no answer within {self.cfg.timeout_s:g}s"
            ) from None
        except dns.resolver.NoNameservers as exc:
            raise SourceError("servfail", f"{name} {rdtype}: {exc}") from None
        except dns.exception.DNSException as exc:
            raise SourceError("garbage", f"{name} {rdtype}: {exc!r}") from None
        out = []
        for rr in answer:
            try:
                out.append(str(ipaddress.ip_address(rr.address)))
            except (AttributeError, ValueError):
                self.problems.report("invalid_object", "%s %s: record %r skipped", name, rdtype, rr)
        return out
