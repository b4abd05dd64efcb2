"""What refuses a data-plane request before its body costs the event loop anything.

Parsing and keying a body is the costly part of a request on the router's one event
loop (about 0.5 s for an 8 MiB chat body of short messages: the JSON parse, then the
routing bytes and their block hashes), and everything else the router serves —
``/health``, other clients' requests — waits while it runs. So a request that will be
refused whatever its body is refused before that work, at the first point that knows:

    head       credentials (401) and the tenant's or API key's rate limits, a bucket
               that cannot give one request and one token (429 + x-ratelimit-*):
               ``DataPlane.screen_head``, before a body byte is read (radixfleet.server.front,
               radixfleet.server.app's aiohttp routes; radixfleet.route.tenancy ``Tenancy.over_limit``)
    raw body   the model named by a body that starts ``{"model": "<name>"`` when no
               routable worker serves it (404 listing the served models, or 503 +
               Retry-After): ``peek_model`` on the bytes, nothing parsed
    parsed     the model (and adapter) of any other body, before it is keyed:
               ``unserved``

``peek_model`` reads the first member only when the rest of the body cannot change
what the parse would find: ``"model"`` occurs once in the whole body (a second
``"model"`` key, which JSON leaves to the last one, sends it to the parse) and no
``lora_path``/``lora_adapter`` does (an adapter a worker lists may be served where
its base model is not: ``radixfleet.route.served``). A duplicate ``model`` key spelled with
escapes (``"\\u006dodel"``) is not looked for: such a body is refused by its first
one's name. The token limit of a body's own cost (prompt + ``max_tokens``) needs the
keyed prompt, so it stays in the route core (``radixfleet.route.core``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from radixfleet.keys import Endpoint, request_adapter, request_model
from radixfleet.wire.errors import MalformedRequest, RequestError

if TYPE_CHECKING:
    from radixfleet.fleet.pool import Pool

#: a body that opens with its model as a plain string (no escapes); the value's
#: first 256 bytes at most (a longer name is no model anyone serves: the parse decides)
_LEADING_MODEL = re.compile(rb'\A[ \t\r\n]*\{[ \t\r\n]*"model"[ \t\r\n]*:[ \t\r\n]*"([^"\\]{0,256})"')
_ADAPTER_FIELDS = (b"lora_path", b"lora_adapter")


def peek_model(raw: bytes | bytearray) -> str | None:
    """The model a body names, read from its first bytes without parsing it: the
    value of its first member when that is ``"model"`` (a string without escapes),
    ``"model"`` occurs nowhere else in it and no adapter field does (module
    docstring); else None (the parse decides). O(len(raw)) in C: three substring
    searches (about 15 ms for 8 MiB, against 0.5 s to parse and key it), nothing
    allocated for the body."""
    m = _LEADING_MODEL.match(raw)
    if m is None or raw.find(b'"model"', m.end()) >= 0:
        return None
    for field in _ADAPTER_FIELDS:  # unquoted: text that names one only costs the parse
        if field in raw:
            return None
    try:
        return m.group(1).decode("utf-8")
    except UnicodeDecodeError:
        return None  # the parse answers 400


def unserved(pool: Pool, model: str, adapter: str | None, now: float) -> RequestError | None:
    """The refusal of a request for (``model``, ``adapter``) that no routable worker
    may take (``radixfleet.route.served``: 404 or 503 + Retry-After), or None. The route core
    refuses the same requests the same way (``RouteCore.decide``'s views); this
    answers them before the body is keyed. O(routable workers)."""
    for w in pool.routable_workers(now):
        if w.serves(model, adapter):
            return None
    return pool.unavailable(model, adapter, now)


def check_raw(pool: Pool, raw: bytes | bytearray, now: float) -> None:
    """Raises the refusal of a body whose leading model (``peek_model``) no routable
    worker serves; returns when the bytes do not say (the parse decides)."""
    model = peek_model(raw)
    if model is not None:
        exc = unserved(pool, model, None, now)
        if exc is not None:
            raise exc


def check_parsed(pool: Pool, endpoint: Endpoint, body: Any, now: float) -> None:
    """Raises the refusal of a parsed body whose model no routable worker serves (or
    ``MalformedRequest`` for a body that is no object, or a model or adapter that is
    no string, as ``request_key`` would); returns when it may be keyed."""
    if not isinstance(body, dict):
        raise MalformedRequest(f"request body must be a JSON object, got {type(body).__name__}")
    exc = unserved(pool, request_model(body, endpoint), request_adapter(body), now)
    if exc is not None:
        raise exc
