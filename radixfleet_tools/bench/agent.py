"""``radixfleet bench agent``: cached TTFT, cost-model arithmetic, bookkeeping req/s.

Three measurements, in one run:

1. **cached TTFT** -- an in-process Llama-3-8B@H100 agent on 127.0.0.1 (KV pool from
   the presets) gets the same 2,048-token prompt twice, streamed; TTFT is wall time
   to the first SSE token chunk. Target: second reports >= 2,000 cached tokens and
   TTFT <= 0.3 x the first.
2. **cost model** -- the docs/DESIGN.md arithmetic (70B prefill on one H100, KV bytes/token).
3. **bookkeeping req/s** -- the agent's per-request Python work with no HTTP and no
   sleeping: request_key (template + block hashes) + tokenize + generate + scheduler
   submit/steps + radix match/insert/evict + events, driven in *virtual* time on one
   core. Compared with the simulated GPU's own throughput on the same workload
   (requests per simulated second): Python must be far faster than the GPU it
   simulates, so that the simulated GPU, not the interpreter, limits an agent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp
from aiohttp import web

from radixfleet.keys import DEFAULT_BLOCK_BYTES, Endpoint, block_hashes, namespace_seed, request_key
from radixfleet_tools.loadtest.local_fleet import free_port


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--requests", type=int, default=5000, help="requests in the bookkeeping run (default 5000)"
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed")


async def _ttft() -> dict:
    from radixfleet_tools.agent.server import AGENT_KEY, AgentConfig, create_app

    app = create_app(AgentConfig(model="llama-3-8b", gpu="h100"))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    agent = app[AGENT_KEY]
    prompt = "".join(f"{i:04d}" for i in range(2048))  # 8,192 bytes = 2,048 tokens
    body = {
        "model": "llama-3-8b",
        "prompt": prompt,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = []
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                t0 = time.perf_counter()
                ttft = None
                usage = None
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        obj = json.loads(line[6:])
                        if ttft is None and obj["choices"] and obj["choices"][0]["text"]:
                            ttft = time.perf_counter() - t0
                        if obj.get("usage"):
                            usage = obj["usage"]
                assert usage is not None, "the agent ends a stream with usage (include_usage)"
                out.append(
                    {
                        "ttft_s": ttft,
                        "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    }
                )
    finally:
        cap = agent.capacity
        await runner.cleanup()
    return {
        "kv_capacity_tokens": cap,
        "first": out[0],
        "second": out[1],
        "ttft_ratio": out[1]["ttft_s"] / out[0]["ttft_s"],
        "simulated_prefill_s": agent.cost.prefill_s(2048),
    }


async def _http_rate(n: int, concurrency: int) -> dict:
    """HTTP req/s of one in-process agent (client in the same process and core):
    short prompts, max_tokens=1, so a step batches many requests and the wall rate
    measures the Python/HTTP path rather than the simulated GPU."""
    from radixfleet_tools.agent.server import AGENT_KEY, AgentConfig, create_app

    app = create_app(AgentConfig(model="llama-3-8b", gpu="h100", kv_tokens=200_000))
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    agent = app[AGENT_KEY]
    url = f"http://127.0.0.1:{port}/v1/completions"
    todo = iter(range(n))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

            async def worker():
                for i in todo:
                    async with s.post(
                        url,
                        json={
                            "model": "llama-3-8b",
                            "max_tokens": 1,
                            "prompt": f"user {i % 50} asks: question {i}",
                        },
                    ) as r:
                        await r.read()

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - t0
    finally:
        busy = agent.sched.stats.busy_s
        await runner.cleanup()
    return {
        "requests": n,
        "concurrency": concurrency,
        "wall_s": wall,
        "http_req_per_s": n / wall,
        "simulated_busy_s": busy,
    }


def _cost_figures() -> dict:
    from radixfleet_tools.agent.cost_model import MODELS, CostModel

    c70 = CostModel("llama-3-70b", "h100", mfu=0.6)
    return {
        "prefill_70b_2048_h100_s": c70.prefill_linear_s(2048),
        "prefill_70b_2048_h100_params70e9_s": 2 * 70e9 * 2048 / (989e12 * 0.6),
        "prefill_70b_2048_h100_with_attention_s": c70.prefill_s(2048),
        "kv_bytes_per_token": {m: MODELS[m].kv_bytes_per_token for m in MODELS},
        "kv_capacity_tokens": {
            "llama-3-8b@h100": CostModel("llama-3-8b", "h100").kv_capacity_tokens(),
            "llama-3-70b@4xh100": CostModel("llama-3-70b", "h100", tp=4).kv_capacity_tokens(),
            "qwen2.5-32b@h200": CostModel("qwen2.5-32b", "h200").kv_capacity_tokens(),
            "deepseek-v3@8xh200": CostModel("deepseek-v3", "h200", tp=8).kv_capacity_tokens(),
        },
        "decode_step_8b_h100_batch32_ctx64k_s": CostModel("llama-3-8b", "h100").decode_step_s(32, 65536),
    }


def _bookkeeping(n: int, seed: int) -> dict:
    """Full per-request agent work in virtual time (no HTTP, no sleeping)."""
    from radixfleet_tools.agent import tokenizer as tk
    from radixfleet_tools.agent.cost_model import CostModel
    from radixfleet_tools.agent.kv_pool import KVPool
    from radixfleet_tools.agent.radix_cache import RadixCache
    from radixfleet_tools.agent.scheduler import SchedRequest, Scheduler

    rng = random.Random(seed)
    cost = CostModel("llama-3-8b", "h100")
    cap = 200_000
    cache = RadixCache(hash_stride=DEFAULT_BLOCK_BYTES // 4, capacity_tokens=cap)
    pool = KVPool(cap, cache)
    sched = Scheduler(cost, cache, pool)
    systems = [f"<system {k}> " + "You answer questions about document %d. " % k * 20 for k in range(50)]
    bodies = [
        {
            "model": "llama-3-8b",
            "messages": [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": f"question {i}: " + "x" * rng.randrange(50, 400)},
            ],
        }
        for i in range(n)
    ]
    max_new = 16
    t = 0.0
    gap = 0.002  # offered load: 500 req per simulated second
    done = 0
    t0 = time.perf_counter()
    for i, body in enumerate(bodies):
        key = request_key(Endpoint.CHAT, body)
        prompt = tk.encode(key.data)
        out = tk.generate(tk.request_seed(key.data), max_new)
        hashes = block_hashes(key.data + tk.decode(out), namespace_seed(key.model), DEFAULT_BLOCK_BYTES)
        sched.submit(SchedRequest(i, (key.model, "", None), prompt, max_new, out, hashes), t)
        arrive_next = (i + 1) * gap
        while sched.has_work() and t < arrive_next:
            res = sched.step(t)
            t += res.duration_s
            done += len(res.finished)
        if t < arrive_next:
            t = arrive_next
        cache.drain_events()
    while sched.has_work():
        res = sched.step(t)
        t += res.duration_s
        done += len(res.finished)
    wall = time.perf_counter() - t0
    st = sched.stats
    return {
        "requests": n,
        "wall_s": wall,
        "bookkeeping_req_per_s": n / wall,
        "simulated_s": t,
        "simulated_req_per_s": n / t,
        "finished": done,
        "steps": st.steps,
        "hit_rate": st.cached_tokens / st.prompt_tokens,
        "evicted_tokens": cache.stats.evicted_tokens,
        "python_headroom": (n / wall) / (n / t),
    }


def run(args: argparse.Namespace) -> int:
    ttft = asyncio.run(_ttft())
    cost = _cost_figures()
    book = _bookkeeping(args.requests, args.seed)
    http = asyncio.run(_http_rate(2000, 64))
    result = {
        "cached_ttft": ttft,
        "cost_model": cost,
        "bookkeeping": book,
        "http": http,
        "pass": {
            "cached_tokens_ge_2000": ttft["second"]["cached_tokens"] >= 2000,
            "ttft_ratio_le_0_3": ttft["ttft_ratio"] <= 0.3,
            "bookkeeping_ge_500_req_s": book["bookkeeping_req_per_s"] >= 500,
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    f, s = ttft["first"], ttft["second"]
    print("cached TTFT (llama-3-8b@h100, 2,048-token prompt, wall time over loopback HTTP)")
    print(f"  first : TTFT {f['ttft_s'] * 1e3:7.2f} ms, cached {f['cached_tokens']} / {f['prompt_tokens']}")
    print(f"  second: TTFT {s['ttft_s'] * 1e3:7.2f} ms, cached {s['cached_tokens']} / {s['prompt_tokens']}")
    print(f"  ratio second/first: {ttft['ttft_ratio']:.3f} (target <= 0.3)")
    print("cost model")
    print(
        f"  70B, 2,048 tokens, 1 x H100 @ 60% MFU: {cost['prefill_70b_2048_h100_s']:.3f} s "
        f"(70e9 params: {cost['prefill_70b_2048_h100_params70e9_s']:.3f} s; "
        f"with attention: {cost['prefill_70b_2048_h100_with_attention_s']:.3f} s)"
    )
    for m, v in cost["kv_bytes_per_token"].items():
        print(f"  KV bytes/token {m:<17} {v:>9,}")
    for k, v in cost["kv_capacity_tokens"].items():
        print(f"  KV capacity {k:<20} {v:>11,} tokens")
    print("bookkeeping (one core, virtual time, no HTTP: keys + tokenize + schedule + radix cache)")
    print(
        f"  {book['requests']} chat requests in {book['wall_s']:.2f} s wall: "
        f"{book['bookkeeping_req_per_s']:,.0f} req/s (target >= 500)"
    )
    print(
        f"  simulated GPU on the same workload: {book['simulated_req_per_s']:,.0f} req per simulated s; "
        f"Python headroom x{book['python_headroom']:.1f}; hit rate {book['hit_rate']:.2f}"
    )
    print(
        f"HTTP path (in-process client, 64 concurrent, max_tokens=1): "
        f"{http['http_req_per_s']:,.0f} req/s over {http['requests']} requests "
        f"(simulated GPU busy {http['simulated_busy_s']:.2f} s of {http['wall_s']:.2f} s wall)"
    )
    return 0
