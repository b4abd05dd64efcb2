"""``radixfleet analyze LOG...``: what the operator's own traffic says about cache size.

::

    radixfleet analyze traffic/                       # every *.jsonl in the directory
    radixfleet analyze traffic/*.jsonl --agent-model llama-3-70b --gpu h100 --tp 4 \\
        --agents 8 --concurrency 48 --plots knee/ --json knee.json
    radixfleet analyze trace.jsonl --policies round_robin,cache_aware,prefix_load

Reads traffic logs (``radixfleet.server.traffic_log``) or Mooncake traces
(``radixfleet_tools.loadtest.trace_format``: the same records ``simulate --trace`` replays) and
reports, in a table, PNG plots (``--plots``) and JSON (``--json``):

**The knee.** Hit rate (share of prompt tokens served from cache) against KV bytes
for one LRU radix cache of that size over the whole fleet (``pooled``: the
simulator's own reference cache, ``BlockReference``, run once per point) and for
an unbounded cache (``oracle``). Bytes are tokens x the model preset's KV bytes per
token (one copy) x ``token_ratio``, the engine's prompt tokens per router token
(``input_length / routed_tokens`` summed over a traffic log; 1 for a trace). The
*knee* is the point farthest above the chord from the curve's first point to its
last (Kneedle, on linear axes): past it each extra GB buys less than average.

**The budget line.** What one worker can give the cache: its KV capacity
(``CostModel.kv_capacity_tokens``: HBM x (1 - activation reserve) - weights, per
GPU) minus the running batch's working set at ``--concurrency`` requests of the
log's mean context (prompt + output tokens; an upper bound: it counts shared
prefixes once per request), times ``--agents``. The slope past the budget is the
hit rate the next ``budget`` bytes buy (pooled at 2 x budget - at budget), per GB;
when doubling the cache adds less than one point, the verdict says to stop buying
cache.

**The Zipf head.** Every block (chained hash) the log holds more than once, kept
most-requested first ("sort by frequency"; ties shallower first, so the kept set is
always whole prefixes): as blocks are kept, a request is *covered* once every block
it shares with any other request is kept, and a static cache of those blocks would
serve each block's requests after its first. For 50, 80 and 95% of requests: the
fewest blocks (and their KV bytes) that cover them, and how many distinct prefixes
those are (runs of blocks that start where the request count changes: a system
prompt is one prefix of many blocks). Requests that share nothing with any other
can never be covered; that share is printed. Conversation traffic has no small
head — each session reuses its own history — and the figures say so.

**Routing against capacity** (traffic logs that carry ``available_tokens``): over
the served requests that reported cached tokens, the prompt tokens not reused,
split by cause (``radixfleet.route.decisions``): the *capacity loss* (no eligible worker held
them: ``prompt - available``; more cache, or a new prefix), the *routing loss*
(another eligible worker held them and the request went elsewhere: ``available -
predicted``; the policy's trade against load) and the *prediction gap* (the chosen
worker was believed to hold them and did not: ``predicted - delivered``; negative
where the engine held more than the index knew). Each per request, available and
predicted capped at its prompt; the three and the delivered tokens add up to the
prompt tokens.

**The policy comparison** (``--policies a,b,c``): the log replayed through the
simulator (``radixfleet_tools.loadtest.simulator``), one run per policy, on ``--agents`` workers of
the preset with the budget's KV tokens each (``--kv-tokens`` to override), at the
log's own timestamps (``--time-scale``). Its time is the simulator's, not counted
in the analysis's own.

Figures are in router tokens (4 bytes each, the units replay runs in); the oracle
and pooled figures are exactly those ``simulate --trace`` reports for the same
file at the same fleet capacity (``tests/loadtest/test_analyze.py`` pins it).

Bad input — a truncated or corrupt line, a log of another version, no requests, a
preset that does not fit the GPU — is one line on stderr naming the file and line
or the flag, exit 2; ``--skip-bad-lines`` skips bad lines instead and counts them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixfleet.server.traffic_log import log_files
from radixfleet.wire.cli_args import DeprecatedAlias
from radixfleet.wire.errors import ConfigError, WorkloadError
from radixfleet_tools.agent.cost_model import ACTIVATION_RESERVE_FRACTION, GPUS, MODELS, CostModel
from radixfleet_tools.loadtest.report import check_outputs, require_plots
from radixfleet_tools.loadtest.simulator.reference import BlockReference
from radixfleet_tools.loadtest.trace_format import TRAFFIC_LOG, LineInfo, TraceData, read_trace

log = logging.getLogger(__name__)

SCHEMA = "radixfleet.analyze/1"
COVERAGE_SHARES = (0.5, 0.8, 0.95)
#: doubling the cache past the budget must add at least this much hit rate to be
#: worth buying ("if the slope is flat, stop buying cache")
FLAT_GAIN = 0.01


@dataclass(frozen=True, slots=True)
class Options:
    model: str = "llama-3-8b"
    gpu: str = "h100"
    tp: int = 1
    workers: int = 1
    concurrency: int = 32
    #: Mooncake traces: tokens per hash id (a traffic log carries its own)
    block_tokens: int = 512
    points: int = 8
    skip_bad: bool = False
    jobs: int = 1
    policies: tuple[str, ...] = ()
    kv_tokens: int | None = None
    time_scale: float = 1.0
    seed: int = 0

    def validate(self) -> CostModel:
        """The preset's cost model; raises ``ConfigError`` naming the flag."""
        if self.model not in MODELS:
            raise ConfigError(
                "--agent-model", f"unknown preset {self.model!r}; choose one of {', '.join(MODELS)}"
            )
        if self.gpu not in GPUS:
            raise ConfigError("--gpu", f"unknown preset {self.gpu!r}; choose one of {', '.join(GPUS)}")
        for flag, v in (
            ("--tp", self.tp),
            ("--agents", self.workers),
            ("--concurrency", self.concurrency),
            ("--block-tokens", self.block_tokens),
        ):
            if type(v) is not int or v < 1:
                raise ConfigError(flag, f"must be an integer >= 1, got {v!r}")
        if type(self.points) is not int or not 3 <= self.points <= 64:
            raise ConfigError("--points", f"must be an integer in [3, 64], got {self.points!r}")
        if self.kv_tokens is not None and (type(self.kv_tokens) is not int or self.kv_tokens < 1):
            raise ConfigError("--kv-tokens", f"must be a positive integer, got {self.kv_tokens!r}")
        if not self.time_scale > 0:
            raise ConfigError("--time-scale", f"must be > 0, got {self.time_scale}")
        return CostModel(self.model, self.gpu, tp=self.tp)


