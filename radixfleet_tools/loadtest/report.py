"""Run reports: one schema for the live load generator and the offline simulator.

``--json FILE`` writes ``{"schema": "radixfleet.report/1", "runs": [run, ...]}``;
each run is a flat JSON object (``RUN_FIELDS`` lists every key, ``validate()``
checks a document)::

    name             str    the target's / policy's name
    target           str    URL (or "simulated")
    workload         dict   {"name", "seed", "params"}
    requests         int    dispatched
    ok               int    answered successfully
    errors           int    failed (requests - ok)
    errors_by_kind   dict   kind -> count (radixfleet_tools.loadtest.client's kinds)
    prompt_tokens    int    sum over ok requests (the server's usage)
    cached_tokens    int    sum over ok requests (usage.prompt_tokens_details)
    output_tokens    int
    hit_rate         float  cached_tokens / prompt_tokens
    oracle_hit_rate  float  share of prompt tokens an unbounded single cache serves
    pooled_hit_rate  float|null  one LRU radix cache of the fleet's whole KV capacity
    kv_capacity_tokens int|null  that capacity
    ttft_ms, itl_ms, e2e_ms   {"p50", "p90", "p99", "mean"} (null when no samples)
    throughput       {"requests_per_s", "output_tokens_per_s"}
    duration_s       float  first dispatch to last answer
    workers          {worker: {"requests", "prompt_tokens", "cached_tokens",
                               "output_tokens"}}   (ok requests; "unknown" when the
                                                    target names no worker)
    load_imbalance   float|null  max / mean of per-worker prompt tokens
    workers_source   str    optional: "agent /metrics" when the target named no
                            worker and the table came from the agents' counters
    cold_start       bool|null  optional (live runs): True when every agent's cache was
                            flushed before the run, False when a flush failed and the
                            user allowed the run anyway (``--allow-warm``), null when
                            there were no agents to flush (the run may start warm)
    flush_failed     list   optional: the agents whose flush failed, with the cause
    floor_ttft_ms    {"p50", "p90", "p99", "mean"}  optional (simulate, --ab against
                            simulated agents): each ok request's TTFT alone on an idle
                            worker holding the oracle's cached prefix (``floor_ttft_ms``)
    stopped_by       str    optional: what ended dispatching: "exhausted" (the
                            workload ran out), "requests" or "duration" (a bound)
    workload_requests int|null  optional: requests the workload holds if every turn
                            succeeds
    started_unix_s   float  optional (live runs): the wall-clock time (UNIX seconds)
                            that ``--requests-out``'s ``send_s`` counts from, to align
                            a run with what else was sampled meanwhile
    cut              str|null  optional: a sentence when a bound (or failed turns)
                            cut the run short of the whole workload; null otherwise

Oracle and pooled rates are computed on the prompts *as sent*, in dispatch order,
over the load generator's own token count (``BYTES_PER_TOKEN``-byte chunks of the
canonical routing bytes, ``radixfleet.keys``), restricted to ok requests so all
three rates share a denominator's population. ``CacheReference`` does it per
request at dispatch time; like an engine, both references also cache each answer
(prompt + generated text) when it comes back, so "any earlier request" includes
the earlier turns' answers that a conversation's next prompt repeats.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from radixfleet.keys import Endpoint, routing_bytes
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.extras import require
from radixfleet_tools.loadtest.client import Result
from radixfleet_tools.loadtest.prefix_trie import PrefixTrie, as_tokens
from radixfleet_tools.loadtest.workloads import API_CHAT, RequestSpec

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress

SCHEMA = "radixfleet.report/1"

_STATS = ("p50", "p90", "p99", "mean")

RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "target": (str,),
    "workload": (dict,),
    "requests": (int,),
    "ok": (int,),
    "errors": (int,),
    "errors_by_kind": (dict,),
    "prompt_tokens": (int,),
    "cached_tokens": (int,),
    "output_tokens": (int,),
    "hit_rate": (float, int),
    "oracle_hit_rate": (float, int),
    "pooled_hit_rate": (float, int, type(None)),
    "kv_capacity_tokens": (int, type(None)),
    "ttft_ms": (dict,),
    "itl_ms": (dict,),
    "e2e_ms": (dict,),
    "throughput": (dict,),
    "duration_s": (float, int),
    "workers": (dict,),
    "load_imbalance": (float, int, type(None)),
}


class AgentLRU:
    """One LRU radix cache of ``capacity_tokens``: the agent's own ``RadixCache``.

    ``serve(data)`` has ``PrefixTrie.serve``'s contract (cached leading tokens, then
    cache it all and evict LRU leaves down to the capacity) on the agent's tokens
    (``radixfleet_tools.agent.tokenizer.encode``), so the pooled reference evicts exactly as
    one agent with the whole fleet's KV pool would (admission ``always``).
    """

    def __init__(self, capacity_tokens: int) -> None:
        from radixfleet_tools.agent.radix_cache import RadixCache
        from radixfleet_tools.agent.tokenizer import encode

        self._encode = encode
        self.capacity_tokens = capacity_tokens
        self.cache = RadixCache(capacity_tokens=capacity_tokens, record_events=False)

    def serve(self, data: bytes) -> int:
        tokens = self._encode(data)
        cached, _ = self.cache.match_prefix(None, tokens)
        self.cache.insert(None, tokens)
        over = self.cache.total_tokens - self.capacity_tokens
        if over > 0:
            self.cache.evict(over)
        return cached

    @property
    def tokens(self) -> int:
        return self.cache.total_tokens

    def check(self) -> None:
        self.cache.check()
        assert self.cache.total_tokens <= self.capacity_tokens, f"{self.cache.total_tokens=}"


class CacheReference:
    """The oracle (unbounded) and pooled (LRU, fleet capacity) caches of one run.

    ``observe(spec)`` returns ``(est_prompt_tokens, oracle_cached, pooled_cached)``
    for a prompt and then caches it in both; call it in dispatch order.
    ``observe_answer(spec, answer)`` caches prompt + answer when the answer is back,
    as an engine keeps the KV of the tokens it generated (so a conversation's next
    turn finds its last answer cached — in the fleet and in the references alike).
    """

    def __init__(self, kv_capacity_tokens: int | None, *, cache_outputs: bool = True) -> None:
        self.kv_capacity_tokens = kv_capacity_tokens
        self.cache_outputs = cache_outputs
        self.oracle = PrefixTrie()
        self.pooled = AgentLRU(kv_capacity_tokens) if kv_capacity_tokens else None

    def observe(self, spec: RequestSpec) -> tuple[int, int, int]:
        data = prompt_bytes(spec)
        pooled = self.pooled.serve(data) if self.pooled is not None else 0
        data = as_tokens(data)
        oracle = self.oracle.serve(data)
        return len(data) // 4, oracle, pooled

    def observe_answer(self, spec: RequestSpec, answer: str) -> None:
        data = prompt_bytes(spec)
        if not self.cache_outputs or not answer or len(data) % 4:
            return  # an unaligned prompt does not tokenize prefix-stably with its answer
        data += answer.encode("utf-8", "surrogatepass")
        self.oracle.serve(as_tokens(data))
        if self.pooled is not None:
            self.pooled.serve(data)

    def check(self) -> None:
        self.oracle.check()
        if self.pooled is not None:
            self.pooled.check()


def prompt_bytes(spec: RequestSpec) -> bytes:
    """The canonical bytes the fleet tokenizes for this spec (contract 1, docs/DESIGN.md)."""
    endpoint = Endpoint.CHAT if spec.api == API_CHAT else Endpoint.COMPLETIONS
    return routing_bytes(endpoint, spec.body)


def percentile(xs: Sequence[float], q: float, *, presorted: bool = False) -> float | None:
    """The nearest-rank ``q``-quantile of ``xs`` (0 < q <= 1; ``presorted``: ``xs``
    is ascending already); None when empty. The one percentile of the reports, the
    benchmarks and the tests."""
    n = len(xs)
    if not n:
        return None
    s = xs if presorted else sorted(xs)
    return s[min(n - 1, max(0, math.ceil(q * n) - 1))]


def percentiles(
    xs: Sequence[float], scale: float = 1000.0, ps: Sequence[float] = (50, 90, 99)
) -> dict[str, float | None]:
    """The ``ps`` percentiles (nearest rank; keys ``p50``, ``p99.9``) and the mean of
    ``xs``, times ``scale``; nulls when empty. O(n log n)."""
    keys = [f"p{p:g}" for p in ps]
    if not xs:
        return {**{k: None for k in keys}, "mean": None}
    s = sorted(xs)
    out: dict[str, float | None] = {}
    for k, p in zip(keys, ps):
        v = percentile(s, p / 100.0, presorted=True)
        assert v is not None, "xs is not empty"
        out[k] = v * scale
    return {**out, "mean": sum(s) / len(s) * scale}


def spread(xs: Sequence[float]) -> dict[str, float]:
    """A benchmark's repeated figure: its median and the min..max over the runs.
    ``xs`` must not be empty."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(
    name: str,
    target: str,
    workload: dict,
    results: Iterable[Result],
    *,
    kv_capacity_tokens: int | None,
    duration_s: float | None = None,
    workers: dict[str, dict[str, int]] | None = None,
) -> dict:
    """One run's report entry from its per-request results.

    ``workers`` replaces the per-worker table built from the results' worker
    names — for targets that do not name the worker (the agents' own counters).
    """
    override = workers
    results = list(results)
    ok = [r for r in results if r.ok]
    errors = Counter(r.error_kind or "unknown" for r in results if not r.ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    est = sum(r.est_prompt_tokens for r in ok)
    table: dict[str, dict[str, int]] = {}
    for r in ok:
        w = table.setdefault(
            r.worker or "unknown", {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
        )
        w["requests"] += 1
        w["prompt_tokens"] += r.prompt_tokens
        w["cached_tokens"] += r.cached_tokens
        w["output_tokens"] += r.output_tokens
    if override:
        table = override
    imbalance = None
    if table and "unknown" not in table:
        loads = [w["prompt_tokens"] for w in table.values()]
        mean = sum(loads) / len(loads)
        imbalance = max(loads) / mean if mean else None
    if duration_s is None:
        if ok:
            t0 = min(r.start for r in results)
            t1 = max(r.start + (r.e2e_s or 0.0) for r in ok)
            duration_s = max(t1 - t0, 1e-9)
        else:
            duration_s = 0.0
    itl = [x for r in ok for x in r.itl_s]
    out = {
        "name": name,
        "target": target,
        "workload": workload,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "errors_by_kind": dict(sorted(errors.items())),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": out_tok,
        "hit_rate": cached / prompt if prompt else 0.0,
        "oracle_hit_rate": sum(r.oracle_cached for r in ok) / est if est else 0.0,
        "pooled_hit_rate": (sum(r.pooled_cached for r in ok) / est if est else 0.0)
        if kv_capacity_tokens
        else None,
        "kv_capacity_tokens": kv_capacity_tokens,
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "throughput": {
            "requests_per_s": len(ok) / duration_s if duration_s else 0.0,
            "output_tokens_per_s": out_tok / duration_s if duration_s else 0.0,
        },
        "duration_s": duration_s,
        "workers": dict(sorted(table.items())),
        "load_imbalance": imbalance,
    }
    sent = [r for r in results if r.prefetch_status is not None]
    if sent:  # POST /v1/prefetch at retrieval time (loadtest --prefetch on)
        out["prefetch"] = {
            "sent": len(sent),
            "accepted": sum(r.prefetch_status == 202 for r in sent),
            # None: the router said for none of them (a client without a tenant)
            "deduplicated": (
                sum(r.prefetch_dedup is True for r in sent)
                if any(r.prefetch_dedup is not None for r in sent)
                else None
            ),
            "refused": sum(r.prefetch_status == 429 for r in sent),
        }
    return out


def mark_bounds(report: dict, bounds, stopped_by: str, dispatched: int, total: int | None) -> None:
    """Adds ``stopped_by``, ``workload_requests`` and ``cut`` (a sentence, or None when
    the workload ran whole) to a run's report. ``bounds``: ``radixfleet_tools.loadtest.arrivals.Bounds``."""
    report["stopped_by"] = stopped_by
    report["workload_requests"] = total
    report["cut"] = bounds.cut_note(stopped_by, dispatched, total)


def validate(doc: Any) -> None:
    """Raises ``ValueError`` naming the first field that breaks the schema."""
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ValueError("report must be an object with a 'runs' list")
    for i, run in enumerate(doc["runs"]):
        where = f"runs[{i}]"
        if not isinstance(run, dict):
            raise ValueError(f"{where} must be an object")
        for key, types in RUN_FIELDS.items():
            if key not in run:
                raise ValueError(f"{where}.{key} is missing")
            v = run[key]
            if isinstance(v, bool) or not isinstance(v, types):
                raise ValueError(f"{where}.{key} has type {type(v).__name__}")
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            for s in _STATS:
                v = run[key].get(s, "missing")
                if v is not None and not isinstance(v, (int, float)):
                    raise ValueError(f"{where}.{key}.{s} must be a number or null")
        for s in ("requests_per_s", "output_tokens_per_s"):
            if not isinstance(run["throughput"].get(s), (int, float)):
                raise ValueError(f"{where}.throughput.{s} must be a number")
        for w, v in run["workers"].items():
            for s in ("requests", "prompt_tokens", "cached_tokens", "output_tokens"):
                if not isinstance(v.get(s), int):
                    raise ValueError(f"{where}.workers.{w}.{s} must be an integer")
        for key in ("hit_rate", "oracle_hit_rate", "pooled_hit_rate"):
            v = run[key]
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"{where}.{key} must be in [0, 1], got {v}")
        if run["ok"] + run["errors"] != run["requests"]:
            raise ValueError(f"{where}: ok + errors != requests")


def write_json(path: str, runs: list[dict]) -> None:
    doc = {"schema": SCHEMA, "runs": runs}
    validate(doc)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def require_plots() -> None:
    """PNG plots need the plots extra (matplotlib): MissingExtra, one line naming it.
    Commands call it before a run that will write plots, not after."""
    require("matplotlib", "plots", "PNG plots")


def check_outputs(
    *, files: Sequence[tuple[str, str | None]] = (), dirs: Sequence[tuple[str, str | None]] = ()
) -> None:
    """Raises ``ConfigError`` (naming the flag) unless every ``(flag, path)`` in
    ``files`` can be written as a file and every one in ``dirs`` can hold new files.
    None paths are skipped. Missing folders are created (as the writers do).

    Called before a run starts, so that a bad ``--json`` or ``--plots`` fails at once
    with exit 2 instead of with a traceback after minutes of results. Writes nothing
    that stays: a probe file is removed, an existing report is not truncated."""
    for flag, path in files:
        if path is None:
            continue
        if os.path.isdir(path):
            raise ConfigError(flag, f"{path} is a directory; give a file name")
        existed = os.path.exists(path)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise ConfigError(flag, f"cannot write {path}: {exc.strerror or exc}") from None
        if not existed:
            os.unlink(path)
    for flag, path in dirs:
        if path is None:
            continue
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            raise ConfigError(flag, f"cannot write into {path}: {exc.strerror or exc}") from None


def load_json(path: str) -> list[dict]:
    """Reads and validates a report file; returns its runs. Raises ``ValueError``."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    validate(doc)
    return doc["runs"]


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


#: what the table's reference columns mean, printed under every comparison table
LEGEND = (
    "hit: share of prompt tokens the workers served from cache.  "
    "oracle: the share one unbounded cache would serve (every earlier prompt kept).  "
    "pooled: the share one LRU cache of the whole fleet's KV capacity would serve "
    "(no routing, no copies).  "
    "imbalance: the busiest worker's prompt tokens over the mean (1.00 = even)."
)

#: the floor columns' legend line (runs whose report has ``floor_ttft_ms``)
FLOOR_LEGEND = (
    "floor: each request's TTFT alone on an idle worker holding every prompt token the oracle "
    "holds (the cost model's prefill of the rest in one pass): no policy can beat it; TTFT "
    "over floor is how far above the physical floor a policy runs."
)


def floor_ttft_ms(cost, results: Iterable[Result]) -> dict[str, float | None]:
    """``floor_ttft_ms`` of a run against simulated agents of cost model ``cost``
    (``radixfleet_tools.agent.cost_model.CostModel``): the percentiles, over the ok requests,
    of each one's prompt prefilled in one pass on an idle agent holding what the
    oracle holds (``CostModel.floor_ttft_s``). The network is not counted."""
    return percentiles(
        [
            cost.floor_ttft_s(r.est_prompt_tokens, r.oracle_cached)
            for r in results
            if r.ok and r.ttft_s is not None
        ]
    )


def print_table(table, file=None, notes: Sequence[str] = (), legend: str | None = LEGEND) -> None:
    """Prints a rich table as wide as its content needs (never cutting a cell to a
    fixed terminal width), then ``notes`` and ``legend`` (None: none), wrapped to
    the table."""
    from rich.console import Console

    out = file or sys.stdout
    probe = Console(file=out, width=100_000)
    width = max(100, probe.measure(table).maximum)
    console = Console(file=out, width=width)
    console.print(table)
    for n in notes:
        console.print(n, highlight=False, markup=False)
    if legend:
        console.print(legend, highlight=False, markup=False)
    if any(n.startswith("* ") for n in notes):
        console.print(
            "*: the run did not send the whole workload (the note above says why).",
            highlight=False,
            markup=False,
        )


def ok_cell(r: dict) -> str:
    """``ok/requests``, starred when a bound or failed turns cut the run short."""
    return f"{r['ok']}/{r['requests']}{'*' if r.get('cut') else ''}"


def cut_notes(runs: Sequence[dict]) -> list[str]:
    """One line per run that did not send its whole workload."""
    return [f"* {r['name']}: {r['cut']}" for r in runs if r.get("cut")]


def render_table(runs: list[dict], file=None) -> None:
    """The comparison table (rich; plain text when not a terminal), the runs a bound
    cut short, and what the columns mean."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="radixfleet load test", show_lines=False)
    floor = any("floor_ttft_ms" in r for r in runs)  # runs against simulated agents
    for col in (
        "run",
        "ok/req",
        "errors",
        "hit",
        "oracle",
        "pooled",
        "TTFT p50 ms",
        "TTFT p99 ms",
        *(("floor p50 ms", "floor p99 ms") if floor else ()),
        "ITL p50 ms",
        "E2E p50 ms",
        "req/s",
        "out tok/s",
        "imbalance",
    ):
        if col == "run":
            table.add_column(col, justify="left", no_wrap=True)
        else:
            table.add_column(col, justify="right")
    for r in runs:
        table.add_row(
            Text(r["name"]),
            ok_cell(r),  # a name is text, never markup: prefix_load[tie_s=0]
            ", ".join(f"{k}:{v}" for k, v in r["errors_by_kind"].items()) or "0",
            _fmt(r["hit_rate"], ".3f"),
            _fmt(r["oracle_hit_rate"], ".3f"),
            _fmt(r["pooled_hit_rate"], ".3f"),
            _fmt(r["ttft_ms"]["p50"]),
            _fmt(r["ttft_ms"]["p99"]),
            *(
                (_fmt(r.get("floor_ttft_ms", {}).get("p50")), _fmt(r.get("floor_ttft_ms", {}).get("p99")))
                if floor
                else ()
            ),
            _fmt(r["itl_ms"]["p50"]),
            _fmt(r["e2e_ms"]["p50"]),
            _fmt(r["throughput"]["requests_per_s"], ".2f"),
            _fmt(r["throughput"]["output_tokens_per_s"], ".0f"),
            _fmt(r["load_imbalance"], ".2f"),
        )
    notes = cut_notes(runs)
    for r in runs:
        pred = r.get("prediction")
        if pred:
            notes.append(
                f"{r['name']} index prediction (predicted matched vs reported cached "
                "tokens, mean |error| per response): "
                + ", ".join(
                    f"{w} {p['mean_abs_tokens']:.1f} ({p['samples']})" for w, p in sorted(pred.items())
                )
            )
    for r in runs:
        if r["errors"]:
            notes.append(
                f"{r['name']}: {r['errors']} of {r['requests']} requests failed "
                f"({', '.join(f'{k}: {v}' for k, v in r['errors_by_kind'].items())}); "
                "the run went on and the figures above cover the ok requests."
            )
    print_table(table, file, notes, legend=LEGEND + "  " + FLOOR_LEGEND if floor else LEGEND)


def write_plots(runs: list[dict], out_dir: str, ttft_samples: dict[str, list[float]]) -> list[str]:
    """PNG plots: TTFT distribution per run, hit rate vs oracle/pooled, per-worker load.

    ``ttft_samples[name]`` holds that run's TTFTs in ms. Returns the paths written.
    """
    require_plots()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        xs = sorted(ttft_samples.get(r["name"], []))
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["name"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution (CDF)")
    ax.grid(True, alpha=0.3)
    if ax.get_lines():
        ax.legend()
    paths.append(os.path.join(out_dir, "ttft_cdf.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["name"] for r in runs]
    width = 0.27
    xs = list(range(len(runs)))
    ax.bar([x - width for x in xs], [r["hit_rate"] for r in runs], width, label="hit rate")
    ax.bar(list(xs), [r["pooled_hit_rate"] or 0 for r in runs], width, label="pooled (one LRU cache)")
    ax.bar([x + width for x in xs], [r["oracle_hit_rate"] for r in runs], width, label="oracle (unbounded)")
    ax.set_xticks(list(xs), names)
    ax.set_ylim(0, 1.15)  # headroom for the legend above the bars
    ax.set_ylabel("share of prompt tokens served from cache")
    ax.set_title("Cache hit rate vs references")
    ax.legend(loc="upper center", ncol=3, fontsize="small")
    paths.append(os.path.join(out_dir, "hit_rate.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    workers = sorted({w for r in runs for w in r["workers"]})
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        ax.bar(
            [j + i * width for j in range(len(workers))],
            [r["workers"].get(w, {}).get("prompt_tokens", 0) for w in workers],
            width,
            label=f"{r['name']} (imbalance {_fmt(r['load_imbalance'], '.2f')})",
        )
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(workers))], workers)
    top = max((v.get("prompt_tokens", 0) for r in runs for v in r["workers"].values()), default=0)
    ax.set_ylim(0, max(1, top) * (1.15 + 0.1 * len(runs)))  # room for the legend
    ax.set_ylabel("prompt tokens")
    ax.set_title("Per-worker load")
    ax.legend(loc="upper right", fontsize="small")
    paths.append(os.path.join(out_dir, "worker_load.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


class Progress:
    """A live progress bar on stderr while a run goes; silent when not a TTY."""

    def __init__(self, label: str, total: int, *, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._p: RichProgress | None = None  # rich is imported only when the bar shows
        self.label = label
        self.total = total

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            # the label is a run name, never markup (prefix_load[tie_s=0])
            self._p = RichProgress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[errors]} errors"),
                TimeElapsedColumn(),
                transient=True,
                console=Console(stderr=True),
            )
            self._p.__enter__()
            self._task = self._p.add_task(self.label, total=self.total, errors=0)
        return self

    def advance(self, errors: int) -> None:
        if self._p is not None:
            self._p.update(self._task, advance=1, errors=errors)

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)
            self._p = None
