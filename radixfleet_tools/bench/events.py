"""``radixfleet bench events``: KV-event ingestion speed and memory per indexed block.

Ingestion is the whole path from a payload's bytes to the index, on one core::

    decode_batch(payload)            msgpack + validation (radixfleet.engines.kv_events)
    EngineBlockMap.apply(events)     re-key stored blocks from their tokens, parent
                                     lookups, PrefixIndex.insert / remove

The stream is what a busy vLLM publishes: sessions that share a few system prompts
and grow turn by turn (a user turn, then the generated answer), 32-token blocks, an
engine cache of ``--capacity`` blocks evicting least recently used leaves (one
``BlockRemoved`` per block, as vLLM sends them), four requests' events per batch (one
engine step). The payloads are built before timing; the figure is
(stored + removed blocks) / CPU seconds of the process (``time.process_time``: the cost
on one core, which other load on the machine does not inflate), wall time beside it.
Two wire forms: vLLM 0.32's (maps, one
``BlockStored`` per request step) and SGLang's (tagged arrays, one per block, signed
hashes, no dp_rank). Target: >= 100,000 blocks/s.

Memory is measured with tracemalloc (Python allocations, int objects included) for
the same number of blocks held three ways: today's byte-keyed index (128-byte blocks
of random prompts keyed with ``block_hashes``, as ``bench index`` does), the same
index holding token-block keys inserted directly, and the index fed by events with
the ``EngineBlockMap`` beside it (its dict: engine hash -> key).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import random
import time
import tracemalloc
from array import array
from collections.abc import Callable
from typing import TypeVar

import msgpack
import xxhash

from radixfleet.engines.block_map import EngineBlockMap
from radixfleet.engines.kv_events import decode_batch
from radixfleet.index.prefix_index import PrefixIndex, tune_gc
from radixfleet.keys import (
    DEFAULT_BLOCK_BYTES,
    block_hashes,
    namespace_seed,
    token_block_hashes,
    token_namespace_seed,
)

TARGET_BLOCKS_PER_S = 100_000
MODEL = "bench-model"
_T = TypeVar("_T")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--requests", type=int, default=6000, help="requests in the stream (default 6000)")
    p.add_argument(
        "--capacity",
        type=int,
        default=20_000,
        help="engine cache in blocks (default 20000: evictions in steady state)",
    )
    p.add_argument("--block-size", type=int, default=32, help="engine block size in tokens")
    p.add_argument(
        "--mem-blocks", type=int, default=64_000, help="blocks held for the memory comparison (default 64000)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")


def _root_seed(adapter, salt, bs):
    return token_namespace_seed(MODEL, salt, adapter, bs)


class _Engine:
    """vLLM's prefix cache in miniature, emitting its events (module docstring)."""

    def __init__(self, capacity: int, bs: int, style: str) -> None:
        self.capacity, self.bs, self.style = capacity, bs, style
        self.blocks: dict[int, list] = {}  # ehash -> [parent, last use, kids]
        self.heap: list[tuple[int, int]] = []  # (last use, ehash) candidates, lazily valid
        self.clock = 0

    def run(self, tokens: list[int]) -> list:
        bs = self.bs
        self.clock += 1
        data = array("I", tokens).tobytes()
        n = len(tokens) // bs
        chain, first_new, parent = [], None, 0x5EED
        for i in range(n):
            e = xxhash.xxh3_64_intdigest(data[i * bs * 4 : (i + 1) * bs * 4], parent)
            chain.append(e)
            b = self.blocks.get(e)
            if b is not None:
                b[1] = self.clock
            elif first_new is None:
                first_new = i
            parent = e
        for e in chain:  # leaves of this chain get a fresh heap record
            b = self.blocks.get(e)
            if b is not None and b[2] == 0:
                heapq.heappush(self.heap, (self.clock, e))
        if first_new is None:
            return []
        new = chain[first_new:]
        events = [self._removed(e) for e in self._evict(len(new), set(chain))]
        for i in range(first_new, n):
            p = chain[i - 1] if i else None
            self.blocks[chain[i]] = [p, self.clock, 0]
            if p is not None:
                self.blocks[p][2] += 1
        heapq.heappush(self.heap, (self.clock, chain[-1]))
        p = chain[first_new - 1] if first_new else None
        toks = tokens[first_new * bs : n * bs]
        if self.style == "sglang":
            for j, e in enumerate(new):
                events.append(
                    [
                        "BlockStored",
                        [_signed(e)],
                        None if p is None else _signed(p),
                        toks[j * bs : (j + 1) * bs],
                        bs,
                        None,
                    ]
                )
                p = e
        else:
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": new,
                    "parent_block_hash": p,
                    "token_ids": toks,
                    "block_size": bs,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None] * len(new),
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            )
        return events

    def _evict(self, need: int, protect: set) -> list[int]:
        out, keep = [], []
        while len(self.blocks) + need > self.capacity and self.heap:
            t, e = heapq.heappop(self.heap)
            b = self.blocks.get(e)
            if b is None or b[1] != t or b[2]:
                continue  # stale record: re-touched, gone, or not a leaf
            if e in protect:
                keep.append((t, e))
                continue
            del self.blocks[e]
            out.append(e)
            p = b[0]
            if p is not None:
                pb = self.blocks[p]
                pb[2] -= 1
                if pb[2] == 0:
                    heapq.heappush(self.heap, (pb[1], p))
        for r in keep:
            heapq.heappush(self.heap, r)
        return out

    def _removed(self, e: int):
        if self.style == "sglang":
            return ["BlockRemoved", [_signed(e)]]
        return {"type": "BlockRemoved", "block_hashes": [e], "medium": "GPU", "group_idx": 0}


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _stream(args, style: str) -> tuple[list[bytes], int, int]:
    """Payloads of a multi-turn workload; returns (payloads, stored, removed) blocks."""
    rng = random.Random(args.seed)
    bs = args.block_size
    systems = [[rng.randrange(32_000) for _ in range(512)] for _ in range(16)]
    sessions: list[list[int]] = []
    eng = _Engine(args.capacity, bs, style)
    payloads, step, stored, removed = [], [], 0, 0
    for _ in range(args.requests):
        if len(sessions) < 64 or rng.random() < 0.2:
            s = list(rng.choice(systems))
            sessions.append(s)
            if len(sessions) > 256:
                sessions.pop(0)
        else:
            s = rng.choice(sessions)
        s.extend(rng.randrange(32_000) for _ in range(rng.randint(64, 320)))  # user turn
        s.extend(rng.randrange(32_000) for _ in range(rng.randint(32, 256)))  # the answer
        if len(s) > 6000:
            s[:] = list(rng.choice(systems))
        evs = eng.run(s)
        for e in evs:
            kind = e["type"] if isinstance(e, dict) else e[0]
            if kind == "BlockStored":
                stored += len(e["block_hashes"] if isinstance(e, dict) else e[1])
            else:
                removed += 1
        step.extend(evs)
        if len(step) and rng.random() < 0.25:
            b = [time.time(), step] if style == "sglang" else [time.time(), step, 0]
            payloads.append(msgpack.packb(b))
            step = []
    if step:
        payloads.append(msgpack.packb([time.time(), step] if style == "sglang" else [time.time(), step, 0]))
    return payloads, stored, removed


