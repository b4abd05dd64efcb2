"""A fake engine's prefix cache (LRU over leaf pages) that publishes vLLM-shape KV events."""

from __future__ import annotations

import hashlib
import time
from array import array

import msgpack

from radixfleet.keys import token_block_hashes, token_namespace_seed

MODEL = "tiny"


BS = 4  # tokens per block in the synthetic tests (vLLM's CPU build needs 32; any works)


U64 = 1 << 64


def seed_of(adapter, salt, block_size):
    return token_namespace_seed(MODEL, salt, adapter, block_size)


def stored_map(
    hashes,
    parent,
    tokens,
    bs=BS,
    *,
    lora_id=None,
    medium="GPU",
    lora_name=None,
    extra_keys=None,
    group_idx=0,
    kind="full_attention",
    **more,
):
    """A BlockStored as vLLM 0.32 encodes it: a map, ``type`` first."""
    d = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": bs,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }
    if extra_keys is not None:
        d["extra_keys"] = extra_keys
    d["group_idx"] = group_idx
    d["kv_cache_spec_kind"] = kind
    d.update(more)
    return d


def stored_tagged(hashes, parent, tokens, bs=BS, *rest):
    """A BlockStored as msgspec ``array_like=True, tag=True`` encodes it (older vLLM,
    SGLang): the tag, then fields in declaration order, trailing defaults omitted."""
    return ["BlockStored", list(hashes), parent, list(tokens), bs, *rest]


def removed_map(hashes, medium="GPU", group_idx=0):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group_idx}


def removed_tagged(hashes, *rest):
    return ["BlockRemoved", list(hashes), *rest]


class FakeEngine:
    """A small model of vLLM's prefix cache that emits vLLM's events.

    Blocks are keyed by an engine hash (SHA-256 of parent and tokens, low 64 bits:
    vLLM's scheme, with our own seed); a sequence caches its whole blocks; over
    ``capacity`` the least recently used *leaf* goes first (so every cached block's
    chain is cached and the expected index is exactly the cached set). ``truth`` is
    what the index must hold: our key of every cached block.
    """

    def __init__(self, capacity=64, bs=BS, seed=1, style="map"):
        self.capacity = capacity
        self.bs = bs
        self.style = style  # "map" (vLLM 0.32), "tagged" (older vLLM), "sglang"
        self.blocks = {}  # engine hash -> [parent hash | None, our key, last use, kids]
        self.clock = 0
        self.root = hashlib.sha256(f"root{seed}".encode()).digest()

    def _ehash(self, parent, toks, salt):
        h = hashlib.sha256(self.root if parent is None else parent.to_bytes(8, "big"))
        h.update(array("I", toks).tobytes())
        if parent is None and salt:
            h.update(salt.encode())
        return int.from_bytes(h.digest()[-8:], "big")

    def truth(self):
        return {b[1] for b in self.blocks.values()}

    def run(self, tokens, salt=""):
        """Caches ``tokens``' whole blocks; returns the step's events (wire form)."""
        bs = self.bs
        self.clock += 1
        n = len(tokens) // bs
        ours = token_block_hashes(tokens[: n * bs], bs, seed_of(None, salt, bs))
        parent = None
        first_new = None
        chain = []
        for i in range(n):
            e = self._ehash(parent, tokens[i * bs : (i + 1) * bs], salt)
            chain.append(e)
            if e in self.blocks:
                self.blocks[e][2] = self.clock
            elif first_new is None:
                first_new = i
            parent = e
        if first_new is None:
            return []
        events = []
        new = chain[first_new:]
        removed = self._evict(len(new), protect=set(chain))
        for e in removed:
            events.append(self._removed([e]))
        p = chain[first_new - 1] if first_new else None
        for i, e in enumerate(new, first_new):
            self.blocks[e] = [chain[i - 1] if i else None, ours[i], self.clock, 0]
            if i:
                self.blocks[chain[i - 1]][3] += 1
        toks = tokens[first_new * bs : n * bs]
        extra = [[salt] if (salt and first_new == 0 and j == 0) else None for j in range(len(new))]
        if self.style == "sglang":  # one event per block, signed hashes, no extras
            for j, e in enumerate(new):
                events.append(
                    [
                        "BlockStored",
                        [_signed(e)],
                        _signed(p) if p is not None else None,
                        toks[j * bs : (j + 1) * bs],
                        bs,
                        None,
                    ]
                )
                p = e
        elif self.style == "tagged":
            events.append(stored_tagged(new, p, toks, bs, None, "GPU", None, extra, 0))
        else:
            events.append(stored_map(new, p, toks, bs, extra_keys=extra))
        return events

    def _evict(self, need, protect):
        out = []
        while len(self.blocks) + need > self.capacity:
            leaves = [(b[2], e) for e, b in self.blocks.items() if b[3] == 0 and e not in protect]
            if not leaves:
                break
            _, e = min(leaves)
            p = self.blocks.pop(e)[0]
            if p is not None:
                self.blocks[p][3] -= 1
            out.append(e)
        return out

    def _removed(self, hashes):
        if self.style == "sglang":
            return ["BlockRemoved", [_signed(h) for h in hashes]]
        if self.style == "tagged":
            return removed_tagged(hashes, "GPU", 0)
        return removed_map(hashes)

    def clear(self):
        self.blocks.clear()
        return [["AllBlocksCleared"] if self.style != "map" else {"type": "AllBlocksCleared"}]

    def payload(self, events, ts=None):
        ts = time.time() if ts is None else ts
        return msgpack.packb([ts, events] if self.style == "sglang" else [ts, events, 0])


def _signed(h):
    return h - U64 if h >= 1 << 63 else h
