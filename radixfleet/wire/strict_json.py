"""RFC 8259 JSON and nothing more, for every parse of what a peer sent: ``json.loads``
refusing NaN, Infinity and numbers that overflow a float. The HTTP bodies
(``radixfleet.common.jsonbody``: also the depth bound and the 400) and the bus messages
(``bus_wire``) parse through ``loads``."""

from __future__ import annotations

import json
import math
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text[:40]} is not a finite number")
    return v


def loads(text: str | bytes) -> Any:
    """Parses JSON text. Raises ``ValueError`` (also ``UnicodeDecodeError``) for
    anything but RFC 8259 JSON with finite numbers, ``RecursionError`` if too deep."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
