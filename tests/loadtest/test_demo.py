"""`radixfleet demo` and `radixfleet up` as a user runs them: real processes, loopback only."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from radixfleet_tools.harness.procs import free_port
from radixfleet_tools.loadtest.report import validate

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("radixfleet_tools.agent.cli") is None
        or importlib.util.find_spec("radixfleet.server.cli") is None,
        reason="needs the agent (radixfleet_tools.agent.cli) and the router (radixfleet.server.cli)",
    ),
]


def _closed(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) != 0


def test_demo_runs_each_policy_writes_report_and_stops_everything(tmp_path):
    out = tmp_path / "demo"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixfleet.cli",
            "demo",
            "--out",
            str(out),
            "--agents",
            "2",
            "--kv-tokens",
            "6000",
            "--policies",
            "round_robin,prefix_load",
            "-o",
            "sessions=8",
            "-o",
            "max_parallel=4",
            "-o",
            "system_tokens=256",
            "-o",
            "output_tokens=16",
            "--rate",
            "10",
            "--duration",
            "4",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert p.returncode == 0, p.stderr + p.stdout
    doc = json.loads((out / "report.json").read_text())
    validate(doc)
    assert [r["name"] for r in doc["runs"]] == ["round_robin", "prefix_load"]
    for r in doc["runs"]:
        assert r["requests"] > 5 and r["errors"] == 0
        assert r["kv_capacity_tokens"] == 12000
        assert set(r["workers"]) <= {"w0", "w1"}
    # the same workload and seed for both
    assert doc["runs"][0]["workload"] == doc["runs"][1]["workload"]
    for png in ("ttft_cdf.png", "hit_rate.png", "worker_load.png"):
        assert (out / png).stat().st_size > 1000
    assert "prefix_load against the targets" in p.stdout
    urls = re.search(r"demo: agents (.*), router (\S+),", p.stdout)
    for url in [*urls.group(1).split(), urls.group(2)]:
        assert _closed(url), f"{url} still listening after the demo exited"


def test_demo_bad_policy_exits_2():
    p = subprocess.run(
        [sys.executable, "-m", "radixfleet.cli", "demo", "--policies", "round_robin,nope"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "'nope' is not one of" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("sigterms", [1, 2], ids=["one SIGTERM", "a second SIGTERM while stopping"])
def test_up_serves_until_sigterm_and_stops_its_children(tmp_path, sigterms):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixfleet.cli",
            "up",
            "--agents",
            "2",
            "--kv-tokens",
            "4000",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--log-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        seen = ""
        deadline = time.monotonic() + 40
        while "serving until Ctrl-C" not in seen:  # printed once every agent registered
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([proc.stdout], [], [], 0.5)[0]:
                seen += os.read(proc.stdout.fileno(), 65536).decode()
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "llama-3-8b", "prompt": "hello world!", "max_tokens": 3},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-radixfleet-worker"] in ("w0", "w1")
        os.kill(proc.pid, signal.SIGTERM)
        if sigterms == 2:  # as a supervisor and the wrapper it signals both do
            time.sleep(0.05)
            os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
        output = seen + output.decode()
        assert proc.returncode == 0, output
        agents = re.findall(r"agent\s+w\d\s+(http://\S+)", output)
        assert len(agents) == 2
        for u in [*agents, url]:
            assert _closed(u), f"{u} still listening after up exited"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_demo_stopped_by_sigterm_stops_its_fleet(tmp_path):
    """A benchmark or the demo killed by a supervisor (SIGTERM, as ``timeout`` sends)
    must not leave its agents and router running in their own process groups."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixfleet.cli",
            "demo",
            "--out",
            str(tmp_path / "demo"),
            "--agents",
            "2",
            "--kv-tokens",
            "6000",
            "--policies",
            "round_robin",
            "-o",
            "sessions=400",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        seen = ""
        deadline = time.monotonic() + 60
        while "demo: running" not in seen:  # the agents and the router answer
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([proc.stdout], [], [], 0.5)[0]:
                seen += os.read(proc.stdout.fileno(), 65536).decode()
        m = re.search(r"demo: agents (.*), router (\S+),", seen)
        assert m, seen
        urls = [*m.group(1).split(), m.group(2)]
        assert len(urls) == 3 and not any(_closed(u) for u in urls), seen
        os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130, seen + output.decode()
        for u in urls:
            assert _closed(u), f"{u} still listening after the demo exited"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
