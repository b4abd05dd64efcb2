"""An engine's load, read from its Prometheus ``/metrics`` page (contract 10, docs/DESIGN.md).

``parse_metrics(text, kind)`` turns one page into a frozen ``EngineMetrics``;
``MetricsScraper`` fetches it on an interval for one worker and hands each reading
(or each failure) to a consumer. What is read, per kind::

                    vllm                           sglang                      agent (ours)
    waiting         vllm:num_requests_waiting      sglang:num_queue_reqs       sglang:num_queue_reqs
    running         vllm:num_requests_running      sglang:num_running_reqs     sglang:num_running_reqs
    kv usage 0..1   vllm:kv_cache_usage_perc       sglang:token_usage          sglang:token_usage
    kv capacity     vllm:cache_config_info         sglang:max_total_num_tokens radixfleet_agent_kv_
                    num_gpu_blocks x block_size                                capacity_tokens
    prefix queries  vllm:prefix_cache_queries_total sglang:prompt_tokens_total radixfleet_agent_
    prefix hits     vllm:prefix_cache_hits_total   sglang:cached_tokens_total  prompt/cached_tokens_total
    prefilled       vllm:time_to_first_token_      sglang:time_to_first_token_ radixfleet_agent_
                    seconds_count                  seconds_count               requests_finished_total
    start time      process_start_time_seconds (where published; restart detection)

The first three are required: a page without them is refused (``MISSING_SERIES``).
vLLM's older names (``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``) are
read where the current ones are absent. Sources: vLLM 0.32's ``v1/metrics/loggers.py``
(a live page is kept in ``tests/data/vllm_metrics.txt``), SGLang's
``srt/metrics/collector.py`` and ``radixfleet_tools/agent/server.py``.

Several engines or models on one page. A page describes one worker (one URL), so a
reading is the worker's total: series are grouped into *instances* — vLLM by its
``engine`` label (one per data-parallel engine), SGLang by ``dp_rank``, every kind
also by ``model_name`` — and summed over instances (queue lengths, capacity, counters)
or averaged (the usage fraction: vLLM's DP engines have equal pools). Within an
instance, series that differ only in other labels (SGLang's ``tp_rank``, ``pp_rank``,
``moe_ep_rank``: every rank of one scheduler reports the same queue) are duplicates,
reduced by their maximum. ``parse_metrics(..., model=M)`` reads only series labelled
``model_name=M`` (or unlabelled), and refuses a page serving only other models
(``WRONG_MODEL``). vLLM's ``cache_config_info`` carries no model label; it repeats
the same config once per engine with ``num_gpu_blocks`` already summed over the DP
engines, so the capacity is taken once (the largest row), never summed.

Cost: only the lines of the series read are parsed (found by plain substring
search, not by a regex over the page), and a line of the plain shape engines write
(``name{label="value",...} value [timestamp]``, no escapes) is read by one regex
here; any other line goes to prometheus_client's parser, which reads or refuses it
as it always did. The live vLLM page is ~600 lines; the parser whole is ~20x the
cost of this, which matters with one scrape per worker per interval on the router's
event loop (bench/RESULTS.md, "Real engines"). The rest of the page is not
validated; a page with none of the lines is parsed whole once to tell "not
Prometheus text" from another kind's page.

Failures (``MetricsFailure``, a small fixed set) are raised as ``EngineMetricsError``
by ``parse_metrics``/``fetch_metrics``; the scraper turns them into consumer calls,
counts them per cause and logs each cause once (WARNING the first time, DEBUG after).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from radixfleet.common import background
from radixfleet.common.background import Lifecycle
from radixfleet.wire.errors import RadixfleetError
from radixfleet.wire.events import Load

log = logging.getLogger("radixfleet.engines.metrics")

#: A metrics page larger than this is refused (``TOO_LARGE``): a vLLM page with many
#: LoRA adapters and histograms is a few hundred KiB; 4 MiB is a peer gone wrong.
DEFAULT_MAX_BYTES = 4 * 2**20


class MetricsKind(str, enum.Enum):
    """Which engine's metric names a page uses."""

    VLLM = "vllm"
    SGLANG = "sglang"
    AGENT = "agent"  # our worker agent: SGLang's gauge names + radixfleet_agent_*


