"""Declaring and validating policy parameters (the ``params`` mapping of a YAML policy).

Each policy's ``Params`` is a frozen dataclass whose fields are declared with
``param(default, doc, lo=..., hi=...)``; the field's annotation (``int``, ``float``
or ``bool``) and its bounds are the whole schema. ``parse_params`` turns a YAML
mapping into an instance, or raises ``ConfigError`` naming the field path::

    policy.params.min_match_tokens: expected an integer >= 0, got -3
    policy.params.load_factor: expected a number >= 1, got 'x'
    policy.params.foo: unknown parameter of prefix_load; valid: a, b, c

Rules: a bool is never a number (YAML ``true`` is not 1); an int is accepted for a
``float`` field, a float (even 3.0) never for an ``int`` one; numbers must be
finite. Absent fields keep their documented defaults.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from protocol.errors import ConfigError


def param(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
          lo_open: bool = False) -> Any:
    """A documented, bounded parameter field. ``lo_open`` makes the lower bound strict."""
    return dataclasses.field(
        default=default, metadata={"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open}
    )


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _expected(kind: str, meta: Mapping[str, Any]) -> str:
    """``an integer >= 0``, ``a number in [0, 1]``, ``a number > 0``."""
    noun = {"int": "an integer", "float": "a number", "bool": "true or false"}[kind]
    if kind == "bool":
        return noun
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and hi is not None:
        left = "(" if meta.get("lo_open") else "["
        return f"{noun} in {left}{_fmt(lo)}, {_fmt(hi)}]"
    if lo is not None:
        return f"{noun} {'>' if meta.get('lo_open') else '>='} {_fmt(lo)}"
    if hi is not None:
        return f"{noun} <= {_fmt(hi)}"
    return noun


def _kind(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if t not in ("int", "float", "bool"):
        raise TypeError(f"policy parameter {f.name} has unsupported type {t!r}")
    return t


def check_value(kind: str, meta: Mapping[str, Any], value: Any, path: str) -> Any:
    """Validates one value against its kind and bounds; returns it (ints as float
    for float fields). Raises ``ConfigError(path, ...)``."""
    bad = ConfigError(path, f"expected {_expected(kind, meta)}, got {value!r}")
    if kind == "bool":
        if type(value) is not bool:
            raise bad
        return value
    if type(value) is bool or not isinstance(value, (int, float)):
        raise bad
    if kind == "int" and type(value) is not int:
        raise bad
    if isinstance(value, float) and not math.isfinite(value):
        raise bad
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value <= lo if meta.get("lo_open") else value < lo):
        raise bad
    if hi is not None and value > hi:
        raise bad
    return float(value) if kind == "float" else value


def parse_params(cls: type, policy_name: str, raw: Any, path: str) -> Any:
    """Builds ``cls`` (a ``Params`` dataclass) from a YAML mapping (``None`` = all
    defaults). ``path`` is the dotted path of the ``params`` mapping itself."""
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected a mapping of parameters, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        f = fields.get(key) if isinstance(key, str) else None
        if f is None:
            valid = ", ".join(sorted(fields)) or "(none)"
            raise ConfigError(
                f"{path}.{key}", f"unknown parameter of {policy_name}; valid: {valid}"
            )
        values[key] = check_value(_kind(f), f.metadata, value, f"{path}.{key}")
    return cls(**values)


def param_docs(cls: type) -> list[dict[str, Any]]:
    """``[{name, type, default, expected, doc}]`` for docs and ``--help`` output."""
    out = []
    for f in dataclasses.fields(cls):
        kind = _kind(f)
        out.append({
            "name": f.name,
            "type": kind,
            "default": f.default,
            "expected": _expected(kind, f.metadata),
            "doc": f.metadata.get("doc", ""),
        })
    return out


def check_defaults(cls: type) -> None:
    """Asserts that every default satisfies its own bounds (tests call this)."""
    for f in dataclasses.fields(cls):
        check_value(_kind(f), f.metadata, f.default, f"{cls.__qualname__}.{f.name}")
