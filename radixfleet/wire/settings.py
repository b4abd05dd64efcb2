"""Settings declared once: each section a frozen pydantic dataclass whose fields carry
their type, default, bounds and doc (``setting``); validation, error messages and the
reference tables in ``deploy/README.md`` all come from that one declaration::

    @settings
    class HealthConfig:
        interval_s: float = setting(2.0, "seconds between checks", lo=0, lo_open=True)

``validate(cls, raw, path)`` builds ``cls`` from a parsed YAML mapping and reports
every error of the document at once, each a ``ConfigError`` with its dotted path::

    limits.max_queue: expected an integer >= 0, got -1
    health.intervall_s: unknown key; valid: failure_threshold, interval_s, ...
    keys.tenant.source: 'jwt' is not one of none, api_key, header

Rules: a bool is never a number; an int is accepted for a float field (made a
float), a float (even 3.0) never for an int one; numbers are finite; ``null`` is
never "the default"; unknown keys are refused. Rules across fields are
``document_check`` validators, run for documents only (never when code builds an
instance); they raise ``ConfigError`` with a path relative to their object. A field
typed ``X | None`` (default ``None``: "not set") takes ``None`` or an ``X`` within
its bounds, and its messages read as ``X``'s.

``from_flags(cls, values, flags)`` validates values taken from a command line the
same way and names each error by the flag that set its field::

    --kv-tokens: expected an integer >= 1, got 0
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import NoneType, UnionType
from typing import Any, Literal, TypeVar, Union, cast, dataclass_transform, get_args, get_origin

import annotated_types
from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.dataclasses import dataclass as _pydantic_dataclass
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from radixfleet.wire.errors import ConfigError

_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


_C = TypeVar("_C")


# dataclass_transform: type checkers see each section's fields and its keyword
# constructor (``setting``/``section``/``internal`` are plain defaults to them)
@dataclass_transform(frozen_default=True)
def settings(cls: type[_C]) -> type[_C]:
    """Declares a settings section: a frozen dataclass validated by pydantic."""
    # pydantic types its result as its own protocol, not as ``cls``
    return cast("type[_C]", _pydantic_dataclass(frozen=True, slots=True, config=_CONFIG)(cls))


def setting(
    default: Any,
    doc: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Any:
    """A documented, bounded scalar setting. ``lo_open``/``hi_open`` make a bound strict."""
    bounds: dict[str, Any] = {}
    if lo is not None:
        bounds["gt" if lo_open else "ge"] = lo
    if hi is not None:
        bounds["lt" if hi_open else "le"] = hi
    # strict: no bool for a number, no 3.0 for an int, no "1" for either (strings and
    # Literal choices are never coerced from other types)
    strict: dict[str, Any] = {} if isinstance(default, str) else {"strict": True}
    return Field(default, description=doc, **strict, **bounds)


def section(cls: type, doc: str) -> Any:
    """A nested section, all defaults when absent."""
    return Field(default_factory=cls, description=doc)


def internal(default_factory: Callable[[], Any]) -> Any:
    """A field set by code, never by the document (refused as an unknown key)."""
    return Field(default_factory=default_factory, json_schema_extra={"internal": True})


def keys_of(cls: Any) -> dict[str, FieldInfo]:
    """The document keys of settings class ``cls``, in declaration order."""
    return {
        name: f
        for name, f in cls.__pydantic_fields__.items()
        if not (f.json_schema_extra or {}).get("internal")
    }


def _checked(fn: Callable[[Any], Any], value: Any, info: ValidationInfo) -> None:
    if (info.context or {}).get("document"):
        try:
            fn(value)
        except ConfigError as exc:
            raise PydanticCustomError(
                "config", "{message}", {"path": exc.path, "message": exc.message}
            ) from None


def value_check(fn: Callable[[Any], None]) -> Any:
    """``document_check`` for a value inside a type: ``Annotated[str, value_check(f)]``."""

    def check(value: Any, info: ValidationInfo) -> Any:
        _checked(fn, value, info)
        return value

    return AfterValidator(check)


def document_check(fn: Callable[[Any], None]) -> Any:
    """An after-validator for rules across fields: ``fn(obj)`` raises ``ConfigError``
    (its path relative to ``obj``). Runs only when a document is validated."""

    def check(self: Any, info: ValidationInfo) -> Any:
        _checked(fn, self, info)
        return self

    check.__name__ = fn.__name__
    return model_validator(mode="after")(check)


@functools.cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def validate(tp: Any, raw: Any, path: str = "", *, checks: bool = True) -> Any:
    """``raw`` validated as ``tp`` (a settings class, or e.g. ``tuple[cls, ...]``);
    ``checks=False`` skips the ``document_check`` rules. Raises ``ConfigError``; with
    several errors, one whose ``errors`` lists each."""
    try:
        return _adapter(tp).validate_python(raw, context={"document": checks})
    except ValidationError as exc:
        errors = sorted(exc.errors(include_url=False), key=lambda e: _place(raw, e["loc"]))
        found = [error(tp, e, path) for e in errors]
    raise_all(found)


def from_flags(
    cls: Any, values: Mapping[str, Any], flags: Mapping[str, str], shown: Mapping[str, Any] | None = None
) -> Any:
    """``values`` (field -> value; a nested section as a mapping or an instance) taken
    from a command line, validated as settings class ``cls``. Raises one
    ``ConfigError`` naming every bad value by the flag that set it: ``flags`` maps a
    field path (``engine.kv_tokens``) to its flag (``--kv-tokens``); an unlisted path
    is kept. ``shown`` maps the path of a field that holds its flag's value converted
    (``--path-latency-ms`` into seconds) to the value as given, which the message
    quotes instead (so such a field's bounds must read the same in both units)."""
    try:
        return validate(cls, values)
    except ConfigError as exc:
        found = []
        for e in exc.errors:
            message = e.message
            head, got, _ = message.rpartition(", got ")
            if shown and e.path in shown and got:
                message = f"{head}, got {shown[e.path]!r}"
            found.append(ConfigError(flags.get(e.path, e.path), message))
        raise_all(found)


def _place(raw: Any, loc: tuple[Any, ...]) -> list[int]:
    """Where ``loc`` is in the document, for reporting errors in document order."""
    place, node = [], raw
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            place.append(list(node).index(part))
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            place.append(part)
            node = node[part]
        else:
            place.append(1 << 30)  # a rule across fields: after its object's keys
            break
    return place


def raise_all(found: list[ConfigError]) -> None:
    """Raises the one error found, or one ``ConfigError`` naming them all."""
    if len(found) == 1:
        raise found[0]
    if found:
        exc = ConfigError("", f"{len(found)} errors: " + "; ".join(str(e) for e in found))
        exc.errors = found
        raise exc


def join(path: str, key: str) -> str:
    """``path`` + a relative ``key`` (``a.b``, ``.b``, ``[0]`` or empty)."""
    key = key.lstrip(".")
    if not key or not path:
        return path or key
    return path + key if key.startswith("[") else f"{path}.{key}"


def typename(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def optional_of(tp: Any) -> Any:
    """``X`` for ``X | None``; any other type as it is."""
    if get_origin(tp) in (Union, UnionType):
        args = [a for a in get_args(tp) if a is not NoneType]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0]
    return tp


def expected(annotation: Any, f: FieldInfo) -> str:
    """``an integer >= 0``, ``a number in [0, 1]``, ``a number > 0``, ``true or false``."""
    annotation = optional_of(annotation)
    if annotation is bool:
        return "true or false"
    noun = "an integer" if annotation is int else "a number"
    bound = {type(m): m for m in f.metadata}
    hi_open = annotated_types.Lt in bound
    hi = bound[annotated_types.Lt].lt if hi_open else getattr(bound.get(annotated_types.Le), "le", None)
    lo_open = annotated_types.Gt in bound
    lo = bound[annotated_types.Gt].gt if lo_open else getattr(bound.get(annotated_types.Ge), "ge", None)
    if lo is not None and hi is not None:
        return f"{noun} in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{noun} {'>' if lo_open else '>='} {_fmt(lo)}"
    return f"{noun} {'<' if hi_open else '<='} {_fmt(hi)}" if hi is not None else noun


def _inner(tp: Any) -> Any:
    """The settings class (or scalar type) one step inside a container annotation."""
    args = get_args(tp)
    return args[0] if get_origin(tp) is tuple else args[-1] if len(args) == 2 else tp


_NUMBER_ERRORS = frozenset(
    {
        "int_type",
        "int_parsing",
        "int_from_float",
        "float_type",
        "float_parsing",
        "finite_number",
        "greater_than",
        "greater_than_equal",
        "less_than",
        "less_than_equal",
        "bool_type",
        "bool_parsing",
    }
)


def error(root: Any, e: Mapping[str, Any], prefix: str = "") -> ConfigError:
    """One pydantic error as a ``ConfigError`` worded as the project words them."""
    tp, owner, f, path = root, None, None, prefix
    loc, kind, value = e["loc"], e["type"], e.get("input")
    bad_key = kind == "invalid_key" or (loc[-1:] == ("[key]",) and kind == "string_type")
    if bad_key:  # a mapping's key that is not a string: the mapping's error
        loc = loc[:-1] if kind == "invalid_key" else loc[:-2]
    elif loc[-1:] == ("[key]",):  # a key's own check: at the key's entry
        loc = loc[:-1]
    for part in loc:
        fields = getattr(tp, "__pydantic_fields__", None)
        if isinstance(part, int) and get_origin(tp) is tuple:
            path, tp, f = f"{path}[{part}]", _inner(tp), None
        elif fields is not None and part in fields:
            owner, f = tp, fields[part]
            path, tp = join(path, str(part)), f.annotation
        elif fields is not None:  # an unknown key
            owner = tp
            path = join(path, str(part)) if isinstance(part, str) else path
        else:
            path, tp, f = join(path, str(part)), _inner(tp), None
    if bad_key:
        return ConfigError(path, f"keys must be strings, got {value!r}")
    if kind == "config":
        ctx = e["ctx"]
        return ConfigError(join(path, ctx["path"]), ctx["message"])
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        valid = ", ".join(sorted(keys_of(owner))) if owner is not None else ""
        return ConfigError(path, f"unknown key; valid: {valid or '(none)'}")
    tp = optional_of(tp)
    if kind == "literal_error":
        return ConfigError(path, f"{value!r} is not one of {', '.join(_choice(c) for c in get_args(tp))}")
    if kind == "string_type":
        return ConfigError(path, f"expected a string, got {value!r}")
    if kind in _NUMBER_ERRORS and f is not None:
        return ConfigError(path, f"expected {expected(tp, f)}, got {value!r}")
    if kind in ("dataclass_type", "dict_type", "mapping_type", "model_type"):
        return ConfigError(path, f"expected a mapping, got {typename(value)}")
    if kind in ("tuple_type", "list_type"):
        return ConfigError(path, f"expected a list, got {typename(value)}")
    return ConfigError(path, e["msg"])


def _choice(c: Any) -> str:
    """A choice as messages and tables show it (the empty string as ``""``)."""
    return '""' if c == "" else str(c)


def reference(cls: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``[(dotted key, default, allowed values, doc)]`` of every key under settings
    class ``cls``, nested sections and list or mapping entries flattened (``a[].b``,
    ``a.<name>.b``): the rows of the generated reference tables."""
    rows = []
    for name, f in keys_of(cls).items():
        key, tp = join(prefix, name), optional_of(f.annotation)
        inner = _inner(tp)
        if hasattr(tp, "__pydantic_fields__"):
            rows += reference(tp, key)
        elif inner is not tp and hasattr(inner, "__pydantic_fields__"):
            entry = f"{key}[]" if get_origin(tp) is tuple else f"{key}.<name>"
            rows.append(
                (
                    key,
                    "[]" if get_origin(tp) is tuple else "{}",
                    "list" if get_origin(tp) is tuple else "mapping",
                    f.description or "",
                )
            )
            rows += reference(inner, entry)
        else:
            default = f.get_default(call_default_factory=True)
            if get_origin(tp) is Literal:
                allowed = ", ".join(f"`{_choice(c)}`" for c in get_args(tp))
            elif tp in (int, float, bool):
                allowed = expected(tp, f)
            elif get_origin(tp) is tuple:
                allowed = "list of strings" if inner is str else "list"
            else:
                allowed = "string" if tp is str else "mapping"
            shown = (
                str(default).lower()
                if isinstance(default, bool)
                else repr(default)
                if default in ("", {})
                else str(list(default))
                if isinstance(default, tuple)
                else str(default)
            )
            rows.append((key, shown.replace("''", '""'), allowed, f.description or ""))
    return rows
