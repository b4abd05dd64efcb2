"""A worker's tokenizer, asked of its engine; and whether a loaded one is the engine's.

An engine names the tokenizer it serves, unconfigured::

    vLLM    GET /v1/models        {"data": [{"id": NAME, "root": "/models/x" | "org/repo",
                                              "parent": null, ...}, ...]}  (root: its --model)
    SGLang  GET /get_model_info   {"model_path": ..., "tokenizer_path": ..., ...}

``fetch_root`` returns what it names (``EngineRoot``) or a ``KeysProblem``;
``locate`` says whether the router can read it here (a folder on this host or a
shared volume, a repo in the local Hugging Face cache, or with ``download`` any repo
id: the hub is asked when it loads); ``probe`` checks a loaded ``TokenKeyer`` once
against the engine's own ``POST /tokenize`` on a fixed prompt (as a completion, and
as a chat where both sides render chats). vLLM's ``root`` is its ``--model``: an
engine started with a separate ``--tokenizer`` names a folder whose tokenizer may
not be the one it uses, which the probe catches.

Why a worker stays on routing bytes, one fixed set of causes (the metric label of
``radixfleet_engine_tokenizer_unavailable_total``):

===========  ========================================================  ===========
cause        meaning                                                    the link
===========  ========================================================  ===========
unreachable  no answer, or a 5xx                                        asks again
no_root      the answer names no tokenizer for the served model (no     bytes
             root, no entry for it, a 404, not JSON)
unreadable   a path the router cannot read (not on this host, no        bytes
             permission), or a repo not in the local cache while
             ``tokenizers.download`` is off
load_failed  the files are there and do not load (no tokenizer in the   bytes
             folder, a broken file, remote code, a template that does
             not compile)
mismatch     its ids are not the engine's on the probe prompt           bytes
===========  ========================================================  ===========

Only this module knows these answers' shapes. I/O: the GET, the probe's POSTs, and
``locate``'s look at the file system and the cache (run it off the event loop).
"""

from __future__ import annotations

import asyncio
import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from radixfleet.common import jsonbody
from radixfleet.keys import Endpoint
from radixfleet.wire.errors import MalformedRequest, MissingExtra
from radixfleet.wire.extras import require

MAX_BODY_BYTES = 1 << 20
#: the longest path or repo id taken from an answer
MAX_SOURCE_CHARS = 4096
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")

#: the probe prompt: words, digits, punctuation, runs of spaces, tabs and newlines,
#: accents, CJK and an emoji (byte fallback), so that two tokenizers that differ
#: anywhere common differ here
PROBE_TEXT = (
    "A routing probe: The quick brown fox jumps over 13 lazy dogs -- twice, at 04:05.\n"
    "  Indented\tline with   three spaces; naïve café, Straße, 東京の天気, 😀 (x**2 + y) / 3.5%\n"
    'def f(a, b=None):\n    return {"k": [a, b]}  # done\n'
)
PROBE_MESSAGES = (
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": PROBE_TEXT},
)


class KeysCause(str, enum.Enum):
    """Why a worker is keyed on routing bytes (module docstring's table)."""

    UNREACHABLE = "unreachable"
    NO_ROOT = "no_root"
    UNREADABLE = "unreadable"
    LOAD_FAILED = "load_failed"
    MISMATCH = "mismatch"


@dataclass(frozen=True, slots=True)
class KeysProblem:
    cause: KeysCause
    detail: str  # one short line for the log and /admin/workers


@dataclass(frozen=True, slots=True)
class EngineRoot:
    """The tokenizer an engine names."""

    source: str  # a folder path or a Hugging Face repo id, as the engine has it
    field: str  # where it was read: "/v1/models root", "/get_model_info tokenizer_path"
    #: the base models the answer lists (vLLM; () where it does not say)
    models: tuple[str, ...] = ()


class Verdict(str, enum.Enum):
    AGREES = "agrees"  # the engine's ids on the probe prompt, token for token
    DISAGREES = "disagrees"
    UNCHECKED = "unchecked"  # the engine did not tokenize it (no /tokenize, an error)


@dataclass(frozen=True, slots=True)
class Probe:
    verdict: Verdict
    detail: str  # what was compared, or why not, or the first difference


def _source(value: Any, what: str) -> str | KeysProblem:
    if not isinstance(value, str) or not value.strip():
        return KeysProblem(KeysCause.NO_ROOT, f"{what} is {str(value)[:60]!r}, not a path or repo id")
    if len(value) > MAX_SOURCE_CHARS or "\x00" in value:
        return KeysProblem(KeysCause.NO_ROOT, f"{what} is not a usable path ({len(value)} characters)")
    return value.strip()


