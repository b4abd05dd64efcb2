"""The runner behind ``radixfleet loadtest`` (its CLI: ``radixfleet_tools.loadtest.cli``), the local
A/Bs (``radixfleet_tools.loadtest.ab``), the demo and the benchmarks: one workload and seed against
each target in turn, cold (``run_ab``; the CLI's docstring says what a run does)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from radixfleet.wire.errors import RunError
from radixfleet_tools.loadtest.arrivals import Bounds, DriveStats, drive
from radixfleet_tools.loadtest.client import Result, Target
from radixfleet_tools.loadtest.report import CacheReference, Progress, mark_bounds, summarize
from radixfleet_tools.loadtest.retry import RetryPolicy
from radixfleet_tools.loadtest.workloads import Workload

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunOutcome:
    """One target's run: its report entry and the raw material for plots."""

    report: dict
    results: list[Result]
    stats: DriveStats
    ttft_ms: list[float] = field(default_factory=list)


async def _json_get(session: aiohttp.ClientSession, url: str) -> object | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def discover_workers(session: aiohttp.ClientSession, router_url: str) -> list[str]:
    """Agent URLs a radixfleet router lists at ``GET /admin/workers`` ([] otherwise)."""
    body = await _json_get(session, router_url.rstrip("/") + "/admin/workers")
    items: Any = body.get("workers", []) if isinstance(body, dict) else body
    urls = []
    if isinstance(items, dict):
        items = list(items.values())
    for item in items or []:
        if isinstance(item, dict) and isinstance(item.get("url"), str):
            urls.append(item["url"].rstrip("/"))
        elif isinstance(item, str) and item.startswith("http"):
            urls.append(item.rstrip("/"))
    return urls


#: fields an agent may report its KV capacity (tokens) under: ours, then SGLang's
_CAPACITY_KEYS = ("kv_capacity_tokens", "max_total_num_tokens", "kv_tokens")


def _find_capacity(body: object) -> int | None:
    if isinstance(body, dict):
        for k in _CAPACITY_KEYS:
            v = body.get(k)
            if type(v) is int and v > 0:
                return v
        for v in body.values():
            found = _find_capacity(v) if isinstance(v, (dict, list)) else None
            if found:
                return found
    elif isinstance(body, list) and body:
        return _find_capacity(body[0])
    return None


async def fleet_capacity(session: aiohttp.ClientSession, agent_urls: list[str]) -> int | None:
    """Sum of the agents' KV capacities (``/get_load`` or ``/get_server_info``)."""
    total = 0
    for url in agent_urls:
        cap = None
        for path in ("/get_load", "/get_server_info", "/server_info"):
            cap = _find_capacity(await _json_get(session, url + path))
            if cap:
                break
        if not cap:
            return None
        total += cap
    return total or None


#: agent counters (Prometheus text at /metrics): report field -> metric family
_COUNTERS = {
    "requests": "radixfleet_agent_requests_finished",
    "prompt_tokens": "sglang:prompt_tokens",
    "cached_tokens": "sglang:cached_tokens",
    "output_tokens": "sglang:generation_tokens",
}


