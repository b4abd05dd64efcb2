"""The report's reference caches, for text-level and block-level prompts.

``oracle_hit_rate`` and ``pooled_hit_rate`` (``loadtest.report``) are the share of
prompt tokens an unbounded single cache, and one LRU cache of the fleet's whole KV
capacity, would have served, over the requests in dispatch order. Text-level runs
use the load generator's own ``CacheReference`` unchanged (a token trie over the
canonical bytes). Block-level runs keep the same two tries over *block ids*: each
id is packed as one 4-byte trie "token", so the tries count blocks, and a matched
block counts its own token length (``block_tokens``, or less for a partial last
block, which is keyed apart from the full block of the same id so that it can only
match an identical partial block).
"""

from __future__ import annotations

import struct
from typing import Sequence

import xxhash

from loadtest.prefix_trie import PrefixTrie
from loadtest.report import CacheReference
from worker_agent.radix_cache import RadixCache

__all__ = ["CacheReference", "BlockReference"]

_MASK32 = 2**32 - 1
_PARTIAL_TAG = 2**31


def partial_unit(block_id: int, tokens: int) -> int:
    """The trie unit of a partial last block of ``tokens`` tokens (never a real id,
    which is below 2**31)."""
    return _PARTIAL_TAG | (xxhash.xxh3_64_intdigest(struct.pack("<QQ", block_id, tokens))
                           & (_PARTIAL_TAG - 1))


class BlockReference:
    """Oracle and pooled caches over block-id sequences (block-level traces).

    ``observe(block_ids, prompt_tokens, last_tokens)`` returns ``(prompt_tokens,
    oracle_cached, pooled_cached)`` for one prompt, then caches it in both tries.
    Call in dispatch order.
    """

    def __init__(self, kv_capacity_tokens: int | None, block_tokens: int) -> None:
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_tokens = block_tokens
        self.oracle = PrefixTrie()
        # the pooled cache counts blocks: the fleet's capacity in whole blocks. It is
        # the agent's own RadixCache (as loadtest.report.AgentLRU), whose LRU eviction
        # is O(log n) per leaf where PrefixTrie rescans its leaves.
        self.pooled_blocks = max(1, kv_capacity_tokens // block_tokens) if kv_capacity_tokens else 0
        self.pooled = RadixCache(capacity_tokens=self.pooled_blocks, record_events=False) \
            if kv_capacity_tokens else None

    @staticmethod
    def pack(units: Sequence[int]) -> bytes:
        """Block units as trie tokens (4 bytes each; ids are folded into 32 bits)."""
        return struct.pack(f"<{len(units)}I", *[u & _MASK32 for u in units])

    def observe(self, block_ids: Sequence[int], prompt_tokens: int,
                last_tokens: int) -> tuple[int, int, int]:
        units = list(block_ids)
        if last_tokens < self.block_tokens and units:
            units[-1] = partial_unit(units[-1], last_tokens)
        data = self.pack(units)
        n = len(units)
        oracle = self._tokens(self.oracle.serve(data), n, prompt_tokens, last_tokens)
        pooled = 0
        if self.pooled is not None:
            cache = self.pooled
            got, _ = cache.match_prefix(None, units)
            cache.insert(None, units)
            over = cache.total_tokens - self.pooled_blocks
            if over > 0:
                cache.evict(over)
            pooled = self._tokens(got, n, prompt_tokens, last_tokens)
        return prompt_tokens, oracle, pooled

    def _tokens(self, blocks: int, n: int, prompt_tokens: int, last_tokens: int) -> int:
        if blocks >= n:
            return prompt_tokens
        return blocks * self.block_tokens

    def check(self) -> None:
        self.oracle.check()
        if self.pooled is not None:
            self.pooled.check()
            assert self.pooled.total_tokens <= self.pooled_blocks

