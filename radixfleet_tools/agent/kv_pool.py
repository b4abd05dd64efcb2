"""The KV pool: one budget of token slots shared by the radix tree and running requests.

::

    capacity = tree (cache.total_tokens) + private + reserved + available
               |                           |         |
               |                           |         '- promised to admitted requests,
               |                           |            not yet computed (rest of the
               |                           |            prompt + remaining max_tokens)
               |                           '- computed KV owned by running requests and
               |                              not (or not yet) in the tree
               '- cached prefixes, locked (in use) or evictable

Invariants (``check()``): private, reserved >= 0 and tree + private + reserved <=
capacity. Only the scheduler moves tokens between the buckets; an allocation that
does not fit evicts cold tree leaves first (``reserve``) and otherwise fails, and the
request waits.
"""

from __future__ import annotations

from radixfleet_tools.agent.radix_cache import RadixCache


class KVPool:
    __slots__ = ("capacity", "cache", "private", "reserved")

    def __init__(self, capacity_tokens: int, cache: RadixCache) -> None:
        if type(capacity_tokens) is not int or capacity_tokens <= 0:
            raise ValueError(f"KV capacity must be a positive number of tokens, got {capacity_tokens!r}")
        self.capacity = capacity_tokens
        self.cache = cache
        #: computed KV of running requests outside the tree (scheduler-owned)
        self.private = 0
        #: slots promised to admitted requests (scheduler-owned)
        self.reserved = 0

    @property
    def used(self) -> int:
        """Tokens holding KV now: the tree plus running requests' own KV."""
        return self.cache.total_tokens + self.private

    @property
    def available(self) -> int:
        return self.capacity - self.cache.total_tokens - self.private - self.reserved

    def reserve(self, n: int) -> bool:
        """Promises ``n`` slots, evicting unlocked LRU leaves if needed; False if it
        cannot fit even after evicting everything evictable (nothing is reserved then,
        but what was evicted stays evicted)."""
        short = n - self.available
        if short > 0:
            if short > self.cache.evictable_tokens:
                return False
            self.cache.evict(short)
            if n > self.available:  # pragma: no cover - evict frees whole leaves
                return False
        self.reserved += n
        return True

    def commit(self, n: int) -> None:
        """``n`` reserved slots now hold computed KV."""
        self.reserved -= n
        self.private += n

    def release(self, private: int, reserved: int) -> None:
        """Returns a request's own KV and unused reservation to the free slots."""
        self.private -= private
        self.reserved -= reserved

    def check(self) -> None:
        assert self.private >= 0 and self.reserved >= 0, (self.private, self.reserved)
        assert self.cache.total_tokens + self.private + self.reserved <= self.capacity, (
            self.cache.total_tokens,
            self.private,
            self.reserved,
            self.capacity,
        )
