"""Which tokenizer keys which model: one ``TokenKeyer`` per tokenizer, shared.

Several models may sit behind one router, each with its own tokenizer and chat
template; several workers (and several model names, e.g. a base model and the
names its LoRA adapters are served under) may share one. The registry maps a served
model name to the keyer of its tokenizer source, loading each source once::

    models   "llama-8b" ──┐
             "llama-8b-sql" ┴──> source "/models/llama-8b" ──> TokenKeyer (one load)
             "qwen-7b" ───────> source "Qwen/Qwen2.5-7B-Instruct" ──> TokenKeyer

Invariants (``check()``): every model's source has a keyer; every keyer is used by
at least one model; ``_users[source]`` is the set of models naming it.
"""

from __future__ import annotations

from typing import Any, Callable

from router.engines.token_keys import TokenKeyer
from protocol.errors import ConfigError


class TokenizerRegistry:
    """Model name -> shared ``TokenKeyer`` (module docstring). Not thread-safe."""

    __slots__ = ("_loader", "_options", "_source_of", "_keyers", "_users")

    def __init__(self, loader: Callable[..., TokenKeyer] = TokenKeyer.load,
                 **options: Any) -> None:
        """``options`` go to every ``loader(source, **options)`` call (the engine's
        flags, see ``TokenKeyer``)."""
        self._loader = loader
        self._options = options
        self._source_of: dict[str, str] = {}  # model -> tokenizer source
        self._keyers: dict[str, TokenKeyer] = {}  # source -> its keyer
        self._users: dict[str, set[str]] = {}  # source -> models naming it

    def add(self, model: str, source: str) -> TokenKeyer:
        """Binds ``model`` to the tokenizer at ``source`` (loaded on first use) and
        returns its keyer. Idempotent for the same pair. Raises ``TokenizerLoadError``
        (nothing is bound then) or ``ConfigError`` when ``model`` is already bound to
        another source."""
        bound = self._source_of.get(model)
        if bound is not None and bound != source:
            raise ConfigError("", f"model {model!r} is keyed with tokenizer {bound!r}, "
                              f"not {source!r}: one model, one tokenizer")
        keyer = self._keyers.get(source)
        if keyer is None:
            keyer = self._loader(source, **self._options)
            self._keyers[source] = keyer
        self._source_of[model] = source
        self._users.setdefault(source, set()).add(model)
        return keyer

    def get(self, model: str) -> TokenKeyer | None:
        """The keyer of ``model``; None when it has no tokenizer (byte keys)."""
        source = self._source_of.get(model)
        return None if source is None else self._keyers[source]

    def remove(self, model: str) -> None:
        """Unbinds ``model``; its keyer is dropped once no model uses it."""
        source = self._source_of.pop(model, None)
        if source is None:
            return
        users = self._users[source]
        users.discard(model)
        if not users:
            del self._users[source]
            del self._keyers[source]

    def models(self) -> list[str]:
        return sorted(self._source_of)

    def __contains__(self, model: object) -> bool:
        return model in self._source_of

    def __len__(self) -> int:
        """Number of loaded tokenizers."""
        return len(self._keyers)

    def check(self) -> None:
        """Asserts the invariants of the module docstring."""
        for model, source in self._source_of.items():
            assert source in self._keyers, f"{model=} {source=}"
            assert model in self._users[source], f"{model=} {source=}"
        assert set(self._users) == set(self._keyers), f"{self._users=}"
        for source, users in self._users.items():
            assert users, f"{source=}"
            assert all(self._source_of[m] == source for m in users), f"{source=} {users=}"