# ------------------------------------------------------------------ the figures


def _flatten(data: TraceData):
    """Per-position unit keys (int64) in dispatch order, record lengths, and each
    record's prompt tokens. A partial last block is keyed apart from the full block
    of the same id (as ``BlockReference`` keys it), so it only matches an identical
    partial block."""
    bt = data.block_tokens
    recs = data.records
    lengths = np.fromiter((len(r[3]) for r in recs), dtype=np.int64, count=len(recs))
    flat = np.fromiter((i for r in recs for i in r[3]), dtype=np.int64, count=int(lengths.sum()))
    prompt = np.fromiter((r[1] for r in recs), dtype=np.int64, count=len(recs))
    last = prompt - bt * (lengths - 1)
    ends = np.cumsum(lengths) - 1
    partial = np.nonzero(last < bt)[0]
    if len(partial):
        pos = ends[partial]
        # ids < 2**31 and last < 2**20: (last+1) << 31 | id is a key no full block has
        flat[pos] = ((last[partial] + 1) << 31) | flat[pos]
    return flat, lengths, prompt


def oracle_and_reuse(data: TraceData):
    """One vectorized pass: the oracle's cached tokens per record (blocks some
    earlier request held, leading run — ids are prefix-chained), the distinct units
    (the unbounded cache's size in blocks) and what the Zipf head needs."""
    bt = data.block_tokens
    flat, lengths, prompt = _flatten(data)
    n_rec = len(lengths)
    rec_of = np.repeat(np.arange(n_rec, dtype=np.int64), lengths)
    uniq, first, inv, counts = np.unique(flat, return_index=True, return_inverse=True, return_counts=True)
    seen = rec_of[first][inv] < rec_of
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    lead_seen = _leading_run(seen, starts, lengths, rec_of)
    oracle = np.where(lead_seen == lengths, prompt, lead_seen * bt)
    shared = counts[inv] >= 2
    lead_shared = _leading_run(shared, starts, lengths, rec_of)
    # reuse windows: positions between two accesses of a unit, an upper bound on the
    # distinct units (the LRU stack distance) between them; where the curve flattens
    by_unit = np.argsort(inv, kind="stable")
    again = inv[by_unit[1:]] == inv[by_unit[:-1]]
    windows = by_unit[1:][again] - by_unit[:-1][again]
    return {
        "oracle_tokens": oracle,
        "prompt_tokens": prompt,
        "distinct_units": len(uniq),
        "inv": inv,
        "starts": starts,
        "lengths": lengths,
        "lead_shared": lead_shared,
        "n_nodes": len(uniq),
        "counts": counts,
        "reuse_window_p95": float(np.quantile(windows, 0.95)) if len(windows) else 0.0,
    }


def _leading_run(
    flags: np.ndarray, starts: np.ndarray, lengths: np.ndarray, rec_of: np.ndarray
) -> np.ndarray:
    """Per record, how many of its positions from the first are all True."""
    bad = np.concatenate(([0], np.cumsum(~flags)))
    # positions whose record has no False up to and including them
    ok = (bad[1:] - bad[starts][rec_of]) == 0
    return np.bincount(rec_of, weights=ok, minlength=len(lengths)).astype(np.int64)


