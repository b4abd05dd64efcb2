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
    worker URL              2,048 chars                      400 / config error
    tenant (header source)  256 UTF-8 bytes                  400
    x-request-id            1..128 chars of [A-Za-z0-9._:@+=-]   replaced by the router's own

``problem(...)`` functions return ``None`` for an acceptable value or a message
naming what is wrong; each caller raises its own error type (``ConfigError`` with
a field path, ``MalformedRequest`` with a param).
"""

from __future__ import annotations

import re

MAX_ID_CHARS = 128
MAX_NAME_CHARS = 256
MAX_MODELS = 64
MAX_URL_CHARS = 2048
MAX_TENANT_BYTES = 256
MAX_REQUEST_ID_CHARS = 128

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=\[\]-]*")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _show(value: str) -> str:
    return repr(value[:40]) + ("..." if len(value) > 40 else "")


def id_problem(value: object, what: str = "worker id") -> str | None:
    """Why ``value`` is not an acceptable worker id (or agent epoch), or None."""
    if not isinstance(value, str) or not value:
        return f"{what} must be a non-empty string"
    if len(value) > MAX_ID_CHARS:
        return f"{what} has {len(value)} characters; at most {MAX_ID_CHARS}"
    if not _ID.fullmatch(value):
        return (f"{what} {_show(value)} must start with a letter or digit and use only "
                "letters, digits and . _ : @ + = [ ] -")
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