async def agent_counters(session: aiohttp.ClientSession, agent_urls: list[str]) -> dict[str, dict[str, int]]:
    """Each agent's cumulative request/token counters from ``GET /metrics``.

    Keyed by ``host:port``; agents without a readable /metrics are left out.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, int]] = {}
    for url in agent_urls:
        try:
            async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    continue
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
        values: dict[str, int] = {}
        try:
            wanted = {n + "_total": k for k, n in _COUNTERS.items()}
            for fam in text_string_to_metric_families(text):
                for sample in fam.samples:  # family naming of '_total' differs by parser
                    key = wanted.get(sample.name)
                    if key is not None:
                        values[key] = values.get(key, 0) + int(sample.value)
        except ValueError:
            continue
        if set(values) == set(_COUNTERS):
            out[url.split("://", 1)[-1]] = values
    return out


def counter_deltas(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {w: {k: after[w][k] - before[w].get(k, 0) for k in _COUNTERS} for w in after if w in before}


#: cache flush endpoints, tried in order: ours and SGLang's, then vLLM's (served when
#: the server runs with VLLM_SERVER_DEV_MODE=1)
FLUSH_PATHS = ("/flush_cache", "/reset_prefix_cache")


async def router_predictions(session: aiohttp.ClientSession, router_url: str) -> dict:
    """Per worker, a radixfleet router's cumulative index prediction accuracy
    (``GET /admin/workers``: ``engine.prediction``); {} for other targets."""
    body = await _json_get(session, router_url.rstrip("/") + "/admin/workers")
    out = {}
    for item in body.get("workers", []) if isinstance(body, dict) else []:
        p = item.get("engine", {}).get("prediction") if isinstance(item, dict) else None
        if isinstance(p, dict) and isinstance(p.get("samples"), int):
            out[str(item.get("id"))] = p
    return out


def prediction_deltas(before: dict, after: dict) -> dict:
    """The run's own prediction figures per worker: predicted matched tokens against
    the cached tokens the worker reported, over the responses of this run."""
    out = {}
    for w, a in after.items():
        b = before.get(w, {})
        n = a["samples"] - b.get("samples", 0)
        if n <= 0:
            continue
        s_abs = a.get("sum_abs_tokens", 0) - b.get("sum_abs_tokens", 0)
        s_sig = a.get("sum_signed_tokens", 0) - b.get("sum_signed_tokens", 0)
        out[w] = {"samples": n, "mean_abs_tokens": s_abs / n, "mean_signed_tokens": s_sig / n}
    return out


async def flush(session: aiohttp.ClientSession, agent_urls: list[str], model: str | None = None) -> list[str]:
    """Flushes every worker's prefix cache (``FLUSH_PATHS``, the first one it serves);
    returns the URLs that failed.

    vLLM queues its ``AllBlocksCleared`` event at the reset but publishes events only
    after a scheduler step, which an idle engine does not take: without a nudge the
    routers following its events learn of the flush only after the next run's first
    requests were routed on the cleared entries (measured: the first turns of a
    multiturn run all routed "affinity" to blocks the engine no longer held). With
    ``model``, a one-token request follows each vLLM reset so the event goes out now;
    its prompt is shorter than a block, so it stores nothing."""
    failed = []
    for url in agent_urls:
        why = None
        for path in FLUSH_PATHS:
            try:
                async with session.post(url + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status < 300:
                        why = None
                        if path == "/reset_prefix_cache" and model:
                            await _nudge(session, url, model)
                        break
                    why = f"HTTP {r.status}"
                    if r.status not in (404, 405):
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                why = exc.__class__.__name__
                break
        if why is not None:
            failed.append(f"{url} ({why})")
    return failed


async def _nudge(session: aiohttp.ClientSession, url: str, model: str) -> None:
    """One tiny completion, so that an idle vLLM takes a step and publishes its
    queued events (``flush``). A failure only leaves the events for later."""
    try:
        async with session.post(
            url + "/v1/completions",
            json={"model": model, "prompt": "flush", "max_tokens": 1},
            timeout=aiohttp.ClientTimeout(total=30),
        ) as r:
            await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        log.info(
            "flush: the step after %s's reset failed (%s): its 'cleared' event "
            "goes out with the next request",
            url,
            exc.__class__.__name__,
        )


async def run_target(
    target: Target,
    workload: Workload,
    arrivals,
    bounds: Bounds,
    *,
    kv_capacity_tokens: int | None,
    progress: bool | None = None,
    check_reference: bool = False,
) -> RunOutcome:
    """Drives ``workload`` against one started, probed target; returns its outcome."""
    ref = CacheReference(kv_capacity_tokens)
    results: dict[str, Result] = {}
    errors = 0
    sessions = workload.sessions()
    total = sum(s.planned_requests for s in sessions)
    t0, t0_unix = time.monotonic(), time.time()

    def on_dispatch(spec) -> None:
        r = Result(spec.id, spec.session, spec.turn)
        r.est_prompt_tokens, r.oracle_cached, r.pooled_cached = ref.observe(spec)
        results[spec.id] = r

    # the bar counts to what this run will send: the bound, or the whole workload
    planned = min(total, bounds.request_cap)
    with Progress(f"{target.name}", int(planned), enabled=progress) as bar:

        async def send(spec):
            nonlocal errors
            r = results[spec.id]
            try:
                answer = await target.send(spec, r)
                if answer is not None:
                    ref.observe_answer(spec, answer)
            finally:
                if not r.ok:
                    errors += 1
                bar.advance(errors)
            return answer

        stats = await drive(
            sessions,
            arrivals,
            bounds,
            send,
            max_active_sessions=workload.max_active_sessions,
            seed=workload.seed,
            on_dispatch=on_dispatch,
        )
    if check_reference:
        ref.check()
    rs = list(results.values())
    for r in rs:
        r.start -= t0
    report = summarize(
        target.name, target.base_url, workload.describe(), rs, kv_capacity_tokens=kv_capacity_tokens
    )
    mark_bounds(report, bounds, stats.stopped_by, stats.dispatched, total)
    report["started_unix_s"] = round(t0_unix, 3)  # sets send_s on the wall clock
    return RunOutcome(report, rs, stats, [r.ttft_s * 1000 for r in rs if r.ok and r.ttft_s])


async def run_ab(
    targets: list[tuple[str, str]],
    workload: Workload,
    arrivals,
    bounds: Bounds,
    *,
    flush_urls: list[str] | None = None,
    kv_capacity_tokens: int | None = None,
    model: str | None = None,
    timeout_s: float = 120.0,
    send_session: bool = False,
    progress: bool | None = None,
    settle_s: float = 0.5,
    between=None,
    allow_warm: bool = False,
    headers: dict[str, str] | None = None,
    retry: RetryPolicy = RetryPolicy("none"),
    prefetch: bool | None = None,
    admin_urls: dict[str, str] | None = None,
) -> list[RunOutcome]:
    """Probes every target, then runs the workload against each in turn, cold.

    ``admin_urls``: a target URL -> its radixfleet router's admin listener (its
    ``/admin/workers``: the agents to flush and the index's predictions); a target
    without one is asked at its own URL (another router: nothing found there).

    ``between(name)`` (async, optional) runs before each target's run (the demo
    restarts its router there). Raises ``ConfigError`` for an unreachable target
    and ``RunError`` when an agent's cache flush fails before a run, unless
    ``allow_warm``: then the run goes on, marked ``cold_start: false``. ``headers``
    go with every request to a target (an API key); ``retry`` is the client's policy
    on refusals (``radixfleet_tools.loadtest.retry``); ``prefetch``: how a request's lead is spent
    (``Target``: None ignores it, False waits it out, True prefetches then waits).
    """
    outcomes = []
    async with aiohttp.ClientSession() as admin:
        if between is None:
            for name, url in targets:  # all unreachable targets fail before any load
                async with Target(name, url, model=model, headers=headers) as t:
                    await t.probe()
        for name, url in targets:
            if between is not None:
                await between(name)
            async with Target(
                name,
                url,
                model=model,
                timeout_s=timeout_s,
                send_session=send_session,
                headers=headers,
                retry=retry,
                prefetch=prefetch,
            ) as target:
                await target.probe()
                # the first replica answers the admin calls (at its admin listener)
                url = (admin_urls or {}).get(url) or target.base_url
                agents = list(flush_urls or []) or await discover_workers(admin, url)
                failed: list[str] = []
                if agents:
                    failed = await flush(admin, agents, target.model)
                    if failed and not allow_warm:
                        raise RunError(
                            f"target {name}: cache flush failed on {', '.join(failed)}; the "
                            f"run would not start cold (pass --allow-warm to run anyway, "
                            f"marked cold_start: false)"
                        )
                    if failed:
                        log.warning(
                            "target %s: flush failed on %s; running warm (--allow-warm)",
                            name,
                            ", ".join(failed),
                        )
                    await asyncio.sleep(settle_s)  # let 'cleared' events reach the router
                else:
                    log.warning(
                        "target %s: no agents to flush (pass --flush URL); this run may start warm", name
                    )
                cap = kv_capacity_tokens or (await fleet_capacity(admin, agents) if agents else None)
                before = await agent_counters(admin, agents)
                pred_before = await router_predictions(admin, url)
                outcome = await run_target(
                    target, workload, arrivals, bounds, kv_capacity_tokens=cap, progress=progress
                )
                pred = prediction_deltas(pred_before, await router_predictions(admin, url))
                if pred:
                    outcome.report["prediction"] = pred
                if "unknown" in outcome.report["workers"] and before:
                    # the target does not name workers (e.g. smg): use the agents' counters
                    per_agent = counter_deltas(before, await agent_counters(admin, agents))
                    if per_agent:
                        kept = {k: outcome.report[k] for k in ("stopped_by", "workload_requests", "cut")}
                        outcome.report = summarize(
                            name,
                            target.base_url,
                            workload.describe(),
                            outcome.results,
                            kv_capacity_tokens=cap,
                            workers=per_agent,
                        )
                        outcome.report.update(kept)
                        outcome.report["workers_source"] = "agent /metrics"
                outcome.report["cold_start"] = (not failed) if agents else None
                if failed:
                    outcome.report["flush_failed"] = failed
                outcomes.append(outcome)
                r = outcome.report
                log.info("target %s: %d/%d ok, hit %.3f", name, r["ok"], r["requests"], r["hit_rate"])
    return outcomes
