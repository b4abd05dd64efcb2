"""Prefetch in front of two real CPU vLLM servers: the RAG workload with the
retriever's lead, ``--prefetch off`` then ``on`` (bench/RESULTS.md, "Prefetch").

    flock /tmp/radixfleet-vllm.lock python3 bench/prefetch_vllm.py [--json FILE]
        [--rate 1.0] [--requests 60] [--lead-ms 300] [--share 0.1] [--kv 16M]

Provisions vLLM and the tiny model as ``bench/vllm_ab.py`` does, starts two servers
and one prefix_load router (the engines' tokenizer and KV events, ``prefetch.share``
as given), and runs ``radixfleet loadtest --workload rag`` against it twice, each
cold (vLLM's caches reset by the load generator's flush). TTFT and hit rate are the
load generator's (vLLM's own ``cached_tokens``); the prefill the engines computed is
vLLM's ``vllm:prompt_tokens_total`` less ``vllm:prompt_tokens_cached_total`` (the
prefetches' own prompts included); the router's prefetch counters follow.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from vllm_ab import admin_url, router_config  # noqa: E402

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv  # noqa: E402
from radixfleet_tools.harness.vllm_env import VllmServer, own_core, tiny_model, vllm_python  # noqa: E402


def sums(url: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """The named series at ``url``/metrics, summed over their labels."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})?\s+([0-9.e+-]+)$", line)
        if m and m.group(1) in prefixes:
            key = m.group(1) + (m.group(2) or "" if m.group(1).startswith("radixfleet") else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def engines_prefill(servers) -> float:
    total = 0.0
    for s in servers:
        v = sums(s.url, ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total"))
        total += v.get("vllm:prompt_tokens_total", 0.0) - v.get("vllm:prompt_tokens_cached_total", 0.0)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--lead-ms", type=float, default=300.0)
    ap.add_argument("--share", type=float, default=0.1)
    ap.add_argument("--kv", default="16M")
    ap.add_argument("--chunk-tokens", type=int, default=192)
    a = ap.parse_args()
    vllm_python()  # provisions (or finds) the venv
    model_dir = tiny_model()
    tmp = Path(tempfile.mkdtemp(prefix="radixfleet-prefetch-vllm-"))
    servers = [
        VllmServer(
            free_port(),
            model=model_dir,
            kv_bytes=a.kv,
            events_port=free_port(),
            replay_port=free_port(),
            log_path=tmp / f"vllm-{i}.log",
            omp_cpus=own_core(i),
        )
        for i in range(2)
    ]
    result: dict = {"args": vars(a)}
    router = None
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        port = free_port()
        cfg = router_config(port, servers, model_dir, policy="prefix_load", tokenizer=True, events=True)
        cfg["prefetch"] = {"share": a.share}
        (tmp / "router.yaml").write_text(json.dumps(cfg))
        router = Proc(
            radixfleet_argv("router", "--config", str(tmp / "router.yaml")),
            ready_url=f"http://127.0.0.1:{port}/health",
            timeout_s=60,
        ).__enter__()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/readiness", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        for mode in ("off", "on"):
            out = tmp / f"{mode}.json"
            before = engines_prefill(servers)
            cmd = radixfleet_argv(
                "loadtest",
                "--target",
                f"{mode}={url}",
                "--workload",
                "rag",
                *("-o", f"lead_ms={a.lead_ms}", "-o", f"chunk_tokens={a.chunk_tokens}"),
                *("-o", "output_tokens=16", "-o", f"requests={a.requests}"),
                *("--rate", str(a.rate), "--requests", str(a.requests), "--model", "tiny"),
                *("--prefetch", mode, "--retry", "none", "--max-failures", "1", "--no-progress"),
                *("--json", str(out)),
                *[x for s in servers for x in ("--flush", s.url)],
            )
            if subprocess.run(cmd, timeout=1800).returncode not in (0, 1):
                print("prefetch_vllm: the load generator failed", file=sys.stderr)
                return 1
            run = json.loads(out.read_text())["runs"][0]
            names = ("radixfleet_prefetch_total", "radixfleet_prefetch_dropped_total")
            result[mode] = {
                "ok": run["ok"],
                "errors": run["errors"],
                "ttft_ms": {k: run["ttft_ms"].get(k) for k in ("p50", "p90", "p99")},
                "hit_rate": run["hit_rate"],
                "prompt_tokens": run["prompt_tokens"],
                "prefetch": run.get("prefetch"),
                "engines_prefill_tokens": engines_prefill(servers) - before,
                "router": sums(admin_url(cfg), (*names, "radixfleet_prefetch_tokens_total")),
            }
            print(mode, json.dumps(result[mode]), flush=True)
    finally:
        if router is not None:
            router.__exit__(None, None, None)
        for s in servers:
            s.stop()
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
