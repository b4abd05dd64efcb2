"""Command-line overrides of a loaded config (``with_overrides``), merged with
``MISSING``, never with ``None``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixfleet.config.document import Config


class _Missing:
    """The sentinel for "not given" when merging settings (never ``None``)."""

    __slots__ = ()
    _inst = None

    def __new__(cls):
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()


def with_overrides(cfg: Config, **overrides: Any) -> Config:
    """``cfg`` with dotted-path overrides (``listen.port=8001``); ``MISSING`` values
    are skipped, so absent command-line options never clobber the file."""
    for dotted, value in overrides.items():
        if value is MISSING:
            continue
        parts = dotted.split("__")
        cfg = _replace_path(cfg, parts, value)
    return cfg


def _replace_path(obj: Any, parts: list[str], value: Any) -> Any:
    if len(parts) == 1:
        return dataclasses.replace(obj, **{parts[0]: value})
    inner = getattr(obj, parts[0])
    return dataclasses.replace(obj, **{parts[0]: _replace_path(inner, parts[1:], value)})
