"""JSON from the wire: the one parse every router and agent endpoint uses.

``loads(raw)`` accepts exactly RFC 8259 JSON in UTF-8 and turns everything else
into ``MalformedRequest`` (a 400 naming what is wrong), never into another
exception::

    not UTF-8                       -> "request body is not valid UTF-8: ..."
    nested deeper than max_depth    -> "... nested deeper than 128 levels"
    NaN, Infinity, -Infinity        -> "... NaN is not JSON"
    a number that overflows a float -> "... 1e400 is not a finite number"
    anything json.loads refuses     -> "request body is not valid JSON: ..."

Why a depth bound of our own: CPython's ``json`` recurses once per nesting level
and raises ``RecursionError`` (not ``ValueError``) a few hundred levels short of
the interpreter's limit, wherever the caller's stack happens to be; code that
walks the parsed value afterwards (``json.dumps`` of a chat request's ``tools``)
recurses again. orjson bounds its own parse (at 1,024 levels, since 3.9.15) but
not what our code does with the result, and ``json`` is what both ends already
use. So the depth is checked before parsing, on the bytes, in C-speed passes:

    1. count of ``[`` and ``{`` <= max_depth       -> cannot be deeper (the common case)
    2. else drop escaped backslashes and quotes, keep only brackets and quotes,
       and take the deepest running bracket count outside string literals (quote
       parity), with numpy cumsums                      O(len(raw))

Brackets inside strings only ever make pass 1 overcount, never undercount, so
the fast path is exact about what it lets through. Pass 2 is exact for valid
JSON (a backslash outside a string is invalid JSON, refused by the parse).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from radixfleet.wire import strict_json
from radixfleet.wire.errors import MalformedRequest

#: Deepest nesting accepted. Real requests nest a dozen levels (a tool's JSON
#: schema); Python's json gives up somewhere near 1,000, minus the caller's stack.
MAX_DEPTH = 128

_NOT_SKELETON = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = np.zeros(256, dtype=np.int32)
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_QUOTE = ord('"')


def nesting_depth(raw: bytes | bytearray) -> int:
    """The deepest bracket nesting of JSON text ``raw`` outside string literals.
    O(len(raw)), in C and numpy passes."""
    # In a string a backslash always escapes the next byte: dropping the escaped
    # backslashes first, then the escaped quotes, leaves only the delimiting quotes.
    if b"\\\\" in raw:
        raw = raw.replace(b"\\\\", b"")
    if b'\\"' in raw:
        raw = raw.replace(b'\\"', b"")
    skeleton = np.frombuffer(raw.translate(None, _NOT_SKELETON), dtype=np.uint8)
    if not len(skeleton):
        return 0
    outside = (np.cumsum(skeleton == _QUOTE, dtype=np.int32) & 1) == 0
    return int(np.cumsum(_STEP[skeleton] * outside).max())


def loads(
    raw: bytes | bytearray | memoryview | str, *, max_depth: int = MAX_DEPTH, what: str = "request body"
) -> Any:
    """Parses JSON text; raises ``MalformedRequest`` for anything that is not
    UTF-8 RFC 8259 JSON nested at most ``max_depth`` levels. ``what`` names the
    text in messages ("request body", "worker's /v1/models answer")."""
    data: bytes | bytearray
    if isinstance(raw, str):
        text = raw
        data = raw.encode("utf-8", "surrogatepass")
    else:
        data = raw if isinstance(raw, (bytes, bytearray)) else bytes(raw)  # no copy of a body
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedRequest(f"{what} is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    if data.count(b"[") + data.count(b"{") > max_depth and nesting_depth(data) > max_depth:
        raise MalformedRequest(f"{what} is nested deeper than {max_depth} levels")
    try:
        return strict_json.loads(text)
    except ValueError as exc:  # JSONDecodeError, ours, int digits over the limit
        raise MalformedRequest(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise MalformedRequest(f"{what} is nested too deeply") from None