class MetricsFailure(str, enum.Enum):
    """Why a reading could not be had. The value is the metric label."""

    NOT_PROMETHEUS = "not_prometheus"  # body is not UTF-8 Prometheus text
    MISSING_SERIES = "missing_series"  # Prometheus text without a required series
    BAD_VALUE = "bad_value"  # a required series is NaN, infinite or negative
    WRONG_MODEL = "wrong_model"  # the page describes only other models
    HTTP_STATUS = "http_status"  # answered with a status other than 200
    TOO_LARGE = "too_large"  # body longer than max_bytes
    TIMEOUT = "timeout"  # no complete answer within timeout_s
    UNREACHABLE = "unreachable"  # connection refused or reset, DNS, TLS, bad payload


class EngineMetricsError(RadixfleetError):
    """A metrics page could not be read. ``cause`` is a ``MetricsFailure``, ``detail``
    a short human-readable line (never the whole page)."""

    def __init__(self, cause: MetricsFailure, detail: str) -> None:
        super().__init__(f"{cause.value}: {detail}")
        self.cause = cause
        self.detail = detail


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One reading of one worker's page, totals over its engines and models."""

    kind: MetricsKind
    waiting_requests: int  # queued, not yet scheduled
    running_requests: int  # scheduled (prefilling or decoding)
    kv_usage: float  # fraction of the KV pool in use, clamped to [0, 1]
    kv_capacity_tokens: int | None  # KV pool size in tokens, where published
    block_size: int | None  # the engine's KV block size in tokens (vLLM only)
    prefix_caching: bool | None  # vLLM's enable_prefix_caching, where published
    prefix_hash_algo: str | None  # vLLM's prefix_caching_hash_algo, where published
    prefix_queries_tokens: float | None  # counter: prompt tokens looked up in the cache
    prefix_hits_tokens: float | None  # counter: of those, tokens found cached
    prefilled_requests: float | None  # counter: requests past their first token
    start_time_s: float | None  # process start, unix seconds, where published
    models: tuple[str, ...]  # model_name labels seen on the required series, sorted
    instances: int  # engines summed (vLLM DP engines, SGLang DP ranks, x models)

    @property
    def kv_capacity_blocks(self) -> int | None:
        """KV capacity in engine blocks (None unless capacity and block size known)."""
        if self.kv_capacity_tokens is None or not self.block_size:
            return None
        return self.kv_capacity_tokens // self.block_size

    def restarted_since(self, earlier: EngineMetrics) -> bool:
        """True if this reading comes from a different engine process than ``earlier``:
        the start time changed, or a prefix-cache counter went backwards."""
        if self.start_time_s is not None and earlier.start_time_s is not None:
            if self.start_time_s != earlier.start_time_s:
                return True
        for now_v, then_v in (
            (self.prefix_queries_tokens, earlier.prefix_queries_tokens),
            (self.prefix_hits_tokens, earlier.prefix_hits_tokens),
        ):
            if now_v is not None and then_v is not None and now_v < then_v:
                return True
        return False

    def load(self, queued_tokens: int, prefill_tokens_per_s: float, capacity_tokens: int) -> Load:
        """This reading as the pool's load of the worker: its queue priced at
        ``queued_tokens`` (radixfleet.engines.queue_estimate), its KV pool at
        ``capacity_tokens`` (0: unknown)."""
        return Load(
            queued_requests=self.waiting_requests,
            queued_tokens=queued_tokens,
            queued_prefill_tokens=queued_tokens,
            running_requests=self.running_requests,
            kv_used_tokens=int(self.kv_usage * capacity_tokens),
            kv_capacity_tokens=capacity_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )


@dataclass(frozen=True, slots=True)
class _Schema:
    """The series one kind publishes; a tuple lists accepted names, preferred first."""

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    usage: tuple[str, ...]
    capacity: tuple[str, ...]  # a gauge in tokens (empty: vLLM reads cache_config_info)
    queries: tuple[str, ...]
    hits: tuple[str, ...]
    prefilled: tuple[str, ...]  # a counter of requests past their first token
    instance_labels: tuple[str, ...]  # besides model_name: what tells engines apart
    config_info: str | None = None  # vLLM's info gauge

    def names(self) -> tuple[str, ...]:
        out = [
            *self.waiting,
            *self.running,
            *self.usage,
            *self.capacity,
            *self.queries,
            *self.hits,
            *self.prefilled,
            _START_TIME,
        ]
        if self.config_info:
            out.append(self.config_info)
        return tuple(out)


_START_TIME = "process_start_time_seconds"

_SCHEMAS: dict[MetricsKind, _Schema] = {
    MetricsKind.VLLM: _Schema(
        waiting=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        capacity=(),
        queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        prefilled=("vllm:time_to_first_token_seconds_count",),
        instance_labels=("engine",),
        config_info="vllm:cache_config_info",
    ),
    MetricsKind.SGLANG: _Schema(
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        usage=("sglang:token_usage",),
        capacity=("sglang:max_total_num_tokens",),
        queries=("sglang:prompt_tokens_total",),
        hits=("sglang:cached_tokens_total",),
        prefilled=("sglang:time_to_first_token_seconds_count",),
        instance_labels=("dp_rank",),
    ),
    MetricsKind.AGENT: _Schema(
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        usage=("sglang:token_usage",),
        capacity=("radixfleet_agent_kv_capacity_tokens",),
        queries=("radixfleet_agent_prompt_tokens_total",),
        hits=("radixfleet_agent_cached_tokens_total",),
        prefilled=("radixfleet_agent_requests_finished_total",),
        instance_labels=(),
    ),
}


def select_lines(text: str, names: tuple[str, ...]) -> list[str]:
    """The sample lines of ``text`` whose metric name is one of ``names``: a line
    (after an LF, as Prometheus text splits them) that starts with the name followed by
    ``{``, a space or a tab, up to its LF or a CR before it; comments never start
    with a name. Found by ``str.find`` on each name (a few hits each: its samples,
    and its HELP and TYPE comments)."""
    out: list[str] = []
    find = text.find
    for name in set(names):
        n = len(name)
        i = find(name)
        while i >= 0:
            if (i == 0 or text[i - 1] == "\n") and text[i + n : i + n + 1] in _AFTER_NAME:
                end = find("\n", i + n)
                if end < 0:
                    end = len(text)
                cr = find("\r", i + n, end)
                out.append(text[i : end if cr < 0 else cr])
            i = find(name, i + n)
    return out


_AFTER_NAME = ("{", " ", "\t")
_NAMES: dict[MetricsKind, tuple[str, ...]] = {k: s.names() for k, s in _SCHEMAS.items()}
#: a label of the plain shape: no escapes in its value
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
#: a sample line of the plain shape engines write: name, labels, value, timestamp
_PLAIN_SAMPLE = re.compile(
    rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})?"
    r"[ \t]+([+-]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?|Inf|NaN))"
    r"(?:[ \t]+-?[0-9]+)?"
)
_LABELS = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"')
_KIND_PROBES = (
    (MetricsKind.AGENT, re.compile(r"^radixfleet_agent_\w*[{ ]", re.M)),
    (MetricsKind.VLLM, re.compile(r"^vllm:\w+[{ ]", re.M)),
    (MetricsKind.SGLANG, re.compile(r"^sglang:\w+[{ ]", re.M)),
)

_Samples = dict[str, list[tuple[Mapping[str, str], float]]]


def detect_kind(text: str) -> MetricsKind | None:
    """Which engine published ``text`` (by its metric names), or None. For probing a
    worker whose kind the config does not say; no validation of the page."""
    for kind, probe in _KIND_PROBES:
        if probe.search(text):
            return kind
    return None


