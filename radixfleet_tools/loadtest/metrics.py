"""Serving metrics of a load-test run, defined as ``vllm bench serve`` and genai-perf do.

Per request (ok requests only; times from the first attempt, retries included)::

    TTFT   first streamed token - send
    TPOT   (E2E - TTFT) / (output_tokens - 1)      requests with >= 2 output tokens
    ITL    every gap between consecutive streamed chunks after the first (pooled
           over all requests)
    E2E    last byte - send

Per run, added to the report's run entry by ``enrich`` (``radixfleet_tools.loadtest.report`` keeps
the base schema; these keys are optional there)::

    percentiles       [50, 90, 99]   what ``--percentiles`` asked for
    ttft_ms, itl_ms, e2e_ms, tpot_ms {"p50", ..., "mean"}: those percentiles
                      (nearest rank) plus p50/p90/p99, which the base schema needs
    throughput        + input_tokens_per_s, total_tokens_per_s (the server's usage
                      counts over the run's duration)
    goodput           {"slo": {"ttft_ms": 500, ...}, "requests": n, "share": n/requests,
                       "requests_per_s": n/duration} — requests that succeeded and
                      met every SLO (vLLM's goodput; a failed request never counts)
    retries           {"requests": requests retried at least once, "attempts": retries
                       in all, "wait_s": seconds spent waiting before them}

``--slo`` (alias ``--goodput``) reads ``ttft_ms=500,tpot_ms=50`` or vLLM's
``ttft:500,tpot:50``; keys ttft, tpot, e2e (vLLM's ``e2el``), milliseconds.
``--percentiles`` reads ``50,90,99``. Both raise ``ConfigError`` naming the flag.

``write_requests`` writes one record per request (``REQUEST_FIELDS``) as JSONL, or CSV
when the file name ends in ``.csv`` (the inter-token gaps then space-separated).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from radixfleet.wire.errors import ConfigError
from radixfleet_tools.loadtest.client import Result
from radixfleet_tools.loadtest.report import percentiles

#: the base schema's percentiles, always reported
BASE_PERCENTILES = (50.0, 90.0, 99.0)
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)

#: --slo keys -> the report's name; vLLM's spellings accepted
_SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}

#: what one line of --requests-out holds, in CSV column order
REQUEST_FIELDS = (
    "run",
    "id",
    "session",
    "turn",
    "send_s",
    "ok",
    "status",
    "error_kind",
    "error",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "itl_ms",
    "prompt_tokens",
    "cached_tokens",
    "available_tokens",
    "predicted_tokens",
    "output_tokens",
    "worker",
    "retries",
    "retry_wait_ms",
)


@dataclass(frozen=True, slots=True)
class MetricOptions:
    """What a run's metrics report: percentiles and the SLOs goodput counts against."""

    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    #: report key (ttft_ms, tpot_ms, e2e_ms) -> bound in ms; empty: no goodput
    slo: dict[str, float] = field(default_factory=dict)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> (50.0, 90.0, 99.0); each in (0, 100], no repeats."""
    out: list[float] = []
    for part in text.split(","):
        try:
            p = float(part)
        except ValueError:
            raise ConfigError(
                "--percentiles", f"{part.strip()!r} in {text!r} is not a number (give e.g. 50,90,99)"
            ) from None
        if not 0 < p <= 100 or math.isnan(p):
            raise ConfigError("--percentiles", f"{p:g} is outside (0, 100]")
        if p in out:
            raise ConfigError("--percentiles", f"{p:g} is given twice")
        out.append(p)
    return tuple(out)


def parse_slo(text: str, flag: str = "--slo") -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` or ``"ttft:500,tpot:50"`` -> {"ttft_ms": 500.0, ...}."""
    out: dict[str, float] = {}
    for part in text.split(","):
        sep = "=" if "=" in part else ":"
        key, found, value = part.partition(sep)
        key = key.strip().lower()
        name = _SLO_KEYS.get(key.removesuffix("_ms"))
        if not found or name is None:
            raise ConfigError(
                flag,
                f"{part.strip()!r} must be KEY=MS with KEY one of ttft, "
                "tpot, e2e (e.g. ttft_ms=500,tpot_ms=50)",
            )
        try:
            bound = float(value)
        except ValueError:
            raise ConfigError(
                flag, f"{part.strip()!r}: {value.strip()!r} is not a number of milliseconds"
            ) from None
        if not bound > 0 or math.isinf(bound):
            raise ConfigError(flag, f"{part.strip()!r}: the bound must be > 0 ms")
        if name in out:
            raise ConfigError(flag, f"{key} is given twice")
        out[name] = bound
    return out


