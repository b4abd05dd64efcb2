"""Prefetch on a local fleet (simulated agents, one router): what ``POST /v1/prefetch``
buys a RAG workload whose retriever runs ahead of its generator, and what its traffic
costs everyone else (bench/RESULTS.md, "Prefetch").

    PYTHONPATH=$PWD python3 bench/prefetch_rag.py OUT.json [--agents 2] [--gpu l4]
        [--rag-rate 1.0] [--rag-requests 120] [--mix-rate 0.8] [--mix-requests 200]
        [--mix-rag-rate 0.5] [--shares 0.1,1.0]

Phase A, the RAG workload alone (``-o lead_ms=300``): ``--prefetch off`` (the lead
waited out, nothing prefetched), then ``--prefetch on`` at each ``prefetch.share``
(hot-reloaded). TTFT p50/p99 per arm; the agents' computed prefill (their
``radixfleet_agent_prefill_tokens``, prefetches included) against the off arm's; the
router's prefetch counters.

Phase B, load: a zipf workload that never prefetches at ``--mix-rate`` beside a RAG
stream at ``--mix-rag-rate`` with prefetch off, then on (default share): the zipf
requests' TTFT p99 in each. Each run starts from flushed caches (the load
generator's own flush), the router restarted between arms.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

from radixfleet_tools.loadtest.local_fleet import Fleet, FleetConfig


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the named Prometheus series (every label set) at ``url``/metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})?\s+([0-9.e+-]+)$", line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        for n in names:
            if name == n:
                key = n + labels
                out[key] = out.get(key, 0.0) + value
    return out


def agents_prefill(fleet: Fleet) -> float:
    """Prompt tokens the agents computed (prefill, prefetches included), all together."""
    return sum(sum(scrape(u, ("radixfleet_agent_prefill_tokens_total",)).values()) for u in fleet.agent_urls)


def loadtest(fleet: Fleet, run: tuple, out: str) -> subprocess.Popen:
    """Starts ``radixfleet loadtest`` for ``run`` (label, workload, opts, rate, n,
    prefetch) against the fleet's router, its report to ``out``."""
    name, workload, opts, rate, n, prefetch = run
    argv = [
        sys.executable,
        "-m",
        "radixfleet.cli",
        "loadtest",
        "--target",
        f"{name}={fleet.router_url}",
        "--admin",
        f"{name}={fleet.admin_url}",
        "--workload",
        workload,
        *sum((["-o", o] for o in opts), []),
        "--rate",
        str(rate),
        "--requests",
        str(n),
        "--retry",
        "none",
        "--max-failures",
        "1",
        "--no-progress",
        "--json",
        out,
    ]
    if prefetch is not None:
        argv += ["--prefetch", prefetch]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(p: subprocess.Popen, out: str) -> dict:
    _, err = p.communicate(timeout=900)
    if p.returncode not in (0, 1):
        raise SystemExit(f"loadtest failed ({p.returncode}): {err.decode()[-2000:]}")
    with open(out) as f:
        return json.load(f)["runs"][0]


def router_yaml(path: str, share: float) -> None:
    with open(path, "w") as f:
        f.write(
            "policy: {name: prefix_load}\n"
            "response_headers: {worker_id: true}\n"
            f"prefetch: {{share: {share}}}\n"
            "reload: {watch: false}\n"
        )


def prefetch_counters(fleet: Fleet) -> dict[str, float]:
    names = (
        "radixfleet_prefetch_total",
        "radixfleet_prefetch_dropped_total",
        "radixfleet_prefetch_tokens_total",
    )
    return {k: v for k, v in scrape(fleet.admin_url, names).items()}


def arm(fleet, cfg_path, share, runs):
    """Restarts the router at ``share`` and runs ``runs`` [(label, workload, opts,
    rate, n, prefetch)] at once; returns {label: report} and the counters."""
    router_yaml(cfg_path, share)
    fleet.start_router(name=f"share{share}")
    before = agents_prefill(fleet)
    tmp = tempfile.mkdtemp(prefix="prefetch-bench-")
    procs = []
    for run in runs:
        out = os.path.join(tmp, f"{run[0]}.json")
        procs.append((run[0], out, loadtest(fleet, run, out)))
        time.sleep(0.05)
    reports = {label: finish(p, out) for label, out, p in procs}
    return reports, agents_prefill(fleet) - before, prefetch_counters(fleet)


def brief(r: dict) -> dict:
    return {
        "ok": r["ok"],
        "errors": r["errors"],
        "ttft_ms": {k: r["ttft_ms"].get(k) for k in ("p50", "p90", "p99")},
        "hit_rate": r["hit_rate"],
        "prompt_tokens": r["prompt_tokens"],
        "cached_tokens": r["cached_tokens"],
        "prefetch": r.get("prefetch"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--gpu", default="l4")
    ap.add_argument("--kv-tokens", type=int, default=60000)
    ap.add_argument("--rag-rate", type=float, default=1.0)
    ap.add_argument("--rag-requests", type=int, default=120)
    ap.add_argument("--mix-rate", type=float, default=0.8)
    ap.add_argument("--mix-requests", type=int, default=200)
    ap.add_argument("--mix-rag-rate", type=float, default=0.5)
    ap.add_argument(
        "--zipf", default="suffix_tokens=1024,output_tokens=32", help="the zipf stream's -o options"
    )
    ap.add_argument("--shares", default="0.1,1.0")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    a = ap.parse_args()
    rag = ["lead_ms=300", "output_tokens=32", f"requests={a.rag_requests}"]
    zipf = [*a.zipf.split(","), "requests=100000"]
    results: dict = {"args": vars(a)}
    cfg_path = os.path.join(tempfile.mkdtemp(prefix="prefetch-cfg-"), "router.yaml")
    router_yaml(cfg_path, 0.1)
    fc = FleetConfig(agents=a.agents, gpu=a.gpu, kv_tokens=a.kv_tokens, router_port=0, router_config=cfg_path)
    with Fleet(fc) as fleet:
        if not a.skip_a:
            arms = [("off", 0.1, "off")] + [(f"on@{s}", float(s), "on") for s in a.shares.split(",")]
            for label, share, pf in arms:
                reps, prefill, ctr = arm(
                    fleet, cfg_path, share, [("rag", "rag", rag, a.rag_rate, a.rag_requests, pf)]
                )
                results[f"A:{label}"] = {
                    "rag": brief(reps["rag"]),
                    "agents_prefill_tokens": prefill,
                    "router": ctr,
                }
                print(label, json.dumps(results[f"A:{label}"]), flush=True)
        if not a.skip_b:
            mix_rag = ["lead_ms=300", "output_tokens=32", "requests=100000"]
            n_rag = max(1, int(a.mix_requests * a.mix_rag_rate / a.mix_rate))
            for label, pf in (("off", "off"), ("on", "on")):
                reps, prefill, ctr = arm(
                    fleet,
                    cfg_path,
                    0.1,
                    [
                        ("zipf", "zipf", zipf, a.mix_rate, a.mix_requests, None),
                        ("rag", "rag", mix_rag, a.mix_rag_rate, n_rag, pf),
                    ],
                )
                results[f"B:{label}"] = {
                    "zipf": brief(reps["zipf"]),
                    "rag": brief(reps["rag"]),
                    "agents_prefill_tokens": prefill,
                    "router": ctr,
                }
                print(label, json.dumps(results[f"B:{label}"]), flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
