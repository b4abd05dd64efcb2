"""Exact keys through the engine itself: a worker whose tokenizer the router cannot
load (``radixfleet.engines.tokenizer_source``) is keyed in its engine's own tokens by
asking the engine, vLLM's and SGLang's ``POST /tokenize``, once per request.

``EngineKeyer`` stands where a ``radixfleet.engines.token_keys.TokenKeyer`` stands in a
``radixfleet.engines.keyspace.TokenSpace``; its keys are the same chained token-block
hashes in the same namespaces, so the engine's KV events (re-keyed from the tokens
they carry) meet them in the index. The data plane awaits one step before it keys::

    await engines.prepare(endpoint, body, views)    per EngineKeyer in use among the
        routable workers: the request's /tokenize body (``tokenize_request``), its ids
        fetched from one of the engine's workers unless cached; bounded by
        ``tokenizers.engine_timeout_s``
    TokenSpace.key(...) -> keyer.key(...)           sync: the prepared ids hashed, or
        no hashes (``unkeyed``: the request routes by load) when the fetch failed, timed
        out, or the request is one /tokenize does not render as the engine serves it

The cost: one round trip before the pick (measured on this 2-core host against CPU
vLLM 0.32, an idle server: p50 2.6 ms for a 900-token completion, 3.0 ms for a
900-token chat, 12.6 ms for 7,000 tokens, where a loaded tokenizer takes 0.004-0.033
ms; see deploy/README.md). What can be cached is: the ids of a request body, by a
digest of its /tokenize body (``cache_tokens`` bounded, least recently used out) —
a retry, a prefetch and the request it warmed, the re-key after an admission wait,
the same prompt from many clients; and identical requests in flight share one
fetch. A conversation's next turn is a new body and costs a round trip.

Only the event loop touches a keyer.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from array import array
from collections import OrderedDict
from typing import Any

import aiohttp
import xxhash

from radixfleet.engines.token_keys import FROM_BODY, TokenKey, key_from_ids
from radixfleet.engines.tokenizer_source import MAX_BODY_BYTES
from radixfleet.keys import (
    Endpoint,
)

log = logging.getLogger("radixfleet.engines")

#: chat fields vLLM's /tokenize renders as its chat completions do
_CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
#: fields whose effect /tokenize does not reproduce: such a request routes by load
_NOT_RENDERED = {
    Endpoint.CHAT: ("documents", "reasoning_effort", "truncate_prompt_tokens", "mm_processor_kwargs"),
    Endpoint.COMPLETIONS: ("suffix", "prompt_embeds", "truncate_prompt_tokens"),
    Endpoint.GENERATE: ("image_data", "audio_data", "video_data", "input_embeds"),
}
_TEXT_PARTS = ("text", "input_text")


def _token_ids(value: Any) -> array | None:
    if isinstance(value, list) and value and all(type(t) is int and 0 <= t < 2**32 for t in value):
        return array("I", value)
    return None


def tokenize_request(endpoint: Endpoint, body: dict, model: str) -> dict | array | str:
    """What to ask the engine's ``/tokenize`` for ``body``'s prompt: a request body,
    or the prompt's ids where the request carries them, or (a str) why /tokenize
    would not give the ids the engine serves it with. Never raises: a body the engine
    refuses is the engine's to answer."""
    for f in _NOT_RENDERED[endpoint]:
        if body.get(f) not in (None, [], ""):
            return f"{f} is not rendered by /tokenize"
    base: dict = {"model": model} if model else {}
    if endpoint is Endpoint.CHAT:
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and not body.get("echo"):
            ids = _token_ids(kv.get("prompt_token_ids"))
            if ids is not None:
                return ids
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "no messages"
        for m in msgs:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(
                not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS for p in content
            ):
                return "media content is expanded by the engine's processor"
        return {**base, **{f: body[f] for f in _CHAT_FIELDS if body.get(f) is not None}}
    field = "prompt" if endpoint is Endpoint.COMPLETIONS else "text"
    prompt = body.get(field)
    if endpoint is Endpoint.GENERATE and prompt is None:
        ids = _token_ids(body.get("input_ids"))
        return ids if ids is not None else "no text or input_ids"
    if isinstance(prompt, list) and prompt:
        ids = _token_ids(prompt)
        if ids is not None:
            return ids
        prompt = prompt[0]  # a list of prompts is keyed on its first (radixfleet.keys)
        ids = _token_ids(prompt)
        if ids is not None:
            return ids
    if not isinstance(prompt, str) or not prompt:
        return f"no {field} string"
    out = {**base, "prompt": prompt}
    if endpoint is Endpoint.COMPLETIONS and body.get("add_special_tokens") is not None:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


