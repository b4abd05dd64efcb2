"""``radixfleet bench priority``: three priority classes at 2x the fleet's capacity.

The fleet of ``radixfleet bench overload`` (``--agents`` simulated Llama-3-8B agents
on an L4 behind ``radixfleet router``, fresh streamed prompts, so the simulated GPUs
are what saturates), the router with ``tenancy: {default_priority: critical}`` and
its default ``queue_scale`` (critical 4, standard 1, sheddable 0.25): each class's
requests name their class in ``x-radixfleet-priority`` (a request may always lower
its class).

1. capacity: ``--calibrate-s`` of a closed loop far above what the fleet serves;
2. critical alone at the rate it has in the overload (its share of ``--load``): the
   queueing among critical requests themselves, which no admission removes; then
   unloaded: critical requests alone, Poisson at ``--light`` x capacity;
3. overload: critical, standard and sheddable requests at once, Poisson at
   ``--load`` x capacity in all, split by ``--shares`` (equal thirds by default),
   for ``--duration`` s.

With equal thirds at 2x, critical and standard alone offer 1.33x: the excess (1x)
is more than the sheddable third (0.67x), so at most 67% of the shed can be
sheddable; ``--shares 1,1,4`` gives the sheddable class enough to absorb it.
At the default factors standard and sheddable requests are shed alike here: one
1,000-token prompt is about two default bounds of prefill, so a worker's queue is
either about empty (both admitted) or past both bounds; ``--queue-scale 8,2.5,0.25``
lets standard requests wait behind one request, and sheddable ones take the shed.

``--schedule`` is the agents' waiting order: ``priority`` (the default) orders each
engine's queue by the class the router sends as vLLM's body ``priority`` (agents
announce it at registration: radixfleet_tools.agent.scheduler), so an admitted critical
request is not queued behind earlier standard and sheddable ones; ``fcfs`` is the
first-come engine queue, for comparison. ``--chunk-tokens`` is the agents' prefill
budget per step: every request whose prefill ends in a step gets its first token at
the step's end, so a step is the grain of any engine-side ordering.

``--scenario queue`` isolates the engine queue: ``--repeats`` times, ``--burst``
sheddable requests per agent at once, then one critical request 0.3 s later, with
nothing shed (``queue_scale`` 100 for every class unless ``--queue-scale`` says
otherwise); the critical request's TTFT against the sheddable ones' (median over
the repeats), to compare ``--schedule priority`` with ``--schedule fcfs``.

Figures per class: requests, served, shed (429), TTFT p50/p99 of the served; the
critical TTFT p99 against the unloaded p99 (target: <= 1.2x) and the
sheddable share of everything shed (target: >= 90%). ``--json`` prints one object.
Takes about 2 x duration + calibration + ~15 s. ``--admission-only``: no fleet, the
cost of the tenancy check per request (median µs).

``--queue-wait S`` turns the fair-share admission queue on (``tenancy.queue.max_wait_s``:
at saturation a request waits up to S seconds at the router, by class then by tenant,
before its 429; radixfleet.route.admission_queue). ``--scenario tenants``: two tenants of equal
weight (``x-tenant-id``, ``keys.tenant.source: header``), all standard: B alone at
``--b-share`` (0.5) of its fair share (half the capacity), then A at ``--a-share`` (5)
of its share with B as before; B's TTFT p99 against B's alone (target: <= 1.2x), the
fraction of B's requests shed (target: <= 5%: A absorbs the shedding) and A's share of
the shed. B, far under its half of what is admitted, is shed as critical is by default
(``tenancy.fair_share``; ``--fair-share 0`` turns that off); ``--b-class`` gives B its
own class instead (``critical``: the most any admission order can do for it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import aiohttp

from radixfleet.config import parse_config
from radixfleet.route.tenancy import PRIORITIES, Tenancy
from radixfleet.server.metrics import Metrics
from radixfleet_tools.bench.overload import Load, Outcome
from radixfleet_tools.loadtest.local_fleet import Fleet, FleetConfig
from radixfleet_tools.loadtest.report import percentile

CRITICAL_P99_TARGET = 1.2
SHEDDABLE_SHARE_TARGET = 0.90
#: tenants: A absorbs the shedding (B, under its share, is shed at most this often)
B_SHED_TARGET = 0.05


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--agents", type=int, default=2, help="simulated agents")
    p.add_argument("--agent-model", dest="model", default="llama-3-8b", help="the agents' model preset")
    p.add_argument("--gpu", default="l4", help="the agents' GPU preset")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument(
        "--load", type=float, default=2.0, help="overload: x capacity, split evenly over the classes"
    )
    p.add_argument("--light", type=float, default=0.2, help="unloaded phase: x capacity (critical only)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--calibrate-s", type=float, default=10.0, help="seconds spent measuring capacity")
    p.add_argument(
        "--shares", default="1,1,1", help="critical,standard,sheddable shares of the overload's rate"
    )
    p.add_argument(
        "--queue-scale",
        default="",
        help="critical,standard,sheddable factors on the shedding bound (tenancy.queue_scale); "
        "empty: the router's defaults",
    )
    p.add_argument(
        "--queue-wait",
        type=float,
        default=0.0,
        help="tenancy.queue.max_wait_s: seconds a refused request waits at the router (0: off)",
    )
    p.add_argument(
        "--fair-share",
        type=float,
        default=None,
        help="tenancy.fair_share.under: a tenant under this share of its fair share is shed "
        "as the next class up (0: off; default: the router's)",
    )
    p.add_argument(
        "--scenario",
        choices=("classes", "tenants", "queue"),
        default="classes",
        help="classes: three classes at --load; tenants: tenant A at --a-share of its fair share "
        "next to B at --b-share; queue: one critical request behind a burst of sheddable ones",
    )
    p.add_argument("--a-share", type=float, default=5.0, help="tenants: A's rate, x its fair share")
    p.add_argument("--b-share", type=float, default=0.5, help="tenants: B's rate, x its fair share")
    p.add_argument(
        "--b-class",
        choices=PRIORITIES,
        default="standard",
        help="tenants: B's class (tenancy.tenants.B.priority; A is standard)",
    )
    p.add_argument(
        "--schedule",
        choices=("priority", "fcfs"),
        default="priority",
        help="the agents' waiting order (radixfleet agent --schedule): priority serves each "
        "engine's queue by class (the router sends it as vLLM's 'priority'); fcfs by arrival",
    )
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=8192,
        help="the agents' prefill token budget per step (radixfleet agent --chunk-tokens): a "
        "request's first token comes at the end of the step it finishes prefill in",
    )
    p.add_argument("--burst", type=int, default=12, help="queue: sheddable requests per agent in a burst")
    p.add_argument("--repeats", type=int, default=5, help="queue: bursts, each after the last drained")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--admission-only",
        action="store_true",
        help="no fleet: what a request's class and rate-limit check (radixfleet.route.tenancy) costs, in µs",
    )


def _session(priority: str, tenant: str = "") -> aiohttp.ClientSession:
    headers = {"x-radixfleet-priority": priority}
    if tenant:
        headers["x-tenant-id"] = tenant
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120),
        connector=aiohttp.TCPConnector(limit=0),
        headers=headers,
    )


def _three(flag: str, text: str) -> list[float]:
    """Three numbers >= 0, not all 0, from ``a,b,c``; else one line and exit 2."""
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        out = []
    if len(out) != len(PRIORITIES) or min(out) < 0 or sum(out) <= 0:
        print(
            f"radixfleet bench priority: error: {flag}: expected three numbers >= 0, got {text!r}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return out


def _shares(text: str) -> list[float]:
    return _three("--shares", text)


async def _nothing() -> list[Outcome]:
    return []


def _figures(outcomes: list[Outcome]) -> dict:
    ttft = [o.ttft_s for o in outcomes if o.status == 200 and o.ttft_s is not None]
    return {
        "requests": len(outcomes),
        "served": sum(o.status == 200 for o in outcomes),
        "shed_429": sum(o.status == 429 for o in outcomes),
        "other": sum(o.status not in (200, 429) for o in outcomes),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
    }


async def _run(args: argparse.Namespace, base: str, model: str) -> dict:
    loads = {
        c: Load(base, model, args.prompt_tokens, args.max_tokens, args.seed + i)
        for i, c in enumerate(PRIORITIES)
    }
    sessions = {c: _session(c) for c in PRIORITIES}
    try:
        for c, s in sessions.items():
            loads[c].session = s
        crit = loads["critical"]
        await crit.closed(4, 2.0)  # warm: rates measured, typical request learned
        served, secs = await crit.closed(16 * args.agents, args.calibrate_s)
        capacity = served / secs
        await asyncio.sleep(2.0)  # drain
        shares = _shares(args.shares)
        rate = args.load * capacity / sum(shares)
        # critical alone at the rate it has in the overload: its own queueing (first, so
        # that the overload follows the light phase, as it always has)
        alone = await crit.poisson(rate * shares[0], args.duration) if shares[0] else []
        await asyncio.sleep(2.0)  # drain
        light = await crit.poisson(args.light * capacity, args.duration)
        await asyncio.sleep(1.0)
        heavy = await asyncio.gather(
            *(
                loads[c].poisson(rate * w, args.duration) if w else _nothing()
                for c, w in zip(PRIORITIES, shares, strict=True)
            )
        )
    finally:
        for s in sessions.values():
            await s.close()
    unloaded, crit_alone = _figures(light), _figures(alone)
    classes = {c: _figures(h) for c, h in zip(PRIORITIES, heavy, strict=True)}
    shed = sum(f["shed_429"] for f in classes.values())
    p99_light, p99_crit = unloaded["ttft_p99_s"], classes["critical"]["ttft_p99_s"]
    out = {
        "agents": args.agents,
        "model": args.model,
        "gpu": args.gpu,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "capacity_rps": round(capacity, 2),
        "load": args.load,
        "shares": args.shares,
        "queue_scale": args.queue_scale or "defaults",
        "schedule": args.schedule,
        "chunk_tokens": args.chunk_tokens,
        "unloaded": unloaded,
        "critical_alone": crit_alone,
        "overload": classes,
        "critical_p99_ratio": round(p99_crit / p99_light, 2) if p99_light and p99_crit else None,
        "critical_p99_vs_alone": (
            round(p99_crit / crit_alone["ttft_p99_s"], 2) if crit_alone["ttft_p99_s"] and p99_crit else None
        ),
        "sheddable_share_of_shed": round(classes["sheddable"]["shed_429"] / shed, 3) if shed else None,
    }
    out["pass"] = bool(
        out["critical_p99_ratio"] is not None
        and out["critical_p99_ratio"] <= CRITICAL_P99_TARGET
        and out["sheddable_share_of_shed"] is not None
        and out["sheddable_share_of_shed"] >= SHEDDABLE_SHARE_TARGET
    )
    return out


async def _run_queue(args: argparse.Namespace, base: str, model: str) -> dict:
    crit = Load(base, model, args.prompt_tokens, args.max_tokens, args.seed)
    low = Load(base, model, args.prompt_tokens, args.max_tokens, args.seed + 1)
    crit.session, low.session = _session("critical"), _session("sheddable")
    critical: list[float] = []
    behind: list[float] = []
    try:
        await crit.closed(2, 2.0)  # warm: rates measured
        for _ in range(args.repeats):
            burst = [asyncio.create_task(low.one()) for _ in range(args.burst * args.agents)]
            await asyncio.sleep(0.3)
            c = await crit.one()
            done = await asyncio.gather(*burst)
            if c.ttft_s is not None:
                critical.append(c.ttft_s)
            behind.extend(o.ttft_s for o in done if o.ttft_s is not None)
            await asyncio.sleep(1.0)
    finally:
        await crit.session.close()
        await low.session.close()
    return {
        "agents": args.agents,
        "schedule": args.schedule,
        "chunk_tokens": args.chunk_tokens,
        "burst_per_agent": args.burst,
        "repeats": args.repeats,
        "critical_ttft_s": [round(x, 3) for x in critical],
        "critical_ttft_median_s": round(statistics.median(critical), 3) if critical else None,
        "sheddable_ttft_median_s": round(statistics.median(behind), 3) if behind else None,
        "sheddable_ttft_max_s": round(max(behind), 3) if behind else None,
    }


async def _run_tenants(args: argparse.Namespace, base: str, model: str) -> dict:
    """Two tenants of equal weight: B alone, then A over its share next to B."""
    loads = {
        t: Load(base, model, args.prompt_tokens, args.max_tokens, args.seed + i) for i, t in enumerate("AB")
    }
    sessions = {t: _session(args.b_class if t == "B" else "standard", t) for t in "AB"}
    try:
        for t, s in sessions.items():
            loads[t].session = s
        a, b = loads["A"], loads["B"]
        await a.closed(4, 2.0)  # warm: rates measured, typical request learned
        served, secs = await a.closed(16 * args.agents, args.calibrate_s)
        capacity = served / secs
        await asyncio.sleep(2.0)  # drain
        fair = capacity / 2  # equal weights
        alone = await b.poisson(args.b_share * fair, args.duration)
        await asyncio.sleep(1.0)
        heavy_a, heavy_b = await asyncio.gather(
            a.poisson(args.a_share * fair, args.duration), b.poisson(args.b_share * fair, args.duration)
        )
    finally:
        for s in sessions.values():
            await s.close()
    b_alone, fa, fb = _figures(alone), _figures(heavy_a), _figures(heavy_b)
    shed = fa["shed_429"] + fb["shed_429"]
    p99_alone, p99_b = b_alone["ttft_p99_s"], fb["ttft_p99_s"]
    out = {
        "scenario": "tenants",
        "agents": args.agents,
        "capacity_rps": round(capacity, 2),
        "a_share": args.a_share,
        "b_share": args.b_share,
        "b_class": args.b_class,
        "fair_share": "default" if args.fair_share is None else args.fair_share,
        "queue_wait_s": args.queue_wait,
        "b_alone": b_alone,
        "overload": {"A": fa, "B": fb},
        "b_p99_ratio": round(p99_b / p99_alone, 2) if p99_alone and p99_b else None,
        "a_share_of_shed": round(fa["shed_429"] / shed, 3) if shed else None,
    }
    out["b_shed_rate"] = round(fb["shed_429"] / fb["requests"], 3) if fb["requests"] else None
    out["pass"] = bool(
        out["b_p99_ratio"] is not None
        and out["b_p99_ratio"] <= CRITICAL_P99_TARGET
        and out["b_shed_rate"] is not None
        and out["b_shed_rate"] <= B_SHED_TARGET
    )
    return out


def admission_cost(repeats: int = 7, n: int = 20_000) -> dict[str, float]:
    """Median µs per request of ``Tenancy.admit`` + ``admitted`` (what the data plane
    adds before the shedding decision): without tenancy settings, with a tenant's
    two limits, with a priority header claim as well, and with 100 tenants in turn
    (the fair share compares each with the others: ``radixfleet.route.fair_share``)."""
    cases = {
        "no_tenancy_settings": ({}, {}),
        "tenant_with_two_limits": (
            {"tenants": {"acme": {"requests_per_s": 1e9, "tokens_per_min": 1e15}}},
            {},
        ),
        "limits_and_a_header_claim": (
            {
                "tenants": {
                    "acme": {"max_priority": "critical", "requests_per_s": 1e9, "tokens_per_min": 1e15}
                }
            },
            {"x-radixfleet-priority": "critical"},
        ),
        "100_tenants_in_turn": ({}, {}),
    }
    out = {}
    body = {"max_tokens": 16}
    many = [f"tenant-{i}" for i in range(100)]
    for name, (raw, headers) in cases.items():
        t = Tenancy(parse_config({"tenancy": raw}).tenancy, ["acme"], Metrics(), 0.0)
        tenants = many if name == "100_tenants_in_turn" else ["acme"]
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(n):
                now = time.monotonic()
                tenant = tenants[i % len(tenants)]
                t.admitted(t.admit(tenant, "", "m", headers, 1000, body, now), now)
            runs.append((time.perf_counter() - t0) / n * 1e6)
        out[name] = round(statistics.median(runs), 2)
    return out


def run(args: argparse.Namespace) -> int:
    if args.admission_only:
        cost = admission_cost()
        if args.json:
            print(json.dumps({"admission_us_p50": cost}))
        else:
            for name, us in cost.items():
                print(f"{name.replace('_', ' ')}: {us:.2f} µs per request (median of 7 x 20,000)")
        return 0
    _shares(args.shares)  # refused before any process starts
    if (
        args.queue_wait < 0
        or (args.fair_share is not None and not 0 <= args.fair_share <= 1)
        or min(args.a_share, args.b_share) <= 0
        or min(args.chunk_tokens, args.burst, args.repeats) <= 0
    ):
        print(
            "radixfleet bench priority: error: --queue-wait must be >= 0, --fair-share in [0, 1], "
            "--a-share, --b-share, "
            "--chunk-tokens, --burst and --repeats > 0",
            file=sys.stderr,
        )
        return 2
    tenants = args.scenario == "tenants"
    yaml = "tenancy:\n  default_priority: %s\n" % ("standard" if tenants else "critical")
    if args.queue_wait:
        yaml += f"  queue: {{max_wait_s: {args.queue_wait}}}\n"
    if args.fair_share is not None:
        yaml += f"  fair_share: {{under: {args.fair_share}}}\n"
    if args.queue_scale or args.scenario == "queue":
        scale = _three("--queue-scale", args.queue_scale or "100,100,100")
        yaml += "  queue_scale: {%s}\n" % ", ".join(
            f"{c}: {x}" for c, x in zip(PRIORITIES, scale, strict=True)
        )
    with tempfile.TemporaryDirectory(prefix="radixfleet-priority-") as logs:
        config = os.path.join(logs, "router.yaml")
        if tenants:
            yaml += "keys:\n  tenant: {source: header}\n"
            if args.b_class != "standard":
                b_rules = f"  tenants: {{B: {{priority: {args.b_class}}}}}\n"
                yaml = yaml.replace("tenancy:\n", "tenancy:\n" + b_rules, 1)
        with open(config, "w") as f:
            f.write(yaml)
        cfg = FleetConfig(
            agents=args.agents,
            model=args.model,
            gpu=args.gpu,
            kv_tokens=200_000,
            agent_args=["--schedule", args.schedule, "--chunk-tokens", str(args.chunk_tokens)],
            router_port=0,
            router_config=config,
        )
        with Fleet(cfg, log_dir=logs) as fleet:
            scenario = {"tenants": _run_tenants, "queue": _run_queue}.get(args.scenario, _run)
            out = asyncio.run(scenario(args, fleet.router_url, args.model))
    if args.json:
        print(json.dumps(out))
        return 0
    if tenants:
        _print_tenants(args, out)
        return 0
    if args.scenario == "queue":
        print(
            f"engine queue {args.schedule}, chunk {args.chunk_tokens} tokens: one critical request "
            f"0.3 s after {args.burst} sheddable per agent ({args.agents} agents), {args.repeats} times"
        )
        print(
            f"critical TTFT median {_ms(out['critical_ttft_median_s'])} "
            f"({', '.join(_ms(x) for x in out['critical_ttft_s'])}); sheddable TTFT median "
            f"{_ms(out['sheddable_ttft_median_s'])}, max {_ms(out['sheddable_ttft_max_s'])}"
        )
        return 0

    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f} ms"

    u = out["unloaded"]
    print(
        f"fleet: {args.agents} x {args.model} on {args.gpu} (simulated); "
        f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens out, streamed"
    )
    print(f"capacity: {out['capacity_rps']:.2f} req/s (closed loop, saturated)")
    print(
        f"unloaded (critical at {args.light:g}x, {u['requests']} requests): "
        f"TTFT p50 {ms(u['ttft_p50_s'])}, p99 {ms(u['ttft_p99_s'])}"
    )
    a = out["critical_alone"]
    print(
        f"critical alone at its overload rate ({a['requests']} requests): "
        f"TTFT p50 {ms(a['ttft_p50_s'])}, p99 {ms(a['ttft_p99_s'])}"
    )
    print(
        f"overload ({args.load:g}x, shares {args.shares} critical,standard,sheddable; "
        f"queue_scale {out['queue_scale']}; engine queue {args.schedule}; admission queue "
        + (f"max_wait_s {args.queue_wait:g}):" if args.queue_wait else "off):")
    )
    for c, f in out["overload"].items():
        print(
            f"  {c:<9} {f['requests']:>5} requests, {f['served']:>5} served, {f['shed_429']:>5} shed; "
            f"TTFT p50 {ms(f['ttft_p50_s'])}, p99 {ms(f['ttft_p99_s'])}"
            + (f", {f['other']} other statuses" if f["other"] else "")
        )
    print(
        f"critical TTFT p99 = {out['critical_p99_ratio']}x the unloaded p99 "
        f"(target <= {CRITICAL_P99_TARGET:g}x), {out['critical_p99_vs_alone']}x its p99 alone at its "
        f"rate; sheddable took {out['sheddable_share_of_shed']} "
        f"of the shed (target >= {SHEDDABLE_SHARE_TARGET:.0%})"
    )
    print("PASS" if out["pass"] else "FAIL")
    return 0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _print_tenants(args: argparse.Namespace, out: dict) -> None:
    u = out["b_alone"]
    print(
        f"fleet: {args.agents} x {args.model} on {args.gpu} (simulated); "
        f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens out, streamed"
    )
    print(f"capacity: {out['capacity_rps']:.2f} req/s (closed loop, saturated); fair share: half each")
    print(
        f"B alone ({args.b_share:g}x its share, {u['requests']} requests): "
        f"TTFT p50 {_ms(u['ttft_p50_s'])}, p99 {_ms(u['ttft_p99_s'])}"
    )
    print(
        f"A at {args.a_share:g}x its share next to B (B {args.b_class}, A standard; fair share "
        f"{out['fair_share']}); admission queue "
        + (f"max_wait_s {args.queue_wait:g}:" if args.queue_wait else "off:")
    )
    for t, f in out["overload"].items():
        print(
            f"  {t} {f['requests']:>5} requests, {f['served']:>5} served, {f['shed_429']:>5} shed; "
            f"TTFT p50 {_ms(f['ttft_p50_s'])}, p99 {_ms(f['ttft_p99_s'])}"
            + (f", {f['other']} other statuses" if f["other"] else "")
        )
    print(
        f"B's TTFT p99 = {out['b_p99_ratio']}x its p99 alone (target <= {CRITICAL_P99_TARGET:g}x); "
        f"A took {out['a_share_of_shed']} of the shed; B was shed {out['b_shed_rate']} of the time "
        f"(target <= {B_SHED_TARGET:g})"
    )
    print("PASS" if out["pass"] else "FAIL")
