"""Which way a worker's requests are keyed, and why (contract 8, docs/DESIGN.md).

``choose_keys`` picks a worker's tokenizer, in this order, and checks it once
against the engine's ``POST /tokenize`` (radixfleet.engines.tokenizer_source.probe)::

    worker   the tokenizer of its own entry          (origin "worker")
    models   its model's ``models:`` entry's          (origin "models")
    engine   the one its engine names, where its adapter's ``engine_tokens`` and
             ``tokenizers.discover``                  (origin "engine")
    through  its engine's own /tokenize, where none of the above is loaded here
             and ``tokenizers.engine_tokenize``       (origin "engine_tokenize",
             radixfleet.engines.engine_keys)
    none     routing bytes, with the cause           (``KeysProblem``)

It decides and changes nothing: the link applies a ``KeyChoice`` (its key space,
``EngineLink._use_keys``); ``log_choice`` writes its one line, ``describe`` its
``/admin`` view. Never raises for what the engine says or serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from radixfleet.engines.adapters import EngineAdapter, ask_until_answered
from radixfleet.engines.keyspace import TokenSpace
from radixfleet.engines.tokenizer_source import EngineRoot, KeysCause, KeysProblem, Verdict, serves_tokenize
from radixfleet.engines.tokenizer_source import probe as probe_tokenize

log = logging.getLogger("radixfleet.engines")


class Keyed(Protocol):
    """What of a worker's link (radixfleet.engines.link.EngineLink) its keys are chosen from."""

    engines: Any  # LinkHost: session, tokenizers, load_keyer, discover_keyer, engine_keyer, prom
    spec: Any  # radixfleet.config.WorkerSpec
    worker: Any  # radixfleet.fleet.pool.Worker: id, url
    own_tokenizer: bool  # spec.tokenizer is its own entry's (not models:)
    keyer: Any
    space: Any
    key_choice: KeyChoice | None

    @property
    def adapter(self) -> EngineAdapter: ...
    @property
    def served_model(self) -> str: ...


@dataclass(frozen=True, slots=True)
class KeyChoice:
    """A worker's keys as ``choose_keys`` found them."""

    keyer: Any  # TokenKeyer or EngineKeyer; None: routing bytes
    origin: str | None  # "worker", "models", "engine", "engine_tokenize" (None: bytes)
    root: EngineRoot | None  # what the engine named, if asked
    probe: tuple[str, str] | None  # (verdict, detail) of the /tokenize probe, if run
    problem: KeysProblem | None  # why no tokenizer is loaded here
    through: str | None  # why its engine's /tokenize cannot key it either (None: not asked, or it can)


async def choose_keys(link: Keyed, alive: Callable[[], bool]) -> KeyChoice | None:
    """The worker's keys (module docstring). None: no longer ``alive()`` meanwhile."""
    eng, spec, adapter = link.engines, link.spec, link.adapter
    session = eng.session
    assert session is not None, "the engines start their session before any link"
    url, served = link.worker.url, link.served_model
    keyer = None
    problem: KeysProblem | None = None
    root: EngineRoot | None = None
    origin: str | None = None
    if spec.tokenizer:
        origin = "worker" if link.own_tokenizer else "models"
        keyer = await eng.load_keyer(spec.tokenizer, link.worker.id, spec.chat_template)
        if keyer is None:  # logged and counted by load_keyer
            problem = KeysProblem(
                KeysCause.LOAD_FAILED, f"tokenizer {spec.tokenizer!r} does not load (above)"
            )
    elif adapter.engine_tokens and eng.tokenizers.discover:
        origin = "engine"
        found = await ask_until_answered(
            lambda: adapter.tokenizer_root(session, url, spec.model), alive, link.worker.id
        )
        if found is None:
            return None
        if isinstance(found, KeysProblem):
            problem = found
        else:
            root = found
            if root.models and not spec.model:
                served = root.models[0]
            named = await eng.discover_keyer(
                root.source, spec.chat_template, download=eng.tokenizers.download
            )
            if isinstance(named, KeysProblem):
                problem = named
            else:
                keyer = named
    pr = None
    if keyer is not None and alive():
        checked = await probe_tokenize(session, url, served, keyer)
        pr = (checked.verdict.value, checked.detail)
        if checked.verdict is Verdict.DISAGREES:
            problem = KeysProblem(
                KeysCause.MISMATCH, f"tokenizer {keyer.source!r} is not the engine's: {checked.detail}"
            )
            keyer = None
    through = None
    if keyer is None and adapter.engine_tokens and eng.tokenizers.engine_tokenize and alive():
        through = await serves_tokenize(session, url, served)
        if through is None:
            keyer = eng.engine_keyer(root.source if root else url, served)
            origin = "engine_tokenize"
    if not alive():
        return None
    return KeyChoice(keyer, origin if keyer is not None else None, root, pr, problem, through)


def log_choice(link: Keyed, choice: KeyChoice) -> None:
    """One line for the worker's keys; bytes for a cause also count it
    (``radixfleet_engine_tokenizer_unavailable_total{cause}``)."""
    wid, problem, keyer = link.worker.id, choice.problem, choice.keyer
    if choice.origin == "engine_tokenize":
        log.info(
            "worker %s: keyed in its engine's tokens through its POST /tokenize (one "
            "round trip before each request's pick)%s",
            wid,
            f": its tokenizer is not loaded here ({problem.cause.value}: {problem.detail})"
            if problem is not None
            else "",
        )
    elif keyer is not None:
        where = {
            "worker": "its own entry",
            "models": "its model's models: entry",
            "engine": f"its engine's {choice.root.field if choice.root else '?'}",
        }[choice.origin or "worker"]
        pr_txt = f"its /tokenize {choice.probe[0]} {choice.probe[1]}" if choice.probe else "-"
        log.info(
            "worker %s: keyed in its engine's tokens with tokenizer %s (from %s); probe: %s",
            wid,
            keyer.source,
            where,
            pr_txt,
        )
    elif problem is not None:
        link.engines.prom.keys_off.labels(wid, problem.cause.value).inc()
        log.warning(
            "worker %s: keyed on routing bytes, approximate matches (%s: %s%s); for exact "
            "keys set its tokenizer (or models: {%s: {tokenizer: ...}})",
            wid,
            problem.cause.value,
            problem.detail,
            f"; and {choice.through}" if choice.through else "",
            link.served_model or "NAME",
        )


def describe(link: Keyed) -> dict:
    """Which way the worker is keyed and why: ``by`` tokens (its engine's tokens,
    exact) or bytes (routing bytes, approximate), the tokenizer and where it came
    from, what the engine named, the probe's verdict, and why no tokenizer is
    loaded here (``cause``: on bytes, or keyed through the engine's /tokenize)."""
    c = link.key_choice if link.key_choice is not None else _NONE
    root, pr, problem = c.root, c.probe, c.problem
    return {
        "by": "tokens" if isinstance(link.space, TokenSpace) else "bytes",
        "tokenizer": None if link.keyer is None else link.keyer.source,
        "from": c.origin,
        "engine_root": None if root is None else {"source": root.source, "field": root.field},
        "probe": None if pr is None else {"verdict": pr[0], "detail": pr[1]},
        "cause": None if problem is None else problem.cause.value,
        "detail": None if problem is None else problem.detail,
    }


_NONE = KeyChoice(None, None, None, None, None, None)
