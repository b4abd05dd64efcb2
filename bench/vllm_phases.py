"""Where a request's time to first token goes, in front of one real vLLM server.

    python3 bench/vllm_phases.py [--requests 20] [--prompt-words 600] [--json FILE]

Starts one vLLM server (as bench/vllm_ab.py does: the tiny model, prefix caching,
KV events) and two routers in front of it — ``precise`` (prefix_load with the
engine's tokenizer and its KV events, the default an operator gets with a
tokenizer) and ``bytes`` (prefix_load keyed on routing bytes: no tokenizer) — and
sends the same kind of streamed chat request, one at a time, round robin over
``direct`` (the server itself), ``precise`` and ``bytes``. Every prompt is new (no
prefix cache hit anywhere), so the three paths do the same engine work. Per path,
the median and p90 of: the client's time to the response head, and to the first
content token. ``via router - direct`` is what the router adds: keying
(tokenizing the rendered chat in precise mode), matching, picking, its two extra
hops. Unloaded on purpose: the router's own cost, not queueing behind others.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.vllm_ab import router_config  # noqa: E402
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv  # noqa: E402
from radixfleet_tools.harness.vllm_env import VllmServer, own_core, tiny_model, vllm_python  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def timed(url: str, messages: list[dict]) -> tuple[float, float]:
    """(seconds to the response head, seconds to the first content token)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        head = time.perf_counter() - t0
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return head, time.perf_counter() - t0
    raise RuntimeError(f"{url}: the stream carried no token")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20, help="per path")
    ap.add_argument("--prompt-words", type=int, default=600)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    vllm_python()
    model_dir = tiny_model()
    tmp = Path(tempfile.mkdtemp(prefix="radixfleet-vllm-phases-"))
    server = VllmServer(
        free_port(),
        model=model_dir,
        kv_bytes="16M",
        max_num_seqs=64,
        events_port=free_port(),
        replay_port=free_port(),
        log_path=tmp / "vllm.log",
        omp_cpus=own_core(0),
    )
    procs = []
    try:
        server.start()
        server.wait_ready()
        paths = {"direct": server.url}
        for name, tokenizer in (("precise", True), ("bytes", False)):
            port = free_port()
            cfg = router_config(
                port, [server], model_dir, policy="prefix_load", tokenizer=tokenizer, events=tokenizer
            )
            (tmp / f"{name}.yaml").write_text(json.dumps(cfg))
            procs.append(
                Proc(
                    radixfleet_argv("router", "--config", str(tmp / f"{name}.yaml")),
                    ready_url=f"http://127.0.0.1:{port}/health",
                    timeout_s=60,
                ).__enter__()
            )
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while httpx.get(url + "/readiness", timeout=5).status_code != 200:
                if time.monotonic() > deadline:
                    raise SystemExit(f"router {name} not ready")
                time.sleep(0.5)
            paths[name] = url
        rng = random.Random(0)
        for url in paths.values():  # one warm-up each (connections, first-call costs)
            timed(url, [{"role": "user", "content": "warm up " + str(rng.random())}])
        got: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
        for _ in range(args.requests):
            for name, url in paths.items():
                text = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                messages = [
                    {"role": "system", "content": f"session {rng.random()}: you are terse."},
                    {"role": "user", "content": text},
                ]
                got[name].append(timed(url, messages))
        out = {}
        for name, rows in got.items():
            heads = sorted(h * 1000 for h, _ in rows)
            firsts = sorted(f * 1000 for _, f in rows)
            p90 = max(0, int(0.9 * len(rows)) - 1)
            out[name] = {
                "head_ms_p50": round(statistics.median(heads), 1),
                "head_ms_p90": round(heads[p90], 1),
                "ttft_ms_p50": round(statistics.median(firsts), 1),
                "ttft_ms_p90": round(firsts[p90], 1),
            }
        for name in ("precise", "bytes"):
            out[name]["added_ttft_ms_p50"] = round(out[name]["ttft_ms_p50"] - out["direct"]["ttft_ms_p50"], 1)
        out["bench"] = {"requests": args.requests, "prompt_words": args.prompt_words}
        print(json.dumps(out, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    finally:
        for p in procs:
            p.__exit__(None, None, None)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
