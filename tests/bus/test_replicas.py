"""Router replicas route as one router: what each replica *routes*, measured.

A real nats-server (tests/nats_server.py), two simulated agents publishing to it,
three ``radixfleet router`` processes reading it — separate processes, as replicas
are deployed, so nothing one process happens to share between its routers (a
module-level secret, say) can stand in for what the bus must carry. The same seeded
mixed workload runs twice through ``radixfleet bench replicas``' fleet
(``measure_once``), every agent flushed before each run: once with every request to
one replica, once in round robin over the three.

The replicas must hit within 5% of one router's rate (a replica that keys prompts
differently from its peers, or ignores their hints, lands near 1/3 of the
continuations on a cache that holds them: ~0.45x) and answer no 429 that one router
did not. On this workload the caches are not under pressure, so nothing but the
bus's timing can make a replica decide otherwise than one router: the simulator
gives the same hit rate to the digit, and three live runs on two loaded cores gave
1.000x each (0.886 both). The 5% leave room for a continuation or two routed before
its peer's hint arrived (one re-prefilled history is 2-3% of the prompt tokens here).
What the replicas keep for themselves under cache pressure (session footprints) is
checked decision by decision in tests/bus/test_replica_decisions.py. Sizes are small
(~60 requests, short answers): about 40 s on two cores.

Keys alike or not at all: a replica configured with a bus but no deployment-wide
salt secret ($RADIXFLEET_TENANT_SALT or an agent token) would salt its keys with its
process's own random secret — every replica hashing the same prompt differently,
the agents caching it once per replica, the fleet at ~0.45x of one router's hit
rate — so it refuses to start, one line naming both ways out, exit 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from radixfleet_tools.bench.replicas import measure_once
from radixfleet_tools.harness.procs import free_port, radixfleet_argv
from tests.nats_server import nats_server_binary

pytestmark = pytest.mark.integration

#: the replicas' hit rate over one router's, at least (module docstring: why 5%)
HIT_MARGIN = 0.95


def test_three_replicas_route_with_one_routers_hit_rate_and_shed_nothing_more():
    args = argparse.Namespace(
        replicas=3,
        agents=2,
        kv_tokens=12_000,
        rate=8.0,
        requests=60,
        duration=30.0,
        seed=3,
        policy="prefix_load",
        no_replicate=False,
        aa=False,
        option=[
            "system_prompts=4",
            "sessions=16",
            "min_turns=3",
            "max_turns=5",
            "max_parallel=8",
            "question_tokens=64",
            "output_tokens=24",
        ],
    )
    one, many = measure_once(args, nats_server_binary())
    print(
        {
            k: (r["hit_rate"], r["ok"], r["requests"], r["errors_by_kind"])
            for k, r in (("one", one), ("replicas", many))
        }
    )
    assert one["ok"] == one["requests"] >= 50, one["errors_by_kind"]
    assert one["hit_rate"] > 0.5, one["hit_rate"]  # the workload reuses prefixes at all
    assert many["hit_rate"] >= HIT_MARGIN * one["hit_rate"], (many["hit_rate"], one["hit_rate"])
    shed_one = one["errors_by_kind"].get("http_429", 0)
    assert many["errors_by_kind"].get("http_429", 0) <= shed_one, many["errors_by_kind"]
    assert many["ok"] == many["requests"], many["errors_by_kind"]


def test_a_replica_without_the_deployments_salt_secret_refuses_to_start(tmp_path):
    cfg = tmp_path / "router.yaml"  # refused before it connects: no server needed
    cfg.write_text(f'listen: {{port: {free_port()}}}\nbus: {{url: "nats://127.0.0.1:{free_port()}"}}\n')
    env = {
        k: v for k, v in os.environ.items() if k not in ("RADIXFLEET_TENANT_SALT", "RADIXFLEET_AGENT_TOKEN")
    }
    p = subprocess.Popen(
        radixfleet_argv("router", "--config", str(cfg)),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the router started on a bus with its own random salt:\n{err}")
    assert p.returncode == 2, (p.returncode, out, err)
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "bus.url" in lines[0] and "RADIXFLEET_TENANT_SALT" in lines[0], err
    assert "Traceback" not in err
