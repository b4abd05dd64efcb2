"""The DRAM KV tier: host memory below the HBM radix cache, inclusive, in 256-token chunks.

::

    request admitted --count its chunks (frequency gate)-----------------+
        |                                                                 |
    HBM radix tree (radix_cache.py)                                      v
        |  completed tokens, whole chunks, gate passed   write_down  --> D2H stream
        |                                                                 | lands at
        |  <-- read_back (H2D stream): a prefix held      DRAM chunks  <--+ its time
        |      only here is copied into HBM before        (own LRU, own capacity)
        |      the request's prefill

Contract:

- **Chunks.** A chunk is ``CHUNK_TOKENS`` (256) consecutive tokens of a key starting at a
  multiple of 256, named by a chained digest of the namespace and every token up to
  its end, so a chunk is one prefix, never a substring found elsewhere. Only whole
  chunks are written down; a match is the longest run of held chunks from the start.
- **Inclusive.** Writing down copies; the HBM tree keeps its tokens. HBM eviction
  keeps the DRAM copy (the tree does not tell this tier); DRAM eviction (its own LRU,
  its own ``capacity_tokens``) drops leaves only: the least recently used chunk, or
  when it has descendants the leaf below it, so the held chunks stay prefix-closed
  (a dropped chunk would make every chunk chained after it unreachable). A match
  touches the chunks deepest first, so ancestors end more recent than descendants.
- **Streams.** Write-down (device to host) and read-back (host to device) each have
  their own timeline (``_Stream``): a copy starts when its stream is free and lasts
  ``cost.pcie_s(tokens)`` (PCIe, ``cost_model.PCIE_GEN5_X16``). Neither enters a
  scheduler step's duration, so write-down never delays decode; a read-back delays
  only its own request (the scheduler holds it until the copy lands, which is part
  of that request's TTFT). A written chunk is matchable, and reported, only once its
  copy has landed (``advance(now)``). A write whose stream is more than
  ``max_backlog_s`` behind is dropped (the copy engine cannot keep up; counted).
- **Admission between tiers** (three levels). HBM: the radix cache's own admission
  (``AdmissionConfig``) decides what is kept at all. DRAM: a chunk is written down
  only once ``admit_hits`` requests reached it (their keys held it: a prompt at
  admission, or a finished request's grown history), counted in a bounded sketch
  (an LRU of chunk digests to counts, ``sketch_entries``, 4 per chunk DRAM holds).
  Nothing: a chunk that fewer requests reached lives in HBM only and is gone when
  HBM evicts it. Why a count of requests and not a probabilistic sketch: the gate is
  asked once per chunk per request, the exact count costs one dict operation, and a
  bounded LRU of counts forgets one-off prefixes first, which is what the gate is
  for (a one-off 100k-token document must not flush a shared system prompt from
  DRAM). ``admit_hits`` 1 (the default) writes every completed chunk: at DRAM = 4 x HBM
  it beat 2 on both the Mooncake trace and the agent workload (bench/RESULTS.md "KV
  tiers, simulated": a tier that size is not short of room, so gating only loses the
  next turn's hit); the gate is for a tier small against its traffic.
- **Events**, vLLM's shape (``radixfleet/engines/kv_events.py``): ``BlockStored`` /
  ``BlockRemoved`` with ``medium`` "CPU" for the router blocks (``hash_stride``
  tokens each) whose last token lies in a chunk that landed or left. Today's
  contract-2 batches carry no medium, so ``drain_events`` is kept apart from the
  HBM cache's log: a router that does not index tiers never sees a CPU block as
  resident on the GPU. ``drain_protocol_events`` gives the same as contract-2
  events with ``tier`` "cpu" (``radixfleet.wire.events``, "KV tiers"), which the agent's
  reporter sends to routers that read tiers; ``held_hashes`` is the tier's part of
  a snapshot.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from radixfleet.wire.events import Removed, Stored
from radixfleet_tools.agent.cost_model import CostModel

#: tokens per DRAM chunk (SGLang HiCache's and LMCache's default page of 256 tokens)
CHUNK_TOKENS = 256
#: most CPU-tier events kept undrained (older ones are dropped and counted)
MAX_PENDING_EVENTS = 10_000
#: the media of vLLM's KV events
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
#: this tier's name on contract 2 (``radixfleet.wire.events.TIERS``)
TIER_CPU = "cpu"


def chunk_digests(ns: Hashable, key: array, start_digest: int | None = None, start: int = 0) -> list[int]:
    """Chained digests of ``key``'s whole chunks from chunk ``start`` on, given the
    digest of chunk ``start - 1`` (``start_digest``; None: the namespace's root).
    O(tokens) in C, O(chunks) Python steps."""
    h = hash(("dram", ns)) if start_digest is None else start_digest
    out = []
    c = CHUNK_TOKENS
    for i in range(start * c, len(key) - c + 1, c):
        h = hash((h, key[i : i + c].tobytes()))
        out.append(h)
    return out


def parse_dram_size(value: str) -> tuple[int | None, float | None]:
    """A ``--dram-tokens`` value: ``(tokens, None)`` for a token count, ``(None, N)`` for
    ``Nx`` (N times the HBM pool). Raises ``ValueError`` with a one-line reason."""
    v = value.strip().lower()
    try:
        if v.endswith("x"):
            ratio = float(v[:-1])
            if 0 < ratio < 1e6:
                return None, ratio
        else:
            tokens = int(v)
            if tokens >= CHUNK_TOKENS:
                return tokens, None
    except ValueError:
        pass
    raise ValueError(
        f"{value!r}: want a token count >= {CHUNK_TOKENS} or a positive multiple of the KV pool (e.g. 4x)"
    )


def vllm_stored(hashes: Sequence[int], parent: int | None, medium: str, block_size: int) -> dict[str, Any]:
    """One vLLM ``BlockStored`` event as a map (the field names of ``kv_events``)."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
    }


