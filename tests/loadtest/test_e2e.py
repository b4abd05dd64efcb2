"""End to end: 2 simulated agents + the router + ~50 requests through `radixfleet loadtest`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.loadtest.local_fleet import wait_registered
from radixfleet_tools.loadtest.report import validate

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("radixfleet_tools.agent.cli") is None
        or importlib.util.find_spec("radixfleet.server.cli") is None,
        reason="needs the agent (radixfleet_tools.agent.cli) and the router (radixfleet.server.cli)",
    ),
]

KV_TOKENS = 6000


def _fleet(router_port: int, agent_ports: list[int], policy: str):
    """(data URL, admin URL, agents, router) of a router on ``router_port`` (its admin
    listener on a free port) and agents on ``agent_ports`` registering with it."""
    router_url = f"http://127.0.0.1:{router_port}"
    admin_port = free_port()
    agents = [
        Proc(
            radixfleet_argv(
                "agent",
                "--engine",
                "sim",
                "--agent-model",
                "llama-3-8b",
                "--gpu",
                "h100",
                "--port",
                str(p),
                "--kv-tokens",
                str(KV_TOKENS),
                "--router",
                router_url,
                "--worker-id",
                f"w{i}",
            ),
            ready_url=f"http://127.0.0.1:{p}/health",
        )
        for i, p in enumerate(agent_ports)
    ]
    # --worker-header: the load generator's per-worker figures read the worker's id
    argv = radixfleet_argv(
        "router",
        *("--port", str(router_port), "--admin-port", str(admin_port)),
        *("--policy", policy, "--worker-header"),
    )
    for p in agent_ports:
        argv += ["--worker", f"http://127.0.0.1:{p}"]
    router = Proc(argv, ready_url=f"{router_url}/v1/models")
    return router_url, f"http://127.0.0.1:{admin_port}", agents, router


def test_loadtest_against_two_agents_and_the_router(tmp_path):
    router_port, ports = free_port(), [free_port(), free_port()]
    router_url, admin_url, agents, router = _fleet(router_port, ports, "prefix_load")
    with agents[0], agents[1], router:
        wait_registered(admin_url, 2)  # so the router names workers by their agent ids
        out = tmp_path / "report.json"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "radixfleet.cli",
                "loadtest",
                "--target",
                f"ours={router_url}",
                "--admin",
                f"ours={admin_url}",
                "--workload",
                "mixed",
                "-o",
                "sessions=16",
                "-o",
                "system_prompts=3",
                "-o",
                "system_tokens=512",
                "-o",
                "output_tokens=16",
                "-o",
                "max_parallel=6",
                "--concurrency",
                "6",
                "--requests",
                "50",
                "--duration",
                "40",
                "--seed",
                "1",
                "--json",
                str(out),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr + p.stdout
        doc = json.loads(out.read_text())
        validate(doc)
        (run,) = doc["runs"]
        assert run["requests"] == 50 and run["errors"] == 0, run["errors_by_kind"]
        # the router names the worker, and the agents reported their KV capacity
        assert set(run["workers"]) == {"w0", "w1"}, run["workers"]
        assert run["kv_capacity_tokens"] == 2 * KV_TOKENS
        assert run["load_imbalance"] is not None
        # shared system prompts and growing sessions: the fleet serves real hits,
        # never more than the unbounded oracle allows
        assert 0.2 < run["hit_rate"] <= run["oracle_hit_rate"] + 0.02
        assert run["pooled_hit_rate"] <= run["oracle_hit_rate"] + 1e-9
        assert run["ttft_ms"]["p50"] > 0 and run["itl_ms"]["p50"] is not None
        assert run["throughput"]["output_tokens_per_s"] > 0
