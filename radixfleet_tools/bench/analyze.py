"""``radixfleet bench analyze``: ``radixfleet analyze`` on a 100,000-request traffic log.

Builds the log first (unless ``--log DIR`` names one): chat sessions behind a few
dozen shared system prompts of Zipf popularity, 2-12 turns each, interleaved in
time (``--active`` sessions in progress at once, Poisson arrivals), every request
keyed by ``request_key`` exactly as the router keys it and written by the real
``TrafficLog`` (its writer thread, rotation off). Then times ``analyze`` on it —
reading, the oracle, the pooled-LRU knee curve, the Zipf head — without policy
replay (that is the simulator's speed, ``bench sim``).

Target: under 60 s for 100,000 requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from radixfleet.config import TrafficLogConfig
from radixfleet.keys import Endpoint, request_key
from radixfleet.server.traffic_log import TrafficLog, log_files
from radixfleet_tools.loadtest.workloads import text_of


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--requests", type=int, default=100_000, help="requests in the generated log")
    parser.add_argument("--log", help="analyze this log (file or directory) instead of building one")
    parser.add_argument("--keep", help="build the log in this directory and keep it")
    parser.add_argument("--jobs", type=int, default=0, help="analyze --jobs (0: one per CPU)")


def synthetic_log(
    out_dir: str,
    requests: int,
    *,
    seed: int = 0,
    systems: int = 40,
    system_tokens: int = 1024,
    question_tokens: int = 96,
    answer_tokens: int = 160,
    active: int = 200,
    rate: float = 50.0,
    tenants: int = 4,
) -> list[str]:
    """Writes a traffic log of ``requests`` chat requests into ``out_dir``; returns
    its files. Deterministic in ``seed`` (but for file names)."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(systems)]
    sys_text = [text_of(system_tokens, f"sys/{k}", seed) for k in range(systems)]
    cfg = TrafficLogConfig(
        enabled=True, dir=out_dir, max_file_bytes=2**40, queue_size=10**9, flush_interval_s=0.05
    )
    sessions: list[list] = []  # [tenant, messages, turns left, session id]
    sid = 0
    t = 1.7e9
    tl = TrafficLog(cfg, key=b"bench")
    tl.start()
    try:
        for i in range(requests):
            while len(sessions) < active:
                k = rng.choices(range(systems), weights)[0]
                sessions.append(
                    [
                        f"tenant{rng.randrange(tenants)}",
                        [{"role": "system", "content": sys_text[k]}],
                        rng.randint(2, 12),
                        f"s{sid}",
                    ]
                )
                sid += 1
            j = rng.randrange(len(sessions))
            s = sessions[j]
            s[1].append({"role": "user", "content": text_of(question_tokens, f"q/{i}", seed)})
            key = request_key(Endpoint.CHAT, {"model": "llama", "messages": s[1]}, tenant=s[0])
            t += rng.expovariate(rate)
            tl.record(
                key,
                arrival_s=t,
                worker=f"w{rng.randrange(8)}",
                matched_tokens=0,
                prompt_tokens=key.prompt_tokens,
                output_tokens=answer_tokens,
                cached_tokens=None,
                ttft_s=None,
                session=s[3],
            )
            s[1].append({"role": "assistant", "content": text_of(answer_tokens, f"a/{i}", seed)})
            s[2] -= 1
            if s[2] == 0:
                sessions[j] = sessions[-1]
                sessions.pop()
            if i % 2000 == 1999:  # the keys hold their prompt bytes: let the writer catch up
                while tl.stats().queued > 500:
                    time.sleep(0.01)
    finally:
        tl.close()
    return log_files([out_dir])


def run(args: argparse.Namespace) -> int:
    from radixfleet_tools.loadtest import analyze

    t0 = time.perf_counter()
    if args.log:
        paths = log_files([args.log])
        built_s = 0.0
    else:
        d = args.keep or tempfile.mkdtemp(prefix="radixfleet-analyze-")
        os.makedirs(d, exist_ok=True)
        paths = synthetic_log(d, args.requests)
        built_s = time.perf_counter() - t0
    size = sum(os.path.getsize(p) for p in paths)
    t1 = time.perf_counter()
    res = analyze.analyze(paths, analyze.Options(jobs=args.jobs or (os.cpu_count() or 1)))
    wall = time.perf_counter() - t1
    out = {
        "requests": res["inputs"]["requests"],
        "log_bytes": size,
        "build_s": built_s,
        "analyze_s": wall,
        "timing_s": res["timing_s"],
        "oracle_hit_rate": res["oracle_hit_rate"],
        "knee": res["knee"],
        "distinct_blocks": res["tokens"]["distinct_blocks"],
        "files": paths,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"analyze on {out['requests']:,} requests ({size / 1e6:.0f} MB of log, "
        f"{out['distinct_blocks']:,} distinct blocks; log built in {built_s:.1f} s)"
    )
    print(
        f"  analyze {wall:.1f} s (target < 60 s): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in res["timing_s"].items())
    )
    print(
        f"  oracle hit rate {res['oracle_hit_rate']:.3f}; knee at "
        f"{res['knee']['kv_bytes'] / 1e9:.2f} GB, hit rate {res['knee']['hit_rate']:.3f}"
    )
    return 0
