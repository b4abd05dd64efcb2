"""``radixfleet bench routing``: the router's routing work per request, without HTTP.

Per request, exactly what ``Router._route_and_forward`` does before forwarding:
``json.loads`` of the body is excluded (it is not routing), then

    key   = request_key(endpoint, body, tenant, block_bytes)   (canonical bytes, hashes)
    match = index.match(key.hashes, now)
    views = pool.views(now)                                    (cached per worker)
    d     = policy.choose(RouteRequest(...), match, views, now)
    index.insert(d.worker, key.hashes, now); pool.pick(...); pool.finish(...)

for an 8 KiB prompt (64 blocks of 128 bytes) over 16 workers, with sessions that
share a system prompt and grow turn by turn (so matches are deep and hot). Target:
<= 50 us per request for keys + match + policy; the optimistic insert and the
load count after the decision are timed separately. Figures: mean, p50, p99.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from policies.base import RouteRequest
from router.config import parse_config
from router.pool import HealthState, Pool
from router.prefix_index import PrefixIndex
from router.prefix_keys import Endpoint, request_key


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--policies", default="round_robin,least_load,cache_aware,prefix_load")


def _bodies(n: int, prompt_bytes: int, rng: random.Random) -> list[dict]:
    system = "You are a careful assistant. Follow the rules. " * (prompt_bytes // 96)
    out = []
    sessions = [[{"role": "system", "content": system}] for _ in range(64)]
    for _ in range(n):
        s = sessions[rng.randrange(len(sessions))]
        if len(s) > 7:
            del s[1:]
        s.append({"role": "user", "content": f"question {rng.random():.12f} " * 4})
        msgs = list(s)
        # pad to the target size with the last turn
        size = sum(len(m["content"]) for m in msgs)
        if size < prompt_bytes:
            msgs[-1] = {"role": "user", "content": msgs[-1]["content"] + "x" * (prompt_bytes - size)}
        out.append({"model": "m", "messages": msgs})
        s.append({"role": "assistant", "content": "answer " * 8})
    return out


def bench_policy(name: str, bodies: list[dict], workers: int) -> dict:
    cfg = parse_config({"workers": [{"url": f"http://10.0.0.{i}:1", "id": f"w{i}"}
                                    for i in range(workers)], "policy": {"name": name}})
    from router.config import build_policy_from

    policy = build_policy_from(cfg.policy)
    index = PrefixIndex()
    pool = Pool(cfg, index)
    for w in pool:
        pool._set_health(w, HealthState.HEALTHY)
    block_bytes = cfg.keys.block_bytes
    lat = []  # keys + match + views + policy (the target's scope)
    book = []  # index.insert + pool.pick (bookkeeping after the decision)
    perf = time.perf_counter
    now0 = time.monotonic()
    in_flight: list = []
    for i, body in enumerate(bodies):
        t0 = perf()
        now = now0 + i * 1e-3
        key = request_key(Endpoint.CHAT, body, tenant="", block_bytes=block_bytes)
        match = index.match(key.hashes, now)
        views = pool.views(now)
        d = policy.choose(RouteRequest(key.hashes, key.prompt_tokens, key.block_tokens, None,
                                       key.model, len(key.data)), match, views, now)
        t1 = perf()
        w = pool.get(d.worker)
        index.insert(w.id, key.hashes, now)
        tokens = max(0, key.prompt_tokens - d.matched_blocks * key.block_tokens)
        pool.pick(w, tokens)
        t2 = perf()
        lat.append(t1 - t0)
        book.append(t2 - t1)
        in_flight.append((w, tokens))
        if len(in_flight) > 32:  # keep a realistic amount of load in flight
            fw, ft = in_flight.pop(0)
            pool.finish(fw, ft, True)
    lat.sort()
    book.sort()
    n = len(lat)
    return {"policy": name, "requests": n, "mean_us": sum(lat) / n * 1e6,
            "p50_us": lat[n // 2] * 1e6, "p99_us": lat[int(n * 0.99)] * 1e6,
            "insert_pick_mean_us": sum(book) / n * 1e6,
            "insert_pick_p50_us": book[n // 2] * 1e6,
            "blocks_per_request": len(key.hashes), "index_nodes": index.stats().nodes}


def run(args: argparse.Namespace) -> int:
    rng = random.Random(0)
    bodies = _bodies(args.requests, args.prompt_bytes, rng)
    results = [bench_policy(p.strip(), bodies, args.workers)
               for p in args.policies.split(",") if p.strip()]
    if args.json:
        print(json.dumps({"workers": args.workers, "prompt_bytes": args.prompt_bytes,
                          "results": results}, indent=2))
        return 0
    print(f"routing work per request: {args.prompt_bytes} B chat prompt, {args.workers} "
          f"workers, {args.requests} requests (target <= 50 us)")
    for r in results:
        print(f"  {r['policy']:14s} keys+match+policy mean {r['mean_us']:6.1f} us  "
              f"p50 {r['p50_us']:6.1f} us  p99 {r['p99_us']:6.1f} us | insert+pick mean "
              f"{r['insert_pick_mean_us']:5.1f} us  ({r['blocks_per_request']} blocks)")
    return 0