def vllm_removed(hashes: Sequence[int], medium: str) -> dict[str, Any]:
    """One vLLM ``BlockRemoved`` event as a map."""
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def gpu_events_vllm(events: Sequence[Any], block_size: int) -> list[dict[str, Any]]:
    """The HBM cache's events (``radixfleet.wire.events``) in vLLM's shape, ``medium`` "GPU"
    (a ``Cleared`` becomes ``AllBlocksCleared``)."""
    out: list[dict[str, Any]] = []
    for e in events:
        kind = getattr(e, "type", None)
        if kind == "stored":
            out.append(vllm_stored(e.hashes, e.parent, MEDIUM_GPU, block_size))
        elif kind == "removed":
            out.append(vllm_removed(e.hashes, MEDIUM_GPU))
        elif kind == "cleared":
            out.append({"type": "AllBlocksCleared"})
    return out


@dataclass(frozen=True, slots=True)
class DramConfig:
    """The DRAM tier's settings (the agent's ``--dram-tokens`` / ``--dram-admit-hits``)."""

    capacity_tokens: int
    #: requests that must reach a chunk before it is written down (>= 1)
    admit_hits: int = 1
    #: drop a write-down when the D2H stream is this far behind (seconds)
    max_backlog_s: float = 1.0

    def __post_init__(self) -> None:
        if type(self.capacity_tokens) is not int or self.capacity_tokens < CHUNK_TOKENS:
            raise ValueError(
                f"DRAM capacity must be an integer >= {CHUNK_TOKENS} tokens, got {self.capacity_tokens!r}"
            )
        if type(self.admit_hits) is not int or self.admit_hits < 1:
            raise ValueError(f"DRAM admit_hits must be an integer >= 1, got {self.admit_hits!r}")
        if not self.max_backlog_s > 0:
            raise ValueError(f"DRAM max_backlog_s must be > 0, got {self.max_backlog_s!r}")


@dataclass(slots=True)
class DramStats:
    #: chunks whose copy landed / were dropped by eviction (cascade included) / by backlog
    written_chunks: int = 0
    evicted_chunks: int = 0
    dropped_writes: int = 0
    #: tokens copied back into HBM, and the copy seconds
    read_back_tokens: int = 0
    read_back_s: float = 0.0
    #: chunks the gate kept out of DRAM at least once (asked, count below admit_hits)
    gated: int = 0
    #: CPU-tier events dropped undrained (``MAX_PENDING_EVENTS``)
    events_dropped: int = 0


class _Stream:
    """One copy direction's timeline: copies run back to back, each at PCIe cost."""

    __slots__ = ("free_at", "busy_s")

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def copy(self, now: float, seconds: float) -> tuple[float, float]:
        """(start, end) of a copy of ``seconds`` queued at ``now``."""
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        return start, self.free_at


class _Chunk:
    __slots__ = ("parent", "children", "hashes", "parent_hash")

    def __init__(self, parent: int | None, hashes: list[int], parent_hash: int | None) -> None:
        self.parent = parent
        #: held chunks chained after this one (a dict: insertion-ordered, deterministic)
        self.children: dict[int, None] = {}
        #: router blocks whose last token lies in this chunk, and the block before them
        self.hashes = hashes
        self.parent_hash = parent_hash