def tpot_s(r: Result) -> float | None:
    """Time per output token after the first (vLLM's definition); None below 2 tokens."""
    if not r.ok or r.e2e_s is None or r.ttft_s is None or r.output_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def meets_slo(r: Result, slo: dict[str, float]) -> bool:
    """True when ``r`` succeeded and every bound in ``slo`` holds (a TPOT bound holds
    for a request too short to have a TPOT, as in vLLM)."""
    if not r.ok:
        return False
    for key, bound in slo.items():
        if key == "ttft_ms":
            v = r.ttft_s
        elif key == "e2e_ms":
            v = r.e2e_s
        else:
            v = tpot_s(r)
            if v is None:
                continue
        if v is None or v * 1000.0 > bound:
            return False
    return True


def goodput(results: Sequence[Result], slo: dict[str, float], duration_s: float) -> dict:
    """The report's ``goodput`` entry (module docstring): of ``results``, those that
    succeeded within every bound of ``slo``, over ``duration_s`` seconds."""
    good = sum(1 for r in results if meets_slo(r, slo))
    return {
        "slo": dict(slo),
        "requests": good,
        "share": good / len(results) if results else 0.0,
        "requests_per_s": good / duration_s if duration_s else 0.0,
    }


def enrich(report: dict, results: Sequence[Result], opts: MetricOptions) -> dict:
    """Adds the metrics of the module docstring to one run's ``report`` (in place;
    returned too). ``results`` are the run's requests, ``report`` its ``summarize``."""
    ps = tuple(sorted(set(opts.percentiles) | set(BASE_PERCENTILES)))
    ok = [r for r in results if r.ok]
    report["percentiles"] = [p for p in opts.percentiles]
    report["ttft_ms"] = percentiles([r.ttft_s for r in ok if r.ttft_s is not None], ps=ps)
    report["itl_ms"] = percentiles([x for r in ok for x in r.itl_s], ps=ps)
    report["e2e_ms"] = percentiles([r.e2e_s for r in ok if r.e2e_s is not None], ps=ps)
    report["tpot_ms"] = percentiles([t for t in map(tpot_s, ok) if t is not None], ps=ps)
    duration = report["duration_s"]
    tp = report["throughput"]
    tp["input_tokens_per_s"] = report["prompt_tokens"] / duration if duration else 0.0
    tp["total_tokens_per_s"] = tp["input_tokens_per_s"] + tp["output_tokens_per_s"]
    if opts.slo:
        report["goodput"] = goodput(results, opts.slo, duration)
    retried = [r for r in results if r.retries]
    report["retries"] = {
        "requests": len(retried),
        "attempts": sum(r.retries for r in retried),
        "wait_s": sum(r.retry_wait_s for r in retried),
    }
    return report


def failure_share(report: dict) -> float:
    """Failed requests over requests sent (1.0 when nothing was sent: a run that sent
    nothing measured nothing)."""
    return report["errors"] / report["requests"] if report["requests"] else 1.0


def over_failure_limit(runs: Iterable[dict], max_failures: float) -> list[str]:
    """One line per run whose failure share exceeds ``max_failures`` (a share in [0, 1])."""
    return [
        f"{r['name']}: {r['errors']} of {r['requests']} requests failed "
        f"({failure_share(r):.1%} > --max-failures {max_failures:g})"
        for r in runs
        if failure_share(r) > max_failures
    ]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def request_record(run: str, r: Result) -> dict:
    """One request as ``--requests-out`` writes it (``REQUEST_FIELDS``)."""
    t = tpot_s(r)
    return {
        "run": run,
        "id": r.id,
        "session": r.session,
        "turn": r.turn,
        "send_s": round(r.start, 6),
        "ok": r.ok,
        "status": r.status,
        "error_kind": r.error_kind,
        "error": r.error,
        "ttft_ms": _ms(r.ttft_s),
        "tpot_ms": _ms(t),
        "e2e_ms": _ms(r.e2e_s),
        "itl_ms": [_ms(x) for x in r.itl_s],
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "available_tokens": r.available_tokens,
        "predicted_tokens": r.predicted_tokens,
        "output_tokens": r.output_tokens,
        "worker": r.worker,
        "retries": r.retries,
        "retry_wait_ms": _ms(r.retry_wait_s),
    }


