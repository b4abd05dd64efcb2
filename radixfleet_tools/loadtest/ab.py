"""``radixfleet loadtest --ab radix|policy``: the seed's two A/Bs, one command each.

::

    radixfleet loadtest --ab radix  --workload multiturn -o clients=32 --requests 300
    radixfleet loadtest --ab policy --workload mixed --rate 12 --duration 60

Each starts a local fleet (``radixfleet_tools.loadtest.local_fleet.Fleet``: ``--agents`` simulated agents
behind one router, on free loopback ports, logs under ``--out``), drives the same
workload and seed through two configurations, one after the other, cold (every
agent flushed first), prints the comparison table and what the difference is
worth, writes ``--json`` / ``--plots`` as ``loadtest`` does, and stops everything
it started:

``radix``   the value of prefix caching, routing aside: the same router policy
            (``--policy``, default ``round_robin``, which ignores caches) in front of
            agents with their radix cache (``radix on``) and restarted with
            ``--disable-radix-cache`` (``radix off``: every prompt computed whole).
``policy``  the value of cache-aware routing, caching held fixed: agents with their
            radix cache behind the router with each of ``--policies`` (default
            ``prefix_load,round_robin``), restarted between runs. ``smg`` among
            them is SGLang's own gateway (cache_aware, its defaults; the test
            extra's ``sglang-router``) in front of the same agents: the live
            side-by-side with the peer, one command. An arm may set policy
            parameters in brackets, ``prefix_load[footprint_room=0,replicate=false]``
            (values read as YAML; the run is named by the whole arm), so two arms
            of one policy A/B a parameter live:
            ``--policies 'prefix_load,prefix_load[footprint_room=0]'``; and smg its
            launch settings (``radixfleet_tools.loadtest.smg.launch_args``): ``smg[policy=round_robin]``
            beside ``round_robin`` measures the two routers' paths alone.

``--plain-workers``: the agents send nothing (no registration, no KV events, no
load reports) and the router takes them as plain OpenAI servers (``kind: openai``,
the approximate index aged at ``--kv-tokens``, corrected by ``cached_tokens``) —
what it sees in front of SGLang, llama.cpp or a vLLM without events. smg reads
no events either way, so its arm always runs against such agents.

Agents run with ``--page-size`` (default 1) in both arms; ``--kv-tokens`` sizes
each agent's KV pool (default 12,000: eviction matters, as in the demo).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import NamedTuple

from radixfleet.wire.errors import ConfigError
from radixfleet_tools.agent.cost_model import CostModel
from radixfleet_tools.loadtest.local_fleet import Fleet, FleetConfig, param_text
from radixfleet_tools.loadtest.report import check_outputs, floor_ttft_ms
from radixfleet_tools.loadtest.runner import run_ab

log = logging.getLogger(__name__)

AB_KINDS = ("radix", "policy")
#: the --policies name of SGLang's gateway (cache_aware) in front of the same agents
SMG = "smg"
DEFAULT_KV_TOKENS = 12_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("local A/B (--ab): a fleet started for the run")
    g.add_argument(
        "--ab",
        choices=AB_KINDS,
        help="radix: radix cache on vs off; policy: --policies compared (no --target)",
    )
    g.add_argument("--agents", type=int, default=4, help="simulated agents (default 4)")
    g.add_argument("--agent-model", default="llama-3-8b", help="the agents' model preset")
    g.add_argument("--gpu", default="h100", help="the agents' GPU preset")
    g.add_argument(
        "--kv-tokens",
        type=int,
        default=DEFAULT_KV_TOKENS,
        help=f"KV tokens per agent (default {DEFAULT_KV_TOKENS:,})",
    )
    g.add_argument("--page-size", type=int, default=1, help="the agents' --page-size")
    g.add_argument(
        "--policy",
        default="round_robin",
        help="--ab radix: the router policy of both arms (default round_robin)",
    )
    g.add_argument(
        "--policies",
        default="prefix_load,round_robin",
        help="--ab policy: the two (or more) arms compared: policies, smg, or "
        "a policy with parameters, e.g. 'prefix_load,prefix_load[tie_s=0]'",
    )
    g.add_argument(
        "--plain-workers",
        action="store_true",
        help="--ab: agents that send no events (the router keys, ages and "
        "corrects its index itself, as in front of a plain engine)",
    )
    g.add_argument("--out", default="radixfleet-ab", help="--ab: where the fleet logs")


class Arm(NamedTuple):
    """One configuration an A/B runs: its run name, the router policy (or ``smg``),
    that policy's parameters, and extra agent arguments."""

    name: str
    policy: str
    params: dict
    agent_args: list[str]