def _ingest(args, style: str) -> dict:
    payloads, stored, removed = _stream(args, style)
    index = PrefixIndex(max_bytes=2**40)
    bmap = EngineBlockMap("w0", index, _root_seed, block_size=args.block_size)
    # CPU seconds of this process (one thread): the cost per core, which a loaded
    # machine does not inflate the way it inflates wall time; wall time beside it.
    cpu, wall = time.process_time, time.perf_counter
    c0 = cpu()
    for p in payloads:
        decode_batch(p)
    c_decode = cpu() - c0
    now = 0.0
    c0, w0 = cpu(), wall()
    for p in payloads:
        now += 1e-3
        bmap.apply(decode_batch(p).events, now)
    c_all, w_all = cpu() - c0, wall() - w0
    st = bmap.stats()
    assert st.orphan_blocks == 0 and st.unknown_removed == 0, st
    assert st.stored_blocks == stored and st.removed_blocks == removed, (st, stored, removed)
    bmap.check(exclusive=True)
    index.check()
    blocks = stored + removed
    return {
        "form": "vllm-map" if style == "map" else "sglang-tagged",
        "batches": len(payloads),
        "payload_bytes": sum(map(len, payloads)),
        "stored_blocks": stored,
        "removed_blocks": removed,
        "cpu_seconds": round(c_all, 4),
        "wall_seconds": round(w_all, 4),
        "blocks_per_cpu_s": round(blocks / c_all),
        "blocks_per_wall_s": round(blocks / w_all),
        "decode_share": round(c_decode / c_all, 3),
        "cpu_us_per_batch": round(c_all / len(payloads) * 1e6, 1),
        "indexed_blocks_at_end": index.stats().nodes,
        "meets_target": blocks / c_all >= TARGET_BLOCKS_PER_S,
    }


