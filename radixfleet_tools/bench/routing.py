"""``radixfleet bench routing``: the router's routing work per request, without HTTP.

Per request, exactly what ``DataPlane.serve`` does before forwarding, on a router
built from its config as ``radixfleet router`` builds it (not started): ``json.loads``
of the body is excluded (it is not routing), then

    key     = request_key(endpoint, body, tenant, block_bytes)  (canonical bytes, hashes)
    verdict = RouteCore.decide(DataPlane.ask_of(...), now)      (radixfleet.route.core: views,
              the key in every space in use and its match, tenancy, shedding, the
              policy's choice, the hint and the load count)

and the load released 32 requests later (``pool.finish``).

``--tracing``: every request traced (radixfleet.server.tracing, sample ratio 1), its spans
exported over OTLP/HTTP to a sink in another process (``bench proxy``'s
``otlp-sink``): the routing work then includes the trace's start, the keying span
and the route span with its stage marks; the rest of a traced request's spans (an
attempt) and their making into SDK spans at its end are timed apart
(``trace_end``), off the routing work, as the data plane does them after the answer.

for an 8 KiB prompt (64 blocks of 128 bytes) over 16 workers, with sessions that
share a system prompt and grow turn by turn (so matches are deep and hot). Target:
<= 50 us per request for the key and the decision (the hint and the load count
included). Figures: mean, p50, p99.

Token rows (precise mode): the same route core's decision with the request keyed in
an engine's own token blocks (the ask's keyer: radixfleet.engines.token_keys, vLLM's chat
rendering, the engine's tokenizer, 32-token blocks; no byte key), for an ~8 KiB chat
prompt over 16 workers.
Target: p50 <= 1 ms, p99 <= 3 ms. Two workloads:

    cold        every request a conversation never seen (nothing cached: the
                tokenizer's full price)
    shared      every request a new conversation: a 7 KiB system prompt all share
                (an agent's instructions and tools) and a new 1 KiB question
    multiturn   64 live conversations, each request the next turn of one: a new
                512 B question on its history (pieces cached); a conversation grows
                from its 1 KiB system prompt to twice the prompt size and starts
                over (so prompts average about the prompt size)

Besides the full routing work, each row shows the keyer alone (render + tokenize +
hash) and, for comparison, the plain transformers path it replaces
(``apply_chat_template`` + ``tokenizer(text)``) on the same bodies. Rows run per
tokenizing backend of the keyer's piece encoder (fastokens when installed, and
tokenizers). The tokenizer is ``--tokenizer DIR`` (a folder or a cached repo id), by
default the tiny test model's, built on the spot (radixfleet_tools.bench.tiny_tokenizer).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from radixfleet.config import parse_config
from radixfleet.engines.keyspace import KeyedRequest, SpaceKey
from radixfleet.fleet.pool import HealthState
from radixfleet.index.prefix_index import tune_gc
from radixfleet.keys import Endpoint, request_key
from radixfleet.policies.base import RouteRequest
from radixfleet.route.core import Ask, Route
from radixfleet_tools.loadtest.report import percentile


def _count(lo: int):
    """An argparse type: an integer >= lo."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {n}")
        return n

    return parse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--requests", type=int, default=20_000, help="requests routed per row")
    parser.add_argument("--workers", type=int, default=16, help="routable workers")
    parser.add_argument("--prompt-bytes", type=int, default=8192, help="bytes per prompt")
    parser.add_argument(
        "--policies",
        default="round_robin,least_load,cache_aware,prefix_load",
        help="comma-separated policies, one row each",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        help="tokenizer folder or cached repo id for the token rows "
        "(default: the tiny test tokenizer, built in a temp dir)",
    )
    parser.add_argument(
        "--token-requests", type=_count(0), default=2_000, help="requests per token row (0: no token rows)"
    )
    parser.add_argument("--token-policy", default="prefix_load", help="the policy of the token-keyed rows")
    parser.add_argument(
        "--tokenizer-backends",
        default="",
        help="comma-separated: fastokens, tokenizers (default: both when "
        "fastokens is installed, else tokenizers)",
    )
    parser.add_argument(
        "--block-size", type=_count(1), default=32, help="engine KV block size in tokens for the token rows"
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="trace every request (OTLP/HTTP to a local sink; needs the tracing extra)",
    )


