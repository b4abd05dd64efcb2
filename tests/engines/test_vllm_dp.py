"""The router in front of one real vLLM server with two data-parallel ranks (CPU build).

The worker is configured with nothing but its kind and tokenizer: the router asks the
server for its KV-event publishers (``GET /kv_event_sources``), follows both ranks'
streams, indexes each rank's prefix cache on its own and sends each request to the
rank that holds its prompt with ``X-data-parallel-rank``. Behind vLLM's own balancer
the same prompt sent twice may land on the other rank, whose cache is cold.

One server of its own (module scope): ``--data-parallel-size 2`` starts two engine
cores. Runs under ``flock /tmp/radixfleet-vllm.lock`` with the other engine tests.
"""

from __future__ import annotations

import json

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv, two_free_ports
from radixfleet_tools.harness.vllm_router import post, remember_admin, text, wait_for, workers

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def dp_server(vllm_model_dir, tmp_path_factory):
    from radixfleet_tools.harness.vllm_env import VllmServer, own_core

    logs = tmp_path_factory.mktemp("vllm-dp")
    # one core per rank ("0|1": vLLM's CPU backend splits the list by DP rank); eager
    # mode: no compile step, a faster start for a short test
    s = VllmServer(
        free_port(),
        model=vllm_model_dir,
        events_port=two_free_ports(),
        replay_port=two_free_ports(),
        log_path=logs / "vllm-dp.log",
        data_parallel_size=2,
        omp_cpus=f"{own_core(0)}|{own_core(1)}",
        extra_args=("--enforce-eager",),
    )
    with s:
        yield s


@pytest.fixture(scope="module")
def dp_router(dp_server, vllm_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("router-dp")
    port, admin = free_port(), free_port()
    remember_admin(port, admin)
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin},
        "policy": {"name": "prefix_load"},
        "health": {"interval_s": 0.5},
        "workers": [
            {
                "url": dp_server.url,
                "id": "dp",
                "kind": "vllm",
                "tokenizer": str(vllm_model_dir),
                "metrics": {"interval_s": 0.25, "timeout_s": 5.0},
            }
        ],
        "response_headers": {"worker_id": True},  # the test reads which rank served
    }
    (d / "router.yaml").write_text(json.dumps(cfg))
    url = f"http://127.0.0.1:{port}"
    with Proc(radixfleet_argv("router", "--config", str(d / "router.yaml")), ready_url=url + "/health") as p:

        def ready():
            w = workers(url)[0]
            ev = w["engine"]["events"]
            return (
                w["routable"]
                and w["engine"]["data_parallel_ranks"] == 2
                and ev
                and ev["source"] == "engine"
                and ev["connected"]
                and w["engine"]["key_space"].startswith("TokenSpace")
            )

        wait_for(ready, 120, "the worker's two ranks followed from /kv_event_sources", p)
        yield url


def test_kv_event_sources_lists_each_rank(dp_server):
    got = httpx.get(dp_server.url + "/kv_event_sources", timeout=5).json()
    assert sorted(got) == ["0", "1"]
    assert got["1"]["endpoint"] == f"tcp://*:{dp_server.events_port + 1}"


def test_same_prompt_twice_lands_on_the_rank_holding_it(dp_router, dp_server):
    """Four prompts, each sent twice through the router: the second time every one
    reports the first one's blocks cached (its rank was chosen), and each rank holds
    what the router believes it holds — asked directly with the header."""
    held = {}
    for i in range(4):
        prompt = text(70_000 + i, 500)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
        _, first, _ = post(dp_router, "/v1/completions", body)
        before = {r: v["entries"] for r, v in workers(dp_router)[0]["engine"]["events"]["ranks"].items()}
        _, second, _ = post(dp_router, "/v1/completions", body)
        cached = second["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (first["prompt_tokens"] // 32 - 1) * 32, (i, first, second)
        held[i] = (prompt, before)
    eng = workers(dp_router)[0]["engine"]
    assert eng["truth"] == "exact" and all(r["in_sync"] for r in eng["events"]["ranks"].values())
    assert all(r["entries"] > 0 for r in eng["events"]["ranks"].values()), eng["events"]
    # the rank the router believes holds a prompt does, the other does not
    prompt = held[3][0]
    answers = {}
    for rank in ("0", "1"):
        r = httpx.post(
            dp_server.url + "/v1/completions",
            timeout=60,
            headers={"X-data-parallel-rank": rank},
            json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
        )
        assert r.status_code == 200, r.text
        answers[rank] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert sorted(answers.values())[0] == 0 and sorted(answers.values())[1] > 0, answers


def test_a_rank_the_engine_does_not_have_is_refused_with_a_400(dp_server):
    """What the router reads as a stale rank map (EngineLink.rank_rejected)."""
    r = httpx.post(
        dp_server.url + "/v1/completions",
        timeout=60,
        headers={"X-data-parallel-rank": "5"},
        json={"model": "tiny", "prompt": "hello", "max_tokens": 1},
    )
    assert r.status_code == 400 and "data_parallel_rank" in r.text, (r.status_code, r.text)