def zipf_head(
    reuse: dict, block_tokens: int, bytes_per_token: float, shares: Sequence[float] = COVERAGE_SHARES
) -> dict:
    """The Zipf head (module docstring): blocks kept most-requested first (ties:
    shallower first, so the kept set is always prefix-closed), and as they are kept,
    the requests *covered* (every block they share with another request is kept) and
    the prompt tokens a static cache of those blocks would serve (each block's
    requests after its first). Returns the blocks, bytes and distinct prefixes (runs
    of blocks that start where the request count changes) needed for each share of
    requests, and the curves for the plots."""
    inv, starts, depth = reuse["inv"], reuse["starts"], reuse["lead_shared"]
    counts, lengths = reuse["counts"], reuse["lengths"]
    n_rec = len(depth)
    n_nodes = reuse["n_nodes"]
    pos_depth = np.arange(len(inv), dtype=np.int64) - np.repeat(starts, lengths)
    node_depth = np.zeros(n_nodes, dtype=np.int64)
    node_depth[inv] = pos_depth
    node_parent = np.full(n_nodes, -1, dtype=np.int64)
    inner = np.nonzero(pos_depth > 0)[0]
    node_parent[inv[inner]] = inv[inner - 1]
    shared_nodes = np.nonzero(counts >= 2)[0]
    order = shared_nodes[np.lexsort((node_depth[shared_nodes], -counts[shared_nodes]))]
    rank = np.full(n_nodes, len(order), dtype=np.int64)
    rank[order] = np.arange(len(order), dtype=np.int64)
    # a request is covered once its deepest shared block is kept (its ancestors, more
    # requested or as much and shallower, are kept before it)
    has = depth > 0
    cover_rank = np.sort(rank[inv[starts[has] + depth[has] - 1]])
    # prefix heads: kept blocks whose parent is the root or serves more requests
    par = node_parent[order]
    head = (par < 0) | (counts[np.maximum(par, 0)] != counts[order])
    cum_heads = np.cumsum(head)
    tokens_total = float(reuse["prompt_tokens"].sum())
    cum_static = (
        np.cumsum((counts[order] - 1) * block_tokens) / tokens_total if tokens_total else np.zeros(len(order))
    )
    cover: list[dict[str, float | None]] = []
    for s in shares:
        need = int(math.ceil(s * n_rec - 1e-9))
        if need <= len(cover_rank) and need > 0:
            k = int(cover_rank[need - 1]) + 1  # blocks kept
            cover.append(
                {
                    "share": s,
                    "blocks": k,
                    "prefixes": int(cum_heads[k - 1]),
                    "kv_tokens": k * block_tokens,
                    "kv_bytes": k * block_tokens * bytes_per_token,
                }
            )
        else:
            cover.append({"share": s, "blocks": None, "prefixes": None, "kv_tokens": None, "kv_bytes": None})
    # curves, thinned to <= 400 points on a log scale of blocks kept
    if len(order):
        ks = np.unique(np.geomspace(1, len(order), num=min(400, len(order))).astype(np.int64))
        covered = np.searchsorted(cover_rank, ks, side="left") / n_rec
    else:
        ks, covered = np.array([], dtype=np.int64), np.array([])
    top = [
        {"requests": int(counts[order[i]]), "depth_blocks": int(node_depth[order[i]]) + 1}
        for i in np.nonzero(head)[0][:10]
    ]
    return {
        "requests": n_rec,
        "sharing_share": float(has.sum() / n_rec) if n_rec else 0.0,
        "shared_blocks": int(len(order)),
        "prefixes": int(cum_heads[-1]) if len(order) else 0,
        "top_prefixes": top,
        "static_hit_rate": float(cum_static[-1]) if len(order) else 0.0,
        "coverage": cover,
        "curve": {
            "blocks": [int(k) for k in ks],
            "kv_bytes": [float(k * block_tokens * bytes_per_token) for k in ks],
            "requests_share": [float(c) for c in covered],
            "static_hit_rate": [float(cum_static[k - 1]) for k in ks],
        },
    }


# pooled LRU passes (one per capacity), optionally in forked processes

_SHARED: tuple | None = None


def _pooled_pass(cap_tokens: int) -> tuple[int, int]:
    """(pooled cached tokens, prompt tokens) of one LRU cache of ``cap_tokens``."""
    assert _SHARED is not None, "set by pooled_curve()"
    records, bt = _SHARED
    ref = BlockReference(cap_tokens, bt, oracle=False)
    observe = ref.observe
    cached = total = 0
    for _, n_in, _, ids in records:
        p, _, c = observe(ids, n_in, n_in - bt * (len(ids) - 1))
        cached += c
        total += p
    return cached, total


def pooled_curve(data: TraceData, capacities: Sequence[int], jobs: int) -> dict[int, float]:
    """Pooled hit rate at each capacity (tokens), in ``jobs`` processes."""
    global _SHARED
    _SHARED = (data.records, data.block_tokens)
    out: dict[int, float] = {}
    try:
        caps = list(dict.fromkeys(capacities))
        jobs = min(jobs, len(caps))
        if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            for c in caps:
                got, total = _pooled_pass(c)
                out[c] = got / total if total else 0.0
        else:
            ctx = multiprocessing.get_context("fork")
            with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
                # the largest first: the slowest passes start earliest
                for c, (got, total) in zip(
                    sorted(caps, reverse=True), pool.map(_pooled_pass, sorted(caps, reverse=True))
                ):
                    out[c] = got / total if total else 0.0
    finally:
        _SHARED = None
    return out


def find_knee(xs: Sequence[float], ys: Sequence[float]) -> int:
    """Kneedle on linear axes: the index of the point farthest above the chord from
    the first point to the last (0 when the curve is flat or has < 3 points)."""
    n = len(xs)
    if n < 3 or xs[-1] == xs[0] or ys[-1] == ys[0]:
        return 0
    best, k = -math.inf, 0
    for i in range(n):
        xn = (xs[i] - xs[0]) / (xs[-1] - xs[0])
        yn = (ys[i] - ys[0]) / (ys[-1] - ys[0])
        if yn - xn > best:
            best, k = yn - xn, i
    return k


