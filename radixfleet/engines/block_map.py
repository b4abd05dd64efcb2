"""One worker's engine blocks mapped to the router's own keys, applied to the index.

An engine names its cached blocks by its own hashes (vLLM: SHA-256 over a pickle
with a configurable seed; SGLang: another scheme). The router does not reproduce
them — that would break whenever an operator changes the algorithm or seed — but
re-keys every stored block from the tokens the event carries, in the same token
space the router keys requests in (contract 8, ``radixfleet.keys``)::

    event BlockStored(hashes=[e1, e2], parent=e0, tokens=t[0:2B])
                       |            parent e0 -> our key k0 (this map)
                       v
    k1, k2 = token_block_hashes(t, B, seed=k0)     k_i = xxh3_64(block i, seed=k_{i-1})
    index.insert(worker, [k1, k2], now, parent=k0);  map[e1] = k1, map[e2] = k2

    parent None -> seed = root_seed(lora_name, cache_salt, B)   (the caller's
                   token_namespace_seed(model, salt, adapter, B): a request of the
                   same model, adapter and salt starts from the same seed)

so a stored chain gets exactly the keys a request with the same tokens gets.

What is applied. Blocks in KV-cache group 0 (or unspecified): a hybrid model's
other groups (sliding window, Mamba) hold the same tokens again under their own
hashes; those events are counted (``other_tier``) and ignored. The GPU tier
(``medium`` "GPU" or unspecified) goes into the index's tree: the index answers "how
much of this prompt can this worker skip prefilling". A block offloaded to a colder
tier (``medium`` "CPU", "DISK", "STORAGE", ...: ``tier_of``) must be loaded back first
(vLLM reports it as an external hit) and goes into the index's colder-tier sets
(``PrefixIndex.tier_add``), priced by the router (``radixfleet.engines.tier_price``).
vLLM's offloading reports such a block without tokens or parent, under the same
engine hash as its GPU copy: it is keyed through this map (the GPU store came
first); a colder store with tokens (another publisher's) is keyed from them like a
GPU one. A block the engine holds only in a colder tier keeps its key in ``_cold``
(engine hash -> (key, tier bits)) after its GPU copy is removed; a colder store of
a hash never mapped cannot be keyed (``cold_unmapped``). An unknown ``medium`` is
counted (``unknown_medium``), logged once a minute at most, and ignored. Only
stored blocks whose extra keys hold nothing but the LoRA name and, on a sequence's
first block, the cache salt are keyed: multimodal and prompt-embedding keys name
content the tokens do not (two images share placeholder tokens), so such a block and
everything chained below it are left out (``unkeyable``, then ``orphan``).

Engine facts this must survive (seen on the wire, ENGINES.md):

- A ``BlockStored`` can repeat for a block already cached (vLLM's "full" report mode
  re-reports reused prefixes): applying it again only touches the entries.
- A stored block whose parent hash is unknown — the subscriber joined late or missed
  batches — cannot be keyed (its key depends on the parent's): the blocks are dropped
  and counted (``orphan_blocks``); they come back when the engine re-stores the chain.
- ``BlockRemoved`` of an unknown hash is counted (``unknown_removed``) and ignored.
- The engine may evict a parent while a child stays cached (vLLM's free queue orders
  blocks by when they were freed, so a shared parent freed by an earlier request can
  go before another request's children). ``PrefixIndex.remove`` drops the worker's
  descendants too, which is right for routing: the engine's own prefix match stops
  at the missing parent, so those children can no longer be hit.

Lookups are tolerant; the map is not kept equal to the index. Removing a block drops
only its own map entry, not those of the descendants the index dropped with it, and
the index's global budget may evict this worker's entries at any time. Such *stale*
entries (mapped, not held in the index) are harmless: a stored child of a stale
parent is refused by the index (it requires the parent held by the worker, and this
map counts it as ``stale_parent``), and a removal of a stale block removes nothing.
They are bounded by the engine's own cache — every engine block is eventually
removed, and its removal deletes its entry; a lost removal comes with a gap, which
resets the map — so the map holds at most one entry per block the engine has cached
in the applied tier. Tracking descendants instead would need a reverse map (a second
dict entry per block) to save entries the engine will remove anyway.

Invariants (``check()`` asserts each):

- Every ``_cold`` entry maps an engine hash to (key, bits) with bits a non-empty
  subset of the colder tiers' bits, and the index holds the key in each such tier
  for this worker (``exclusive``: and nothing else in its colder tiers).
- Every map entry maps an engine hash in [0, 2**64) to a key in [0, 2**64).
- ``stats().mapped == len(map)``; every counter is >= 0.
- Closure through the map: a mapped key the index holds for this worker has its index
  parent held by the worker too (or is a root child) — PrefixIndex's closure, seen
  from here.
- ``check(exclusive=True)``, when the router inserts nothing else for this worker
  (no pick-time hints in this key space): every key the index holds for the worker is
  a mapped key — the index claims no block the engine has not reported or has
  reported removed.

Memory: one ``dict`` entry per mapped block: the engine hash's int object (40 bytes
for a full 64-bit value) and the entry's slot (~35-45 bytes with the dict's spare
capacity); the value is the very int object the index node keys on, shared. ~77-82
bytes per block on top of the index's ~160 (``radixfleet bench events``, tracemalloc):
an event-fed block costs ~1.5x a byte-keyed one. The price of not reproducing the
engine's hash function; an array-backed open-addressing table would bring the map
to ~32 bytes if it matters. A block held in a colder tier costs one ``_cold`` entry more
(its hash, a 2-tuple: ~130 bytes) beside the index's ~90-110 per colder entry
(``radixfleet bench index``).

Speed: consecutive removals reach the index as one ``remove``, and consecutive plain
stores that continue one chain (SGLang publishes one per page; vLLM one per decoded
block) are keyed and inserted as one chain — both equivalent to one at a time.

Not thread-safe; one event loop owns it and the index. ``EngineBlockMap`` is also an
``EventConsumer`` (``radixfleet.engines.zmq_events``): a gap, a reset or an
``AllBlocksCleared`` drops the worker's entries, and what follows rebuilds them.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from radixfleet.engines.kv_events import (
    DecodedBatch,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
    KvEventCause,
)
from radixfleet.index.prefix_index import COLDER_TIERS, PrefixIndex
from radixfleet.keys import token_block_hashes

log = logging.getLogger("radixfleet.engines")

#: ``root_seed(adapter, cache_salt, block_size) -> seed``: h_0 of a sequence's chain;
#: ``lambda a, s, b: token_namespace_seed(model, s, a, b)`` for a worker serving ``model``.
RootSeed = Callable[[str | None, str, int], int]

_U64 = 1 << 64
_GPU_MEDIA = (None, "GPU")
_MAIN_GROUPS = (None, 0)
GPU = "gpu"
#: an engine's ``medium`` (upper-cased) -> the router's tier. vLLM names its GPU
#: cache "GPU" (or nothing) and its CPU offloading tier "CPU"; disk and remote
#: stores report "DISK" or "STORAGE" (LMCache, storage connectors)
_MEDIA = {
    "GPU": GPU,
    "CPU": "cpu",
    "DRAM": "cpu",
    "DISK": "disk",
    "STORAGE": "disk",
    "SSD": "disk",
    "NVME": "disk",
}
_TIER_BIT = {t: 1 << i for i, t in enumerate(COLDER_TIERS)}
_ALL_BITS = (1 << len(COLDER_TIERS)) - 1
#: seconds between two log lines about unknown media (the counter counts every block)
UNKNOWN_MEDIUM_LOG_S = 60.0
_last_unknown_log = [-UNKNOWN_MEDIUM_LOG_S]


def tier_of(medium: str | None) -> str | None:
    """The router's tier of an engine's ``medium``: "gpu", one of ``COLDER_TIERS``,
    or None for a medium it does not know."""
    if medium is None:
        return GPU
    return _MEDIA.get(medium.upper())


def _unknown_medium(worker: str, medium: str | None, n: int) -> None:
    now = time.monotonic()
    if now - _last_unknown_log[0] >= UNKNOWN_MEDIUM_LOG_S:
        _last_unknown_log[0] = now
        log.warning(
            "worker %s: %d KV event blocks of unknown medium %r ignored (counted in "
            "radixfleet_engine_event_ignored_blocks{cause=unknown_medium}; logged once a minute)",
            worker,
            n,
            medium,
        )


@dataclass(frozen=True, slots=True)
class BlockMapStats:
    """Counters since construction (``mapped`` is current). Blocks, not events."""

    mapped: int  # map entries now
    stored_blocks: int  # blocks keyed and handed to the index (repeats included)
    removed_blocks: int  # mapped blocks removed
    orphan_blocks: int  # stored blocks dropped: parent hash unknown (or below unkeyable)
    stale_parent_blocks: int  # stored blocks the index refused: parent mapped, not held
    unknown_removed: int  # removed hashes never mapped (or already removed)
    other_tier_blocks: int  # stored/removed blocks of another KV group, ignored
    unknown_medium_blocks: int  # stored/removed blocks of a medium tier_of does not know, ignored
    cold_mapped: int  # engine hashes held in a colder tier now (``_cold``)
    cold_stored_blocks: int  # colder-tier blocks handed to the index (repeats included)
    cold_removed_blocks: int  # colder-tier blocks removed from the index
    cold_unmapped_blocks: int  # colder-tier stores of an unknown hash without tokens, dropped
    untokenized_blocks: int  # stored blocks with no tokens (offload placeholders)
    unaligned_blocks: int  # stored blocks whose tokens do not line up with their hashes
    unkeyable_blocks: int  # stored blocks with multimodal / embedding / unknown extra keys
    block_size_mismatch_blocks: int  # stored blocks of a block size other than ours
    remapped_blocks: int  # an engine hash stored again with different tokens: re-keyed
    cleared: int  # AllBlocksCleared applied
    resets: int  # reset() calls (gaps, restarts, joins, clears)
    errors: int  # on_error calls (malformed input, counted by the subscriber too)


class EngineBlockMap:
    """Engine block hashes -> the router's token-block keys, for one worker.

    ``block_size``: tokens per block of the worker's key space; None learns it from
    the first tokenized ``BlockStored`` (``block_size`` then reads it; a reset keeps
    it). ``clock`` gives the ``now`` of the ``on_batch`` path (the index's clock).
    """

    def __init__(
        self,
        worker: str,
        index: PrefixIndex,
        root_seed: RootSeed,
        *,
        block_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.worker = worker
        self.index = index
        self._root_seed = root_seed
        self._block_size = block_size
        self._clock = clock
        self._keys: dict[int, int] = {}  # engine hash -> our key; only apply()/reset() change it
        #: engine hash -> (our key, bits of the colder tiers holding it)
        self._cold: dict[int, tuple[int, int]] = {}
        # counters (BlockMapStats fields), bumped where the outcome is decided
        self._stored = self._removed = self._orphan = self._stale_parent = 0
        self._unknown_removed = self._other_tier = self._untokenized = self._unaligned = 0
        self._unkeyable = self._bs_mismatch = self._remapped = 0
        self._cleared = self._resets = self._errors = 0
        self._unknown_medium = self._cold_stored = self._cold_removed = self._cold_unmapped = 0

    # ------------------------------------------------------------------ queries

    @property
    def block_size(self) -> int | None:
        return self._block_size

    def __len__(self) -> int:
        return len(self._keys)

    def key_of(self, engine_hash: int) -> int | None:
        """Our key for an engine block hash (None: not mapped)."""
        return self._keys.get(engine_hash & (_U64 - 1))

    def stats(self) -> BlockMapStats:
        return BlockMapStats(
            mapped=len(self._keys),
            stored_blocks=self._stored,
            removed_blocks=self._removed,
            orphan_blocks=self._orphan,
            stale_parent_blocks=self._stale_parent,
            unknown_removed=self._unknown_removed,
            other_tier_blocks=self._other_tier,
            unknown_medium_blocks=self._unknown_medium,
            cold_mapped=len(self._cold),
            cold_stored_blocks=self._cold_stored,
            cold_removed_blocks=self._cold_removed,
            cold_unmapped_blocks=self._cold_unmapped,
            untokenized_blocks=self._untokenized,
            unaligned_blocks=self._unaligned,
            unkeyable_blocks=self._unkeyable,
            block_size_mismatch_blocks=self._bs_mismatch,
            remapped_blocks=self._remapped,
            cleared=self._cleared,
            resets=self._resets,
            errors=self._errors,
        )

    # ---------------------------------------------------------------- mutations

    def apply(self, events: Iterable[EngineEvent], now: float) -> None:
        """Applies decoded events in order. O(tokens stored + blocks removed).

        May insert into, remove from and clear the worker's index entries; may make
        the index evict (its budget is global). Two shortcuts, each equivalent to
        applying the events one by one: consecutive removals (vLLM sends one event per
        evicted block) reach the index as one ``remove`` call, and consecutive plain
        stored events that continue one chain (SGLang sends one per page) are keyed
        and inserted as one chain."""
        gone: list[int] = []  # keys of consecutive removals, not yet removed
        chain: list[EngineBlockStored] = []  # consecutive plain stores of one chain
        # told apart by __class__ (cheaper than isinstance), which mypy does not narrow
        ev: Any
        for ev in events:
            cls = ev.__class__
            if cls is EngineBlockStored:
                if gone:
                    self._flush_removed(gone)
                if _plain(ev):
                    if chain and (
                        ev.parent_block_hash != chain[-1].block_hashes[-1]
                        or ev.block_size != chain[-1].block_size
                    ):
                        self._flush_chain(chain, now)
                    chain.append(ev)
                    continue
                if chain:
                    self._flush_chain(chain, now)
                self._apply_stored(ev, now)
                continue
            if chain:
                self._flush_chain(chain, now)
            if cls is EngineBlockRemoved:
                self._apply_removed(ev, gone)
                continue
            if gone:
                self._flush_removed(gone)
            if cls is EngineAllCleared:
                self._cleared += 1
                self.reset()
            else:
                raise TypeError(f"not an engine event: {ev!r}")
        if chain:
            self._flush_chain(chain, now)
        if gone:
            self._flush_removed(gone)

    def reset(self) -> int:
        """Forgets every block of the worker, in the map and in the index. Returns the
        index entries removed. What follows rebuilds (a suffix of the engine's history
        applied to an empty state claims nothing the engine does not hold)."""
        self._resets += 1
        self._keys.clear()
        self._cold.clear()
        self.index.clear_tiers(self.worker)
        return self.index.clear(self.worker)

    # ------------------------------------------------------- EventConsumer protocol

    def on_batch(self, seq: int, batch: DecodedBatch) -> None:
        self.apply(batch.events, self._clock())

    def on_gap(self, first_missing: int, next_seq: int) -> None:
        self.reset()

    def on_reset(self, reason: str, seq: int) -> None:
        self.reset()

    def on_error(self, cause: KvEventCause, detail: str) -> None:
        self._errors += 1  # the subscriber logs and reports the loss (a gap) itself

    def on_synced(self, seq: int) -> None:
        pass  # what the join delivered is already applied

    # ---------------------------------------------------------------- internals

    def _apply_stored(self, ev: EngineBlockStored, now: float) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if not n:
            return
        if ev.group_idx not in _MAIN_GROUPS:
            self._other_tier += n
            return
        if ev.medium not in _GPU_MEDIA:
            tier = tier_of(ev.medium)
            if tier is None:
                self._unknown_medium += n
                _unknown_medium(self.worker, ev.medium, n)
            elif tier == GPU:
                self._apply_stored(ev._replace(medium=None), now)
            else:
                self._apply_cold_stored(ev, tier)
            return
        keyed = self._key_chain(ev, self._keys)
        if keyed is None:
            return
        hashes, ours, parent_key = keyed
        keys = self._keys
        usable = len(ours)
        for e, k in zip(hashes, ours):
            old = keys.get(e)
            if old is not None and old != k:
                # The same engine block with other content (a collision, or extra keys
                # we do not see): the old key is not what the engine holds under e.
                self._remapped += 1
                self.index.remove(self.worker, (old,))
            keys[e] = k
        self._stored += usable
        if (
            not self.index.insert(self.worker, ours, now, parent_key)
            and parent_key is not None
            and self.worker not in self.index.holders(parent_key)
        ):
            # Refused, not a repeat: the parent is mapped but no longer held (stale).
            self._stale_parent += usable

    def _key_chain(self, ev: EngineBlockStored, parents) -> tuple[Any, list[int], int | None] | None:
        """(engine hashes, our keys, our parent key) of a stored event's keyable
        blocks, or None (counted); ``parents`` maps an engine hash to our key (a
        dict's ``get`` or a lookup over several)."""
        hashes = ev.block_hashes
        n = len(hashes)
        if not ev.token_ids:
            self._untokenized += n
            return None
        bs = ev.block_size
        if not ev.aligned:
            self._unaligned += n
            return None
        if self._block_size is None:
            self._block_size = bs
        elif bs != self._block_size:
            self._bs_mismatch += n
            return None
        parent_hash = ev.parent_block_hash
        lora = ev.lora_name
        if lora is None and ev.lora_id is not None:
            # An adapter we cannot name: requests key adapters by name.
            self._unkeyable += n
            return None
        extra = ev.extra_keys
        if parent_hash is None:
            salt = _salt_and_check(extra[0] if extra else None, lora, True)
            if salt is None:
                self._unkeyable += 1
                self._orphan += n - 1
                return None
            seed = self._root_seed(lora, salt, bs)
            parent_key = None
        else:
            parent_key = parents.get(parent_hash)
            if parent_key is None:
                self._orphan += n
                return None
            seed = parent_key
            if _salt_and_check(extra[0] if extra else None, lora, False) is None:
                self._unkeyable += 1
                self._orphan += n - 1
                return None
        usable = n
        if extra:
            for i in range(1, n):
                if _salt_and_check(extra[i], lora, False) is None:
                    self._unkeyable += 1
                    self._orphan += n - i - 1
                    usable = i
                    break
        toks = ev.token_ids
        if usable < n:
            toks = toks[: usable * bs]
            hashes = hashes[:usable]
        return hashes, token_block_hashes(toks, bs, seed), parent_key

    def _known_key(self, e: int) -> int | None:
        """Our key of an engine hash mapped in any tier."""
        k = self._keys.get(e)
        if k is None:
            c = self._cold.get(e)
            if c is not None:
                k = c[0]
        return k

    def _apply_cold_stored(self, ev: EngineBlockStored, tier: str) -> None:
        """A colder tier's stored blocks (module docstring): keyed from this map where
        it knows the hash (vLLM's offloading: no tokens), else from the tokens."""
        known = self._known_key
        found = [known(e) for e in ev.block_hashes]
        pairs: list[tuple[int, int]]
        if None not in found:
            pairs = list(zip(ev.block_hashes, found))  # type: ignore[arg-type]
        elif ev.token_ids:
            keyed = self._key_chain(ev, _Lookup(known))
            if keyed is None:
                return
            pairs = list(zip(keyed[0], keyed[1]))
        else:
            self._cold_unmapped += found.count(None)
            pairs = [(e, k) for e, k in zip(ev.block_hashes, found) if k is not None]
        bit = _TIER_BIT[tier]
        cold = self._cold
        for e, k in pairs:
            c = cold.get(e)
            if c is None:
                cold[e] = (k, bit)
            elif c[0] != k:
                self._remapped += 1
                self._cold_forget(e, c)
                cold[e] = (k, bit)
            else:
                cold[e] = (k, c[1] | bit)
        self._cold_stored += len(pairs)
        self.index.tier_add(self.worker, tier, [k for _, k in pairs])

    def _cold_forget(self, e: int, c: tuple[int, int]) -> None:
        """Drops engine hash ``e``'s colder-tier entries (re-keyed: other content)."""
        k, bits = c
        for t, b in _TIER_BIT.items():
            if bits & b:
                self.index.tier_discard(self.worker, t, (k,))
        del self._cold[e]

    def _apply_cold_removed(self, ev: EngineBlockRemoved, tier: str) -> None:
        bit = _TIER_BIT[tier]
        cold = self._cold
        gone = []
        for e in ev.block_hashes:
            c = cold.get(e)
            if c is None or not c[1] & bit:
                self._unknown_removed += 1
                continue
            k, bits = c
            bits &= ~bit
            if bits:
                cold[e] = (k, bits)
            else:
                del cold[e]
            gone.append(k)
        if gone:
            self._cold_removed += self.index.tier_discard(self.worker, tier, gone)

    def _flush_chain(self, chain: list[EngineBlockStored], now: float) -> None:
        if len(chain) == 1:
            self._apply_stored(chain[0], now)
        else:
            first = chain[0]
            toks = array("I")
            hashes: list[int] = []
            for ev in chain:
                toks.extend(ev.token_ids)
                hashes.extend(ev.block_hashes)
            self._apply_stored(
                first._replace(block_hashes=tuple(hashes), token_ids=toks, extra_keys=None), now
            )
        chain.clear()

    def _flush_removed(self, gone: list[int]) -> None:
        self._removed += len(gone)
        self.index.remove(self.worker, gone)
        gone.clear()

    def _apply_removed(self, ev: EngineBlockRemoved, gone: list[int]) -> None:
        hashes = ev.block_hashes
        if ev.group_idx not in _MAIN_GROUPS:
            self._other_tier += len(hashes)
            return
        if ev.medium not in _GPU_MEDIA:
            tier = tier_of(ev.medium)
            if tier is None:
                self._unknown_medium += len(hashes)
                _unknown_medium(self.worker, ev.medium, len(hashes))
                return
            if tier != GPU:
                if gone:
                    self._flush_removed(gone)  # keep the engine's order
                self._apply_cold_removed(ev, tier)
                return
        pop = self._keys.pop
        for e in hashes:
            k = pop(e, None)
            if k is None:
                self._unknown_removed += 1
            else:
                gone.append(k)

    # ---------------------------------------------------------------- invariants

    def check(self, exclusive: bool = False) -> None:
        """Asserts the invariants in the module docstring. O(mapped blocks), and
        O(index nodes) with ``exclusive``."""
        st = self.stats()
        assert st.mapped == len(self._keys), f"{st.mapped=} vs {len(self._keys)=}"
        for f in fields(st):
            assert getattr(st, f.name) >= 0, f"counter {f.name} negative: {st}"
        w = self.worker
        idx = self.index
        mapped = set()
        for e, k in self._keys.items():
            assert e.__class__ is int and 0 <= e < _U64, f"engine hash {e!r} out of range"
            assert k.__class__ is int and 0 <= k < _U64, f"key {k!r} of {e:#x} out of range"
            mapped.add(k)
            if w in idx.holders(k):
                p = _index_parent(idx, k)
                assert p is None or w in idx.holders(p), (
                    f"closure: {w=} holds {k:#x} but not its parent {p:#x}"
                )
        cold_keys: dict[str, set[int]] = {t: set() for t in COLDER_TIERS}
        for e, (k, bits) in self._cold.items():
            assert e.__class__ is int and 0 <= e < _U64, f"engine hash {e!r} out of range"
            assert k.__class__ is int and 0 <= k < _U64, f"cold key {k!r} of {e:#x} out of range"
            assert 0 < bits <= _ALL_BITS, f"tier bits {bits:#b} of {e:#x}"
            for t, b in _TIER_BIT.items():
                if bits & b:
                    cold_keys[t].add(k)
                    assert idx.tier_holds(w, t, k), f"{w=}: {e:#x} in {t} but the index lacks {k:#x}"
        if exclusive:
            for k in _index_keys_held(idx, w):
                assert k in mapped, f"index holds {k:#x} for {w=} but no engine block maps to it"
            for t, keys in cold_keys.items():
                held = idx._tiers[t].get(w, set())  # test-time audit only
                assert held <= keys, f"index holds {len(held - keys)} {t} keys for {w=} nothing maps to"


class _Lookup:
    """A ``get`` over a function (``_key_chain``'s parent lookup)."""

    __slots__ = ("get",)

    def __init__(self, fn: Callable[[int], int | None]) -> None:
        self.get = fn


def _plain(ev: EngineBlockStored) -> bool:
    """A stored event that can be merged with its chain's neighbours: applied tier, no
    adapter, no extra keys, tokens aligned (what _apply_stored keys the simple way)."""
    return (
        ev.medium in _GPU_MEDIA
        and ev.group_idx in _MAIN_GROUPS
        and ev.lora_name is None
        and ev.lora_id is None
        and (ev.extra_keys is None or not any(ev.extra_keys))
        and ev.aligned
    )


def _salt_and_check(entry, lora: str | None, first: bool) -> str | None:
    """The cache salt in one block's extra keys ('' if none), or None when the entry
    holds anything we cannot key: multimodal pairs, prompt-embedding digests, an
    unexplained string. vLLM's per-block layout is ``[lora_name?] + [(mm_id,
    offset)...] + [cache_salt? (first block only)] + [embeds_digest?]``, untagged."""
    if entry is None:
        return ""
    items = list(entry)
    if lora is not None and items and items[0] == lora:
        del items[0]
    salt = ""
    if first and items and items[-1].__class__ is str:
        salt = items.pop()
    return None if items else salt


def _index_parent(index: PrefixIndex, key: int) -> int | None:
    # Test-time audit only (check()): PrefixIndex has no public parent lookup.
    n = index._nodes.get(key)
    p = n.parent if n is not None else None
    return None if p is None or p is index._root else p.key


def _index_keys_held(index: PrefixIndex, worker: str) -> list[int]:
    # Test-time audit only (check(exclusive=True)): PrefixIndex lists no worker's keys.
    return [k for k, n in index._nodes.items() if n.held_by(worker)]
