"""The router in front of two real vLLM servers under cache pressure.

The two servers' KV caches together hold 1.3 times the multiturn workload's final
working set (radixfleet_tools/harness/pressure.py): round robin, which sends every session to
both engines, needs twice that and thrashes; a router that keeps each session on one
engine fits. Checked, with the load generator (hit rate from vLLM's own
``cached_tokens``), round robin and the router alternated on the same servers:

- approximate mode (the engine's tokenizer, events off: hints aged at the learned
  capacity and corrected by ``cached_tokens``) beats round robin's hit by 1.2 times
  and its index's mean prediction error stays within 2 blocks a request, on a quiet
  host and with a CPU burner beside the engines (``CpuBurner``: a router shares its
  host with other work).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from radixfleet_tools.harness.pressure import CpuBurner, pressure_kv_bytes
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.harness.vllm_router import admin_url, router_yaml, wait_for, workers

pytestmark = pytest.mark.engine

#: both caches together over the working set (bench/vllm_ab.py's --kv 16M: 1.26)
PRESSURE = 1.3
CLIENTS, ROUNDS = 32, 5


@pytest.fixture(scope="module")
def pressure_pair(vllm_model_dir, tmp_path_factory):
    """Two vLLM servers (events on, the routers choose to follow them or not) whose KV
    caches together hold ``PRESSURE`` times the workload's final working set."""
    from radixfleet_tools.harness.vllm_env import VllmServer, own_core

    kv, _ = pressure_kv_bytes(vllm_model_dir, PRESSURE, clients=CLIENTS, rounds=ROUNDS)
    logs = tmp_path_factory.mktemp("vllm-pressure-logs")
    servers = [
        VllmServer(
            free_port(),
            model=vllm_model_dir,
            kv_bytes=str(kv),
            max_num_seqs=64,
            events_port=free_port(),
            replay_port=free_port(),
            log_path=logs / f"vllm-{i}.log",
            omp_cpus=own_core(i),
        )
        for i in range(2)
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def routers(pressure_pair, vllm_model_dir, tmp_path_factory):
    """round_robin and prefix_load in approximate mode (events off) -> their URLs."""
    d = tmp_path_factory.mktemp("routers")
    urls, procs = {}, []
    try:
        for name, policy in (("round_robin", "round_robin"), ("approx", "prefix_load")):
            port = free_port()
            cfg = d / f"{name}.yaml"
            router_yaml(cfg, port, pressure_pair, vllm_model_dir, policy=policy, events=(False, False))
            procs.append(
                Proc(
                    radixfleet_argv("router", "--config", str(cfg)),
                    ready_url=f"http://127.0.0.1:{port}/health",
                ).__enter__()
            )
            urls[name] = f"http://127.0.0.1:{port}"
        for u in urls.values():
            wait_for(
                lambda u=u: all(
                    w["routable"] and w["engine"]["key_space"].startswith("TokenSpace") for w in workers(u)
                ),
                120,
                "routable and keyed in the engines' tokens",
            )
        yield urls
    finally:
        for p in procs:
            p.__exit__(None, None, None)


def _ab(urls: dict[str, str], servers, out) -> dict[str, dict]:
    """One load-generator run over round robin then approximate prefix_load, each cold
    (the engines' prefix caches reset between targets) -> runs by name."""
    cmd = radixfleet_argv(
        "loadtest",
        *[a for name, u in urls.items() for a in ("--target", f"{name}={u}")],
        *[a for name, u in urls.items() for a in ("--admin", f"{name}={admin_url(u)}")],
        "--workload",
        "multiturn",
        "-o",
        f"clients={CLIENTS}",
        "-o",
        f"rounds={ROUNDS}",
        "-o",
        "question_tokens=128",
        "-o",
        "output_tokens=16",
        "--concurrency",
        "8",
        "--requests",
        str(CLIENTS * ROUNDS),
        "--duration",
        "400",
        "--json",
        str(out),
        "--no-progress",
        "--model",
        "tiny",
        *[a for s in servers for a in ("--flush", s.url)],
    )
    res = subprocess.run(cmd, capture_output=True, timeout=900)
    assert res.returncode == 0, res.stdout.decode()[-3000:] + res.stderr.decode()[-3000:]
    return {r["name"]: r for r in json.loads(out.read_text())["runs"]}


def _check(runs: dict[str, dict], url: str) -> None:
    rr, ap = runs["round_robin"], runs["approx"]
    assert rr["errors"] == 0 and ap["errors"] == 0, runs
    # the caches hold 1.3x the working set: round robin's copies thrash, one engine
    # per session fits
    assert ap["hit_rate"] >= 1.2 * rr["hit_rate"], (ap["hit_rate"], rr["hit_rate"])
    bt = 32
    for w in workers(url):
        pred = w["engine"]["prediction"]
        assert pred["samples"] > 0, w
        assert pred["mean_abs_tokens"] <= 2 * bt, (w["id"], pred)


def test_approximate_mode_beats_round_robin_under_cache_pressure(routers, pressure_pair, tmp_path):
    _check(_ab(routers, pressure_pair, tmp_path / "quiet.json"), routers["approx"])


def test_approximate_mode_beats_round_robin_with_a_cpu_burner(routers, pressure_pair, tmp_path):
    # the approximate router's prediction stats are cumulative: this run's on top of
    # the quiet one's, each bounded alike
    with CpuBurner(2, max_s=900):
        _check(_ab(routers, pressure_pair, tmp_path / "burner.json"), routers["approx"])
