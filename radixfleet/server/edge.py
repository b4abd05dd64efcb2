"""What crosses the client edge of the data plane: the fields a client may not set
and an answer may not carry back.

The prefill/decode legs and data-parallel ranks are the router's (``radixfleet.route.pd``,
``EngineLink.pick_rank``): a client must neither steer them nor read them, since
their values name engines, hosts and ports (the fleet's layout, which
``response_headers.worker_id`` off keeps internal). So::

    request body   a non-null ROUTER_FIELDS value -> 400 naming the field
                   (``check_request``, once per request, before it is keyed)
    request head   never forwarded: a worker gets only the router's own header
                   lines (Host, Content-Type, Content-Length, x-radixfleet-tenant
                   and its signature, x-request-id, x-data-parallel-rank; see
                   ``Attempts._attempt``), so a client's X-data-parallel-rank or
                   x-radixfleet-* header never reaches one
    answer body    ROUTER_FIELDS dropped from a non-streamed JSON answer
                   (``scrub_answer``) and from every stream event
                   (``radixfleet.server.sse.StreamWatch``)
    answer head    only Content-Type, and the router's own headers, reach a client

``priority`` is the router's too, but a client's value is not an error: the worker
gets the request's class in its engine's own meaning, or no ``priority`` at all
(``radixfleet.engines.manager.Engines.forward_body``).

Refused rather than stripped: a client that sends ``kv_transfer_params`` expects a
disaggregated leg it would not get; a 400 says so instead of answering something
else. A null value means "not set" to vLLM and SGLang alike and is let through
(clients that serialize every field of an engine's request model send them).
"""

from __future__ import annotations

import json
from typing import Any

from radixfleet.wire.errors import MalformedRequest

#: body fields that steer or report the P/D legs and data-parallel ranks: vLLM's
#: ``kv_transfer_params``; SGLang's bootstrap fields, decode TP size, prefill and
#: data-parallel ranks
ROUTER_FIELDS = (
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
    "data_parallel_rank",
)
#: what marks bytes that may hold one (each field is a JSON key)
_MARKS = tuple(f'"{f}"'.encode() for f in ROUTER_FIELDS)
_FIELDS = frozenset(ROUTER_FIELDS)


def check_request(body: Any) -> None:
    """Raises ``MalformedRequest`` (400, ``param`` the field) when a client's body
    sets one of ``ROUTER_FIELDS`` to anything but null. O(len(ROUTER_FIELDS))."""
    if not isinstance(body, dict):
        return  # refused by the keying, which names what is wrong
    if body.keys().isdisjoint(_FIELDS):
        return  # one set test: the usual body names none
    for f in ROUTER_FIELDS:
        if body.get(f) is not None:
            raise MalformedRequest(
                f"'{f}' is set by the router, which runs the prefill/decode legs and picks "
                "data-parallel ranks itself; send the request without it",
                param=f,
            )


def carries(data: bytes | bytearray) -> bool:
    """Whether ``data`` may hold one of ``ROUTER_FIELDS`` (a byte scan: a False is
    certain, a True is checked by parsing)."""
    return any(m in data for m in _MARKS)


def scrub(obj: Any) -> bool:
    """Drops ``ROUTER_FIELDS`` from a parsed answer object's top level; whether any
    was there."""
    if not isinstance(obj, dict):
        return False
    found = False
    for f in ROUTER_FIELDS:
        if f in obj:
            del obj[f]
            found = True
    return found


def scrub_answer(data: bytes | bytearray) -> bytes | bytearray:
    """A non-streamed JSON answer without ``ROUTER_FIELDS`` at its top level (vLLM
    reports ``kv_transfer_params`` there); the bytes unchanged when it holds none
    (one byte scan) or is not JSON."""
    if not carries(data):
        return data
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if not scrub(obj):
        return data
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