def parse_metrics(text: str, kind: MetricsKind, model: str | None = None) -> EngineMetrics:
    """One reading from a Prometheus text page of ``kind``.

    With ``model``, only series labelled ``model_name=model`` (or with no model label)
    count. Raises ``EngineMetricsError`` (``NOT_PROMETHEUS``, ``MISSING_SERIES``,
    ``BAD_VALUE``, ``WRONG_MODEL``). O(page length) for finding the lines, O(lines read)
    for the parse.
    """
    schema = _SCHEMAS[kind]
    lines = select_lines(text, _NAMES[kind])
    if not lines:
        _classify_unreadable(text, kind, schema)
    samples = _parse(lines)
    waiting_name = _first_present(samples, schema.waiting)
    running_name = _first_present(samples, schema.running)
    usage_name = _first_present(samples, schema.usage)
    missing = [
        alts[0]
        for alts, n in (
            (schema.waiting, waiting_name),
            (schema.running, running_name),
            (schema.usage, usage_name),
        )
        if n is None
    ]
    if missing:
        raise EngineMetricsError(
            MetricsFailure.MISSING_SERIES, f"{kind.value} page lacks {', '.join(missing)}{_hint(text, kind)}"
        )
    assert waiting_name is not None and running_name is not None and usage_name is not None, missing
    if model is not None:
        seen = _models(samples[waiting_name])
        samples = {
            name: [(lb, v) for lb, v in rows if lb.get("model_name", model) == model]
            for name, rows in samples.items()
        }
        if not samples[waiting_name]:
            raise EngineMetricsError(MetricsFailure.WRONG_MODEL, f"page serves {sorted(seen)}, not {model!r}")
        for name in (running_name, usage_name):
            if not samples[name]:
                raise EngineMetricsError(
                    MetricsFailure.MISSING_SERIES, f"{kind.value} page lacks {name} for {model!r}"
                )
    inst = schema.instance_labels
    waiting = _per_instance(samples[waiting_name], inst, waiting_name, required=True)
    running = _per_instance(samples[running_name], inst, running_name, required=True)
    usage = _per_instance(samples[usage_name], inst, usage_name, required=True)
    capacity: int | None = None
    block_size: int | None = None
    caching: bool | None = None
    algo: str | None = None
    if schema.config_info is not None:
        capacity, block_size, caching, algo = _vllm_cache_config(samples.get(schema.config_info, ()))
    cap_name = _first_present(samples, schema.capacity)
    if cap_name is not None:
        cap = _sum_or_none(_per_instance(samples[cap_name], inst, cap_name, required=False))
        capacity = int(cap) if cap is not None and cap >= 1 else None
    q_name = _first_present(samples, schema.queries)
    h_name = _first_present(samples, schema.hits)
    queries = (
        None if q_name is None else _sum_or_none(_per_instance(samples[q_name], inst, q_name, required=False))
    )
    hits = (
        None if h_name is None else _sum_or_none(_per_instance(samples[h_name], inst, h_name, required=False))
    )
    p_name = _first_present(samples, schema.prefilled)
    prefilled = (
        None if p_name is None else _sum_or_none(_per_instance(samples[p_name], inst, p_name, required=False))
    )
    starts = [v for _, v in samples.get(_START_TIME, ()) if math.isfinite(v) and v > 0]
    return EngineMetrics(
        kind=kind,
        waiting_requests=round(sum(waiting.values())),
        running_requests=round(sum(running.values())),
        kv_usage=min(1.0, sum(usage.values()) / len(usage)),
        kv_capacity_tokens=capacity,
        block_size=block_size,
        prefix_caching=caching,
        prefix_hash_algo=algo,
        prefix_queries_tokens=queries,
        prefix_hits_tokens=hits,
        prefilled_requests=prefilled,
        start_time_s=max(starts) if starts else None,
        models=tuple(sorted(_models(samples[waiting_name]))),
        instances=len(waiting),
    )