class DramTier:
    """Host-memory KV chunks of one worker, priced by ``cost`` (see the module docstring).

    Synchronous; the scheduler passes ``now`` (virtual or real time)."""

    def __init__(self, config: DramConfig, cost: CostModel, *, hash_stride: int | None = None) -> None:
        self.config = config
        self.cost = cost
        self.hash_stride = hash_stride
        #: digest -> chunk, least recently used first (landed chunks only)
        self._chunks: OrderedDict[int, _Chunk] = OrderedDict()
        #: writes in flight: (land time, digest, parent digest, hashes, parent hash), in land order
        self._inflight: list[tuple[float, int, int | None, list[int], int | None]] = []
        self._inflight_set: set[int] = set()
        #: the admission gate's counts: digest -> requests that reached the chunk
        self._sketch: OrderedDict[int, int] = OrderedDict()
        self._sketch_cap = 4 * (config.capacity_tokens // CHUNK_TOKENS)
        self.d2h = _Stream()
        self.h2d = _Stream()
        self.stats = DramStats()
        self._events: deque[dict[str, Any]] = deque()

    @property
    def capacity_tokens(self) -> int:
        return self.config.capacity_tokens

    @property
    def held_tokens(self) -> int:
        return len(self._chunks) * CHUNK_TOKENS

    # ------------------------------------------------------------- gate

    def count(self, digests: Sequence[int]) -> None:
        """One request reached these chunks (each counted once per call)."""
        sk = self._sketch
        for d in digests:
            sk[d] = sk.get(d, 0) + 1
            sk.move_to_end(d)
        while len(sk) > self._sketch_cap:
            sk.popitem(last=False)

    def hits(self, digest: int) -> int:
        return self._sketch.get(digest, 0)

    # ------------------------------------------------------------- write-down

    def write_down(
        self, digests: Sequence[int], held_tokens: int, hashes: Sequence[int] | None, now: float
    ) -> int:
        """Queues on the D2H stream the copy of every chunk of ``digests`` (a key's
        chunks from 0) that lies within its first ``held_tokens`` tokens (in HBM),
        passed the gate, and is neither held nor in flight. Returns the chunks queued."""
        cfg = self.config
        n = min(len(digests), held_tokens // CHUNK_TOKENS)
        queued = 0
        cost_s = self.cost.pcie_s(CHUNK_TOKENS)
        for c in range(n):
            d = digests[c]
            if d in self._chunks or d in self._inflight_set:
                continue
            if self._sketch.get(d, 0) < cfg.admit_hits:
                self.stats.gated += 1
                continue
            if self.d2h.free_at - now > cfg.max_backlog_s:
                self.stats.dropped_writes += n - c
                break
            _, end = self.d2h.copy(now, cost_s)
            hs, ph = self._blocks(c, hashes)
            self._inflight.append((end, d, digests[c - 1] if c else None, hs, ph))
            self._inflight_set.add(d)
            queued += 1
        return queued

    def _blocks(self, c: int, hashes: Sequence[int] | None) -> tuple[list[int], int | None]:
        """Router blocks (1-based j, last token j*s - 1) ending in chunk ``c``."""
        s = self.hash_stride
        if not s or not hashes:
            return [], None
        lo = (c * CHUNK_TOKENS) // s + 1  # first j with j*s - 1 >= c*256
        hi = ((c + 1) * CHUNK_TOKENS) // s  # last j with j*s - 1 < (c+1)*256
        hi = min(hi, len(hashes))
        if lo > hi:
            return [], None
        return list(hashes[lo - 1 : hi]), (hashes[lo - 2] if lo >= 2 else None)

    def advance(self, now: float) -> None:
        """Lands every write-down whose copy ended by ``now`` (oldest first), evicting
        to capacity. A chunk whose parent chunk left meanwhile is dropped."""
        inf = self._inflight
        i = 0
        while i < len(inf) and inf[i][0] <= now:
            _, d, parent, hs, ph = inf[i]
            self._inflight_set.discard(d)
            i += 1
            if parent is not None and parent not in self._chunks:
                self.stats.dropped_writes += 1
                continue
            while self.held_tokens + CHUNK_TOKENS > self.config.capacity_tokens and self._chunks:
                self._evict_one()
            if parent is not None and parent not in self._chunks:  # its parent was the victim
                self.stats.dropped_writes += 1
                continue
            ch = _Chunk(parent, hs, ph)
            self._chunks[d] = ch
            if parent is not None:
                self._chunks[parent].children[d] = None
            self.stats.written_chunks += 1
            if hs:
                self._log(vllm_stored(hs, ph, MEDIUM_CPU, self.hash_stride or 0))
        if i:
            del inf[:i]

    def next_landing(self) -> float | None:
        return self._inflight[0][0] if self._inflight else None

    # ------------------------------------------------------------- eviction

    def _evict_one(self) -> None:
        """Evicts one chunk: the least recently used one if it is a leaf, else the
        leaf its newest descendants lead to (a chain lands parent first, so a fresh
        chain's head can be the oldest entry; dropping it would take the whole chain)."""
        chunks = self._chunks
        d = next(iter(chunks))
        while chunks[d].children:
            d = next(reversed(chunks[d].children))
        self._drop(d)

    def _drop(self, d: int) -> None:
        """Removes chunk ``d`` and every held chunk chained after it."""
        gone: list[int] = []
        stack = [d]
        while stack:
            x = stack.pop()
            ch = self._chunks.pop(x)
            self.stats.evicted_chunks += 1
            gone.extend(ch.hashes)
            stack.extend(ch.children)
            if ch.parent is not None and ch.parent in self._chunks:
                self._chunks[ch.parent].children.pop(x, None)
        if gone:
            self._log(vllm_removed(gone, MEDIUM_CPU))

    # ------------------------------------------------------------- read-back

    def match(self, digests: Sequence[int]) -> int:
        """Tokens of the longest run of held chunks from chunk 0; touches them deepest
        first (ancestors end most recent). O(chunks)."""
        chunks = self._chunks
        n = 0
        for d in digests:
            if d not in chunks:
                break
            n += 1
        for c in range(n - 1, -1, -1):
            chunks.move_to_end(digests[c])
        return n * CHUNK_TOKENS

    def read_back(self, tokens: int, now: float) -> float:
        """Queues the H2D copy of ``tokens`` tokens; returns when it lands."""
        seconds = self.cost.pcie_s(tokens)
        _, end = self.h2d.copy(now, seconds)
        self.stats.read_back_tokens += tokens
        self.stats.read_back_s += seconds
        return end

    # ------------------------------------------------------------- events

    def _log(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        if len(self._events) > MAX_PENDING_EVENTS:
            self._events.popleft()
            self.stats.events_dropped += 1

    @property
    def pending_events(self) -> int:
        return len(self._events)

    def drain_events(self) -> list[dict[str, Any]]:
        """CPU-tier events since the last drain, oldest first (vLLM's shape). Bounded:
        past ``MAX_PENDING_EVENTS`` undrained the oldest are dropped (counted)."""
        ev = list(self._events)
        self._events.clear()
        return ev

    def drain_protocol_events(self) -> list[Stored | Removed]:
        """``drain_events`` as contract-2 events of the ``"cpu"`` tier."""
        out: list[Stored | Removed] = []
        for e in self.drain_events():
            if e["type"] == "BlockStored":
                out.append(Stored(e["parent_block_hash"], e["block_hashes"], tier=TIER_CPU))
            else:
                out.append(Removed(e["block_hashes"], tier=TIER_CPU))
        return out

    def held_hashes(self) -> list[int]:
        """The router blocks of every landed chunk (a snapshot's ``"cpu"`` tier)."""
        return [h for ch in self._chunks.values() for h in ch.hashes]

    def clear(self) -> None:
        """Drops every chunk and write in flight (an engine fingerprint change)."""
        gone = [h for ch in self._chunks.values() for h in ch.hashes]
        if gone:  # not AllBlocksCleared: vLLM's carries no medium, a router would clear its GPU view
            self._log(vllm_removed(gone, MEDIUM_CPU))
        self._chunks.clear()
        self._inflight.clear()
        self._inflight_set.clear()

    def check(self) -> None:
        assert self.held_tokens <= self.config.capacity_tokens, (
            self.held_tokens,
            self.config.capacity_tokens,
        )
        for d, ch in self._chunks.items():
            if ch.parent is not None:
                assert ch.parent in self._chunks, f"orphan chunk {d}"
                assert d in self._chunks[ch.parent].children
            for c in ch.children:
                assert c in self._chunks and self._chunks[c].parent == d
        assert self._inflight_set == {x[1] for x in self._inflight}
        assert len(self._sketch) <= self._sketch_cap
