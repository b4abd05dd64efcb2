"""The router's disaggregated prefill/decode (radixfleet.route.pd) in front of two real CPU vLLM
servers, one ``role: prefill`` and one ``role: decode``, each with vLLM's
``ExampleConnector`` (``kv_role: kv_both``) on one shared folder: the prefill leg
(``max_tokens`` 1, ``kv_transfer_params``) stores the prompt's KV there, the decode leg
loads it instead of computing it, and reports it cached. The example connector hands
KV by prompt through storage, not by ``kv_transfer_params`` (its prefill answer has
none, so the router forwards the decode leg without); the protocol's params path is
covered by tests/router/test_pd.py. Runs under ``flock /tmp/radixfleet-vllm.lock``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from radixfleet_tools.harness.vllm_router import remember_admin, text, wait_for, workers

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pd_servers(vllm_model_dir, tmp_path_factory):
    from radixfleet_tools.harness.vllm_env import VllmServer, own_core

    logs = tmp_path_factory.mktemp("vllm-pd")
    store = logs / "kv"
    store.mkdir()
    kv = json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
    )
    servers = [
        VllmServer(
            free_port(),
            model=vllm_model_dir,
            log_path=logs / f"vllm-{role}.log",
            omp_cpus=own_core(i),
            extra_args=("--enforce-eager", "--kv-transfer-config", kv),
        )
        for i, role in enumerate(("prefill", "decode"))
    ]
    with servers[0], servers[1]:
        yield servers, store


@pytest.fixture(scope="module")
def pd_router(pd_servers, tmp_path_factory):
    (p, d), _ = pd_servers
    cfg_dir = tmp_path_factory.mktemp("router-pd")
    port, admin = free_port(), free_port()
    remember_admin(port, admin)
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin},
        "policy": {"name": "prefix_load"},
        "health": {"interval_s": 0.5},
        "disagg": {"colocate_below_tokens": 64},
        "workers": [
            {"url": p.url, "id": "p", "kind": "openai", "role": "prefill", "model": "tiny"},
            {"url": d.url, "id": "d", "kind": "openai", "role": "decode", "model": "tiny"},
        ],
        "response_headers": {"worker_id": True},
    }
    (cfg_dir / "router.yaml").write_text(json.dumps(cfg))
    url = f"http://127.0.0.1:{port}"
    with Proc(
        radixfleet_argv("router", "--config", str(cfg_dir / "router.yaml")), ready_url=url + "/health"
    ) as pr:
        wait_for(
            lambda: all(w["routable"] for w in workers(url)) and len(workers(url)) == 2,
            60,
            "both routable",
            pr,
        )
        yield url


def test_decode_leg_loads_the_prefill_legs_kv(pd_router, pd_servers):
    _, store = pd_servers
    prompt = text(91_000, 600)
    r = httpx.post(
        pd_router + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-radixfleet-worker"] == "d"
    usage = r.json()["usage"]
    assert any(store.iterdir()), "the prefill leg stored no KV"
    # the decode worker never saw this prompt: what it reports cached came from the
    # prefill leg's KV (the example connector loads whole blocks of 32)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (usage["prompt_tokens"] // 32 - 1) * 32, usage