def _classify_unreadable(text: str, kind: MetricsKind, schema: _Schema) -> None:
    """Raises for a page holding none of the kind's lines: garbage, or another kind's."""
    try:
        n = sum(1 for _ in text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError, IndexError, ... on garbage
        raise EngineMetricsError(MetricsFailure.NOT_PROMETHEUS, _short(e)) from None
    raise EngineMetricsError(
        MetricsFailure.MISSING_SERIES,
        f"{kind.value} page lacks {schema.waiting[0]}; {n} metric families{_hint(text, kind)}",
    )


def _hint(text: str, kind: MetricsKind) -> str:
    other = detect_kind(text)
    return f" (it looks like a {other.value} page)" if other not in (None, kind) else ""


def _parse(lines: list[str]) -> _Samples:
    """Samples by name, as prometheus_client reads them: a plain line here (values as
    its parser gives them: an int where the text is one, else a float), any other
    through the parser (module docstring). Raises ``NOT_PROMETHEUS`` for a line the
    parser refuses."""
    out: _Samples = {}
    other: list[str] = []
    plain = _PLAIN_SAMPLE.fullmatch
    for line in lines:
        m = plain(line)
        if m is None:
            other.append(line)
            continue
        name, labels, value = m.group(1, 2, 3)
        lb = dict(_LABELS.findall(labels)) if labels else {}
        if labels and len(lb) != labels.count('="'):  # a label given twice: the parser's call
            other.append(line)
            continue
        try:
            v: float = int(value)
        except ValueError:
            v = float(value)
        out.setdefault(name, []).append((lb, v))
    if other:
        try:
            families = list(text_string_to_metric_families("\n".join(other) + "\n"))
        except Exception as e:  # garbage inside a line we read: the page is not what it claims
            raise EngineMetricsError(MetricsFailure.NOT_PROMETHEUS, _short(e)) from None
        for fam in families:
            for s in fam.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _first_present(samples: _Samples, names: tuple[str, ...]) -> str | None:
    for n in names:
        if n in samples:
            return n
    return None


def _models(rows) -> set[str]:
    return {lb["model_name"] for lb, _ in rows if "model_name" in lb}


def _per_instance(rows, inst_labels: tuple[str, ...], name: str, *, required: bool) -> dict:
    """Value per instance key (model_name + instance labels), duplicates reduced by max.
    A NaN, infinite or negative value is refused for a required series (``BAD_VALUE``)
    and makes an optional one absent (an empty dict)."""
    out: dict[tuple, float] = {}
    for lb, v in rows:
        if not math.isfinite(v) or v < 0:
            if required:
                raise EngineMetricsError(MetricsFailure.BAD_VALUE, f"{name} = {v}")
            return {}
        key = (lb.get("model_name"), *(lb.get(k) for k in inst_labels))
        old = out.get(key)
        if old is None or v > old:
            out[key] = v
    return out


def _sum_or_none(per: dict) -> float | None:
    return sum(per.values()) if per else None


def _label_int(lb: Mapping[str, str], key: str) -> int | None:
    v = lb.get(key, "")
    return int(v) if v.isdigit() and int(v) > 0 else None


def _vllm_cache_config(rows) -> tuple[int | None, int | None, bool | None, str | None]:
    """(capacity tokens, block size, prefix caching, hash algo) from cache_config_info.
    Every engine's row repeats the same config with num_gpu_blocks summed over the DP
    engines, so the largest row is the worker's capacity."""
    best: tuple[int | None, int | None, bool | None, str | None] = (None, None, None, None)
    for lb, _ in rows:
        blocks = _label_int(lb, "num_gpu_blocks")
        bs = _label_int(lb, "block_size")
        cap = blocks * bs if blocks is not None and bs is not None else None
        flag = lb.get("enable_prefix_caching")
        caching = {"True": True, "False": False}.get(flag) if flag is not None else None
        algo = lb.get("prefix_caching_hash_algo") or None
        if best[0] is None or (cap is not None and cap > best[0]):
            best = (cap, bs, caching, algo)
    return best


def _short(e: BaseException, limit: int = 160) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= limit else s[: limit - 3] + "..."


#: the page uncompressed: on loopback or a LAN, gzip (prometheus_client's exporter,
#: vLLM's included, compresses whenever asked, as aiohttp does by default) costs the
#: engine's server and the router more CPU than the bytes it saves
_FETCH_HEADERS = {"Accept": "text/plain", "Accept-Encoding": "identity"}


async def fetch_metrics(
    session: aiohttp.ClientSession,
    url: str,
    kind: MetricsKind,
    *,
    timeout_s: float = 2.0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    model: str | None = None,
) -> EngineMetrics:
    """GETs ``url`` (the full ``/metrics`` URL) and parses it. One request, no retry.

    Raises ``EngineMetricsError``: ``TIMEOUT``, ``UNREACHABLE``, ``HTTP_STATUS``,
    ``TOO_LARGE`` for the transfer, then whatever ``parse_metrics`` raises.
    """
    try:
        async with session.get(
            url, timeout=aiohttp.ClientTimeout(total=timeout_s), headers=_FETCH_HEADERS
        ) as resp:
            if resp.status != 200:
                raise EngineMetricsError(MetricsFailure.HTTP_STATUS, f"HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length > max_bytes:
                raise EngineMetricsError(
                    MetricsFailure.TOO_LARGE, f"{resp.content_length} bytes > {max_bytes}"
                )
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_chunked(65536):
                size += len(chunk)
                if size > max_bytes:
                    raise EngineMetricsError(MetricsFailure.TOO_LARGE, f"more than {max_bytes} bytes")
                chunks.append(chunk)
    except EngineMetricsError:
        raise
    except asyncio.TimeoutError:
        raise EngineMetricsError(MetricsFailure.TIMEOUT, f"no answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise EngineMetricsError(MetricsFailure.UNREACHABLE, _short(e)) from None
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise EngineMetricsError(MetricsFailure.NOT_PROMETHEUS, _short(e)) from None
    return parse_metrics(text, kind, model)


class MetricsConsumer(Protocol):
    """Who receives a scraper's readings. Called on the event loop, must not block."""

    def on_metrics(self, metrics: EngineMetrics, now: float) -> None:
        """A fresh reading; ``now`` is the scraper's clock when it was parsed."""

    def on_failure(self, cause: MetricsFailure, detail: str) -> None:
        """A failed scrape (count it in a metric; the scraper already logs)."""


class ScraperState(enum.Enum):
    NEW = "new"  # constructed; start() not called yet
    RUNNING = "running"  # the loop task scrapes every interval
    CLOSED = "closed"  # loop stopped (or never started); start() refuses


class MetricsScraper(Lifecycle):
    """Scrapes one worker's ``/metrics`` every ``interval_s`` and reports to a consumer.

    Each cycle: GET with ``timeout_s``, parse, then ``consumer.on_metrics(reading,
    now)`` or ``consumer.on_failure(cause, detail)``. Cycles start every
    ``interval_s`` (a slow scrape delays the next, never overlaps it); the first is
    immediate. Staleness: ``fresh(now)`` returns the last reading only while it is at
    most ``stale_after_s`` old, so a consumer falls back to its own counts once
    scrapes have failed for that long. The default, three intervals plus the
    timeout, keeps a reading while its successor may still be on its way: a busy
    engine answers /metrics slowly (seconds, measured on a CPU vLLM whose engine
    took both cores), and a shorter default dropped its load from the view exactly
    while it was busy. ``now`` values come from
    ``clock`` (``time.monotonic`` unless injected).

    The aiohttp session is the caller's (shared by all scrapers); the scraper never
    closes it. Only the scraper's task mutates its fields.

    Lifecycle: ``start()`` once, then ``aclose()`` (idempotent); ``async with`` works.
    """

    def __init__(
        self,
        url: str,
        kind: MetricsKind,
        session: aiohttp.ClientSession,
        consumer: MetricsConsumer,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        stale_after_s: float | None = None,
        model: str | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
        name: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"metrics url must be http(s)://..., got {url!r}")
        if not (interval_s > 0 and timeout_s > 0):
            raise ValueError(f"interval_s and timeout_s must be positive, got {interval_s}, {timeout_s}")
        if stale_after_s is not None and not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be positive, got {stale_after_s}")
        self.url = url
        self.kind = MetricsKind(kind)
        self.name = name or url  # for log lines
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stale_after_s = 3 * interval_s + timeout_s if stale_after_s is None else stale_after_s
        self.model = model
        self.max_bytes = max_bytes
        self.state = ScraperState.NEW
        self.scrapes = 0  # cycles completed, ok or not
        self.consecutive_failures = 0  # failed cycles since the last good one
        self.last_failure: tuple[MetricsFailure, str] | None = None
        self._session = session
        self._consumer = consumer
        self._clock = clock
        self._latest: EngineMetrics | None = None  # the last good reading
        self._last_ok: float | None = None  # clock time of that reading
        self._failures: dict[MetricsFailure, int] = {}  # failed cycles per cause
        self._logged: set[MetricsFailure] = set()  # causes already logged at WARNING
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ readings

    @property
    def latest(self) -> EngineMetrics | None:
        """The last good reading, however old (see ``fresh``)."""
        return self._latest

    @property
    def last_ok(self) -> float | None:
        """Clock time of the last good reading (None: none yet)."""
        return self._last_ok

    @property
    def failures(self) -> dict[MetricsFailure, int]:
        """Failed cycles per cause since start (a copy)."""
        return dict(self._failures)

    def fresh(self, now: float) -> EngineMetrics | None:
        """The last reading if at most ``stale_after_s`` old at ``now``, else None."""
        t = self._last_ok
        if t is None or now - t > self.stale_after_s:
            return None
        return self._latest

    def is_stale(self, now: float) -> bool:
        return self.fresh(now) is None

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.state is not ScraperState.NEW:
            raise RuntimeError(f"scraper is {self.state.value}; start() is called once")
        self._task = asyncio.create_task(self._run(), name=f"metrics-scraper {self.name}")
        self.state = ScraperState.RUNNING

    async def aclose(self) -> None:
        """Stops the loop (waits for it). Idempotent; safe before ``start()``."""
        if self.state is ScraperState.CLOSED:
            return
        self.state = ScraperState.CLOSED
        task, self._task = self._task, None
        await background.stop(task)

    # ------------------------------------------------------------------ the loop

    async def scrape_once(self) -> EngineMetrics:
        """One fetch and parse, outside the loop's bookkeeping; raises EngineMetricsError."""
        return await fetch_metrics(
            self._session,
            self.url,
            self.kind,
            timeout_s=self.timeout_s,
            max_bytes=self.max_bytes,
            model=self.model,
        )

    async def _run(self) -> None:
        clock = self._clock
        while True:
            started = clock()
            await self._cycle()
            delay = started + self.interval_s - clock()
            await asyncio.sleep(delay if delay > 0 else 0)

    async def _cycle(self) -> None:
        try:
            m = await self.scrape_once()
        except EngineMetricsError as e:
            self._failed(e.cause, e.detail)
        else:
            now = self._clock()
            self._latest = m
            self._last_ok = now
            if self.consecutive_failures:
                log.debug(
                    "metrics scrape of %s ok again after %d failures", self.name, self.consecutive_failures
                )
            self.consecutive_failures = 0
            self.scrapes += 1
            try:
                self._consumer.on_metrics(m, now)
            except Exception:  # a consumer bug must not stop the scraping
                log.exception("metrics consumer of %s failed on a reading", self.name)

    def _failed(self, cause: MetricsFailure, detail: str) -> None:
        self._failures[cause] = self._failures.get(cause, 0) + 1
        self.consecutive_failures += 1
        self.last_failure = (cause, detail)
        self.scrapes += 1
        if cause not in self._logged:
            self._logged.add(cause)
            log.warning(
                "metrics scrape of %s failed (%s): %s; further %s failures are counted, not logged",
                self.name,
                cause.value,
                detail,
                cause.value,
            )
        else:
            log.debug("metrics scrape of %s failed (%s): %s", self.name, cause.value, detail)
        try:
            self._consumer.on_failure(cause, detail)
        except Exception:
            log.exception("metrics consumer of %s failed on a failure", self.name)