def budget(cost: CostModel, workers: int, concurrency: int, mean_context_tokens: float) -> dict:
    """Per worker and fleet cache budget (module docstring). Raises ``ConfigError``
    when the weights do not fit, or the running batch alone fills the KV."""
    m = cost.model
    cap = cost.kv_capacity_tokens()  # ConfigError("tp", ...) when the weights do not fit
    working = int(math.ceil(concurrency * mean_context_tokens))
    if working >= cap:
        raise ConfigError(
            "--concurrency",
            f"{concurrency} running requests of "
            f"{mean_context_tokens:,.0f} tokens ({working:,} KV tokens) fill "
            f"{m.name} on {cost.tp} x {cost.gpu.name} ({cap:,} KV tokens): "
            "lower --concurrency or raise --tp",
        )
    per_token = m.kv_bytes_per_token
    cache_tokens = cap - working
    return {
        "hbm_bytes": cost.gpu.hbm_bytes * cost.tp,
        "activation_reserve_bytes": cost.gpu.hbm_bytes * cost.tp * ACTIVATION_RESERVE_FRACTION,
        "weights_bytes": m.weight_bytes,
        "kv_capacity_tokens": cap,
        "concurrency": concurrency,
        "mean_context_tokens": mean_context_tokens,
        "working_set_tokens": working,
        "working_set_bytes": working * per_token,
        "per_worker_tokens": cache_tokens,
        "per_worker_bytes": cache_tokens * per_token,
        "workers": workers,
        "fleet_tokens": cache_tokens * workers,
        "fleet_bytes": cache_tokens * workers * per_token,
    }


def routing_losses(served: Sequence[LineInfo]) -> dict | None:
    """The prompt tokens of ``served`` lines not reused, split into capacity loss,
    routing loss and prediction gap (module docstring), over the lines that carry
    ``available_tokens`` and ``cached_tokens``; None when none does (a log of an
    earlier version, or engines that report no cached tokens)."""
    prompt = available = predicted = delivered = n = 0
    for i in served:
        if i.available_tokens is None or i.cached_tokens is None:
            continue
        p = i.input_length
        a = min(i.available_tokens, p)
        m = min(i.matched_tokens, a)
        prompt += p
        available += a
        predicted += m
        delivered += i.cached_tokens
        n += 1
    if not n:
        return None

    def share(x: int) -> float:
        return x / prompt if prompt else 0.0

    return {
        "requests": n,
        "prompt_tokens": prompt,
        "available_tokens": available,
        "predicted_tokens": predicted,
        "delivered_tokens": delivered,
        "capacity_loss_tokens": prompt - available,
        "routing_loss_tokens": available - predicted,
        "prediction_gap_tokens": predicted - delivered,
        "capacity_loss_share": share(prompt - available),
        "routing_loss_share": share(available - predicted),
        "prediction_gap_share": share(predicted - delivered),
        "delivered_share": share(delivered),
        "captured_share": predicted / available if available else None,
    }


