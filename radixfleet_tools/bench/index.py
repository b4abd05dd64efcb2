"""``radixfleet bench index``: the prefix index's speed and memory.

Modelled on SGLang gateway's tree benchmark: a pool of 10,000 unique prompts; a
seeded mix of one third matches and two thirds inserts (a random prompt, for an
insert a random worker) at 8, 64 and 500 workers; prompts of ~1 KiB and 8 KiB.

Per row, three kinds of timing:

- **inserts** of the mixed plan (µs per insert, inserts/s);
- **matches of the mixed plan, split by outcome**: a match of a prompt not yet
  inserted misses at its first block (a dict miss, ~1-2 µs) while a hit walks
  every block — the plan's overall match average is mostly misses early on, so
  hits and misses are reported apart, with the share of each;
- **directed matches on the row's finished index, by matched depth**: prompts
  that share exactly 1 block, a quarter, half or all of an inserted prompt (then
  diverge), and fresh prompts (miss at the first block). The full-depth 1 KiB hit
  is what SGLang's published 124,000 matches/s is compared with.

Each is timed on precomputed block hashes (the index alone) and again keying the
prompt bytes into chained hashes on every call (``+key``: what a request costs,
and what SGLang's tree, which walks the text, is compared with).

Memory is measured with tracemalloc (Python allocations only, the hash ints the
index keeps included) **for every row** — the row's own index (its plan's inserts
replayed into a fresh index, untimed): nodes, holder entries, bytes per node and
per byte of the distinct prompts it holds — plus 10,000 cached 8 KiB prompts
held once each (the bytes-per-prompt-byte target) and a stream of 3x that many
unique prompts under a budget (it must stay flat).

Colder tiers (``match_tiers``, what a request adds once engines offload KV): 1,000
cached 8 KiB prompts at 8 and 64 workers, each prompt held by one worker in GPU
memory for its first half and in its CPU tier whole; per full-prompt probe, the GPU
match alone and the tier walk after it (µs), and tracemalloc's bytes per colder
entry.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import tracemalloc

from radixfleet.index.prefix_index import PrefixIndex, tune_gc
from radixfleet.keys import DEFAULT_BLOCK_BYTES, block_hashes, namespace_seed

#: SGLang gateway's published tree figures (v0.3.1), 1 KiB prompts.
SGLANG_INSERT_OPS_PER_S = 216_000
SGLANG_MATCH_OPS_PER_S = 124_000
#: the directed match cases: (label, matched blocks as a function of the prompt's blocks)
DEPTHS = (
    ("miss", lambda n: 0),
    ("1 block", lambda n: 1),
    ("1/4", lambda n: max(1, n // 4)),
    ("1/2", lambda n: max(1, n // 2)),
    ("full", lambda n: n),
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--prompts", type=int, default=10_000, help="pool size (default 10000)")
    p.add_argument("--ops", type=int, default=30_000, help="ops per row (default 30000)")
    p.add_argument(
        "--probes", type=int, default=2_000, help="directed matches per depth and row (default 2000)"
    )
    p.add_argument(
        "--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, help="prefix key block size in bytes"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")


def _pool(n: int, size: int, rng: random.Random) -> list[bytes]:
    return [rng.randbytes(size) for _ in range(n)]


def _us(total_s: float, n: int) -> float | None:
    return round(total_s / n * 1e6, 2) if n else None


def _per_s(total_s: float, n: int) -> int | None:
    return round(n / total_s) if n and total_s > 0 else None


def _directed(
    idx: PrefixIndex,
    prompts: list[bytes],
    held: list[int],
    probes: int,
    block_bytes: int,
    seed: int,
    rng: random.Random,
    now: float,
) -> list[dict]:
    """Matches that reach exactly each depth of ``DEPTHS`` on the finished index."""
    clock = time.perf_counter
    size = len(prompts[0])
    nblocks = size // block_bytes
    out = []
    for label, depth_of in DEPTHS:
        d = depth_of(nblocks)
        cases = []
        for _ in range(probes):
            if d == 0:
                data = rng.randbytes(size)
            else:  # an inserted prompt's first d blocks, then bytes of its own
                data = prompts[rng.choice(held)][: d * block_bytes] + rng.randbytes(size - d * block_bytes)
            cases.append(data)
        hashes = [block_hashes(c, seed, block_bytes) for c in cases]
        t_idx = t_key = 0.0
        depths = 0
        for h in hashes:
            t = clock()
            m = idx.match(h, now, count=False)
            t_idx += clock() - t
            depths += m.depth
        for c in cases:
            t = clock()
            idx.match(block_hashes(c, seed, block_bytes), now, count=False)
            t_key += clock() - t
        got = depths / probes
        # d is what the prompt shares; the index may hold a chain that shares more
        # only by a 64-bit hash collision, so the mean depth is d exactly
        assert abs(got - d) < 1e-9, f"{label}: mean matched depth {got} != {d}"
        out.append(
            {
                "case": label,
                "depth_blocks": d,
                "match_us": _us(t_idx, probes),
                "match_ops_per_s": _per_s(t_idx, probes),
                "match_keyed_us": _us(t_key, probes),
                "match_keyed_ops_per_s": _per_s(t_key, probes),
            }
        )
    return out


def _row_memory(plan: list, hashes: list, prompts: list[bytes]) -> dict:
    """tracemalloc bytes of the index the row's inserts build (replayed, untimed)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(max_bytes=2**40)
    now = 0.0
    distinct = set()
    for is_insert, i, w in plan:
        now += 1e-4
        if is_insert:
            idx.insert(w, hashes[i], now)
            distinct.add(i)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    st = idx.stats()
    held_bytes = sum(len(prompts[i]) for i in distinct)
    return {
        "bytes_total": used,
        "nodes": st.nodes,
        "holder_entries": st.holder_entries,
        "bytes_per_block": round(used / st.nodes, 1),
        "bytes_per_holder_entry": round(used / st.holder_entries, 1),
        "bytes_per_prompt_byte": round(used / held_bytes, 3),
        "est_bytes": st.est_bytes,
    }


