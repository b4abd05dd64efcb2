"""Prefill selection on a live disaggregated fleet of agents: a router in front of P
``--role prefill`` and D ``--role decode`` agents on loopback (vLLM's
``kv_transfer_params`` protocol end to end), one fresh fleet per policy, driven by
``radixfleet loadtest`` with a shared-prefix workload.

::

    python3 bench/pd_live.py [--policies prefix_load,round_robin] [--prefill 2] [--decode 2]
        [--prefill-kv-tokens 20000] [--decode-kv-tokens 40000] [--duration 40] [--rate 8]
        [--out DIR] [-- LOADTEST ARGS ...]

Every request takes both legs (``disagg.colocate_below_tokens: 0``), so the policy's
prefill pick decides every prompt's prefill-side hit. Per policy it prints the
prefill side's hit rate (the prefill agents' ``cached / prompt`` tokens: the client's
``cached_tokens`` is the decode leg's local reuse), the decode side's KV pulled, and
the client's TTFT p50/p99 (from the loadtest JSON report). Loadtest arguments after
``--`` replace the default workload (gsp, 16 groups of 2,048-token system prompts,
128-token questions, 64 output tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from radixfleet_tools.loadtest.local_fleet import Child, cli_argv, free_port, wait_registered

DEFAULT_LOAD = [
    "--workload",
    "gsp",
    "-o",
    "groups=16",
    "-o",
    "prompts_per_group=64",
    "-o",
    "system_tokens=2048",
    "-o",
    "question_tokens=128",
    "-o",
    "output_tokens=64",
    "-o",
    "api=chat",
]


def totals(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def hit(m: dict[str, float]) -> float:
    """An agent's cached / prompt tokens, from its metrics."""
    prompt = m["radixfleet_agent_prompt_tokens_total"]
    return round(m["radixfleet_agent_cached_tokens_total"] / prompt, 3) if prompt else 0.0


def run_policy(policy: str, args: argparse.Namespace, load: list[str], out: str) -> dict:
    """One fresh fleet under ``policy``, one loadtest run; the figures."""
    rport = free_port()
    router_url = f"http://127.0.0.1:{rport}"
    cfg_path = os.path.join(out, f"router-{policy}.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(
            {
                "policy": {"name": policy},
                "disagg": {"colocate_below_tokens": 0},
                "response_headers": {"worker_id": True},
            },
            f,
        )
    children: list[Child] = []
    roles = [("prefill", i, args.prefill_kv_tokens) for i in range(args.prefill)]
    roles += [("decode", i, args.decode_kv_tokens) for i in range(args.decode)]
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    try:
        router = Child(
            f"router ({policy})",
            cli_argv("router", "--config", cfg_path, "--port", str(rport), "--log-level", "WARNING"),
            os.path.join(out, f"router-{policy}.log"),
            router_url + "/v1/models",
        )
        router.start()
        children.append(router)
        router.wait_ready(60)
        for role, i, kv in roles:
            port = free_port()
            wid = f"{role[0]}{i}"
            agent = Child(
                f"agent {wid}",
                cli_argv(
                    "agent",
                    "--engine",
                    "sim",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--worker-id",
                    wid,
                    "--role",
                    role,
                    "--kv-tokens",
                    str(kv),
                    "--router",
                    router_url,
                ),
                os.path.join(out, f"agent-{policy}-{wid}.log"),
                f"http://127.0.0.1:{port}/health",
            )
            agent.start()
            children.append(agent)
            urls[role].append(f"http://127.0.0.1:{port}")
        for c in children[1:]:
            c.wait_ready(60)
        wait_registered(router_url, len(roles))
        report = os.path.join(out, f"loadtest-{policy}.json")
        cmd = cli_argv(
            "loadtest",
            "--target",
            f"{policy}={router_url}",
            "--rate",
            str(args.rate),
            "--duration",
            str(args.duration),
            "--seed",
            str(args.seed),
            "--no-progress",
            "--json",
            report,
            *load,
        )
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(report) as f:
            run = json.load(f)
        res = run["runs"][0] if "runs" in run else run
        pre = [totals(u) for u in urls["prefill"]]
        dec = [totals(u) for u in urls["decode"]]
        prompt = sum(m["radixfleet_agent_prompt_tokens_total"] for m in pre)
        cached = sum(m["radixfleet_agent_cached_tokens_total"] for m in pre)
        return {
            "policy": policy,
            "requests": res["requests"],
            "errors": res["errors"],
            "prefill_hit_rate": cached / prompt if prompt else 0.0,
            "prefill_hit_by_worker": [hit(m) for m in pre],
            "decode_local_hit_rate": res.get("hit_rate"),
            "kv_pulled_tokens": sum(m["radixfleet_agent_kv_transferred_in_tokens_total"] for m in dec),
            "ttft_ms": res["ttft_ms"],
        }
    finally:
        for c in reversed(children):
            c.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="prefix_load,round_robin")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--prefill-kv-tokens", type=int, default=20_000)
    p.add_argument("--decode-kv-tokens", type=int, default=40_000)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="where logs and reports go (default: a temp dir)")
    argv = sys.argv[1:]
    load = DEFAULT_LOAD
    if "--" in argv:
        cut = argv.index("--")
        argv, load = argv[:cut], argv[cut + 1 :]
    args = p.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="pd-live-")
    os.makedirs(out, exist_ok=True)
    for policy in args.policies.split(","):
        print(json.dumps(run_policy(policy, args, load, out)), flush=True)
    print(f"logs and reports: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