def analyze(paths: Sequence[str], opts: Options) -> dict:
    """The whole analysis of ``paths`` (files, in order) as a JSON-able dict.
    Raises ``WorkloadError`` / ``ConfigError`` for bad input (module docstring)."""
    cost = opts.validate()
    timing: dict[str, float] = {}
    t = time.perf_counter()
    if not paths:
        raise WorkloadError("no log files given (a directory holds none?)")
    data = read_trace(paths, opts.block_tokens, skip_bad=opts.skip_bad, keep_info=True)
    if not data.records:
        where = ", ".join(paths[:3]) + (" ..." if len(paths) > 3 else "")
        raise WorkloadError(
            f"{where}: no requests" + (f" ({len(data.skipped)} bad lines skipped)" if data.skipped else "")
        )
    timing["read"] = time.perf_counter() - t
    bt = data.block_tokens
    recs = data.records
    n = len(recs)

    t = time.perf_counter()
    reuse = oracle_and_reuse(data)
    routed = int(reuse["prompt_tokens"].sum())
    oracle_hit = float(reuse["oracle_tokens"].sum() / routed) if routed else 0.0
    info = data.info
    if data.kind == TRAFFIC_LOG and info:
        engine_prompt = sum(i.input_length for i in info)
        ratio = engine_prompt / routed if routed else 1.0
        # shed and failed lines are offered load (replayed above) but were served by
        # no worker: the observed figures are the served requests' (a broken stream
        # was served, partly: its 200 stays in)
        served = [i for i in info if i.status < 400]
        served_prompt = sum(i.input_length for i in served)
        with_cached = [i for i in served if i.cached_tokens is not None]
        observed = {
            "hit_rate": (
                sum(i.cached_tokens or 0 for i in with_cached) / sum(i.input_length for i in with_cached)
            )
            if with_cached
            else None,
            "requests_reporting_cached": len(with_cached),
            "router_matched_share": sum(i.matched_tokens for i in served) / served_prompt
            if served_prompt
            else 0.0,
            "shed_requests": sum(1 for i in info if not i.worker and i.status == 429),
            "failed_requests": sum(1 for i in info if i.worker and i.status >= 400),
            "broken_requests": sum(1 for i in info if i.broken),
            "routing": routing_losses(served),
        }
        rates = sorted({i.sample_rate for i in info})
        tenants = len({i.tenant for i in info})
        models = sorted({i.model for i in info})
    else:
        engine_prompt, ratio, observed, rates, tenants, models = routed, 1.0, None, [1.0], None, []
    per_token = cost.model.kv_bytes_per_token * ratio  # KV bytes per router token
    out_tokens = sum(r[2] for r in recs)
    mean_context = (engine_prompt + out_tokens * 1.0) / n
    bud = budget(cost, opts.workers, opts.concurrency, mean_context)
    timing["oracle_zipf"] = time.perf_counter() - t

    t = time.perf_counter()
    units = reuse["distinct_units"]
    top = units * bt  # the unbounded cache's size: pooled == oracle from here on
    # the grid: from 1/256 of hi to hi, twice the 95th-percentile reuse window (in
    # units accessed, an overestimate of the distinct units between): where the curve
    # has flattened; the unbounded size closes it without a pass
    hi = min(top, max(bt, 2 * int(reuse["reuse_window_p95"]) * bt))
    lo = max(bt, hi // 256)
    grid = {int(round(x / bt)) * bt for x in np.geomspace(lo, hi, opts.points)}
    budget_tokens = max(bt, int(bud["fleet_tokens"] / ratio))
    caps = sorted(c for c in grid | {budget_tokens, 2 * budget_tokens} if c < top)
    pooled = pooled_curve(data, caps, opts.jobs)
    for c in (top, budget_tokens, 2 * budget_tokens):
        if c >= top:  # a cache that holds every block ever seen is the oracle
            pooled[c] = oracle_hit
    curve = sorted(pooled.items())
    xs = [c * per_token for c, _ in curve]
    ys = [h for _, h in curve]
    # the knee within the measured span: the unbounded size, far past it, would
    # make every point before the plateau look like a knee
    span = [i for i, (c, _) in enumerate(curve) if c <= hi] or list(range(len(curve)))
    k = span[find_knee([xs[i] for i in span], [ys[i] for i in span])]
    timing["knee"] = time.perf_counter() - t

    t = time.perf_counter()
    head = zipf_head(reuse, bt, per_token)
    timing["oracle_zipf"] += time.perf_counter() - t

    at_b, at_2b = pooled[budget_tokens], pooled[2 * budget_tokens]
    gb = budget_tokens * per_token / 1e9
    gain = at_2b - at_b
    if budget_tokens >= top:
        verdict = "the budget holds the whole working set: pooled = oracle; more cache buys nothing"
    elif gain < FLAT_GAIN:
        verdict = (
            f"flat: doubling the cache past the budget adds {gain * 100:.2f} points "
            "of hit rate: stop buying cache"
        )
    else:
        verdict = f"rising: doubling the cache past the budget adds {gain * 100:.1f} points of hit rate"
    span_s = (recs[-1][0] - recs[0][0]) / 1000.0
    res = {
        "schema": SCHEMA,
        "inputs": {
            "files": list(paths),
            "format": data.kind,
            "requests": n,
            "skipped_lines": len(data.skipped),
            "first_skipped": ([f"{p}:{ln}" for p, ln in data.skipped[:5]]),
            "span_s": span_s,
            "block_tokens": bt,
            "sample_rates": rates,
            "tenants": tenants,
            "models": models,
        },
        "tokens": {
            "prompt_tokens": routed,
            "engine_prompt_tokens": engine_prompt,
            "token_ratio": ratio,
            "output_tokens": out_tokens,
            "distinct_blocks": units,
            "working_set_tokens": top,
            "working_set_bytes": top * per_token,
        },
        "observed": observed,
        "model": {
            "model": opts.model,
            "gpu": opts.gpu,
            "tp": opts.tp,
            "kv_bytes_per_token": cost.model.kv_bytes_per_token,
        },
        "budget": bud,
        "oracle_hit_rate": oracle_hit,
        "knee_curve": [{"kv_tokens": c, "kv_bytes": c * per_token, "hit_rate": h} for c, h in curve],
        "knee": {"kv_tokens": curve[k][0], "kv_bytes": xs[k], "hit_rate": ys[k]},
        "at_budget": {"kv_tokens": budget_tokens, "kv_bytes": budget_tokens * per_token, "hit_rate": at_b},
        "at_2x_budget": {
            "kv_tokens": 2 * budget_tokens,
            "kv_bytes": 2 * budget_tokens * per_token,
            "hit_rate": at_2b,
        },
        "slope_past_budget": {
            "points_per_gb": gain * 100 / gb if gb else 0.0,
            "gain_doubling": gain,
            "verdict": verdict,
        },
        "zipf_head": head,
        "timing_s": timing,
    }
    if opts.policies:
        t = time.perf_counter()
        res["policies"] = replay(data, opts, bud, ratio, paths)
        timing["replay"] = time.perf_counter() - t
    return res


def replay(data: TraceData, opts: Options, bud: dict, ratio: float, paths) -> list[dict]:
    """The log through the simulator, one run per policy (module docstring)."""
    from radixfleet.policies.registry import policy_names
    from radixfleet_tools.loadtest.arrivals import Bounds, TraceTimes
    from radixfleet_tools.loadtest.simulator.cli import simulate
    from radixfleet_tools.loadtest.simulator.engine import EngineSpec
    from radixfleet_tools.loadtest.simulator.simulation import SimConfig
    from radixfleet_tools.loadtest.simulator.sweep import plan_runs
    from radixfleet_tools.loadtest.workloads import Trace

    for p in opts.policies:
        if p not in policy_names():
            raise ConfigError("--policies", f"{p!r} is not one of {', '.join(policy_names())}")
    kv = opts.kv_tokens or max(1, int(bud["per_worker_tokens"] / ratio))
    trace = Trace.from_records(
        data.records,
        block_tokens=data.block_tokens,
        path=",".join(paths),
        time_scale=opts.time_scale,
        seed=opts.seed,
    )
    engine = EngineSpec(model=opts.model, gpu=opts.gpu, tp=opts.tp, kv_tokens=kv)
    base = SimConfig(workers=opts.workers, engine=engine, level="block")
    base.validate()
    plans = plan_runs(base, list(opts.policies), ["events"], TraceTimes(), None)
    outs = simulate(plans, trace, Bounds(None, None, 600.0), {}, seed=opts.seed, jobs=opts.jobs)
    return [o.report for o in outs]


# ------------------------------------------------------------------ output


def _gb(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / 1e9:,.2f} GB" if b >= 1e8 else f"{b / 1e6:,.1f} MB"


def print_report(res: dict, file=None) -> None:
    """The rich tables and the verdict."""
    from rich.table import Table

    from radixfleet_tools.loadtest.report import print_table

    out = file or sys.stdout
    inp, tok, bud = res["inputs"], res["tokens"], res["budget"]
    m = res["model"]
    t = Table(title="radixfleet analyze: the cache-size knee", show_header=True)
    t.add_column("figure", no_wrap=True)
    t.add_column("value", justify="right", no_wrap=True)
    t.add_column("what it is", no_wrap=False)
    t.add_row(
        "requests",
        f"{inp['requests']:,}",
        f"{inp['format'].replace('_', ' ')}, {inp['span_s']:,.0f} s, "
        f"{len(inp['files'])} file(s)"
        + (f", {inp['skipped_lines']} bad lines skipped" if inp["skipped_lines"] else ""),
    )
    t.add_row(
        "working set",
        _gb(tok["working_set_bytes"]),
        f"{tok['distinct_blocks']:,} distinct blocks of {inp['block_tokens']} tokens "
        f"({m['model']}, {m['kv_bytes_per_token']:,} B/token, token ratio "
        f"{tok['token_ratio']:.2f})",
    )
    obs = res.get("observed")
    if obs and obs["hit_rate"] is not None:
        t.add_row(
            "observed hit",
            f"{obs['hit_rate']:.3f}",
            "cached tokens the workers reported, over prompt tokens (live)",
        )
    rl = obs.get("routing") if obs else None
    if rl:
        t.add_row(
            "capacity loss",
            f"{rl['capacity_loss_share']:.3f}",
            "share of prompt tokens no eligible worker held (the prefix was nowhere: cache size, "
            "new prefixes)",
        )
        t.add_row(
            "routing loss",
            f"{rl['routing_loss_share']:.3f}",
            "share of prompt tokens another eligible worker held while the request went elsewhere "
            "(the policy's trade against load)",
        )
        t.add_row(
            "prediction gap",
            f"{rl['prediction_gap_share']:.3f}",
            "share of prompt tokens the chosen worker was believed to hold and did not report cached "
            "(negative: it held more than the index knew)",
        )
    if obs and obs["shed_requests"]:
        t.add_row(
            "shed",
            f"{obs['shed_requests']:,}",
            "requests the router answered 429 (every worker saturated); replayed as offered load",
        )
    if obs and obs.get("failed_requests"):
        t.add_row(
            "failed",
            f"{obs['failed_requests']:,}",
            "requests answered with an error status (a worker's, or the router's when every "
            "attempt failed); replayed as offered load",
        )
    if obs and obs.get("broken_requests"):
        t.add_row(
            "broken",
            f"{obs['broken_requests']:,}",
            "streams a worker broke off after the client had its 200 (answer incomplete)",
        )
    t.add_row(
        "oracle",
        f"{res['oracle_hit_rate']:.3f}",
        "hit rate of one unbounded cache (every earlier prompt kept)",
    )
    kn = res["knee"]
    t.add_row(
        "knee",
        f"{_gb(kn['kv_bytes'])}",
        f"pooled hit {kn['hit_rate']:.3f}: past here each GB buys less than average",
    )
    t.add_row(
        "budget / worker",
        _gb(bud["per_worker_bytes"]),
        f"{m['gpu']} x{m['tp']} HBM {_gb(bud['hbm_bytes'])} - reserve "
        f"{_gb(bud['activation_reserve_bytes'])} - weights {_gb(bud['weights_bytes'])} - "
        f"batch {bud['concurrency']} x {bud['mean_context_tokens']:,.0f} tokens "
        f"({_gb(bud['working_set_bytes'])})",
    )
    ab, a2 = res["at_budget"], res["at_2x_budget"]
    t.add_row(
        "pooled @ budget",
        f"{ab['hit_rate']:.3f}",
        f"{bud['workers']} worker(s): one LRU cache of {_gb(ab['kv_bytes'])}",
    )
    t.add_row("pooled @ 2x", f"{a2['hit_rate']:.3f}", f"{_gb(a2['kv_bytes'])}")
    sl = res["slope_past_budget"]
    t.add_row("slope past budget", f"{sl['points_per_gb']:.3f}", "hit-rate points per GB: " + sl["verdict"])
    z = res["zipf_head"]
    t.add_row(
        "sharing requests",
        f"{z['sharing_share']:.3f}",
        "share of requests that share a prefix with any other",
    )
    for c in z["coverage"]:
        pct = f"{c['share'] * 100:.0f}%"
        if c["prefixes"] is None:
            t.add_row(
                f"Zipf head {pct}", "-", f"{pct} of requests: never covered (fewer than that share anything)"
            )
        else:
            t.add_row(
                f"Zipf head {pct}",
                f"{c['prefixes']:,}",
                f"fewest prefixes covering {pct} of requests: {c['blocks']:,} blocks, {_gb(c['kv_bytes'])}",
            )
    print_table(t, out, [], legend=None)
    curve = Table(title="knee curve (pooled LRU)")
    for col in ("KV", "tokens", "pooled hit", "of oracle"):
        curve.add_column(col, justify="right")
    for p in res["knee_curve"]:
        mark = (
            " <- knee"
            if p["kv_tokens"] == kn["kv_tokens"]
            else (" <- budget" if p["kv_tokens"] == ab["kv_tokens"] else "")
        )
        curve.add_row(
            _gb(p["kv_bytes"]) + mark,
            f"{p['kv_tokens']:,}",
            f"{p['hit_rate']:.3f}",
            f"{p['hit_rate'] / res['oracle_hit_rate']:.0%}" if res["oracle_hit_rate"] else "-",
        )
    print_table(
        curve,
        out,
        [],
        legend=(
            "pooled hit: share of prompt tokens one LRU cache of that size serves (no routing, "
            "no copies); of oracle: that share over the unbounded cache's."
        ),
    )
    if res.get("policies"):
        from radixfleet_tools.loadtest.simulator.cli import _print_table

        _print_table(res["policies"])
        for r in res["policies"]:
            if r["errors"]:
                kinds = ", ".join(f"{k}: {v}" for k, v in r["errors_by_kind"].items())
                print(
                    f"replay {r['name']}: {r['errors']} of {r['requests']} requests failed "
                    f"({kinds}; http_400: prompt + output exceed a worker's "
                    f"{r['sim']['kv_tokens_per_worker']:,} KV tokens); the replay's figures, "
                    "oracle and pooled too, cover the ok requests",
                    file=out,
                )


def write_plots(res: dict, out_dir: str) -> list[str]:
    """knee.png, zipf_head.png and (with --policies) policies.png."""
    require_plots()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    curve = res["knee_curve"]
    xs = [p["kv_bytes"] / 1e9 for p in curve]
    ys = [p["hit_rate"] for p in curve]
    oracle = res["oracle_hit_rate"]
    y_top = min(1.0, max(ys + [oracle]) * 1.15 + 0.02)
    ab, a2, kn = res["at_budget"], res["at_2x_budget"], res["knee"]
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    ax.plot(xs, ys, "-o", color="tab:blue", ms=4, lw=2, label="pooled LRU (one cache of that size)")
    ax.axhline(oracle, color="tab:gray", ls="--", lw=1.2, label=f"oracle (unbounded) {oracle:.3f}")
    bx = ab["kv_bytes"] / 1e9
    ax.axvline(bx, color="tab:red", lw=1.5, label=f"budget {bx:,.1f} GB (HBM - weights - running batch)")
    ax.axvspan(bx, max(xs[-1], 2 * bx), color="tab:red", alpha=0.06)
    ax.plot(
        [bx, 2 * bx],
        [ab["hit_rate"], a2["hit_rate"]],
        color="tab:red",
        lw=2.2,
        label=f"past the budget: {res['slope_past_budget']['points_per_gb']:.2f} pt/GB",
    )
    ax.plot(
        [kn["kv_bytes"] / 1e9],
        [kn["hit_rate"]],
        marker="*",
        ms=16,
        color="tab:orange",
        ls="none",
        label=f"knee {kn['kv_bytes'] / 1e9:,.2f} GB, hit {kn['hit_rate']:.3f}",
    )
    ax.set_xscale("log")
    ax.set_xlabel("KV cache, GB (log scale)")
    ax.set_ylabel("hit rate (share of prompt tokens from cache)")
    m = res["model"]
    ax.set_title(
        f"Cache-size knee: {res['inputs']['requests']:,} requests, {m['model']} on "
        f"{res['budget']['workers']} x {m['gpu']}" + (f" x{m['tp']}" if m["tp"] > 1 else "")
    )
    ax.set_ylim(0, y_top)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="lower right", fontsize="small")
    ax.annotate(
        res["slope_past_budget"]["verdict"],
        xy=(0.01, 0.97),
        xycoords="axes fraction",
        va="top",
        fontsize="small",
        wrap=True,
    )
    paths.append(os.path.join(out_dir, "knee.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    z = res["zipf_head"]
    c = z["curve"]
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    gbs = [b / 1e9 for b in c["kv_bytes"]]
    if gbs:
        ax.plot(
            gbs,
            c["requests_share"],
            color="tab:green",
            lw=2.2,
            label="requests covered (all their shared blocks kept)",
        )
        ax.plot(
            gbs,
            c["static_hit_rate"],
            color="tab:purple",
            lw=1.8,
            ls="--",
            label="hit rate of a static cache of those blocks",
        )
    ax.plot(xs, ys, "o", color="tab:blue", ms=4, alpha=0.7, label="pooled LRU (the knee curve)")
    ax.axhline(
        z["sharing_share"],
        color="tab:gray",
        ls=":",
        lw=1.2,
        label=f"requests sharing any prefix: {z['sharing_share']:.0%}",
    )
    for cov in z["coverage"]:
        if cov["prefixes"] is None:
            continue
        x = cov["kv_bytes"] / 1e9
        ax.plot([x], [cov["share"]], "o", color="black", ms=6)
        ax.annotate(
            f"{cov['share']:.0%} of requests: {cov['prefixes']:,} prefixes, {_gb(cov['kv_bytes'])}",
            (x, cov["share"]),
            textcoords="offset points",
            xytext=(-8, 6),
            ha="right",
            fontsize="small",
        )
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.grid(True, which="both", alpha=0.25)
    ax.set_xlabel("KV of the most-requested blocks kept, GB (log scale)")
    ax.set_ylabel("share of requests (green) / of prompt tokens (purple, blue)")
    ax.set_title(f"Zipf head: {z['prefixes']:,} shared prefixes, most requested first")
    ax.legend(loc="upper left", fontsize="small")
    paths.append(os.path.join(out_dir, "zipf_head.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    runs = res.get("policies") or []
    if runs:
        fig, (h, l) = plt.subplots(1, 2, figsize=(11, 4.6))
        names = [r["name"] for r in runs]
        x = range(len(runs))
        h.bar(list(x), [r["hit_rate"] for r in runs], color="tab:blue", label="hit rate")
        h.axhline(runs[0]["oracle_hit_rate"], color="tab:gray", ls="--", label="oracle")
        if runs[0]["pooled_hit_rate"] is not None:
            h.axhline(runs[0]["pooled_hit_rate"], color="tab:red", ls=":", label="pooled")
        h.set_xticks(list(x), names)
        h.set_ylim(0, 1.05)
        h.set_ylabel("hit rate")
        h.set_title("Your traffic, replayed: hit rate")
        h.legend(fontsize="small")
        w = 0.38
        l.bar([i - w / 2 for i in x], [r["ttft_ms"]["p50"] or 0 for r in runs], w, label="p50")
        l.bar([i + w / 2 for i in x], [r["ttft_ms"]["p99"] or 0 for r in runs], w, label="p99")
        l.set_xticks(list(x), names)
        l.set_yscale("log")
        l.set_ylabel("TTFT, ms (simulated, log)")
        l.set_title("…and time to first token")
        l.legend(fontsize="small")
        paths.append(os.path.join(out_dir, "policies.png"))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


# ------------------------------------------------------------------ CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="traffic-log files or directories (their *.jsonl), or Mooncake traces",
    )
    parser.add_argument("--model", dest="model", action=DeprecatedAlias, use="--agent-model")
    parser.add_argument(
        "--agent-model",
        dest="model",
        default="llama-3-8b",
        help=f"model preset (default llama-3-8b; {', '.join(MODELS)})",
    )
    parser.add_argument("--gpu", default="h100", help=f"GPU preset ({', '.join(GPUS)})")
    parser.add_argument("--tp", type=int, default=1, help="GPUs per worker (tensor parallel)")
    parser.add_argument(
        "--agents", dest="workers", type=int, default=1, help="agents (workers) in the fleet (default 1)"
    )
    parser.add_argument("--workers", dest="workers", type=int, action=DeprecatedAlias, use="--agents")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="running requests per worker at the target load (default 32)",
    )
    parser.add_argument(
        "--block-tokens", type=int, default=512, help="Mooncake traces: tokens per hash id (default 512)"
    )
    parser.add_argument(
        "--points",
        type=int,
        default=8,
        help="points on the knee curve, besides budget and 2x budget (default 9)",
    )
    parser.add_argument(
        "--policies", default="", help="replay the log through the simulator with these policies (a,b,c)"
    )
    parser.add_argument("--kv-tokens", type=int, help="replay: KV tokens per worker (default: the budget's)")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="replay: timestamp multiplier (0.5 = twice as fast)"
    )
    parser.add_argument("--seed", type=int, default=0, help="replay: workload seed")
    parser.add_argument(
        "--skip-bad-lines",
        dest="skip_bad",
        action="store_true",
        help="skip (and count) bad lines instead of stopping at the first",
    )
    parser.add_argument(
        "--skip-bad", dest="skip_bad", action=DeprecatedAlias, nargs=0, use="--skip-bad-lines"
    )
    parser.add_argument(
        "--jobs", type=int, default=0, help="processes for the knee curve and the replay (0: one per CPU)"
    )
    parser.add_argument("--json", metavar="FILE", help="write the analysis here")
    parser.add_argument(
        "--plots", metavar="DIR", help="write knee.png, zipf_head.png (and policies.png) here"
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.jobs < 0:
        raise ConfigError("--jobs", f"must be >= 0 (0: one per CPU), got {args.jobs}")
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    opts = Options(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        workers=args.workers,
        concurrency=args.concurrency,
        block_tokens=args.block_tokens,
        points=args.points,
        skip_bad=args.skip_bad,
        jobs=args.jobs or (os.cpu_count() or 1),
        policies=policies,
        kv_tokens=args.kv_tokens,
        time_scale=args.time_scale,
        seed=args.seed,
    )
    opts.validate()
    for p in args.logs:
        if not os.path.exists(p):
            raise WorkloadError(f"{p}: no such file or directory")
    paths = log_files(args.logs)
    check_outputs(files=[("--json", args.json)], dirs=[("--plots", args.plots)])
    if args.plots:
        require_plots()
    res = analyze(paths, opts)
    print_report(res)
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        print(f"analysis: {args.json}")
    if args.plots:
        print("plots: " + ", ".join(write_plots(res, args.plots)))
    return 0


def options_from(**kw) -> Options:
    """``Options`` with keyword overrides (tests)."""
    return dataclasses.replace(Options(), **kw)