def _bodies(n: int, prompt_bytes: int, rng: random.Random) -> list[dict]:
    system = "You are a careful assistant. Follow the rules. " * (prompt_bytes // 96)
    out = []
    sessions = [[{"role": "system", "content": system}] for _ in range(64)]
    for _ in range(n):
        s = sessions[rng.randrange(len(sessions))]
        if len(s) > 7:
            del s[1:]
        s.append({"role": "user", "content": f"question {rng.random():.12f} " * 4})
        msgs = list(s)
        # pad to the target size with the last turn
        size = sum(len(m["content"]) for m in msgs)
        if size < prompt_bytes:
            msgs[-1] = {"role": "user", "content": msgs[-1]["content"] + "x" * (prompt_bytes - size)}
        out.append({"model": "m", "messages": msgs})
        s.append({"role": "assistant", "content": "answer " * 8})
    return out


def _router(workers: int, policy: str):
    """A router as ``radixfleet router`` builds it (not started: nothing listens or
    connects), its workers healthy."""
    from radixfleet.server.app import Router

    cfg = parse_config(
        {
            "workers": [{"url": f"http://127.0.0.1:{20000 + i}", "id": f"w{i}"} for i in range(workers)],
            "policy": {"name": policy},
        }
    )
    router = Router(cfg)
    for w in router.pool:
        router.pool._set_health(w, HealthState.HEALTHY)
    return router


def bench_policy(name: str, bodies: list[dict], workers: int, tracing=None) -> dict:
    """One row: the data plane's routing work per request, through the route core it
    routes with (``radixfleet.route.core``): the byte key (``request_key``) and
    ``RouteCore.decide`` (views, keys in every space in use and the match, tenancy,
    shedding, the policy's choice, the hint and the load count), as
    ``DataPlane.serve`` calls them; each request's load released 32 requests later."""
    router = _router(workers, name)
    dp, pool = router.dataplane, router.pool
    traced: Any = None
    if tracing is not None:
        from radixfleet.server import tracing as traced
    ends: list[float] = []
    block_bytes = router.cfg.keys.block_bytes
    lat = []
    perf = time.perf_counter
    now0 = time.monotonic()
    in_flight: list = []
    headers: dict[str, str] = {}
    blocks = 0
    for i, body in enumerate(bodies):
        t0 = perf()
        now = now0 + i * 1e-3
        trace = None if traced is None else traced.start(tracing, headers, Endpoint.CHAT)
        if trace is not None:
            trace.admitted(False)
        key = request_key(Endpoint.CHAT, body, tenant="", block_bytes=block_bytes)
        ask = dp.ask_of(Endpoint.CHAT, body, key, None, "", "", headers)
        if trace is None:
            verdict = dp.route.decide(ask, now)
        else:
            trace.keyed(key.model, False, 0, len(key.hashes))
            verdict = trace.decide(dp.route, ask, now)
        t1 = perf()
        if trace is not None:  # what the rest of a traced request adds: one attempt
            span, _ = trace.attempt()
            sent = time.monotonic()
            trace.attempt_end(span, "w0", sent, sent, None, 200, True, (100, 50), 1)
            trace.end()
            ends.append(perf() - t1)
        assert isinstance(verdict, Route), f"routed at light load, not {verdict!r}"
        placed = verdict.placement
        assert placed is not None
        lat.append(t1 - t0)
        blocks = len(key.hashes)
        in_flight.append((verdict.worker, placed))
        if len(in_flight) > 32:  # keep a realistic amount of load in flight
            fw, fp = in_flight.pop(0)
            pool.finish(fw, fp.own, True, fp.key.prompt_tokens)
    lat.sort()
    n = len(lat)
    extra = {}
    if ends:
        tracing.flush()
        extra = {"trace_end": _pct(ends), "spans": tracing.stats()}
    return {
        **extra,
        "policy": name,
        "requests": n,
        "mean_us": sum(lat) / n * 1e6,
        "p50_us": lat[n // 2] * 1e6,
        "p99_us": lat[int(n * 0.99)] * 1e6,
        "blocks_per_request": blocks,
        "index_nodes": router.index.stats().nodes,
    }


# ------------------------------------------------------------------ token rows


def _words(rng: random.Random, nbytes: int) -> str:
    """Text like the tiny tokenizer's training text (its words, 20% random ones)."""
    from radixfleet_tools.bench.tiny_tokenizer import WORDS

    out: list[str] = []
    size = 0
    while size < nbytes:
        w = (
            rng.choice(WORDS)
            if rng.random() < 0.8
            else "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(2, 8)))
        )
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def _size(msgs: list[dict]) -> int:
    return sum(len(m["content"]) for m in msgs)


def _token_bodies(n: int, prompt_bytes: int, rng: random.Random, workload: str) -> list[dict]:
    """Chat bodies of about ``prompt_bytes`` (module docstring: cold, shared, multiturn)."""
    if workload == "shared":
        system = {"role": "system", "content": _words(rng, prompt_bytes - 1024)}
        return [
            {"model": "m", "messages": [system, {"role": "user", "content": _words(rng, 1024)}]}
            for _ in range(n)
        ]
    system = {"role": "system", "content": "You are a careful assistant. " + _words(rng, 1024)}

    def fresh() -> list[dict]:
        msgs = [system]
        while _size(msgs) < prompt_bytes - 512:
            msgs.append({"role": "user", "content": _words(rng, 400)})
            msgs.append({"role": "assistant", "content": _words(rng, 400)})
        return msgs

    out = []
    if workload == "cold":
        for _ in range(n):
            msgs = fresh() + [{"role": "user", "content": _words(rng, 512)}]
            out.append({"model": "m", "messages": msgs})
        return out
    sessions = [[system] for _ in range(64)]
    for _ in range(n):
        i = rng.randrange(len(sessions))
        s = sessions[i]
        if _size(s) > 2 * prompt_bytes:
            s = sessions[i] = [system]
        s.append({"role": "user", "content": _words(rng, 512)})
        out.append({"model": "m", "messages": list(s)})
        s.append({"role": "assistant", "content": _words(rng, 256)})
    return out


def _pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    p50, p99 = percentile(xs, 0.5, presorted=True), percentile(xs, 0.99, presorted=True)
    assert p50 is not None and p99 is not None, "an empty timing sample"
    return {
        "mean_us": sum(xs) / len(xs) * 1e6,
        "p50_us": p50 * 1e6,
        "p99_us": p99 * 1e6,
    }


def bench_tokens(
    workload: str,
    bodies: list[dict],
    workers: int,
    source: str,
    policy_name: str,
    block_size: int,
    backend: str,
) -> dict:
    """One token row: the route core's decision (``RouteCore.decide`` of a router
    built as the byte rows build it) with the request keyed in one token space by the
    engine's tokenizer (the ask's keyer: ``TokenKeyer.key``, matched in the router's
    index), the keyer alone, and the plain transformers path, over the same bodies;
    each request's load released 32 requests later."""
    from radixfleet.engines.token_keys import TokenKeyer

    keyer = TokenKeyer.load(source, tokenizer_backend=backend)
    plain = keyer.tokenizer
    router = _router(workers, policy_name)
    core, index, pool = router.dataplane.route, router.index, router.pool
    space = ("tokens", source, block_size)
    perf = time.perf_counter
    full, keys, ref = [], [], []
    tokens = blocks = 0
    now0 = time.monotonic()
    in_flight: list = []
    keyed_s = 0.0  # the keyer's own time in the decision just made
    for i, body in enumerate(bodies):
        now = now0 + i * 1e-3
        text_len = _size(body["messages"])

        def key_tokens(views, now: float, body=body, text_len=text_len) -> KeyedRequest:
            nonlocal keyed_s
            k0 = perf()
            tk = keyer.key(Endpoint.CHAT, body, block_size=block_size)
            keyed_s = perf() - k0
            sk = SpaceKey(tk.hashes, tk.prompt_tokens, block_size, tk.exact)
            req = RouteRequest(tk.hashes, tk.prompt_tokens, block_size, None, tk.model, text_len)
            return KeyedRequest.single(space, sk, req, index.match(tk.hashes, now))

        t0 = perf()
        verdict = core.decide(Ask(key_tokens, "m"), now)
        t1 = perf()
        assert isinstance(verdict, Route), f"routed at light load, not {verdict!r}"
        placed = verdict.placement
        assert placed is not None
        in_flight.append((verdict.worker, placed))
        if len(in_flight) > 32:  # keep a realistic amount of load in flight
            fw, fp = in_flight.pop(0)
            pool.finish(fw, fp.own, True, fp.key.prompt_tokens)
        full.append(t1 - t0)
        keys.append(keyed_s)
        tokens += placed.key.prompt_tokens
        blocks += len(placed.key.hashes)
    for body in bodies[: min(len(bodies), 500)]:
        t0 = perf()
        text = plain.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        plain(text, add_special_tokens=False)["input_ids"]
        ref.append(perf() - t0)
    n = len(bodies)
    enc = keyer.encoder
    return {
        "workload": workload,
        "backend": enc.backend,
        "policy": policy_name,
        "requests": n,
        "workers": workers,
        "prompt_bytes_mean": sum(_size(b["messages"]) for b in bodies) / n,
        "prompt_tokens_mean": tokens / n,
        "blocks_mean": blocks / n,
        "index_nodes": index.stats().nodes,
        "routing": _pct(full),
        "keyer": _pct(keys),
        "transformers": _pct(ref),
        "piece_cache": {
            "piecewise": enc.piecewise is None,
            "hits": enc.hits,
            "misses": enc.misses,
            "bytes": enc.cost,
        },
    }


def _token_rows(args: argparse.Namespace) -> list[dict]:
    import tempfile

    if args.token_requests <= 0:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        source = args.tokenizer
        if not source:
            from radixfleet_tools.bench.tiny_tokenizer import build

            source = build(tmp)
        from radixfleet.engines.piece_encoder import BACKENDS
        from radixfleet.wire.errors import ConfigError

        backends = [b.strip() for b in args.tokenizer_backends.split(",") if b.strip()]
        for b in backends:
            if b not in BACKENDS[1:]:
                raise ConfigError(
                    "--tokenizer-backends", f"unknown backend {b!r} (expected {', '.join(BACKENDS[1:])})"
                )
        if not backends:
            from importlib.util import find_spec

            backends = ["fastokens", "tokenizers"] if find_spec("fastokens") else ["tokenizers"]
        rows = []
        for backend in backends:
            for workload in ("cold", "shared", "multiturn"):
                rng = random.Random(1)
                bodies = _token_bodies(args.token_requests, args.prompt_bytes, rng, workload)
                rows.append(
                    bench_tokens(
                        workload, bodies, args.workers, source, args.token_policy, args.block_size, backend
                    )
                )
        return rows


def _traced_rows(policies: list[str], bodies: list[dict], workers: int) -> list[dict]:
    """The rows with every request traced, exported to an OTLP sink process."""
    import asyncio
    import shutil
    import tempfile

    from radixfleet.common.tracing import Tracing
    from radixfleet_tools.bench.proxy import start_otlp_sink
    from radixfleet_tools.loadtest.local_fleet import stop_children

    log_dir = tempfile.mkdtemp(prefix="radixfleet-bench-routing-")
    sink, url = start_otlp_sink(log_dir)
    try:
        rows = []
        for p in policies:
            tracing = Tracing(service_name="bench", endpoint=url, sample_ratio=1.0, max_queue_spans=1 << 16)
            try:
                rows.append(bench_policy(p, bodies, workers, tracing))
            finally:
                asyncio.run(tracing.aclose(10.0))
        return rows
    finally:
        stop_children([sink])
        shutil.rmtree(log_dir, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    tune_gc()  # the collector's thresholds the router runs with (radixfleet.server.cli)
    rng = random.Random(0)
    bodies = _bodies(args.requests, args.prompt_bytes, rng)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.tracing:
        results = _traced_rows(policies, bodies, args.workers)
    else:
        results = [bench_policy(p, bodies, args.workers) for p in policies]
    token_rows = _token_rows(args)
    if args.json:
        print(
            json.dumps(
                {
                    "workers": args.workers,
                    "prompt_bytes": args.prompt_bytes,
                    "results": results,
                    "token_results": token_rows,
                },
                indent=2,
            )
        )
        return 0
    print(
        f"routing work per request: {args.prompt_bytes} B chat prompt, {args.workers} "
        f"workers, {args.requests} requests (target <= 50 us)"
    )
    for r in results:
        print(
            f"  {r['policy']:14s} key + route core mean {r['mean_us']:6.1f} us  "
            f"p50 {r['p50_us']:6.1f} us  p99 {r['p99_us']:6.1f} us  ({r['blocks_per_request']} blocks)"
        )
        if "trace_end" in r:
            te, sp = r["trace_end"], r["spans"]
            print(
                f"  {'':14s} traced; the trace's end (spans made, queued) p50 {te['p50_us']:6.1f} us "
                f"p99 {te['p99_us']:6.1f} us; spans {sp['exported']} exported, "
                f"{sp['dropped_queue_full']} dropped (queue full), {sp['dropped_export_failed']} failed"
            )
    if token_rows:
        tok = args.tokenizer or "the tiny test tokenizer"
        print(
            f"with exact token keys ({tok}, {args.block_size}-token blocks, "
            f"{args.token_policy}; target p50 <= 1 ms, p99 <= 3 ms):"
        )
        for r in token_rows:
            ro, ke, tr = r["routing"], r["keyer"], r["transformers"]
            print(
                f"  {r['backend']:10s} {r['workload']:9s} {r['prompt_bytes_mean']:6.0f} B "
                f"{r['prompt_tokens_mean']:5.0f} tok | routing p50 {ro['p50_us']:6.0f} us "
                f"p99 {ro['p99_us']:6.0f} us | keyer p50 {ke['p50_us']:6.0f} us "
                f"p99 {ke['p99_us']:6.0f} us | transformers p50 {tr['p50_us']:6.0f} us "
                f"p99 {tr['p99_us']:6.0f} us"
            )
    return 0
