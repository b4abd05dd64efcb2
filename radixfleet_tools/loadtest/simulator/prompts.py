"""What the simulator routes and caches: a request's prompt at text or block level.

Two levels, one shape (``SimPrompt``)::

    text level   spec.body --routing_bytes--> canonical bytes (contract 1, docs/DESIGN.md)
                   units  = the agent tokenizer's tokens of those bytes
                            (``tokenizer.encode_key``: an ``array('Q')``, built in C)
                   hashes = radixfleet.keys.block_hashes(bytes, ns, block_bytes)
    block level  a trace record (timestamp, input_length, output_length, hash_ids)
                   units  = the block's id, repeated for each of its tokens
                            (an ``array('Q')`` built in C: no text is synthesized
                            or tokenized)
                   hashes = chained xxh3 over the ids of the whole blocks:
                            h_k = xxh3_64(id_k as 8 LE bytes, seed=h_{k-1}), h_0 = ns

Block-level units have exactly the sharing structure of the text the load
generator's ``Trace`` workload would synthesize: two prompts share their first n
tokens iff they share the blocks those tokens fall in (ids are prefix-chained, so
one id never sits at two positions of a prompt), and a partial last block is a
prefix of the full block of the same id. Units are ``array('Q')`` cache keys
(``radixfleet_tools.agent.radix_cache.as_key``): a prompt is built by repeating each id in C,
and the cache copies and compares it with memcpy/memcmp, never an int object per
token. So the agent's cache, at page size 1,
serves the same tokens at both levels; only the router's block size differs (the
trace's block, not ``block_bytes``), which is what makes a 125k-token prompt cost
~250 hashes instead of ~4,000. The router keys only whole blocks (contract 1, docs/DESIGN.md).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from radixfleet.keys import BYTES_PER_TOKEN, block_hashes
from radixfleet.wire.errors import WorkloadError
from radixfleet_tools.agent.radix_cache import KEY_TYPECODE
from radixfleet_tools.loadtest.report import prompt_bytes
from radixfleet_tools.loadtest.workloads import API_CHAT, RequestSpec

_xxh3 = xxhash.xxh3_64_intdigest
#: block ids the reference caches can pack (4 bytes each, top bit kept for partials)
MAX_BLOCK_ID = 2**31 - 1


@dataclass(slots=True)
class SimPrompt:
    """One prompt as the simulated fleet sees it. Built once per request; the
    simulation drops ``units`` and ``data`` (None) once its request is done."""

    #: radix-cache key (``array('Q')``): tokens (text level) or block units (block level)
    units: Sequence[int] | None
    #: router-space chained block hashes (whole blocks only)
    hashes: list[int]
    #: prompt tokens (the engine's count)
    prompt_tokens: int
    #: characters of routing text (SGLang cache_aware's match rate)
    text_len: int
    #: tokens per trace block (block level), else 1
    unit_tokens: int = 1
    #: tokens of the last trace block (block level: less than unit_tokens when partial)
    last_tokens: int = 1
    #: canonical routing bytes (text level only; the agent's answer seed)
    data: bytes | None = None
    #: the trace's block ids (block level only; the reference caches count blocks)
    block_ids: list[int] | None = None


def chain_block_ids(ids: Sequence[int], seed: int) -> list[int]:
    """Router-space hashes of a block-id chain: ``h_k = xxh3_64(id_k, seed=h_{k-1})``."""
    out: list[int] = []
    append = out.append
    h = seed
    pack = struct.Struct("<Q").pack
    for i in ids:
        h = _xxh3(pack(i), seed=h)
        append(h)
    return out


def block_prompt(ids: Sequence[int], input_length: int, block_tokens: int, seed: int) -> SimPrompt:
    """A trace record's prompt at block level. Raises ``WorkloadError`` on a bad id."""
    full, last = divmod(input_length, block_tokens)
    if len(ids) != full + (1 if last else 0):
        raise WorkloadError(
            f"{len(ids)} hash ids do not cover input_length {input_length} in blocks of {block_tokens}"
        )
    for i in ids:
        if not 0 <= i <= MAX_BLOCK_ID:
            raise WorkloadError(f"hash id {i} out of range [0, {MAX_BLOCK_ID}]")
    # each id's 8 bytes repeated per token, joined once: one exact-size buffer (an
    # array grown block by block reallocates, and copies, about once per block)
    order = sys.byteorder
    parts = [i.to_bytes(8, order) * block_tokens for i in ids]
    if last:
        parts[-1] = parts[-1][: 8 * last]
    units = array(KEY_TYPECODE)
    units.frombytes(b"".join(parts))
    if last:
        hashes = chain_block_ids(ids[:-1], seed)
    else:
        hashes = chain_block_ids(ids, seed)
        last = block_tokens
    return SimPrompt(
        units, hashes, input_length, input_length * BYTES_PER_TOKEN, block_tokens, last, None, list(ids)
    )


def text_prompt(
    spec: RequestSpec, seed: int, block_bytes: int, tokenize: Callable[[bytes], Sequence[int]]
) -> SimPrompt:
    """A spec's prompt at text level: the agent's tokens and the router's hashes."""
    data = prompt_bytes(spec)
    units = tokenize(data)
    return SimPrompt(units, block_hashes(data, seed, block_bytes), len(units), len(data), 1, 1, data)


def truncate(p: SimPrompt, blocks: int, block_tokens: int) -> SimPrompt:
    """The first ``blocks`` router blocks of a prompt (a hot-root warm-up's prompt)."""
    n = blocks * block_tokens
    assert p.units is not None, "a routed prompt has its radix-cache key"
    if p.data is None:  # block level: whole blocks of block_tokens
        assert p.block_ids is not None, "block-level prompts carry their block ids"
        units = p.units[:n]
        return SimPrompt(
            units,
            p.hashes[:blocks],
            len(units),
            len(units) * BYTES_PER_TOKEN,
            p.unit_tokens,
            block_tokens,
            None,
            p.block_ids[:blocks],
        )
    data = p.data[: n * BYTES_PER_TOKEN]
    return SimPrompt(p.units[:n], p.hashes[:blocks], min(n, len(p.units)), len(data), 1, 1, data)


def endpoint_of(spec: RequestSpec) -> str:
    return "chat" if spec.api == API_CHAT else "completions"
