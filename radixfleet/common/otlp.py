"""OTLP/protobuf encoding of ``radixfleet.common.tracing``'s span records, without the SDK.

``encode(resource, scope, traces)`` writes one ``ExportTraceServiceRequest``
(opentelemetry-proto ``collector/trace/v1``) for a batch of ended traces, straight
from the plain records a ``Trace`` keeps: no ``ReadableSpan`` and no protobuf message
objects are made. It is what an exported span costs the router's process; the SDK's
``encode_spans`` builds a message object per span, attribute and value.

Rules (``tests/service/test_otlp.py`` checks them against the SDK's own encoding,
parsed back with opentelemetry-proto):

- the wire format of OTLP 1.x: fields by number, lengths as varints, times fixed64;
  a span's kind as ``SpanKind``'s OTLP value (INTERNAL 1, SERVER 2, CLIENT 3), its
  status ERROR (2) with the error type as its message and as ``error.type``;
- attribute values: ``str``, ``bool``, ``int`` (64-bit, two's complement),
  ``float`` and a tuple or list of them (an array); any other value is written as
  its ``str``;
- what repeats is encoded once: a (key, value) pair of a string or a bool is kept
  (at most ``_CACHE_MAX`` pairs, then the cache starts again), a key's tag always.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

_CACHE_MAX = 4096
_pairs: dict[tuple[str, Any], bytes] = {}  # (key, str/bool value) -> its KeyValue field
_keys: dict[str, bytes] = {}  # key -> its KeyValue's key field, tagged and sized
_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack


def varint(n: int) -> bytes:
    """``n`` (0 <= n < 2**64) as a protobuf varint."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) numbered ``tag`` (< 16)."""
    return _SMALL[(tag << 3) | 2] + varint(len(payload)) + payload


def _key(key: str) -> bytes:
    k = _keys.get(key)
    if k is None:
        if len(_keys) >= _CACHE_MAX:
            _keys.clear()
        k = _keys[key] = _field(1, key.encode())
    return k


def _any(value: Any) -> bytes:
    """An ``AnyValue`` of ``value`` (module docstring)."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _double(value)
    if isinstance(value, tuple | list):  # ArrayValue{values: 1}
        return _field(5, b"".join(_field(1, _any(v)) for v in value))
    return _field(1, (value if isinstance(value, str) else str(value)).encode())


def key_value(key: str, value: Any) -> bytes:
    """One attribute as a tagged ``KeyValue`` field of the number 9 a span's
    attributes have (an event's and the resource's differ: ``_attributes``)."""
    return _attributes(9, ((key, value),))


def _attributes(tag: int, attrs: Iterable[tuple[str, Any]]) -> bytes:
    out = []
    head = _SMALL[(tag << 3) | 2]
    for key, value in attrs:
        cacheable = isinstance(value, str | bool)
        if cacheable:
            kv = _pairs.get((key, value))
            if kv is not None:
                out.append(head + kv)
                continue
        v = _any(value)
        body = _key(key) + b"\x12" + varint(len(v)) + v
        kv = varint(len(body)) + body
        if cacheable:
            if len(_pairs) >= _CACHE_MAX:
                _pairs.clear()
            _pairs[(key, value)] = kv
        out.append(head + kv)
    return b"".join(out)


#: SpanKind's OTLP values by the SDK's enum value (INTERNAL 0, SERVER 1, CLIENT 2,
#: PRODUCER 3, CONSUMER 4) -> the proto's (INTERNAL 1, ..., CONSUMER 5)
_KIND = [b"\x30" + _SMALL[i + 1] for i in range(5)]


def span(
    trace_id: bytes,
    span_id: int,
    parent_id: int | None,
    trace_state: str,
    name: str,
    kind: int,
    start_ns: int,
    end_ns: int,
    attrs: Mapping[str, Any],
    error: str | None,
    events: Iterable[tuple[str, int]] | None,
) -> bytes:
    """One ``Span`` message (its bytes, untagged). ``kind``: the SDK's
    ``SpanKind.value``; ``parent_id`` None for a root without a parent."""
    parts = [b"\x0a\x10", trace_id, b"\x12\x08", span_id.to_bytes(8, "big")]
    if trace_state:
        parts.append(_field(3, trace_state.encode()))
    if parent_id:
        parts.append(b"\x22\x08" + parent_id.to_bytes(8, "big"))
    parts.append(_field(5, name.encode()))
    parts.append(_KIND[kind])
    parts.append(b"\x39" + _fixed64(start_ns))
    parts.append(b"\x41" + _fixed64(max(start_ns, end_ns)))
    if error is not None:
        attrs = {**attrs, "error.type": error}
    if attrs:
        parts.append(_attributes(9, attrs.items()))
    if events:
        for ev_name, ts in events:
            parts.append(_field(11, b"\x09" + _fixed64(ts) + _field(2, ev_name.encode())))
    if error is not None:  # Status{message: 2, code: 3 = ERROR (2)}
        parts.append(_field(15, _field(2, error.encode()) + b"\x18\x02"))
    else:  # UNSET: an empty Status, as the SDK writes it
        parts.append(b"\x7a\x00")
    return b"".join(parts)


def resource(attrs: Mapping[str, Any]) -> bytes:
    """A ``Resource`` message of ``attrs``."""
    return _attributes(1, attrs.items())


def scope(name: str, version: str = "") -> bytes:
    """An ``InstrumentationScope`` message."""
    return _field(1, name.encode()) + (_field(2, version.encode()) if version else b"")


def request(resource_msg: bytes, scope_msg: bytes, spans: Iterable[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of ``spans`` (each ``span``'s bytes) under one
    resource and one scope."""
    scope_spans = _field(1, scope_msg) + b"".join(_field(2, s) for s in spans)
    resource_spans = _field(1, resource_msg) + _field(2, scope_spans)
    return _field(1, resource_spans)