def _digest(endpoint: Endpoint, req: dict) -> int:
    raw = json.dumps(req, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return xxhash.xxh3_64_intdigest(f"{endpoint.value}\x00{raw}".encode("utf-8", "surrogatepass"))


class EngineKeyer:
    """The /tokenize of one engine's workers (one served model, one tokenizer: the
    workers that name the same root share it) as a tokenizer (module docstring).

    Invariants (``check``): the cache holds at most ``cache_tokens`` ids in total and
    every entry's ids; an in-flight fetch is keyed by the digest it will fill."""

    __slots__ = (
        "source",
        "model",
        "timeout_s",
        "cache_tokens",
        "prom",
        "_cache",
        "_held",
        "_inflight",
        "_why",
    )

    #: TokenSpace asks; an engine renders its own chats
    chat_blocked = None

    def __init__(self, source: str, model: str, *, timeout_s: float, prom: Any, cache_tokens: int = 4 << 20):
        self.source = source  # "engine:<root or url>": the space id's tokenizer part
        self.model = model  # the served name /tokenize is asked for
        self.timeout_s = timeout_s
        self.cache_tokens = cache_tokens
        self.prom = prom  # radixfleet.engines.manager.EnginePrometheus
        self._cache: OrderedDict[int, array] = OrderedDict()  # digest -> ids, LRU order
        self._held = 0  # ids held in the cache
        self._inflight: dict[int, asyncio.Future] = {}
        #: digest -> why its last fetch failed (kept one request: the key that follows)
        self._why: dict[int, str] = {}

    def configure(self, timeout_s: float) -> None:
        """A reloaded ``tokenizers.engine_timeout_s``."""
        self.timeout_s = timeout_s

    async def prepare(self, session: aiohttp.ClientSession, url: str, endpoint: Endpoint, body: dict) -> bool:
        """Makes ``body``'s ids ready for ``key`` (fetched from the worker at ``url``
        unless cached or carried). True when it awaited the engine."""
        req = tokenize_request(endpoint, body, self.model)
        if not isinstance(req, dict):
            return False
        d = _digest(endpoint, req)
        if d in self._cache:
            self._cache.move_to_end(d)
            self.prom.engine_tokenize.labels("cached").inc()
            return False
        fut = self._inflight.get(d)
        if fut is None:
            fut = self._inflight[d] = asyncio.ensure_future(self._fetch(session, url, d, req))
            fut.add_done_callback(functools.partial(self._fetched, d))
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a worker's answer never fails a request
            log.exception("keying through %s's /tokenize failed; the request routes by load", url)
        return True

    def _fetched(self, d: int, fut: asyncio.Future) -> None:
        if self._inflight.get(d) is fut:
            del self._inflight[d]

    async def _fetch(self, session: aiohttp.ClientSession, url: str, d: int, req: dict) -> None:
        t0 = time.monotonic()
        why = None
        try:
            async with session.post(
                url + "/tokenize", json=req, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as r:
                raw = await r.content.read(MAX_BODY_BYTES + 1)
                status = r.status
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            why, status, raw = f"/tokenize took over {self.timeout_s} s", 0, b""
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            why, status, raw = f"/tokenize failed: {type(exc).__name__}", 0, b""
        self.prom.engine_tokenize_s.observe(time.monotonic() - t0)
        ids = None
        if why is None and status != 200:
            why = f"/tokenize answered {status}"
        elif why is None:
            try:
                obj = json.loads(raw) if len(raw) <= MAX_BODY_BYTES else None
            except ValueError:
                obj = None
            ids = _token_ids(obj.get("tokens")) if isinstance(obj, dict) else None
            if ids is None:
                why = "/tokenize answered no token ids"
        if ids is None:
            self.prom.engine_tokenize.labels("failed").inc()
            if len(self._why) > 1024:
                self._why.clear()
            self._why[d] = why or "?"
            return
        self.prom.engine_tokenize.labels("fetched").inc()
        self._cache[d] = ids
        self._held += len(ids)
        while self._held > self.cache_tokens and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._held -= len(old)

    def token_ids(self, endpoint: Endpoint, body: dict) -> tuple[array, str | None]:
        """The prepared ids of ``body``'s prompt, and why there are none (None: there are)."""
        req = tokenize_request(endpoint, body, self.model)
        if isinstance(req, array):
            return req, None
        if isinstance(req, str):
            return array("I"), req
        d = _digest(endpoint, req)
        ids = self._cache.get(d)
        if ids is not None:
            return ids, None
        return array("I"), self._why.pop(d, "not prepared: the engine was not asked")

    def key(
        self,
        endpoint: Endpoint,
        body: Any,
        *,
        block_size: int,
        model: Any = FROM_BODY,
        salt: Any = FROM_BODY,
        adapter: Any = FROM_BODY,
    ) -> TokenKey:
        """``TokenKeyer.key``'s contract, from the prepared ids. Raises
        ``MalformedRequest`` for a body that is not an object or a bad ``cache_salt``."""
        key = key_from_ids(self.token_ids, endpoint, body, block_size, model, salt, adapter)
        if key.unkeyed is not None:
            self.prom.engine_tokenize.labels("unkeyed").inc()
        return key

    def check(self) -> None:
        assert self._held == sum(len(v) for v in self._cache.values()), f"{self._held=}"
        assert self._held <= self.cache_tokens or len(self._cache) <= 1, f"{self._held=}"
