"""`radixfleet loadtest` as a client of a live router that authenticates and refuses.

One simulated agent behind the router, whose ``keys.tenant.source: api_key`` answers
401 to a request without a known key and whose ``limits`` (one request proxied at a
time, no queue) answer 429 + ``Retry-After: 1`` to the second request in flight. The
load generator must send the key (``$OPENAI_API_KEY``, as the OpenAI SDK reads it),
retry the 429s after the second they ask for and say so, export every request, and
exit non-zero when the failures exceed ``--max-failures`` (2 when the target refuses
the key before any load).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("radixfleet_tools.agent.cli") is None
        or importlib.util.find_spec("radixfleet.server.cli") is None,
        reason="needs the agent (radixfleet_tools.agent.cli) and the router (radixfleet.server.cli)",
    ),
]

KEY = "sk-loadgen-test"


def _loadtest(router_url: str, tmp_path, *extra: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "radixfleet.cli",
        "loadtest",
        "--target",
        f"r={router_url}",
        "--workload",
        "zipf",
        "-o",
        "requests=12",
        "-o",
        "prompts=3",
        "-o",
        "system_tokens=64",
        "-o",
        "suffix_tokens=8",
        "-o",
        "output_tokens=4",
        "--concurrency",
        "3",
        "--duration",
        "60",
        "--no-progress",
        *extra,
    ]
    clean = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**clean, **env})


def test_key_sent_429_retried_after_retry_after_export_and_exit_status(tmp_path):
    agent_port, router_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {router_port}}}\n"
        f"workers: [{{url: 'http://127.0.0.1:{agent_port}', id: w0}}]\n"
        f"keys: {{tenant: {{source: api_key, api_keys: [{{tenant: a, key: {KEY}}}]}}}}\n"
        "limits: {max_concurrency: 1, max_queue: 0, retry_after_s: 1, worker_queue_requests: 0}\n"
        "response_headers: {worker_id: true}\n"  # the export's worker column reads it
    )
    agent = Proc(
        radixfleet_argv(
            "agent", "--engine", "sim", "--port", str(agent_port), "--kv-tokens", "20000", "--worker-id", "w0"
        ),
        ready_url=f"http://127.0.0.1:{agent_port}/health",
    )
    router = Proc(radixfleet_argv("router", "--config", str(cfg)), ready_url=f"{router_url}/health")
    with agent, router:
        # no key: the router refuses the probe, so no load is sent and the status is 2
        p = _loadtest(router_url, tmp_path, env={})
        assert p.returncode == 2, p.stderr + p.stdout
        assert p.stderr.strip().endswith("answered HTTP 401 (pass --api-key KEY or set OPENAI_API_KEY)"), (
            p.stderr
        )
        # a key the router does not know: the same
        p = _loadtest(router_url, tmp_path, "--api-key", "sk-wrong", env={"OPENAI_API_KEY": KEY})
        assert p.returncode == 2 and "HTTP 401" in p.stderr, p.stderr

        # the key from the environment; 3 in flight against a limit of 1: 429s retried
        out, reqs = tmp_path / "ok.json", tmp_path / "requests.jsonl"
        p = _loadtest(
            router_url,
            tmp_path,
            "--max-retries",
            "20",
            "--percentiles",
            "50,95",
            "--slo",
            "ttft_ms=60000",
            "--json",
            str(out),
            "--requests-out",
            str(reqs),
            env={"OPENAI_API_KEY": KEY},
        )
        assert p.returncode == 0, p.stderr + p.stdout
        (run,) = json.loads(out.read_text())["runs"]
        assert run["ok"] == run["requests"] == 12, run["errors_by_kind"]
        assert run["retries"]["attempts"] > 0
        assert run["goodput"]["requests"] == 12 and "p95" in run["tpot_ms"]
        lines = [json.loads(x) for x in reqs.read_text().splitlines()]
        assert len(lines) == 12 and {x["status"] for x in lines} == {200}
        assert {x["worker"] for x in lines} == {"w0"}
        retried = [x for x in lines if x["retries"]]
        assert retried
        for x in lines:
            # each retry waited the Retry-After the router gave (1 s), not the backoff
            assert x["retry_wait_ms"] == pytest.approx(1000.0 * x["retries"])
            assert x["ttft_ms"] > 0 and x["e2e_ms"] >= x["ttft_ms"] and x["output_tokens"] == 4
            assert len(x["itl_ms"]) == 3 and x["prompt_tokens"] > 0
        for x in retried:
            assert x["ttft_ms"] >= x["retry_wait_ms"]  # TTFT counts from the first attempt
        assert "retried" in p.stdout

        # no retries: the 429s are the outcome; a share above --max-failures exits 1
        p = _loadtest(
            router_url,
            tmp_path,
            "--retry",
            "none",
            "--api-key",
            KEY,
            "--json",
            str(tmp_path / "none.json"),
            env={},
        )
        (run,) = json.loads((tmp_path / "none.json").read_text())["runs"]
        assert set(run["errors_by_kind"]) == {"http_429"} and run["ok"] > 0
        assert p.returncode == 1
        p = _loadtest(
            router_url, tmp_path, "--retry", "none", "--api-key", KEY, "--max-failures", "1", env={}
        )
        assert p.returncode == 0, p.stderr
