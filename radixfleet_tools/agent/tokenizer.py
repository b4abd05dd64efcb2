"""The deterministic byte-chunk tokenizer of the simulated engine.

A token is a ``BYTES_PER_TOKEN``-byte (4) chunk of the prompt's canonical bytes
(``radixfleet.keys.routing_bytes`` -- that function *is* the chat template),
read as a little-endian unsigned integer::

    b"abcdefghij"  ->  [LE("abcd"), LE("efgh"), LE("ij") + 2**32 * 2]
                        full chunks: [0, 2**32)    partial tail: 2**32 * len + LE(bytes)

Properties the cache and the router rely on:

- **Prefix-stable**: the tokens of ``a + b`` start with the full-chunk tokens of
  ``a`` whenever ``len(a)`` is a multiple of 4 (the chat template pads every segment
  so, and a conversation's next turn re-tokenizes its history exactly as cached).
- **Partial tails are distinguishable**: a trailing 1-3 byte chunk never equals a
  full chunk, so "ab" and "abcd" do not share a token.
- **Token ids pass through**: ``prefix_keys`` encodes a token-id prompt as 4-byte
  LE words, so ``encode`` of those bytes returns the ids themselves.

Generated text is deterministic from a seed: every generated token is 4 ASCII bytes
(a space and three lowercase letters), so an answer echoed back in the next turn
keeps the template's alignment.
"""

from __future__ import annotations

import sys
from array import array

import numpy as _np
import xxhash

from radixfleet.keys import BYTES_PER_TOKEN

#: Offset that marks a partial (1-3 byte) tail token: ``PARTIAL * len + LE(bytes)``.
PARTIAL = 2**32

_LITTLE = sys.byteorder == "little"
#: an array typecode of exactly 4 bytes ("I" on every mainstream platform)
_U32 = next(t for t in ("I", "L") if array(t).itemsize == 4)
_xxh3 = xxhash.xxh3_64_intdigest
_ZERO = (0,)

# 4096 generated "words": b" " + three lowercase letters, all distinct.
_LETTERS = b"abcdefghijklmnopqrstuvwxyz"
_VOCAB: list[bytes] = []
for _i in range(4096):
    _h = _xxh3(_i.to_bytes(4, "little"), seed=0x5EED)
    _w = b" " + bytes(_LETTERS[(_h >> (8 * k)) % 26] for k in range(3))
    _VOCAB.append(_w)
_VOCAB = list(dict.fromkeys(_VOCAB))  # drop the rare duplicate, keep order
VOCAB_SIZE = len(_VOCAB)
#: token id of each generated word (a full 4-byte chunk)
_VOCAB_IDS = [int.from_bytes(w, "little") for w in _VOCAB]


def encode(data: bytes) -> list[int]:
    """Tokens of ``data``: O(len(data)), one list allocation."""
    n_full = len(data) // BYTES_PER_TOKEN
    cut = n_full * BYTES_PER_TOKEN
    words = array(_U32)
    words.frombytes(data[:cut])
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        words.byteswap()
    out = words.tolist()
    tail = data[cut:]
    if tail:
        out.append(PARTIAL * len(tail) + int.from_bytes(tail, "little"))
    return out


def encode_key(data: bytes) -> array:
    """``encode(data)`` as a radix-cache key (``array('Q')``, ``radix_cache.as_key``):
    the same token ids, widened from 4 to 8 bytes by numpy in one vectorised pass,
    with no int object per token. O(len(data))."""
    n_full = len(data) // BYTES_PER_TOKEN
    out = array("Q", _ZERO) * n_full
    if n_full:
        # read as little-endian u32 whatever the host, widen into the key's own buffer
        view = _np.frombuffer(out, dtype=_np.uint64)
        view[:] = _np.frombuffer(data, dtype="<u4", count=n_full)
        del view  # release the buffer export: the array may grow below
    tail = data[n_full * BYTES_PER_TOKEN :]
    if tail:
        out.append(PARTIAL * len(tail) + int.from_bytes(tail, "little"))
    return out


def decode(tokens) -> bytes:
    """The bytes ``tokens`` stand for (inverse of ``encode``)."""
    out = bytearray()
    for t in tokens:
        if t < PARTIAL:
            out += t.to_bytes(4, "little")
        else:
            n, v = divmod(t, PARTIAL)
            if not 1 <= n < BYTES_PER_TOKEN:
                raise ValueError(f"not a token of this tokenizer: {t}")
            out += v.to_bytes(n, "little")
    return bytes(out)


def is_aligned(tokens) -> bool:
    """True when no token is a partial tail (the bytes are a whole number of tokens)."""
    return not tokens or tokens[-1] < PARTIAL


def generate(seed: int, n: int) -> list[int]:
    """``n`` deterministic generated tokens for ``seed`` (each 4 ASCII bytes).

    Token ``i`` depends only on ``(seed, i)``, so a shorter answer is a prefix of a
    longer one with the same seed.
    """
    seed &= 2**64 - 1
    ids = _VOCAB_IDS
    size = VOCAB_SIZE
    return [ids[_xxh3(i.to_bytes(4, "little"), seed=seed) % size] for i in range(n)]


def request_seed(prompt: bytes, agent_seed: int = 0) -> int:
    """The generation seed of a prompt: the same prompt gets the same answer (greedy-like)."""
    return _xxh3(prompt, seed=agent_seed & (2**64 - 1))