def _answer(status: int, body: bytes, path: str) -> Any:
    """The JSON of a 200 answer, or the ``KeysProblem`` of any other."""
    if status >= 500:
        return KeysProblem(KeysCause.UNREACHABLE, f"GET {path} answered {status}")
    if status != 200:
        return KeysProblem(KeysCause.NO_ROOT, f"GET {path} answered {status}")
    try:
        return jsonbody.loads(body, max_depth=16, what=f"its {path} answer")
    except MalformedRequest as exc:
        return KeysProblem(KeysCause.NO_ROOT, str(exc)[:200])


def parse_vllm_models(status: int, body: bytes, model: str) -> EngineRoot | KeysProblem:
    """The ``root`` of served model ``model`` ("": the first base model) in a vLLM
    ``/v1/models`` answer. LoRA adapters (entries with a ``parent``) are not roots."""
    obj = _answer(status, body, "/v1/models")
    if isinstance(obj, KeysProblem):
        return obj
    items = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(items, list):
        return KeysProblem(KeysCause.NO_ROOT, "its /v1/models answer has no data list")
    bases = [m for m in items if isinstance(m, dict) and isinstance(m.get("id"), str) and not m.get("parent")]
    models = tuple(m["id"] for m in bases)[:64]
    entry = next((m for m in bases if m["id"] == model), None) if model else (bases[0] if bases else None)
    if entry is None:
        return KeysProblem(
            KeysCause.NO_ROOT,
            f"its /v1/models lists no model {model!r}" if model else "its /v1/models lists no model",
        )
    if "root" not in entry:
        return KeysProblem(KeysCause.NO_ROOT, f"its /v1/models entry {entry['id']!r} has no root")
    src = _source(entry["root"], f"its /v1/models root of {entry['id']!r}")
    if isinstance(src, KeysProblem):
        return src
    return EngineRoot(src, "/v1/models root", models)


def parse_sglang_model_info(status: int, body: bytes) -> EngineRoot | KeysProblem:
    """``tokenizer_path`` (else ``model_path``) of an SGLang ``/get_model_info`` answer."""
    obj = _answer(status, body, "/get_model_info")
    if isinstance(obj, KeysProblem):
        return obj
    if not isinstance(obj, dict):
        return KeysProblem(KeysCause.NO_ROOT, "its /get_model_info answer is not an object")
    for field in ("tokenizer_path", "model_path"):
        if obj.get(field):
            src = _source(obj[field], f"its /get_model_info {field}")
            if isinstance(src, KeysProblem):
                return src
            return EngineRoot(src, f"/get_model_info {field}")
    return KeysProblem(KeysCause.NO_ROOT, "its /get_model_info names no tokenizer_path or model_path")


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, bytes] | str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            body = await r.content.read(MAX_BODY_BYTES + 1)
            return r.status, body
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        return type(exc).__name__


async def fetch_root(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    parse: Callable[[int, bytes], EngineRoot | KeysProblem],
    timeout_s: float = 5.0,
) -> EngineRoot | KeysProblem:
    """What the engine at ``url`` names as its tokenizer: ``GET path``'s answer read
    by ``parse`` (``parse_vllm_models``, ``parse_sglang_model_info``: the engine's
    adapter, radixfleet.engines.adapters, says which)."""
    got = await _get(session, url + path, timeout_s)
    if isinstance(got, str):
        return KeysProblem(KeysCause.UNREACHABLE, f"GET {path} failed: {got}")
    status, body = got
    if len(body) > MAX_BODY_BYTES:
        return KeysProblem(KeysCause.NO_ROOT, f"its {path} answer is over {MAX_BODY_BYTES} bytes")
    return parse(status, body)


def _path_like(source: str) -> bool:
    """A folder path rather than a repo id (``org/name``): token_keys' rule."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1


def locate(source: str, download: bool) -> KeysProblem | None:
    """None when the router can read ``source`` here: a readable folder, a repo in
    the local Hugging Face cache, or (``download``) any repo id; else why not
    (``unreadable``). Whether the files load is the loader's to say."""
    folder = os.path.expanduser(source)
    if os.path.isdir(folder):
        try:
            os.listdir(folder)
        except OSError as exc:
            return KeysProblem(
                KeysCause.UNREADABLE, f"folder {source!r} is not readable here ({exc.strerror or exc})"
            )
        return None
    if os.path.exists(folder):
        return KeysProblem(KeysCause.UNREADABLE, f"{source!r} is not a folder")
    if _path_like(source):
        return KeysProblem(
            KeysCause.UNREADABLE,
            f"no folder {source!r} on the router's host (mount the engine's model folder "
            "at the same path, or set the worker's tokenizer)",
        )
    if download:
        return None
    try:
        hub = require("huggingface_hub", "engines", "a tokenizer from the Hugging Face cache")
    except MissingExtra as exc:
        return KeysProblem(KeysCause.LOAD_FAILED, str(exc))
    for name in _TOKENIZER_FILES:
        try:
            hit = hub.try_to_load_from_cache(source, name)
        except ValueError:  # not a valid repo id (HFValidationError)
            return KeysProblem(KeysCause.UNREADABLE, f"{source!r} is neither a folder here nor a repo id")
        if isinstance(hit, str):
            return None
    return KeysProblem(
        KeysCause.UNREADABLE,
        f"repo {source!r} is not in the local Hugging Face cache and tokenizers.download is off",
    )


