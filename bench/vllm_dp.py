"""The same prompt twice to one real vLLM server with two data-parallel ranks: behind
vLLM's own balancer, and through the router (ranks from /kv_event_sources, the rank
that holds the prompt named with X-data-parallel-rank).

    flock /tmp/radixfleet-vllm.lock python3 bench/vllm_dp.py [--prompts 12] [--json FILE]

Provisions vLLM and the tiny model as the engine tests do (radixfleet_tools/harness/vllm_env.py),
starts one server with ``--data-parallel-size 2`` (one core per rank, eager), sends
each of N distinct ~500-token prompts twice straight to vLLM, then N others twice
through a router whose worker is configured with nothing but its kind and tokenizer.
Prints, per arm, how many second requests reported cached tokens and the mean cached
tokens, the router's per-rank index entries and its prediction error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv, two_free_ports  # noqa: E402
from radixfleet_tools.harness.vllm_env import VllmServer, own_core, tiny_model  # noqa: E402
from radixfleet_tools.harness.vllm_router import text  # noqa: E402


def twice(url: str, seed: int) -> tuple[int, int]:
    """(prompt tokens, cached tokens of the second answer)."""
    body = {"model": "tiny", "prompt": text(seed, 500), "max_tokens": 2}
    usage = []
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, (r.status_code, r.text)
        usage.append(r.json()["usage"])
    return usage[0]["prompt_tokens"], usage[1]["prompt_tokens_details"]["cached_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args()
    n = a.prompts
    d = Path(tempfile.mkdtemp(prefix="radixfleet-vllm-dp-"))
    model = tiny_model()
    s = VllmServer(
        free_port(),
        model=model,
        events_port=two_free_ports(),
        replay_port=two_free_ports(),
        log_path=d / "vllm.log",
        data_parallel_size=2,
        omp_cpus=f"{own_core(0)}|{own_core(1)}",
        extra_args=("--enforce-eager",),
    )
    with s:
        direct = [twice(s.url, 90_000 + i) for i in range(n)]
        port, admin_port = free_port(), free_port()
        cfg = {
            "listen": {"host": "127.0.0.1", "port": port},
            "admin": {"host": "127.0.0.1", "port": admin_port},
            "health": {"interval_s": 0.5},
            "limits": {"worker_queue_requests": 0},
            "workers": [{"url": s.url, "id": "dp", "kind": "vllm", "tokenizer": str(model)}],
        }
        (d / "router.yaml").write_text(json.dumps(cfg))
        url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        with Proc(radixfleet_argv("router", "--config", str(d / "router.yaml")), ready_url=url + "/health"):
            end = time.monotonic() + 120
            while True:
                w = httpx.get(admin + "/admin/workers", timeout=5).json()["workers"][0]
                ev = w["engine"]["events"]
                if w["routable"] and ev and ev["connected"] and w["engine"]["data_parallel_ranks"] == 2:
                    break
                if time.monotonic() > end:
                    raise SystemExit(f"the router did not follow both ranks: {w}")
                time.sleep(0.2)
            routed = [twice(url, 95_000 + i) for i in range(n)]
            eng = httpx.get(admin + "/admin/workers", timeout=5).json()["workers"][0]["engine"]
    out = {}
    for name, rows in (("vllm_balancer", direct), ("router_rank_header", routed)):
        out[name] = {
            "second_request_hits": f"{sum(1 for _, c in rows if c > 0)}/{n}",
            "mean_cached_tokens": round(sum(c for _, c in rows) / n, 1),
            "mean_prompt_tokens": round(sum(p for p, _ in rows) / n, 1),
        }
    out["router_rank_entries"] = {r: v["entries"] for r, v in eng["events"]["ranks"].items()}
    out["router_prediction"] = {
        k: eng["prediction"][k] for k in ("samples", "mean_abs_tokens", "over", "under")
    }
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
