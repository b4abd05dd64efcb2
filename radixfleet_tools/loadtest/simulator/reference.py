"""The report's reference caches, for text-level and block-level prompts.

``oracle_hit_rate`` and ``pooled_hit_rate`` (``radixfleet_tools.loadtest.report``) are the share of
prompt tokens an unbounded single cache, and one LRU cache of the fleet's whole KV
capacity, would have served, over the requests in dispatch order. Text-level runs
use the load generator's own ``CacheReference`` unchanged (a token trie over the
canonical bytes, and the agent's RadixCache for the pooled LRU). Block-level runs
count *blocks*: the oracle is the same trie over block ids (each packed as one
4-byte trie "token"), the pooled cache the agent's RadixCache over block ids with
the fleet's capacity in whole blocks. A matched block counts its own token length
(``block_tokens``, or less for a partial last block, which is keyed apart from the
full block of the same id so that it can only match an identical partial block).
Answers are not cached at block level (a trace's prompts never contain them).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import xxhash

from radixfleet_tools.agent.radix_cache import KEY_TYPECODE, RadixCache, as_key
from radixfleet_tools.loadtest.prefix_trie import PrefixTrie, as_tokens
from radixfleet_tools.loadtest.report import CacheReference

__all__ = ["CacheReference", "TextReference", "BlockReference"]

_MASK32 = 2**32 - 1
_PARTIAL_TAG = 2**31


class TextReference(CacheReference):
    """``CacheReference`` fed with what the simulator already computed.

    The live load generator derives each prompt's canonical bytes and tokens itself;
    the simulator has them in hand (the engine needs them too), so these two methods
    do exactly what ``observe`` / ``observe_answer`` do — the same trie, the same
    agent ``RadixCache`` (``AgentLRU``), the same operations in the same order —
    without rendering and tokenizing every prompt twice more.
    ``tests/sim/test_core.py`` pins that both give the same numbers.
    """

    def _pooled(self, tokens) -> int:
        lru = self.pooled
        assert lru is not None, "callers check that the pooled LRU exists"
        tokens = as_key(tokens)  # converted once for both calls (the simulator's already are)
        cached, node = lru.cache.match_prefix(None, tokens)
        lru.cache.insert(None, tokens, below=node)  # resumes at the match: same tree
        over = lru.cache.total_tokens - lru.capacity_tokens
        if over > 0:
            lru.cache.evict(over)
        return cached

    def observe_prompt(self, data: bytes, tokens) -> tuple[int, int, int]:
        """``observe(spec)`` for a prompt of canonical ``data`` and agent ``tokens``."""
        pooled = self._pooled(tokens) if self.pooled is not None else 0
        padded = as_tokens(data)
        return len(padded) // 4, self.oracle.serve(padded), pooled

    def observe_answer_bytes(self, data: bytes, tokens, answer: bytes, answer_tokens) -> None:
        """``observe_answer(spec, answer)`` given the prompt's and the answer's bytes
        and tokens (the answer is whole 4-byte tokens, as the agent generates)."""
        if not self.cache_outputs or not answer or len(data) % 4:
            return
        self.oracle.serve(data + answer)
        if self.pooled is not None:
            self._pooled(as_key(tokens) + as_key(answer_tokens))

    def observe_unread_answer(self, data: bytes, tokens, n_tokens: int, uid: int) -> None:
        """``observe_answer_bytes`` for an answer nobody sends back (a single-shot
        request): ``n_tokens`` tokens that occur in no prompt, standing for its text.

        Such an answer can only ever be a cache's unmatched tail, so what it changes
        is the pooled LRU's occupancy and order — kept exactly with ``n_tokens`` copies
        of ``uid`` (an id outside the tokenizer's range, unique per answer) in place of
        text. The unbounded oracle is left alone: a branch no prompt can match changes
        none of its counts. Generating and tokenizing the text cost more than the
        rest of a short request's simulation."""
        if not self.cache_outputs or n_tokens <= 0 or len(data) % 4:
            return
        if self.pooled is not None:
            self._pooled(as_key(tokens) + array(KEY_TYPECODE, (uid,)) * n_tokens)


def partial_unit(block_id: int, tokens: int) -> int:
    """The trie unit of a partial last block of ``tokens`` tokens (never a real id,
    which is below 2**31)."""
    return _PARTIAL_TAG | (
        xxhash.xxh3_64_intdigest(struct.pack("<QQ", block_id, tokens)) & (_PARTIAL_TAG - 1)
    )


class BlockReference:
    """Oracle and pooled caches over block-id sequences (block-level traces).

    ``observe(block_ids, prompt_tokens, last_tokens)`` returns ``(prompt_tokens,
    oracle_cached, pooled_cached)`` for one prompt, then caches it in both tries.
    Call in dispatch order. ``oracle=False`` keeps no oracle (its figure is then 0):
    ``radixfleet analyze`` runs the pooled cache alone at many capacities.
    """

    def __init__(self, kv_capacity_tokens: int | None, block_tokens: int, *, oracle: bool = True) -> None:
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_tokens = block_tokens
        self.oracle = PrefixTrie() if oracle else None
        # the pooled cache counts blocks: the fleet's capacity in whole blocks. It is
        # the agent's own RadixCache (as radixfleet_tools.loadtest.report.AgentLRU), whose LRU eviction
        # is O(log n) per leaf where PrefixTrie rescans its leaves.
        self.pooled_blocks = max(1, kv_capacity_tokens // block_tokens) if kv_capacity_tokens else 0
        self.pooled = (
            RadixCache(capacity_tokens=self.pooled_blocks, record_events=False)
            if kv_capacity_tokens
            else None
        )

    @staticmethod
    def pack(units: Sequence[int]) -> bytes:
        """Block units as trie tokens (4 bytes each; ids are folded into 32 bits)."""
        return struct.pack(f"<{len(units)}I", *[u & _MASK32 for u in units])

    def observe(self, block_ids: Sequence[int], prompt_tokens: int, last_tokens: int) -> tuple[int, int, int]:
        units = list(block_ids)
        if last_tokens < self.block_tokens and units:
            units[-1] = partial_unit(units[-1], last_tokens)
        n = len(units)
        oracle = 0
        if self.oracle is not None:
            oracle = self._tokens(self.oracle.serve(self.pack(units)), n, prompt_tokens, last_tokens)
        pooled = 0
        if self.pooled is not None:
            cache = self.pooled
            key = as_key(units)
            got, node = cache.match_prefix(None, key)
            cache.insert(None, key, below=node)
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
        if self.oracle is not None:
            self.oracle.check()
        if self.pooled is not None:
            self.pooled.check()
            assert self.pooled.total_tokens <= self.pooled_blocks