async def _tokenize(
    session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float
) -> list[int] | str | int:
    """The engine's token ids for ``body``; else its status (an int) or what failed."""
    try:
        async with session.post(
            url + "/tokenize", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            raw = await r.content.read(MAX_BODY_BYTES + 1)
            if r.status != 200:
                return r.status
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        return type(exc).__name__
    try:
        obj = jsonbody.loads(raw, max_depth=8, what="its /tokenize answer")
    except MalformedRequest:
        return "not JSON"
    toks = obj.get("tokens") if isinstance(obj, dict) else None
    if not isinstance(toks, list) or any(type(t) is not int for t in toks):
        return "no token id list"
    return toks


async def serves_tokenize(
    session: aiohttp.ClientSession, url: str, model: str, timeout_s: float = 5.0
) -> str | None:
    """None when the engine at ``url`` tokenizes the probe prompt (its ``/tokenize``
    can key requests: radixfleet.engines.engine_keys); else why not."""
    body = {**({"model": model} if model else {}), "prompt": PROBE_TEXT}
    got = await _tokenize(session, url, body, timeout_s)
    if isinstance(got, list):
        return None
    return f"its POST /tokenize {'answered' if isinstance(got, int) else 'failed:'} {got}"


def _first_difference(engine: list[int], ours: list[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(engine, ours)) if a != b), min(len(engine), len(ours)))
    e = engine[i] if i < len(engine) else "end"
    o = ours[i] if i < len(ours) else "end"
    return f"{len(engine)} ids against {len(ours)}, first difference at {i}: engine {e}, router {o}"


async def probe(
    session: aiohttp.ClientSession, url: str, model: str, keyer: Any, timeout_s: float = 5.0
) -> Probe:
    """``keyer``'s ids against the engine's ``/tokenize`` on the probe prompt: as a
    completion (special tokens added, vLLM's default), then as a chat (the engine's
    chat template, ``add_generation_prompt``) unless either side cannot render chats
    (a ``chat_blocked`` model, an engine that tokenizes no ``messages``)."""
    base: dict = {"model": model} if model else {}
    got = await _tokenize(session, url, {**base, "prompt": PROBE_TEXT}, timeout_s)
    if not isinstance(got, list):
        why = f"answered {got}" if isinstance(got, int) else f"failed: {got}"
        return Probe(Verdict.UNCHECKED, f"its POST /tokenize {why}")
    try:
        ours = list(keyer.token_ids(Endpoint.COMPLETIONS, {"prompt": PROBE_TEXT})[0])
    except MalformedRequest as exc:  # the router's tokenizer refuses what the engine took
        return Probe(Verdict.DISAGREES, f"the probe prompt: {exc}"[:300])
    if got != ours:
        return Probe(Verdict.DISAGREES, f"on the probe prompt: {_first_difference(got, ours)}")
    if keyer.chat_blocked is not None:
        return Probe(Verdict.AGREES, f"on the probe prompt ({len(got)} ids); chats: {keyer.chat_blocked}")
    msgs = [dict(m) for m in PROBE_MESSAGES]
    chat = await _tokenize(session, url, {**base, "messages": msgs}, timeout_s)
    try:
        mine: list[int] | None = list(keyer.token_ids(Endpoint.CHAT, {"messages": msgs})[0])
    except MalformedRequest:
        mine = None  # no chat template here
    if not isinstance(chat, list):
        if mine is None:
            return Probe(Verdict.AGREES, f"on the probe prompt ({len(got)} ids); neither side renders chats")
        return Probe(Verdict.AGREES, f"on the probe prompt ({len(got)} ids); chat not checked ({chat})")
    if mine is None:
        return Probe(Verdict.DISAGREES, "the engine renders chats and the tokenizer has no chat template")
    if chat != mine:
        return Probe(Verdict.DISAGREES, f"on the probe chat: {_first_difference(chat, mine)}")
    return Probe(Verdict.AGREES, f"on the probe prompt and chat ({len(got)} and {len(chat)} ids)")