def _row(
    prompts: list[bytes], workers: int, ops: int, probes: int, block_bytes: int, rng: random.Random
) -> dict:
    seed = namespace_seed("bench-model")
    hashes = [block_hashes(p, seed, block_bytes) for p in prompts]
    names = [f"w{i}" for i in range(workers)]
    plan = [(rng.random() < 2 / 3, rng.randrange(len(prompts)), rng.choice(names)) for _ in range(ops)]
    idx = PrefixIndex(max_bytes=2**40)
    ins_t = hit_t = miss_t = 0.0
    n_ins = n_hit = n_miss = 0
    hit_depth = 0
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
            m = idx.match(h, now)
            dt = clock() - t
            if m.depth:
                hit_t += dt
                n_hit += 1
                hit_depth += m.depth
            else:
                miss_t += dt
                n_miss += 1
    idx.check()
    held = sorted({i for is_insert, i, _ in plan if is_insert})
    directed = _directed(idx, prompts, held, probes, block_bytes, seed, rng, now)
    # The same plan again on a fresh index, keying the bytes on every op.
    idx2 = PrefixIndex(max_bytes=2**40)
    ins_k = hit_k = miss_k = 0.0
    for is_insert, i, w in plan:
        now += 1e-4
        p = prompts[i]
        if is_insert:
            t = clock()
            idx2.insert(w, block_hashes(p, seed, block_bytes), now)
            ins_k += clock() - t
        else:
            t = clock()
            m = idx2.match(block_hashes(p, seed, block_bytes), now)
            dt = clock() - t
            if m.depth:
                hit_k += dt
            else:
                miss_k += dt
    del idx, idx2
    n_match = n_hit + n_miss
    return {
        "prompt_bytes": len(prompts[0]),
        "blocks": len(prompts[0]) // block_bytes,
        "workers": workers,
        "block_bytes": block_bytes,
        "insert_ops_per_s": _per_s(ins_t, n_ins),
        "insert_us": _us(ins_t, n_ins),
        "insert_keyed_us": _us(ins_k, n_ins),
        "insert_keyed_ops_per_s": _per_s(ins_k, n_ins),
        "plan_matches": n_match,
        "plan_hit_share": round(n_hit / n_match, 3) if n_match else None,
        "plan_hit_mean_depth": round(hit_depth / n_hit, 1) if n_hit else None,
        "plan_hit_us": _us(hit_t, n_hit),
        "plan_miss_us": _us(miss_t, n_miss),
        "plan_hit_keyed_us": _us(hit_k, n_hit),
        "plan_miss_keyed_us": _us(miss_k, n_miss),
        "plan_match_all_us": _us(hit_t + miss_t, n_match),
        "by_depth": directed,
        "memory": _row_memory(plan, hashes, prompts),
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
    return {
        "budget_bytes": budget,
        "est_bytes": idx.stats().est_bytes,
        "traced_bytes_at_sixths": samples,
        "evicted_entries": idx.stats().evicted_entries,
    }


def _tiers(size: int, n: int, workers: int, probes: int, block_bytes: int, rng: random.Random) -> dict:
    """Colder tiers: the tier walk's cost after a GPU match, and its memory (module
    docstring)."""
    seed = namespace_seed("bench-model")
    chains = [block_hashes(p, seed, block_bytes) for p in _pool(n, size, rng)]
    idx = PrefixIndex()
    owner = [rng.randrange(workers) for _ in chains]
    for h, w in zip(chains, owner):
        idx.insert(f"w{w}", h[: len(h) // 2], 1.0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for h, w in zip(chains, owner):
        idx.tier_add(f"w{w}", "cpu", h)
    cold_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    sample = [rng.choice(chains) for _ in range(probes)]
    t = time.perf_counter()
    ms = [idx.match(h, 2.0, count=False) for h in sample]
    t_match = time.perf_counter() - t
    t = time.perf_counter()
    for h, m in zip(sample, ms):
        idx.match_tiers(h, m)
    t_tiers = time.perf_counter() - t
    entries = sum(len(h) for h in chains)
    return {
        "prompt_bytes": size,
        "workers": workers,
        "gpu_match_us": _us(t_match, probes),
        "tier_walk_us": _us(t_tiers, probes),
        "blocks_walked": len(chains[0]) - len(chains[0]) // 2,
        "bytes_per_cold_entry": round(cold_bytes / entries, 1),
    }


def run(args: argparse.Namespace) -> int:
    tune_gc()
    rng = random.Random(args.seed)
    rows = []
    mem: dict = {}  # the 8 KiB pool's, measured in the loop
    for size in (1024, 8192):
        prompts = _pool(args.prompts, size, rng)
        for workers in (8, 64, 500):
            rows.append(_row(prompts, workers, args.ops, args.probes, args.block_bytes, rng))
        if size == 8192:
            mem = _memory(prompts, args.block_bytes, 8)
        del prompts
    stream = _budget_stream(8192, min(3 * args.prompts, 30_000), args.block_bytes, rng)
    tiers = [_tiers(8192, 1000, w, args.probes, args.block_bytes, rng) for w in (8, 64)]
    doc = {
        "benchmark": "index",
        "block_bytes": args.block_bytes,
        "prompts": args.prompts,
        "ops": args.ops,
        "probes": args.probes,
        "seed": args.seed,
        "sglang_published": {
            "insert_ops_per_s": SGLANG_INSERT_OPS_PER_S,
            "match_ops_per_s": SGLANG_MATCH_OPS_PER_S,
        },
        "rows": rows,
        "memory_10k_8k_prompts": mem,
        "budget_stream": stream,
        "colder_tiers": tiers,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"prefix index, block_bytes={args.block_bytes}, pool {args.prompts} unique prompts, "
        f"{args.ops} ops per row (2/3 insert, 1/3 match); µs per op, +key: keying included"
    )
    print(
        f"{'prompt':>7} {'workers':>7} {'insert/s':>10} {'ins µs':>7} {'ins+key':>8} "
        f"{'plan hits':>10} {'hit µs':>7} {'miss µs':>8} {'all µs':>7}  memory"
    )
    for r in rows:
        m = r["memory"]
        print(
            f"{r['prompt_bytes']:>7} {r['workers']:>7} {r['insert_ops_per_s']:>10,} "
            f"{r['insert_us']:>7} {r['insert_keyed_us']:>8} "
            f"{r['plan_hit_share']:>9.0%} {r['plan_hit_us']:>7} {r['plan_miss_us']:>8} "
            f"{r['plan_match_all_us']:>7}  {m['bytes_total'] / 2**20:.1f} MiB, "
            f"{m['bytes_per_block']} B/node, {m['bytes_per_prompt_byte']} B/prompt byte"
        )
    print("directed matches on each row's finished index, by matched depth (µs; +key µs)")
    labels = [lbl for lbl, _ in DEPTHS]
    print(f"{'prompt':>7} {'workers':>7} " + " ".join(f"{lbl:>15}" for lbl in labels))
    for r in rows:
        cells = [f"{c['match_us']:>6} ({c['match_keyed_us']:>6})" for c in r["by_depth"]]
        print(f"{r['prompt_bytes']:>7} {r['workers']:>7} " + " ".join(f"{c:>15}" for c in cells))
    full = [c for r in rows if r["prompt_bytes"] == 1024 for c in r["by_depth"] if c["case"] == "full"]
    print(
        f"SGLang gateway tree (1 KiB, published v0.3.1): {SGLANG_INSERT_OPS_PER_S:,} inserts/s, "
        f"{SGLANG_MATCH_OPS_PER_S:,} matches/s; ours, 1 KiB full-depth hits: "
        + ", ".join(f"{c['match_ops_per_s']:,}/s ({c['match_keyed_ops_per_s']:,}/s +key)" for c in full)
    )
    print(
        f"memory (tracemalloc), {args.prompts} cached 8 KiB prompts: {mem['bytes_total'] / 2**20:.1f} MiB, "
        f"{mem['bytes_per_block']} B per block, {mem['bytes_per_prompt_byte']} B per prompt byte "
        f"(index estimate {mem['est_bytes'] / 2**20:.1f} MiB)"
    )
    print(
        f"budget stream: {min(3 * args.prompts, 30_000)} unique 8 KiB prompts into "
        f"{stream['budget_bytes'] / 2**20:.1f} MiB: traced MiB at each sixth "
        f"{[round(x / 2**20, 1) for x in stream['traced_bytes_at_sixths']]}, "
        f"evicted {stream['evicted_entries']:,} entries"
    )
    for r in tiers:
        print(
            f"colder tiers, 8 KiB prompts, {r['workers']} workers, GPU prefix half, CPU whole: "
            f"GPU match {r['gpu_match_us']} µs, tier walk +{r['tier_walk_us']} µs "
            f"({r['blocks_walked']} blocks), {r['bytes_per_cold_entry']} B per colder entry"
        )
    return 0
