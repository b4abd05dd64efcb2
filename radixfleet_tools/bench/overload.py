"""``radixfleet bench overload``: shedding with default settings at 4x the fleet's capacity.

A live fleet on loopback (``radixfleet_tools.loadtest.local_fleet.Fleet``: ``--agents`` simulated agents,
Llama-3-8B on an L4 by default — about 0.23 s of prefill per 1,000-token prompt,
so the simulated GPUs, not this host's CPUs, are what saturates) behind
``radixfleet router`` with its defaults. Every request is a streamed completion
with a fresh prompt (no cache reuse: every one costs its full prefill).

1. capacity: ``--calibrate-s`` of a closed loop with far more clients than the
   fleet can serve; capacity = requests served per second (the router sheds the
   rest, so the fleet runs saturated, not queued);
2. unloaded: Poisson arrivals at ``--light`` x capacity for ``--duration`` s:
   time to first token (TTFT: from sending to the first streamed token);
3. overload: Poisson arrivals at ``--load`` x capacity for ``--duration`` s.

Figures: capacity (req/s); the excess (offered - capacity x duration) and the
share of it shed with 429 + ``Retry-After`` (target >= 90%); TTFT p50/p99 of the
admitted requests against the unloaded p99 (target p99 <= 3x); any other status.
The excess is computed with the calibrated capacity (the offered rate's own basis);
the share is also printed against the rate actually served during the overload
(on a shared host the calibration can come out low or high).
``--json`` prints one object. Takes about 2 x duration + calibration + ~15 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass

import aiohttp

from radixfleet.wire.cli_args import DeprecatedAlias
from radixfleet_tools.loadtest.local_fleet import Fleet, FleetConfig
from radixfleet_tools.loadtest.report import percentile

SHED_TARGET = 0.90
TTFT_RATIO_TARGET = 3.0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--agents", type=int, default=2, help="simulated agents")
    p.add_argument("--agent-model", dest="model", default="llama-3-8b", help="the agents' model preset")
    p.add_argument("--model", dest="model", action=DeprecatedAlias, use="--agent-model")
    p.add_argument("--gpu", default="l4", help="the agents' GPU preset")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--load", type=float, default=4.0, help="overload: x capacity")
    p.add_argument("--light", type=float, default=0.2, help="unloaded phase: x capacity")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--calibrate-s", type=float, default=10.0, help="seconds spent measuring capacity")
    p.add_argument("--seed", type=int, default=0, help="random seed")


@dataclass(slots=True)
class Outcome:
    status: int | None  # None: no answer (connection error or timeout)
    ttft_s: float | None = None
    retry_after: str | None = None


class Load:
    """Streams completions at the router; one ``aiohttp`` session."""

    def __init__(self, base: str, model: str, prompt_tokens: int, max_tokens: int, seed: int) -> None:
        self.url = base + "/v1/completions"
        self.model = model
        self.words = max(1, prompt_tokens * 4 // 6)  # "wNNNN " is 6 bytes = 1.5 tokens
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.n = 0
        self.session: aiohttp.ClientSession | None = None

    def prompt(self) -> str:
        self.n += 1
        r = self.rng.randrange
        return f"request {self.n}: " + " ".join(f"w{r(10000):04d}" for _ in range(self.words))

    async def one(self) -> Outcome:
        body = {"model": self.model, "prompt": self.prompt(), "max_tokens": self.max_tokens, "stream": True}
        t0 = time.monotonic()
        assert self.session is not None, "_run sets the session before the load"
        try:
            async with self.session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    await resp.read()
                    return Outcome(resp.status, retry_after=resp.headers.get("Retry-After"))
                ttft = None
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data: {") and b'"text":""' not in line:
                        ttft = time.monotonic() - t0
                return Outcome(200, ttft)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return Outcome(None)

    async def poisson(self, rate: float, duration_s: float) -> list[Outcome]:
        """Open-loop arrivals at ``rate``/s for ``duration_s``; waits for all answers."""
        tasks = []
        end = time.monotonic() + duration_s
        t = time.monotonic()
        while True:
            t += self.rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.create_task(self.one()))
        return list(await asyncio.gather(*tasks))

    async def closed(self, clients: int, duration_s: float) -> tuple[int, float]:
        """``clients`` back-to-back loops; returns (served requests, seconds)."""
        end = time.monotonic() + duration_s
        served = 0

        async def loop():
            nonlocal served
            while time.monotonic() < end:
                o = await self.one()
                if o.status == 200:
                    served += 1
                elif o.status == 429:
                    await asyncio.sleep(0.05)

        t0 = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(clients)))
        return served, time.monotonic() - t0


async def _run(args: argparse.Namespace, base: str, model: str) -> dict:
    load = Load(base, model, args.prompt_tokens, args.max_tokens, args.seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        load.session = s
        await load.closed(4, 2.0)  # warm: rates measured, typical request learned
        served, secs = await load.closed(16 * args.agents, args.calibrate_s)
        capacity = served / secs
        await asyncio.sleep(2.0)  # drain
        light = await load.poisson(args.light * capacity, args.duration)
        await asyncio.sleep(1.0)
        heavy = await load.poisson(args.load * capacity, args.duration)
    light_ttft = [o.ttft_s for o in light if o.status == 200 and o.ttft_s is not None]
    admitted = [o.ttft_s for o in heavy if o.status == 200 and o.ttft_s is not None]
    shed = [o for o in heavy if o.status == 429]
    with_retry = [o for o in shed if o.retry_after and o.retry_after.isdigit() and int(o.retry_after) >= 1]
    other = sorted(
        {o.status for o in [*light, *heavy] if o.status not in (200, 429)},
        key=lambda s: -1 if s is None else s,
    )
    served_rps = sum(o.status == 200 for o in heavy) / args.duration
    excess = len(heavy) - capacity * args.duration
    excess_served = len(heavy) - served_rps * args.duration
    p99_light = percentile(light_ttft, 0.99)
    p99_heavy = percentile(admitted, 0.99)
    out = {
        "agents": args.agents,
        "model": args.model,
        "gpu": args.gpu,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "capacity_rps": round(capacity, 2),
        "overload_served_rps": round(served_rps, 2),
        "unloaded": {
            "rate_rps": round(args.light * capacity, 2),
            "requests": len(light),
            "served": sum(o.status == 200 for o in light),
            "ttft_p50_s": percentile(light_ttft, 0.5),
            "ttft_p99_s": p99_light,
        },
        "overload": {
            "rate_rps": round(args.load * capacity, 2),
            "requests": len(heavy),
            "served": sum(o.status == 200 for o in heavy),
            "shed_429": len(shed),
            "shed_with_retry_after": len(with_retry),
            "ttft_p50_s": percentile(admitted, 0.5),
            "ttft_p99_s": p99_heavy,
        },
        "other_statuses": [s for s in other],
        "excess_requests": round(excess, 1),
        "shed_share_of_excess": round(len(with_retry) / excess, 3) if excess > 0 else None,
        "shed_share_of_unserved": (round(len(with_retry) / excess_served, 3) if excess_served > 0 else None),
        "ttft_p99_ratio": round(p99_heavy / p99_light, 2) if p99_light and p99_heavy else None,
    }
    out["pass"] = bool(
        out["shed_share_of_excess"] is not None
        and out["shed_share_of_excess"] >= SHED_TARGET
        and out["ttft_p99_ratio"] is not None
        and out["ttft_p99_ratio"] <= TTFT_RATIO_TARGET
        and not other
    )
    return out


def run(args: argparse.Namespace) -> int:
    cfg = FleetConfig(agents=args.agents, model=args.model, gpu=args.gpu, kv_tokens=200_000, router_port=0)
    with tempfile.TemporaryDirectory(prefix="radixfleet-overload-") as logs:
        with Fleet(cfg, log_dir=logs) as fleet:
            out = asyncio.run(_run(args, fleet.router_url, args.model))
    if args.json:
        print(json.dumps(out))
        return 0
    u, o = out["unloaded"], out["overload"]

    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f} ms"

    print(
        f"fleet: {args.agents} x {args.model} on {args.gpu} (simulated), router defaults; "
        f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens out, streamed"
    )
    print(
        f"capacity: {out['capacity_rps']:.2f} req/s calibrated (closed loop, saturated); "
        f"{out['overload_served_rps']:.2f} req/s served during the overload"
    )
    print(
        f"unloaded ({args.light:g}x, {u['rate_rps']:.2f} req/s, {u['requests']} requests): "
        f"TTFT p50 {ms(u['ttft_p50_s'])}, p99 {ms(u['ttft_p99_s'])}"
    )
    print(
        f"overload ({args.load:g}x, {o['rate_rps']:.2f} req/s, {o['requests']} requests): "
        f"{o['served']} served, {o['shed_429']} shed with 429 "
        f"({o['shed_with_retry_after']} with Retry-After)"
    )
    share, unserved = out["shed_share_of_excess"], out["shed_share_of_unserved"]
    if share is None:
        print("  no excess over the calibrated capacity")
    else:
        print(
            f"  excess {out['excess_requests']:.0f} requests, shed {share:.0%} of it "
            f"(target >= {SHED_TARGET:.0%})"
            + ("" if unserved is None else f"; {unserved:.0%} of the requests not served were shed with 429")
        )
    ratio = out["ttft_p99_ratio"]
    print(
        f"  admitted TTFT p50 {ms(o['ttft_p50_s'])}, p99 {ms(o['ttft_p99_s'])} = "
        f"{ratio}x the unloaded p99 (target <= {TTFT_RATIO_TARGET:g}x)"
    )
    if out["other_statuses"]:
        print(f"  other statuses: {out['other_statuses']}")
    print("PASS" if out["pass"] else "FAIL")
    return 0
