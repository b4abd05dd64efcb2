"""Bounds on every identifier a client, an agent or a config file can name.

Each value here ends up somewhere that must stay small: a worker id is a metric
label on every scrape and a path segment of ``DELETE /admin/workers/{id}``; a
request id is a header sent to the worker (whose own limit is ~8 KB per header);
model names are listed in 404 messages and ``/v1/models``. Unbounded, one 100 KB
``worker_id`` made ``/metrics`` 310 KB per scrape and the worker impossible to
delete (the DELETE's request line was refused with 431).

    what                    limit                           refused as
    worker id               1..128 chars of [A-Za-z0-9._:@+=[]-],
                            starting with a letter or digit  400 / config error
    agent epoch             1..128 chars, same alphabet      400
    model / adapter name    1..256 chars, no control chars   400
    models per worker       64                               400
    worker URL              2,048 chars; no user:password@; its host
                            not link-local (169.254/16, fe80::/10: cloud
                            metadata), wildcard (0.0.0.0, ::), multicast or
                            broadcast; numeric IPv4 forms normalised
                            (0x7f.1, 2130706433 -> 127.0.0.1)   400 / config error
    tenant (header source)  256 UTF-8 bytes                  400
    x-request-id            1..128 chars of [A-Za-z0-9._:@+=-]   replaced by the router's own

``problem(...)`` functions return ``None`` for an acceptable value or a message
naming what is wrong; each caller raises its own error type (``ConfigError`` with
a field path, ``MalformedRequest`` with a param).
"""

from __future__ import annotations

import ipaddress
import re
import socket

MAX_ID_CHARS = 128
MAX_NAME_CHARS = 256
MAX_MODELS = 64
MAX_URL_CHARS = 2048
MAX_TENANT_BYTES = 256
MAX_REQUEST_ID_CHARS = 128

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=\[\]-]*")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: what inet_aton reads as an IPv4 address: dotted parts in decimal, octal or hex
_NUMERIC_V4 = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}", re.I)


def _show(value: str) -> str:
    return repr(value[:40]) + ("..." if len(value) > 40 else "")


def id_problem(value: object, what: str = "worker id") -> str | None:
    """Why ``value`` is not an acceptable worker id (or agent epoch), or None."""
    if not isinstance(value, str) or not value:
        return f"{what} must be a non-empty string"
    if len(value) > MAX_ID_CHARS:
        return f"{what} has {len(value)} characters; at most {MAX_ID_CHARS}"
    if not _ID.fullmatch(value):
        return (
            f"{what} {_show(value)} must start with a letter or digit and use only "
            "letters, digits and . _ : @ + = [ ] -"
        )
    return None


def name_problem(value: object, what: str = "model name") -> str | None:
    """Why ``value`` is not an acceptable model or adapter name, or None."""
    if not isinstance(value, str) or not value:
        return f"{what} must be a non-empty string"
    if len(value) > MAX_NAME_CHARS:
        return f"{what} has {len(value)} characters; at most {MAX_NAME_CHARS}"
    if _CONTROL.search(value):
        return f"{what} {_show(value)} contains control characters"
    return None


def models_problem(value: object, what: str = "models") -> str | None:
    """Why ``value`` is not an acceptable list of served model names, or None."""
    if not isinstance(value, list):
        return f"'{what}' must be a list of strings"
    if len(value) > MAX_MODELS:
        return f"'{what}' lists {len(value)} models; at most {MAX_MODELS}"
    for i, m in enumerate(value):
        p = name_problem(m, f"{what}[{i}]")
        if p:
            return p
    return None


def tenant_problem(value: str) -> str | None:
    """Why a tenant name taken from a trusted header is not acceptable, or None."""
    n = len(value.encode("utf-8", "surrogateescape"))
    if n > MAX_TENANT_BYTES:
        return f"the tenant header has {n} bytes; at most {MAX_TENANT_BYTES}"
    return None


def request_id(value: str | None) -> str | None:
    """A client's ``x-request-id`` if it is safe to pass on (<= 128 characters of
    [A-Za-z0-9._:@+=-]), else None: the router then uses its own."""
    if value and len(value) <= MAX_REQUEST_ID_CHARS and _REQUEST_ID.fullmatch(value):
        return value
    return None


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` (a URL's or endpoint's host: brackets and a zone allowed) as an IP
    address, an IPv4-mapped IPv6 address as its IPv4 one; None for a name."""
    h = host.strip("[]").split("%", 1)[0]
    try:
        a = ipaddress.ip_address(h)
    except ValueError:
        return None
    if a.version == 6 and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def worker_host(host: str) -> tuple[str, str | None]:
    """A worker URL's host, canonical, and why it is refused (or None).

    A host that only *looks* like a name but is an IPv4 number in another notation
    (``0x7f.1``, ``2130706433``, ``0177.0.0.1``: what ``inet_aton`` and so every HTTP
    client accepts) is rewritten as a dotted quad, so that one worker cannot hide
    under several URLs and the address checks below see what a connection would
    reach. Refused: link-local addresses (169.254.0.0/16 holds the cloud metadata
    service; fe80::/10), the unspecified address (``0.0.0.0``, ``::``: a listening
    wildcard, reachable from nowhere else), multicast and broadcast. Names are kept
    as written (lower case); they are not resolved here.
    """
    h = host.lower()
    addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    if ":" in h:
        try:
            addr = ipaddress.IPv6Address(h.split("%", 1)[0])
        except ValueError:
            return h, f"invalid IPv6 address {_show(host)}"
        if addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
    elif _NUMERIC_V4.fullmatch(h):
        try:
            addr = ipaddress.IPv4Address(socket.inet_aton(h))
        except OSError:
            return h, f"invalid IPv4 address {_show(host)}"
    if addr is None:
        return h, None
    canon = str(addr) if addr.version == 4 else f"[{addr}]"
    if addr.is_link_local:
        return canon, (
            f"worker host {canon} is link-local (169.254.0.0/16, fe80::/10: "
            "the cloud metadata service lives there); use the worker's "
            "routable address"
        )
    if addr.is_unspecified:
        return canon, (
            f"worker host {canon} is a listening wildcard, not an address "
            "anyone can reach; use the worker's routable address (an agent: "
            "--advertise-url)"
        )
    if addr.is_multicast or (addr.version == 4 and addr == ipaddress.IPv4Address("255.255.255.255")):
        return canon, f"worker host {canon} is a multicast or broadcast address"
    return canon, None