def _traced(build: Callable[[], _T]) -> tuple[int, _T]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    keep = build()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used, keep


def _memory(args) -> dict:
    bs = args.block_size
    per = 64  # blocks per prompt: 8 KiB of bytes, 2048 tokens of 32
    prompts = max(1, args.mem_blocks // per)
    rng = random.Random(args.seed + 1)
    byte_prompts = [rng.randbytes(per * DEFAULT_BLOCK_BYTES) for _ in range(prompts)]
    tok_prompts = [[rng.randrange(32_000) for _ in range(per * bs)] for _ in range(prompts)]
    bseed = namespace_seed(MODEL)
    tseed = _root_seed(None, "", bs)
    payloads = [
        msgpack.packb(
            [
                0.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [rng.getrandbits(64) for _ in range(per)],
                        "parent_block_hash": None,
                        "token_ids": t,
                        "block_size": bs,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                    }
                ],
                0,
            ]
        )
        for t in tok_prompts
    ]

    # Keys are made inside each traced build: the index keeps their int objects.
    def byte_index():
        idx = PrefixIndex(max_bytes=2**40)
        for i, p in enumerate(byte_prompts):
            idx.insert("w0", block_hashes(p, bseed), float(i))
        return idx

    def token_index():
        idx = PrefixIndex(max_bytes=2**40)
        for i, t in enumerate(tok_prompts):
            idx.insert("w0", token_block_hashes(t, bs, tseed), float(i))
        return idx

    def via_events():
        idx = PrefixIndex(max_bytes=2**40)
        m = EngineBlockMap("w0", idx, _root_seed, block_size=bs)
        for i, p in enumerate(payloads):
            m.apply(decode_batch(p).events, float(i))
        return idx, m

    b_bytes, b_idx = _traced(byte_index)
    t_bytes, t_idx = _traced(token_index)
    del t_idx
    e_bytes, (e_idx, e_map) = _traced(via_events)
    blocks = b_idx.stats().nodes
    assert e_idx.stats().nodes == blocks == len(e_map), (blocks, e_idx.stats(), len(e_map))
    return {
        "blocks": blocks,
        "byte_index_bytes_per_block": round(b_bytes / blocks, 1),
        "token_index_bytes_per_block": round(t_bytes / blocks, 1),
        "events_index_plus_map_bytes_per_block": round(e_bytes / blocks, 1),
        "map_bytes_per_block": round((e_bytes - t_bytes) / blocks, 1),
        "ratio_to_byte_index": round(e_bytes / b_bytes, 3),
    }


def run(args: argparse.Namespace) -> int:
    tune_gc()
    rows = [_ingest(args, "map"), _ingest(args, "sglang")]
    mem = _memory(args)
    if args.json:
        print(json.dumps({"ingest": rows, "memory": mem, "target_blocks_per_s": TARGET_BLOCKS_PER_S}))
        return 0
    print(
        f"KV-event ingestion: decode + block map + index, one core, {args.block_size}-token blocks, "
        f"{args.requests} requests, engine cache {args.capacity} blocks"
    )
    print(
        f"{'form':<14} {'batches':>8} {'stored':>9} {'removed':>9} {'blocks/cpu-s':>13} "
        f"{'blocks/wall-s':>14} {'decode':>7} {'cpu µs/batch':>13}"
    )
    for r in rows:
        print(
            f"{r['form']:<14} {r['batches']:>8,} {r['stored_blocks']:>9,} {r['removed_blocks']:>9,} "
            f"{r['blocks_per_cpu_s']:>13,} {r['blocks_per_wall_s']:>14,} {r['decode_share']:>6.0%} "
            f"{r['cpu_us_per_batch']:>13}"
        )
    print(
        f"target >= {TARGET_BLOCKS_PER_S:,} blocks per CPU second: "
        f"{'met' if all(r['meets_target'] for r in rows) else 'NOT met'}"
    )
    print(
        f"memory per indexed block (tracemalloc, {mem['blocks']:,} blocks): byte-keyed index "
        f"{mem['byte_index_bytes_per_block']} B; token-keyed index {mem['token_index_bytes_per_block']} B"
        f" + engine block map {mem['map_bytes_per_block']} B = "
        f"{mem['events_index_plus_map_bytes_per_block']} B ({mem['ratio_to_byte_index']}x)"
    )
    return 0
