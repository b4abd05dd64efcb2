"""Declaring and validating policy parameters (the ``params`` mapping of a YAML policy).

Each policy's ``Params`` is a ``@parameters`` class (a frozen settings dataclass,
``radixfleet.wire.settings``) whose fields are declared with ``param(default, doc, lo=...,
hi=...)``; the field's annotation (``int``, ``float`` or ``bool``) and its bounds
are the whole schema. ``parse_params`` turns a YAML mapping into an instance, or
raises ``ConfigError`` naming each bad field's path (all of them at once)::

    policy.params.min_match_tokens: expected an integer >= 0, got -3
    policy.params.load_factor: expected a number >= 1, got 'x'
    policy.params.foo: unknown parameter of prefix_load; valid: a, b, c

The rules are the router config's: a bool is never a number, an int is accepted for
a ``float`` field, a float (even 3.0) never for an ``int`` one; numbers are finite.
Absent fields keep their documented defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import expected, raise_all, validate
from radixfleet.wire.settings import setting as param
from radixfleet.wire.settings import settings as parameters

#: ``param`` and ``parameters`` are re-exported: the declaration helper and the class
#: decorator every policy's ``Params`` uses
__all__ = ["check_defaults", "param", "param_docs", "parameters", "parse_params"]


def parse_params(cls: type, policy_name: str, raw: Any, path: str) -> Any:
    """Builds ``cls`` (a ``Params`` class) from a YAML mapping (``None`` = all
    defaults). ``path`` is the dotted path of the ``params`` mapping itself."""
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected a mapping of parameters, got {type(raw).__name__}")
    try:
        return validate(cls, raw, path)
    except ConfigError as exc:
        raise_all(
            [
                ConfigError(
                    e.path, e.message.replace("unknown key;", f"unknown parameter of {policy_name};", 1)
                )
                for e in exc.errors
            ]
        )


def param_docs(cls: Any) -> list[dict[str, Any]]:
    """``[{name, type, default, expected, doc}]`` for docs and ``--help`` output."""
    return [
        {
            "name": name,
            "type": f.annotation.__name__,
            "default": f.default,
            "expected": expected(f.annotation, f),
            "doc": f.description or "",
        }
        for name, f in cls.__pydantic_fields__.items()
    ]


def check_defaults(cls: type) -> None:
    """Raises ``ConfigError`` unless every default satisfies its own bounds (tests
    call this)."""
    validate(cls, dataclasses.asdict(cls()), cls.__qualname__)
