"""The prefix index's colder KV tiers: blocks a worker's engine holds outside GPU
memory, beside the tree (``radixfleet.index.prefix_index.PrefixIndex``'s base; it works on the
index's own state, and ``PrefixIndex.check`` asserts its invariants too).

Colder tiers. An engine that offloads KV (vLLM's CPU offloading, a disk or remote
store) still holds a block it evicted from GPU memory, one load away: such a hit saves
the prefill but costs the load back. ``tier_add(w, tier, keys)`` / ``tier_discard``
record the blocks w holds in a colder tier (``COLDER_TIERS``: "cpu", then "disk"), a
set of keys per (tier, worker) beside the tree, independent of it: offloading is
inclusive (a block may be held in GPU memory and in CPU memory at once), a block
leaves one tier without leaving the other, and the engine reports no parent for an
offloaded block (a key's holders per tier are kept too, for the match: ~2x the
memory of one set entry per block). ``match_tiers(hashes, match)`` extends each worker's GPU prefix
(``match.blocks[w]``) block by block through the colder tiers, each block counted in
the warmest colder tier holding it, as the engine looks them up: from its own
prefix hit onward. The tree's budget and caps do not count them (a colder tier is the
engine's own bounded memory, and every block it evicts is reported removed: the
tier sets hold at most what the engines' colder tiers hold); ``clear`` leaves them
and ``clear_tiers`` (an engine restart, an event gap) drops them; ``drop_worker``
drops both. The hot paths (``match``, ``insert``) never look at them.

Tier invariants (``check()``):

- Every tier is one of ``COLDER_TIERS``; no (tier, worker) set is empty; every key is
  an int in [0, 2**64).
- ``_tier_entries`` equals the number of (tier, worker, key) entries.
- ``_tier_holders`` (key -> holders, per tier: what the match walks) names exactly
  the (worker, key) pairs of the sets; a holder set has at least two members.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from radixfleet.policies.base import MatchResult

#: colder KV tiers, warmest first (the GPU tier is the tree itself); an engine's
#: ``medium`` is mapped onto them by ``radixfleet.engines.block_map``
COLDER_TIERS = ("cpu", "disk")
_U64 = 1 << 64


class ColderTiers:
    """The colder-tier sets of ``PrefixIndex`` (module docstring)."""

    #: colder tier -> worker -> keys it holds there
    _tiers: dict[str, dict[str, set[int]]]
    #: colder tier -> key -> its holders there (str: one, set: several), for the match
    _tier_holders: dict[str, dict[int, Any]]
    _tier_entries: int

    def _init_tiers(self) -> None:
        self._tiers = {t: {} for t in COLDER_TIERS}
        self._tier_holders = {t: {} for t in COLDER_TIERS}
        self._tier_entries = 0

    def tier_entries(self, worker: str) -> dict[str, int]:
        """Blocks ``worker`` holds per colder tier (every tier named, 0 included)."""
        return {t: len(ws.get(worker, ())) for t, ws in self._tiers.items()}

    def tier_holds(self, worker: str, tier: str, key: int) -> bool:
        ws = self._tiers.get(tier)
        keys = ws.get(worker) if ws is not None else None
        return keys is not None and key in keys

    def match_tiers(self, hashes: Sequence[int], match: MatchResult) -> dict[str, dict[str, int]]:
        """Per holder with colder-tier blocks, how far each colder tier extends its GPU
        prefix ``match.blocks[w]`` ({worker: {tier: blocks}}, only extensions > 0).
        Each block after the GPU prefix counts in the warmest colder tier holding it;
        the walk stops at the first block no colder tier holds. O(1) with no colder
        entries at all, else O(tiers * (holders in ``match`` + colder holders of the
        first block) + blocks extended)."""
        if not self._tier_entries or not hashes:
            return {}
        maps = [(t, m) for t, m in self._tier_holders.items() if m]
        blocks: Any = match.blocks  # keyed by holder (a worker, or a worker's part)
        n = len(hashes)
        starts: dict[str, int] = {}
        # holders without a GPU prefix start at block 0 ...
        k0 = hashes[0]
        for _, m in maps:
            h = m.get(k0)
            if h is not None:
                for w in (h,) if h.__class__ is str else h:
                    if not blocks.get(w):
                        starts[w] = 0
        # ... the others where their GPU prefix stops, if a colder tier holds that block
        for w, g in blocks.items():
            if g < n:
                key = hashes[g]
                for _, m in maps:
                    h = m.get(key)
                    if h is not None and (h == w if h.__class__ is str else w in h):
                        starts[w] = g
                        break
        out: dict[str, dict[str, int]] = {}
        if len(maps) == 1:
            # one colder tier in use (the usual case): a tight walk per holder
            t, get = maps[0][0], maps[0][1].get
            for w, i in starts.items():
                j = i + 1  # the start block is held (checked above)
                while j < n:
                    h = get(hashes[j])
                    if h is None or (h != w if h.__class__ is str else w not in h):
                        break
                    j += 1
                out[w] = {t: j - i}
            return out
        for w, i in starts.items():
            ext: dict[str, int] = {}
            while i < n:
                key = hashes[i]
                for t, m in maps:
                    h = m.get(key)
                    if h is not None and (h == w if h.__class__ is str else w in h):
                        ext[t] = ext.get(t, 0) + 1
                        break
                else:
                    break
                i += 1
            out[w] = ext
        return out

    def tier_add(self, worker: str, tier: str, keys: Iterable[int]) -> int:
        """Records that ``worker`` holds ``keys`` in the colder ``tier`` (one of
        ``COLDER_TIERS``). Returns the number newly held. O(keys)."""
        ws = self._tiers[tier]
        hm = self._tier_holders[tier]
        held = ws.get(worker)
        if held is None:
            held = set()
        added = 0
        for k in keys:
            if k in held:
                continue
            held.add(k)
            added += 1
            h = hm.get(k)
            if h is None:
                hm[k] = worker
            elif h.__class__ is str:
                hm[k] = {h, worker}
            else:
                h.add(worker)
        if held:
            ws[worker] = held
        self._tier_entries += added
        return added

    def tier_discard(self, worker: str, tier: str, keys: Iterable[int]) -> int:
        """Records that ``worker`` no longer holds ``keys`` in ``tier``. Returns the
        number it held. O(keys)."""
        held = self._tiers[tier].get(worker)
        if held is None:
            return 0
        gone = 0
        for k in keys:
            if k in held:
                held.discard(k)
                self._tier_unhold(tier, k, worker)
                gone += 1
        self._tier_entries -= gone
        if not held:
            del self._tiers[tier][worker]
        return gone

    def clear_tiers(self, worker: str) -> int:
        """Drops every colder-tier entry of ``worker``. Returns how many. O(them)."""
        removed = 0
        for tier, ws in self._tiers.items():
            held = ws.pop(worker, None)
            if held is not None:
                removed += len(held)
                for k in held:
                    self._tier_unhold(tier, k, worker)
        self._tier_entries -= removed
        return removed

    def _tier_unhold(self, tier: str, key: int, worker: str) -> None:
        hm = self._tier_holders[tier]
        h = hm[key]
        if h.__class__ is str:
            del hm[key]
        else:
            h.discard(worker)
            if len(h) == 1:
                hm[key] = next(iter(h))

    def _check_tiers(self) -> None:
        """Asserts the tier invariants (module docstring)."""
        tier_entries = 0
        assert set(self._tiers) == set(COLDER_TIERS), f"tiers {set(self._tiers)}"
        for tier, ws in self._tiers.items():
            for w, keys in ws.items():
                assert keys, f"empty {tier} set of {w=}"
                tier_entries += len(keys)
                for k in keys:
                    assert k.__class__ is int and 0 <= k < _U64, f"{tier} key {k!r} of {w=}"
        assert tier_entries == self._tier_entries, f"{tier_entries=} vs {self._tier_entries=}"
        for tier, hm in self._tier_holders.items():
            ws = self._tiers[tier]
            pairs = 0
            for k, h in hm.items():
                hs = {h} if h.__class__ is str else h
                assert h.__class__ is str or len(h) >= 2, f"{tier} holders of {k:#x}: {h!r}"
                for w in hs:
                    assert k in ws.get(w, ()), f"{tier} holders of {k:#x} name {w=}, who lacks it"
                pairs += len(hs)
            assert pairs == sum(map(len, ws.values())), f"{tier}: holder map disagrees with the sets"