def write_requests(path: str, runs: Sequence[tuple[str, Sequence[Result]]]) -> int:
    """Writes every request of ``runs`` ((run name, results) in order) to ``path``:
    JSONL, or CSV for a ``.csv`` name. Returns the records written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = 0
    as_csv = path.lower().endswith(".csv")
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=REQUEST_FIELDS) if as_csv else None
        if writer is not None:
            writer.writeheader()
        for name, results in runs:
            for r in sorted(results, key=lambda r: r.start):
                rec = request_record(name, r)
                if writer is not None:
                    rec["itl_ms"] = " ".join(f"{x:g}" for x in rec["itl_ms"])
                    writer.writerow(rec)
                else:
                    f.write(json.dumps(rec, separators=(",", ":")) + "\n")
                n += 1
    return n


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def render_latency(runs: Sequence[dict], file=None) -> None:
    """The latency table: TTFT, TPOT, ITL and E2E at the asked percentiles, input and
    output tokens/s, goodput and retries, one row per run."""
    from rich.table import Table
    from rich.text import Text

    from radixfleet_tools.loadtest.report import print_table

    ps = runs[0].get("percentiles", list(DEFAULT_PERCENTILES)) if runs else []
    table = Table(title="latency (ms) and throughput", show_lines=False)
    table.add_column("run", justify="left", no_wrap=True)
    metrics = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
    for label, _ in metrics:
        for p in ps:
            table.add_column(f"{label} p{p:g}", justify="right")
    for col in ("in tok/s", "out tok/s", "goodput req/s", "retried"):
        table.add_column(col, justify="right")
    slo = None
    for r in runs:
        row: list[Text | str] = [Text(r["name"])]
        for _, key in metrics:
            stats = r.get(key) or {}
            row += [_fmt(stats.get(f"p{p:g}")) for p in ps]
        tp = r["throughput"]
        g = r.get("goodput")
        if g:
            slo = g["slo"]
        rt = r.get("retries") or {}
        row += [
            _fmt(tp.get("input_tokens_per_s"), ".0f"),
            _fmt(tp["output_tokens_per_s"], ".0f"),
            f"{g['requests_per_s']:.2f} ({g['share']:.0%})" if g else "-",
            f"{rt.get('requests', 0)} ({rt.get('attempts', 0)} retries)",
        ]
        table.add_row(*row)
    legend = (
        "TTFT: send to first token.  TPOT: (E2E - TTFT) / (output tokens - 1).  "
        "ITL: gaps between streamed chunks.  Times count from the first attempt; "
        "'retried' says how many requests a refusal (429/503...) made wait."
    )
    if slo:
        legend += (
            "  goodput: ok requests within "
            + ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in slo.items())
            + " per second."
        )
    print_table(table, file, legend=legend)


def render_sweep(runs: Sequence[dict], file=None) -> None:
    """One row per (target, rate) of a ``--rate`` sweep: offered rate against what
    was achieved and what it cost in latency."""
    from rich.table import Table
    from rich.text import Text

    from radixfleet_tools.loadtest.report import print_table

    table = Table(title="rate sweep", show_lines=False)
    for col in (
        "run",
        "offered req/s",
        "achieved req/s",
        "ok/req",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "E2E p99",
        "out tok/s",
        "goodput req/s",
    ):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=col == "run")
    for r in runs:
        g = r.get("goodput")
        table.add_row(
            Text(r["name"]),
            _fmt(r.get("offered_rate"), "g"),
            _fmt(r["throughput"]["requests_per_s"], ".2f"),
            f"{r['ok']}/{r['requests']}",
            _fmt(r["ttft_ms"]["p50"]),
            _fmt(r["ttft_ms"]["p99"]),
            _fmt((r.get("tpot_ms") or {}).get("p50")),
            _fmt(r["e2e_ms"]["p99"]),
            _fmt(r["throughput"]["output_tokens_per_s"], ".0f"),
            _fmt(g["requests_per_s"], ".2f") if g else "-",
        )
    print_table(
        table,
        file,
        legend="offered: the --rate of the run; achieved: ok requests "
        "per second over the run's duration. Latencies in ms.",
    )


def write_sweep_plot(runs: Sequence[dict], out_dir: str) -> str:
    """``sweep.png``: TTFT p50/p99 and TPOT p50 against achieved throughput, one curve
    per target (runs carry ``target_name`` and ``offered_rate``). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    by_target: dict[str, list[dict]] = {}
    for r in runs:
        by_target.setdefault(r.get("target_name", r["name"]), []).append(r)
    for name, rs in by_target.items():
        rs = sorted(rs, key=lambda r: r.get("offered_rate") or 0)
        x = [r["throughput"]["requests_per_s"] for r in rs]
        ax1.plot(x, [r["ttft_ms"]["p50"] for r in rs], "o-", label=f"{name} p50")
        ax1.plot(x, [r["ttft_ms"]["p99"] for r in rs], "s--", label=f"{name} p99")
        ax2.plot(x, [(r.get("tpot_ms") or {}).get("p50") for r in rs], "o-", label=f"{name} p50")
    for ax, title in ((ax1, "TTFT (ms)"), (ax2, "TPOT (ms)")):
        ax.set_xlabel("achieved throughput (ok requests/s)")
        ax.set_ylabel(title)
        ax.set_title(f"{title} against throughput")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    path = os.path.join(out_dir, "sweep.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
