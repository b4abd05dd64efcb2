"""``radixfleet bench index``: the prefix index's speed and memory.

Modelled on SGLang gateway's tree benchmark: a pool of 10,000 unique prompts; a
seeded mix of one third matches and two thirds inserts (a random prompt, for an
insert a random worker) at 8, 64 and 500 workers; prompts of ~1 KiB and 8 KiB.

Two timings per op are reported: the index operation on precomputed block hashes
(``insert_us``, ``match_us``) and the same including keying the prompt bytes into
chained hashes (``insert_keyed_us``, ``match_keyed_us``) — the latter is what a
request costs, and is what we compare with SGLang's tree (which walks the text).

Memory is measured with tracemalloc (Python allocations only, the hash ints the
index keeps included) for 10,000 cached 8 KiB prompts in a fresh index, and under
a budget with a stream of 3x that many unique prompts (it must stay flat).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import tracemalloc

from router.prefix_index import PrefixIndex, tune_gc
from router.prefix_keys import DEFAULT_BLOCK_BYTES, block_hashes, namespace_seed

#: SGLang gateway's published tree figures (v0.3.1), 1 KiB prompts.
SGLANG_INSERT_OPS_PER_S = 216_000
SGLANG_MATCH_OPS_PER_S = 124_000


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON list of rows")
    p.add_argument("--prompts", type=int, default=10_000, help="pool size (default 10000)")
    p.add_argument("--ops", type=int, default=30_000, help="ops per row (default 30000)")
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES)
    p.add_argument("--seed", type=int, default=0)


def _pool(n: int, size: int, rng: random.Random) -> list[bytes]:
    return [rng.randbytes(size) for _ in range(n)]


def _row(prompts: list[bytes], workers: int, ops: int, block_bytes: int, rng: random.Random) -> dict:
    seed = namespace_seed("bench-model")
    hashes = [block_hashes(p, seed, block_bytes) for p in prompts]
    names = [f"w{i}" for i in range(workers)]
    plan = [(rng.random() < 2 / 3, rng.randrange(len(prompts)), rng.choice(names)) for _ in range(ops)]
    idx = PrefixIndex(max_bytes=2**40)
    ins_t = match_t = 0.0
    n_ins = n_match = 0
    clock = time.perf_counter
    now = 0.0
    for is_insert, i, w in plan:
        now += 1e-4
        h = hashes[i]
        if is_insert:
            t = clock()
            idx.insert(w, h, now)
            ins_t += clock() - t
            n_ins += 1
        else:
            t = clock()
            idx.match(h, now)
            match_t += clock() - t
            n_match += 1
    # The same plan again on a fresh index, keying the bytes on every op.
    idx = PrefixIndex(max_bytes=2**40)
    ins_k = match_k = 0.0
    for is_insert, i, w in plan:
        now += 1e-4
        p = prompts[i]
        if is_insert:
            t = clock()
            idx.insert(w, block_hashes(p, seed, block_bytes), now)
            ins_k += clock() - t
        else:
            t = clock()
            idx.match(block_hashes(p, seed, block_bytes), now)
            match_k += clock() - t
    idx.check()
    return {
        "prompt_bytes": len(prompts[0]),
        "workers": workers,
        "block_bytes": block_bytes,
        "insert_ops_per_s": round(n_ins / ins_t),
        "match_ops_per_s": round(n_match / match_t),
        "insert_us": round(ins_t / n_ins * 1e6, 2),
        "match_us": round(match_t / n_match * 1e6, 2),
        "insert_keyed_us": round(ins_k / n_ins * 1e6, 2),
        "match_keyed_us": round(match_k / n_match * 1e6, 2),
        "insert_keyed_ops_per_s": round(n_ins / ins_k),
        "match_keyed_ops_per_s": round(n_match / match_k),
    }


def _memory(prompts: list[bytes], block_bytes: int, workers: int) -> dict:
    """tracemalloc bytes of an index holding every prompt of ``prompts`` once."""
    seed = namespace_seed("bench-model")
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(max_bytes=2**40)
    for i, p in enumerate(prompts):
        idx.insert(f"w{i % workers}", block_hashes(p, seed, block_bytes), float(i))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    st = idx.stats()
    return {
        "bytes_total": used,
        "bytes_per_block": round(used / st.nodes, 1),
        "bytes_per_prompt_byte": round(used / sum(len(p) for p in prompts), 3),
        "est_bytes": st.est_bytes,
        "nodes": st.nodes,
    }


def _budget_stream(size: int, n: int, block_bytes: int, rng: random.Random) -> dict:
    """A stream of ``n`` unique prompts into a budget a third of their size."""
    seed = namespace_seed("bench-model")
    budget = n // 3 * (size // block_bytes) * 200
    idx = PrefixIndex(max_bytes=budget)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    samples = []
    for i in range(n):
        idx.insert(f"w{i % 8}", block_hashes(rng.randbytes(size), seed, block_bytes), float(i))
        if (i + 1) % (n // 6) == 0:
            samples.append(tracemalloc.get_traced_memory()[0] - base)
    tracemalloc.stop()
    idx.check()
    return {"budget_bytes": budget, "est_bytes": idx.stats().est_bytes,
            "traced_bytes_at_sixths": samples, "evicted_entries": idx.stats().evicted_entries}


def run(args: argparse.Namespace) -> int:
    tune_gc()
    rng = random.Random(args.seed)
    rows = []
    mem = None
    for size in (1024, 8192):
        prompts = _pool(args.prompts, size, rng)
        for workers in (8, 64, 500):
            row = _row(prompts, workers, args.ops, args.block_bytes, rng)
            rows.append(row)
        if size == 8192:
            mem = _memory(prompts, args.block_bytes, 8)
            del prompts
    for row in rows:
        row["bytes_per_block"] = mem["bytes_per_block"]
        row["bytes_per_prompt_byte"] = mem["bytes_per_prompt_byte"]
    stream = _budget_stream(8192, min(3 * args.prompts, 30_000), args.block_bytes, rng)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"prefix index, block_bytes={args.block_bytes}, pool {args.prompts} unique prompts, "
          f"{args.ops} ops per row (2/3 insert, 1/3 match); µs per op")
    hdr = f"{'prompt':>7} {'workers':>7} {'insert/s':>10} {'match/s':>10} {'ins µs':>8} {'match µs':>8}" \
          f" {'ins+key µs':>10} {'match+key µs':>12}"
    print(hdr)
    for r in rows:
        print(f"{r['prompt_bytes']:>7} {r['workers']:>7} {r['insert_ops_per_s']:>10,} "
              f"{r['match_ops_per_s']:>10,} {r['insert_us']:>8} {r['match_us']:>8} "
              f"{r['insert_keyed_us']:>10} {r['match_keyed_us']:>12}")
    print(f"SGLang gateway tree (1 KiB, published v0.3.1): {SGLANG_INSERT_OPS_PER_S:,} inserts/s, "
          f"{SGLANG_MATCH_OPS_PER_S:,} matches/s")
    print(f"memory (tracemalloc), {args.prompts} cached 8 KiB prompts: {mem['bytes_total'] / 2**20:.1f} MiB, "
          f"{mem['bytes_per_block']} B per block, {mem['bytes_per_prompt_byte']} B per prompt byte "
          f"(index estimate {mem['est_bytes'] / 2**20:.1f} MiB)")
    print(f"budget stream: {min(3 * args.prompts, 30_000)} unique 8 KiB prompts into "
          f"{stream['budget_bytes'] / 2**20:.1f} MiB: traced MiB at each sixth "
          f"{[round(x / 2**20, 1) for x in stream['traced_bytes_at_sixths']]}, "
          f"evicted {stream['evicted_entries']:,} entries")
    return 0
