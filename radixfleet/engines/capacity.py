"""A plain engine's effective KV capacity, learned from its answers (approximate mode).

The router ages an approximate-mode worker's index entries at the engine's KV capacity
(``PrefixIndex.set_capacity``: its least recently used chains go first). The engine's
cache holds less of the prompts the router routed than that capacity: its KV also
holds what the router never hashes — the tokens it generated, every prompt's partial
last block, the running batch — so at the configured cap the index keeps chains the
engine has already evicted. The ``evict_older`` correction cannot see this: the
entries older than the engine's missing block are the ones the index's own LRU
dropped already (measured in the simulator's ``--feedback plain`` on the agent
workload: 26 over-predictions in 132 answers, 0 entries removed). What an answer does
show is how much less the engine holds: a request matched k blocks and the engine
reported c cached tokens, so it held at least ``k - c // block`` blocks fewer than the
index believed.

Rule, per answer with a match (additive decrease, slow additive increase)::

    over-predicted by d blocks    cap -= d                       (not below the floor)
    prediction held               cap += max(1, matched // 100)  (not above configured)

The floor is a quarter of the configured capacity: a burst of misses (a restart the
router has not noticed, a cache reset) must not shrink the index to nothing. Growth is
slow, ~1% of the match per answer that held, so a cap that is right stays near right
while the engine's own use of its KV (longer outputs, a bigger batch) changes.

Invariants (``check()``): ``floor <= blocks <= configured``, ``configured >= 1``.

A worker whose KV events come into sync goes back to its configured cap
(``EngineLink.events_synced``): the events say what it holds.

Why learn it: without events an index aged at the configured capacity keeps entries the
engine has evicted, and prefix_load sends requests to caches that no longer hold them;
the measured effect is in bench/RESULTS.md, "Engines that send nothing".
"""

from __future__ import annotations

from collections.abc import Sequence

#: growth per answer whose prediction held: this share of its matched blocks
GROW_SHARE = 0.01


class LearnedCapacity:
    """One worker's learned index cap, in index entries (blocks)."""

    __slots__ = ("configured", "blocks")

    def __init__(self, configured_blocks: int) -> None:
        if configured_blocks < 1:
            raise ValueError(f"configured_blocks must be >= 1, got {configured_blocks}")
        self.configured = configured_blocks
        self.blocks = configured_blocks

    @property
    def floor(self) -> int:
        return max(1, self.configured // 4)

    def observe(self, matched_blocks: int, lost_blocks: int) -> int:
        """One answer to a request that matched ``matched_blocks`` (> 0) on this
        worker, ``lost_blocks`` of them not cached there (0: the prediction held).
        Returns the new cap."""
        if lost_blocks > 0:
            self.blocks = max(self.floor, self.blocks - lost_blocks)
        else:
            grow = max(1, int(matched_blocks * GROW_SHARE))
            self.blocks = min(self.configured, self.blocks + grow)
        return self.blocks

    def check(self) -> None:
        assert self.configured >= 1, self.configured
        assert self.floor <= self.blocks <= self.configured, (self.blocks, self.configured)


def correct(
    index,
    worker: str,
    learned: LearnedCapacity | None,
    matched_blocks: int,
    predicted: int,
    cached: int,
    block_tokens: int,
    touches: Sequence[float | None] | None,
) -> int:
    """What an approximate-mode answer teaches the index about ``worker``: the live
    router's rule (``radixfleet.engines.link.EngineLink.observe``) and the simulator's
    (``--feedback plain``), one function. ``predicted`` / ``cached``: the tokens the
    index predicted cached and the worker reported; ``touches``: the matched blocks'
    last-use times before the request's hint. Returns the entries removed.

    Over-predicted: the first block the worker lacked was evicted, and least recently
    used first, every entry of ``worker`` last used before it (``evict_older``; the
    request's own chain stays, its prefill stored it again); the learned cap shrinks
    by the blocks lost. Held: the learned cap grows back a little.
    """
    removed = 0
    lost = 0
    if predicted > cached:
        lost = -(-(predicted - cached) // block_tokens)
        if touches:
            t = touches[min(cached // block_tokens, len(touches) - 1)]
            if t is not None:
                removed = index.evict_older(worker, t)
    if learned is not None and matched_blocks > 0:
        before = learned.blocks
        if learned.observe(matched_blocks, lost) != before:
            removed += index.set_capacity(worker, learned.blocks)
    return removed
