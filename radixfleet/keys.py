"""Prefix keys: the one way a request becomes a chain of block hashes (contract 1, docs/DESIGN.md).

A leaf module: no I/O, imported by the router, the worker agent and the simulator
alike, so that all three agree byte for byte on what a prefix is.

Pipeline::

    body (dict) --routing_bytes()--> canonical bytes --block_hashes()--> [h_1, h_2, ...]
                                          |
                          cut into blocks of block_bytes; the partial tail is not keyed
                          h_0 = namespace_seed(model, tenant, adapter)
                          h_k = xxh3_64(block_k, seed=h_{k-1})

Because every hash is seeded by its predecessor, ``h_k`` fingerprints the whole
prefix up to block k: equal text at different positions never collides, and two
requests share their first k hashes exactly when they share their first k blocks
under the same (model, tenant, adapter) namespace.

The canonical bytes are also the *prompt* the simulated engine tokenizes (its chat
template), so an agent can tell which router-space block ends inside which span of
its token radix tree. Tokens are ``BYTES_PER_TOKEN``-byte chunks of those bytes; the
template pads every segment to a whole number of tokens so that a conversation's
next turn re-tokenizes its history exactly as it was cached::

    [tools]   pad(<|tools|>\\n) pad(canonical-json(tools)<|end|>\\n)
    message   pad(<|role|>\\n)  pad(content<|end|>\\n)         (in order)
    gen       pad(<|assistant|>\\n)                            (chat only)

Token-id prompts are keyed on their ids as 4-byte little-endian words, which is
exactly what the byte-chunk tokenizer would have produced for the same bytes.
"""

from __future__ import annotations

import enum
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NewType

import xxhash

from radixfleet.wire.errors import MalformedRequest

BlockHash = NewType("BlockHash", int)
WorkerId = NewType("WorkerId", str)
TenantId = NewType("TenantId", str)

#: Bytes per token of the deterministic byte-chunk tokenizer (radixfleet_tools.agent.tokenizer).
#: The router estimates prompt tokens as ceil(bytes / BYTES_PER_TOKEN).
BYTES_PER_TOKEN = 4

#: Default routing block: 128 bytes, 32 tokens — chosen for index memory; see
#: bench/RESULTS.md for the index-memory consequences of this choice.
DEFAULT_BLOCK_BYTES = 128

#: Tenant used when no identity is configured.
DEFAULT_TENANT = TenantId("")

_xxh3 = xxhash.xxh3_64_intdigest