def split_arms(text: str) -> list[str]:
    """``"a,b[x=1,y=2],c"`` -> ``["a", "b[x=1,y=2]", "c"]``: commas inside brackets
    belong to the arm. Raises ``ConfigError`` for unbalanced brackets."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError("--policies", f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ConfigError("--policies", f"unclosed '[' in {text!r}")
    out.append("".join(cur).strip())
    return [a for a in out if a]


def parse_arm(spec: str, where: str) -> tuple[str, dict]:
    """``"prefix_load[footprint_room=0]"`` -> ``("prefix_load", {"footprint_room": 0})``.
    The parameters are not validated here (``arms`` does, with the policy)."""
    from radixfleet.server.cli import policy_params

    name, bracket, rest = spec.partition("[")
    name = name.strip()
    if not bracket:
        return name, {}
    if not rest.endswith("]") or "[" in rest[:-1] or "]" in rest[:-1]:
        raise ConfigError(where, f"{spec!r}: parameters go in one trailing [NAME=VALUE,...]")
    body = rest[:-1].strip()
    if not body:
        raise ConfigError(where, f"{spec!r}: empty brackets")
    return name, policy_params([p for p in body.split(",")], where)


def arms(args: argparse.Namespace) -> list[Arm]:
    """The arms, in run order. Raises ``ConfigError`` for a bad flag (an unknown
    policy or parameter, a parameter out of range, parameters for smg)."""
    import random

    from radixfleet.policies.registry import build_policy, policy_class

    if args.page_size < 1:
        raise ConfigError("--page-size", f"must be >= 1, got {args.page_size}")
    page = ["--page-size", str(args.page_size)] if args.page_size != 1 else []
    if args.ab == "radix":
        policy_class(args.policy, path="--policy")
        return [
            Arm(f"radix on ({args.policy})", args.policy, {}, page),
            Arm(f"radix off ({args.policy})", args.policy, {}, [*page, "--disable-radix-cache"]),
        ]
    specs = split_arms(args.policies)
    if len(specs) < 2 or len(set(specs)) != len(specs):
        raise ConfigError(
            "--policies",
            "name two or more distinct arms, comma-separated (a policy, or a policy with [NAME=VALUE,...])",
        )
    out = []
    for i, spec in enumerate(specs):
        where = f"--policies[{i}]"
        name, params = parse_arm(spec, where)
        if name == SMG:
            from radixfleet_tools.loadtest.smg import launch_args

            launch_args(params, where)  # checked before anything starts
        else:
            try:
                build_policy(name, params, random.Random(0), path=where)
            except ConfigError as exc:
                msg = exc.message
                if exc.path == f"{where}.name":
                    msg = f"{msg}, or {SMG} (SGLang's gateway)"
                raise ConfigError(exc.path, msg) from None
        out.append(Arm(spec, name, params, page))
    return out


def worth(runs: list[dict], kind: str) -> list[str]:
    """What the difference is worth, first arm against each other arm (lines)."""
    a = runs[0]
    out = []
    for b in runs[1:]:
        parts = [f"hit rate {a['hit_rate']:.3f} vs {b['hit_rate']:.3f}"]
        for k in ("p50", "p99"):
            x, y = a["ttft_ms"][k], b["ttft_ms"][k]
            if x is not None and y:
                parts.append(f"TTFT {k} {x:,.0f} vs {y:,.0f} ms ({x / y:.2f}x)")
        x, y = a["throughput"]["requests_per_s"], b["throughput"]["requests_per_s"]
        if y:
            parts.append(f"{x:.2f} vs {y:.2f} req/s")
        what = "prefix caching" if kind == "radix" else f"{a['name']} over {b['name']}"
        out.append(f"{what}: " + "; ".join(parts))
    return out


def run_local(args: argparse.Namespace, workload, arrivals, bounds) -> list:
    """Starts the fleet, runs every arm, stops the fleet; returns the outcomes."""
    plan = arms(args)
    if not 1 <= args.agents <= 64:
        raise ConfigError("--agents", f"must be in [1, 64], got {args.agents}")
    if args.kv_tokens <= 0:
        raise ConfigError("--kv-tokens", "must be > 0")
    if any(a.policy == SMG for a in plan):
        from radixfleet_tools.loadtest.smg import require_smg

        require_smg()  # before any agent starts: missing is said at once
    plain = bool(getattr(args, "plain_workers", False))
    cfg = FleetConfig(
        agents=args.agents,
        model=args.agent_model,
        gpu=args.gpu,
        kv_tokens=args.kv_tokens,
        router_port=0,
        policy=next((a.policy for a in plan if a.policy != SMG), "prefix_load"),
        plain_workers=plain,
    ).validate()
    check_outputs(dirs=[("--out", args.out)])
    fleet = Fleet(cfg, log_dir=os.path.join(args.out, "logs"), start_router=False)
    by_name = {a.name: a for a in plan}
    current: list = [None]  # the agents' (extra args, plain) now running

    def switch(name: str) -> None:
        arm = by_name[name]
        want = (list(arm.agent_args), plain or arm.policy == SMG)
        if current[0] != want:
            fleet.stop()
            fleet.cfg.agent_args = list(arm.agent_args)
            fleet.cfg.plain_workers = want[1]
            fleet.agents = []
            fleet.start_agents()
            current[0] = want
        if arm.policy == SMG:
            from radixfleet_tools.loadtest.smg import launch_args

            fleet.start_smg(launch_args(arm.params), name=arm.name)
        else:
            fleet.start_router(arm.policy, arm.params, name=arm.name)

    async def between(name: str) -> None:
        await asyncio.to_thread(switch, name)
        print(f"ab: running {name} ...", flush=True)

    print(
        f"ab {args.ab}: {cfg.agents} agents ({cfg.model} on {cfg.gpu}, {cfg.kv_tokens:,} KV "
        f"tokens each), workload {workload.name} seed {workload.seed}; logs {fleet.log_dir}",
        flush=True,
    )
    try:
        outcomes = asyncio.run(
            run_ab(
                [(a.name, fleet.router_url) for a in plan],
                workload,
                arrivals,
                bounds,
                flush_urls=fleet.agent_urls,
                kv_capacity_tokens=cfg.kv_tokens * cfg.agents,
                model=None,
                timeout_s=args.timeout,
                send_session=args.send_session,
                progress=False if args.no_progress else None,
                settle_s=0.5,
                between=between,
                admin_urls={fleet.router_url: fleet.admin_url},
            )
        )
    finally:
        fleet.stop()
    cost = CostModel(cfg.model, cfg.gpu)  # the agents' own (FleetConfig starts them at tp 1)
    for o, a in zip(outcomes, plan):
        o.report["floor_ttft_ms"] = floor_ttft_ms(cost, o.results)
        if a.policy == SMG:
            from radixfleet_tools.loadtest.smg import launch_args

            front = f"smg launch {' '.join(launch_args(a.params))} (SGLang's gateway)"
        else:
            front = f"radixfleet router --policy {a.policy}" + "".join(
                f" --policy-param {k}={param_text(v)}" for k, v in a.params.items()
            )
        events = "no events" if plain or a.policy == SMG else "events to the router"
        o.report["target"] = f"{front}; agents {' '.join(a.agent_args) or '(defaults)'}, {events}"
    return outcomes