class Endpoint(enum.Enum):
    """The request shapes the router and agents key on."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    GENERATE = "/generate"


# Content-part kinds of the chat API we can key on, and how each renders. Images,
# audio and files render as a digest of their payload: the engine's KV depends on the
# media, so two different images must not share a key.
_MEDIA_PARTS = ("image_url", "input_audio", "file")
KNOWN_PART_TYPES = ("text", "refusal", *_MEDIA_PARTS)


def _pad(segment: bytes) -> bytes:
    """Pads with spaces to a whole number of tokens (see the module docstring)."""
    rem = len(segment) % BYTES_PER_TOKEN
    return segment if rem == 0 else segment + b" " * (BYTES_PER_TOKEN - rem)


def _utf8(text: str) -> bytes:
    """UTF-8 of any ``str`` a JSON parser can produce: a lone surrogate (``"\\ud800"``
    is valid JSON) is encoded as itself rather than refused, so keying never fails on
    it and equal strings always key equally."""
    return text.encode("utf-8", "surrogatepass")


def _canonical_json(value: Any) -> bytes:
    return _utf8(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False))


def _encode_ids(ids: list[Any], field: str) -> bytes:
    if not ids:
        raise MalformedRequest(f"'{field}' must not be empty", param=field)
    out = bytearray()
    for i, tok in enumerate(ids):
        if type(tok) is not int or not 0 <= tok < 2**32:
            raise MalformedRequest(
                f"'{field}[{i}]' must be a token id (an integer in [0, 2^32)), got {tok!r}",
                param=field,
            )
        out += tok.to_bytes(4, "little")
    return bytes(out)


def _text(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedRequest(f"'{field}' must be a string, got {type(value).__name__}", param=field)
    return _utf8(value)


def _completion_prompt(prompt: Any, field: str = "prompt") -> bytes:
    """``prompt``: a string, token ids, or a list of either (keyed on the first)."""
    if isinstance(prompt, str):
        return _text(prompt, field)
    if isinstance(prompt, list):
        if not prompt:
            raise MalformedRequest(f"'{field}' must not be empty", param=field)
        first = prompt[0]
        if isinstance(first, str):
            for i, p in enumerate(prompt):
                _text(p, f"{field}[{i}]")
            return _text(first, f"{field}[0]")
        if isinstance(first, list):
            for i, p in enumerate(prompt):
                if not isinstance(p, list):
                    raise MalformedRequest(f"'{field}[{i}]' must be a list of token ids", param=field)
            return _encode_ids(first, f"{field}[0]")
        if type(first) is int:
            return _encode_ids(prompt, field)
    raise MalformedRequest(
        f"'{field}' must be a string, a list of strings or a list of token ids, got {type(prompt).__name__}",
        param=field,
    )


def _content_bytes(content: Any, field: str) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return _utf8(content)
    if not isinstance(content, list):
        raise MalformedRequest(
            f"'{field}' must be a string or a list of content parts, got {type(content).__name__}",
            param=field,
        )
    out = bytearray()
    for i, part in enumerate(content):
        pf = f"{field}[{i}]"
        if not isinstance(part, dict):
            raise MalformedRequest(f"'{pf}' must be an object", param=field)
        kind = part.get("type")
        if kind == "text" or kind == "refusal":
            out += _text(part.get(kind), f"{pf}.{kind}")
        elif kind in _MEDIA_PARTS:
            payload = part.get(kind)
            if not isinstance(payload, dict):
                raise MalformedRequest(f"'{pf}.{kind}' must be an object", param=field)
            out += f"<|{kind}:{_xxh3(_canonical_json(payload)):016x}|>".encode("ascii")
        else:
            raise MalformedRequest(
                f"'{pf}.type' {kind!r} is not one of {', '.join(KNOWN_PART_TYPES)}",
                param=field,
            )
    return bytes(out)


def render_chat(body: dict[str, Any]) -> bytes:
    """The canonical chat template: tools first, then every message in order."""
    messages = body.get("messages")
    if messages is None:
        raise MalformedRequest("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise MalformedRequest("'messages' must be a non-empty list", param="messages")
    out = bytearray()
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise MalformedRequest("'tools' must be a list", param="tools")
        out += _pad(b"<|tools|>\n") + _pad(_canonical_json(tools) + b"<|end|>\n")
    for i, msg in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise MalformedRequest(f"'{field}' must be an object", param="messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise MalformedRequest(f"'{field}.role' must be a non-empty string", param="messages")
        seg = _content_bytes(msg.get("content"), f"{field}.content")
        if msg.get("tool_calls") is not None:
            seg += _canonical_json(msg["tool_calls"])
        out += _pad(b"<|" + _utf8(role) + b"|>\n") + _pad(seg + b"<|end|>\n")
    out += GENERATION_PROMPT
    return bytes(out)


#: What the template appends after the conversation: the assistant's turn begins.
GENERATION_PROMPT = _pad(b"<|assistant|>\n")


def routing_bytes(endpoint: Endpoint, body: Any) -> bytes:
    """Canonical routing bytes of a request body. Raises ``MalformedRequest``."""
    if not isinstance(body, dict):
        raise MalformedRequest(f"request body must be a JSON object, got {type(body).__name__}")
    if endpoint is Endpoint.CHAT:
        return render_chat(body)
    if endpoint is Endpoint.COMPLETIONS:
        if "prompt" not in body:
            raise MalformedRequest("'prompt' is required", param="prompt")
        return _completion_prompt(body["prompt"])
    # SGLang /generate: text or input_ids
    if body.get("text") is not None:
        return _completion_prompt(body["text"], "text")
    if body.get("input_ids") is not None:
        return _completion_prompt(body["input_ids"], "input_ids")
    raise MalformedRequest("'text' or 'input_ids' is required", param="text")


def namespace_seed(model: str, tenant: str = DEFAULT_TENANT, adapter: str | None = None) -> int:
    """h_0: the seed of a (model, tenant salt, LoRA adapter) namespace.

    Each field is length-prefixed (4-byte little-endian length, then its UTF-8), so
    no two different triples share an encoding: model ``ab`` + tenant ``c`` and
    model ``a`` + tenant ``bc`` are different namespaces, and so are fields that
    contain the separator a plain join would use. No adapter and ``""`` are the
    same namespace (both mean the base model)."""
    parts = [b"radixfleet-ns"]
    for f in (model, tenant, adapter or ""):
        b = _utf8(f)
        parts.append(len(b).to_bytes(4, "little") + b)
    return _xxh3(b"".join(parts))


def block_hashes(data: bytes, seed: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> list[int]:
    """Chained xxh3_64 hashes of the whole blocks of ``data``; the tail is not keyed.

    O(len(data)). ``h_k = xxh3_64(block_k, seed=h_{k-1})`` with ``h_0 = seed``.
    """
    out: list[int] = []
    append = out.append
    h = seed
    # bytes slices and a positional seed: ~25% faster than memoryview slices here
    for off in range(0, len(data) - block_bytes + 1, block_bytes):
        h = _xxh3(data[off : off + block_bytes], h)
        append(h)
    return out


def token_namespace_seed(model: str, salt: str = "", adapter: str | None = None, block_size: int = 0) -> int:
    """h_0 of a *token* key space (contract 8, docs/DESIGN.md): an engine's own token blocks.

    Fields are length-prefixed, so no two different (model, salt, adapter, block
    size) tuples share a seed, and a token chain never meets a byte chain (the
    leading tag differs from ``namespace_seed``'s).
    """
    parts = [b"radixfleet-tok"]
    for f in (model, salt, adapter or "", str(block_size)):
        b = f.encode("utf-8", "surrogatepass")
        parts.append(len(b).to_bytes(4, "little") + b)
    return _xxh3(b"".join(parts))


def token_block_hashes(token_ids: Sequence[int] | array[int], block_size: int, seed: int) -> list[int]:
    """Chained xxh3_64 hashes of the whole ``block_size``-token blocks of ``token_ids``.

    ``h_k = xxh3_64(uint32-le(tokens of block k), seed=h_{k-1})``, ``h_0 = seed``;
    the partial tail is not keyed (an engine caches whole blocks only). O(tokens).
    Used alike for a request's keys (radixfleet.engines.token_keys) and for the blocks
    an engine's events report (radixfleet.engines.block_map), so both meet in the index.
    Raises ``OverflowError`` for an id outside [0, 2^32).
    """
    buf = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)
    data = buf.tobytes()
    step = block_size * 4
    out: list[int] = []
    append = out.append
    h = seed
    for off in range(0, len(data) - step + 1, step):
        h = _xxh3(data[off : off + step], h)
        append(h)
    return out


def request_adapter(body: dict[str, Any]) -> str | None:
    """The LoRA adapter a request names (SGLang's ``lora_path`` or ``lora_adapter``)."""
    for field in ("lora_path", "lora_adapter"):
        value = body.get(field)
        if value is not None:
            if not isinstance(value, str):
                raise MalformedRequest(f"'{field}' must be a string", param=field)
            return value
    return None


def request_model(body: dict[str, Any], endpoint: Endpoint) -> str:
    model = body.get("model")
    if model is None:
        if endpoint is Endpoint.GENERATE:
            return ""
        raise MalformedRequest("'model' is required", param="model")
    if not isinstance(model, str):
        raise MalformedRequest("'model' must be a string", param="model")
    return model


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """A request's routing key: its namespace and the chain of block hashes."""

    model: str
    tenant: str
    adapter: str | None
    #: canonical routing bytes (also the simulated engine's prompt)
    data: bytes
    #: chained block hashes, one per whole block of ``data``
    hashes: list[int]
    block_bytes: int

    @property
    def prompt_tokens(self) -> int:
        """Estimated prompt tokens: ceil(bytes / BYTES_PER_TOKEN)."""
        return -(-len(self.data) // BYTES_PER_TOKEN)

    @property
    def block_tokens(self) -> int:
        return self.block_bytes // BYTES_PER_TOKEN


def check_block_bytes(block_bytes: int) -> int:
    """Validates a block size: a positive multiple of BYTES_PER_TOKEN."""
    if type(block_bytes) is not int or block_bytes <= 0 or block_bytes % BYTES_PER_TOKEN:
        raise ValueError(f"block_bytes must be a positive multiple of {BYTES_PER_TOKEN}, got {block_bytes!r}")
    return block_bytes


def request_key(
    endpoint: Endpoint,
    body: Any,
    *,
    tenant: str = DEFAULT_TENANT,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> PrefixKey:
    """The routing key of a request body. Raises ``MalformedRequest`` naming the field.

    ``tenant`` must come from an authenticated identity, never from the body.
    """
    data = routing_bytes(endpoint, body)
    model = request_model(body, endpoint)
    adapter = request_adapter(body)
    seed = namespace_seed(model, tenant, adapter)
    return PrefixKey(model, tenant, adapter, data, block_hashes(data, seed, block_bytes), block_bytes)
