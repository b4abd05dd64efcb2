"""The Grafana dashboard (deploy/grafana/radixfleet.json) shows only metrics that
exist: a real router and a real agent are started, their /metrics scraped, and
every metric name in every panel expression must be one of the series they export,
a live vLLM page's (tests/data/vllm_metrics.txt), or a declared exception below.

In front of real vLLM servers (``engine``), every panel's queries are evaluated
(tests/promql.py: a small PromQL evaluator over two scrapes of the router's and the
engines' pages, as a Prometheus would take them) and each panel must return data,
except those whose subject a plain vLLM pool does not have (``NO_DATA_IN_FRONT_OF_VLLM``).
The panels of KV tiers, prefetch and prefill/decode are evaluated the same way in
front of a fleet of agents (``integration``): two with a DRAM tier serving one model,
a prefill and a decode agent serving another, prefetches sent until the budget
drops one, and the decode agent stopped to draw the no-decode 503. The routing-quality
row's the same way in front of two agents (``integration``): conversations sharing
a system prompt, and the row's figures checked against what the router counted."""

from __future__ import annotations

import json
import math
import re
import time

import httpx
import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from tests.deploy_tools import ROOT
from tests.promql import Evaluator, PromQLError, scrape

DASHBOARD = ROOT / "deploy" / "grafana" / "radixfleet.json"

#: metrics a panel may name that neither the router, the agent nor vLLM exports here:
#: SGLang's own TTFT histogram (srt/metrics/collector.py; SGLang is not installed here),
#: the dashboard's fallback for an SGLang pool without streamed traffic
PENDING: set[str] = {"sglang:time_to_first_token_seconds_bucket"}

#: the row whose panels a fleet of agents fills (DRAM tiers, prefetches, a
#: prefill/decode pair): ``test_tier_prefetch_and_pd_panels_return_data_in_front_of_agents``
AGENTS_ROW = "KV tiers, prefetch, prefill/decode"
#: the routing-quality row (radixfleet.route.decisions): ``test_routing_quality_panels_return_data``
QUALITY_ROW = "Routing quality"

#: panels that show nothing in front of a plain vLLM pool, with the reason
NO_DATA_IN_FRONT_OF_VLLM = {
    "Discovered endpoints": "no discovery source is configured",
    "Discovery problems": "no discovery source is configured",
    "Prefetches: warmed, used, wasted, dropped": "no prefetch is sent (the agents' test sends them)",
    "Prefill/decode: requests by path, no-decode 503s": "no disaggregated model (the agents' test has one)",
    "Prefill leg time (to the KV hand-off)": "no disaggregated model (the agents' test has one)",
}

VLLM_PAGE = ROOT / "tests" / "data" / "vllm_metrics.txt"

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not
    functions (followed by ``(``), keywords, label names (inside ``{}`` or a
    ``by``/``without``/``on``/``ignoring`` list), strings or durations."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range and subquery selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        rest = e[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def test_metric_names_parser():
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(x_bucket{a="b"}[5m])))') == {"x_bucket"}
    assert metric_names("sum by (instance) (sglang:num_queue_reqs) / on(pod) y_total") == {
        "sglang:num_queue_reqs",
        "y_total",
    }
    assert metric_names("count(min by (w) (h) == 0) or vector(0)") == {"h"}


def exported(text: str) -> set[str]:
    """Every series name a /metrics page can carry, from its TYPE lines (labelled
    metrics without a child yet have no samples, but do have their TYPE)."""
    out = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter":
            base = name.removesuffix("_total")
            out |= {base + "_total", base + "_created"}
        elif kind == "histogram":
            out |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
        elif kind == "summary":
            out |= {name, name + "_sum", name + "_count", name + "_created"}
        else:
            out.add(name)
    out |= {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    return out


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def row_panels(dash: dict, title: str) -> list[dict]:
    """The panels under the row ``title`` (those after it, up to the next row)."""
    ps = panels(dash)
    start = next(i for i, p in enumerate(ps) if p["type"] == "row" and p["title"] == title)
    out = []
    for p in ps[start + 1 :]:
        if p["type"] == "row":
            break
        out.append(p)
    return out


@pytest.fixture(scope="module")
def scraped() -> set[str]:
    rp, ap = free_port(), free_port()
    admin = free_port()  # the router's admin listener: its /metrics
    with Proc(
        radixfleet_argv("router", "--port", str(rp), "--admin-port", str(admin)),
        ready_url=f"http://127.0.0.1:{rp}/health",
    ):
        with Proc(
            radixfleet_argv(
                "agent", "--port", str(ap), "--router", f"http://127.0.0.1:{rp}", "--kv-tokens", "50000"
            ),
            ready_url=f"http://127.0.0.1:{ap}/health",
            timeout_s=30,
        ):
            with httpx.Client(timeout=10) as c:
                ok = False
                for _ in range(100):  # until the agent has registered
                    r = c.post(
                        f"http://127.0.0.1:{rp}/v1/completions",
                        json={"model": "llama-3-8b", "prompt": "hi " * 60, "max_tokens": 2},
                    )
                    if r.status_code == 200:
                        ok = True
                        break
                    time.sleep(0.05)
                assert ok, r.text
                router = c.get(f"http://127.0.0.1:{admin}/metrics").text
                agent = c.get(f"http://127.0.0.1:{ap}/metrics").text
    return exported(router) | exported(agent) | exported(VLLM_PAGE.read_text())


@pytest.mark.integration
def test_every_panel_names_only_exported_metrics(scraped):
    dash = json.loads(DASHBOARD.read_text())
    used: dict[str, list[str]] = {}
    for p in panels(dash):
        for t in p.get("targets", []):
            for name in metric_names(t["expr"]):
                used.setdefault(name, []).append(p["title"])
    unknown = {n: t for n, t in used.items() if n not in scraped and n not in PENDING}
    assert not unknown, f"panels use metrics nobody exports: {unknown}"
    assert len(used) >= 25  # the dashboard is not empty by accident
    assert "radixfleet_prediction_error_tokens_bucket" in used  # index accuracy has a panel
    assert any(n.startswith("vllm:") for n in used)  # a vLLM pool has its fallbacks
    assert "radixfleet_ttft_seconds_bucket" in used  # TTFT, not time to the first byte


def test_dashboard_shape():
    dash = json.loads(DASHBOARD.read_text())
    ps = panels(dash)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"].lower() for p in ps)
    for topic in (
        "hit rate",
        "ttft",
        "in flight per worker",
        "index size",
        "prediction accuracy",
        "retries",
        "breakers",
        "hot prefixes",
        "replicas",
        "shed",
        "kv tier",
        "prefetch",
        "prefill/decode",
        "captured / available",
        "delivered / predicted",
        "reuse was lost",
    ):
        assert topic in titles, topic
    for p in ps:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24


def test_promql_evaluator():
    page0 = (
        'c_total{w="a"} 10\nc_total{w="b"} 0\nh_bucket{le="1.0"} 0\n'
        'h_bucket{le="2.0"} 0\nh_bucket{le="+Inf"} 0\ng 3\n'
    )
    page1 = (
        'c_total{w="a"} 30\nc_total{w="b"} 10\nh_bucket{le="1.0"} 5\n'
        'h_bucket{le="2.0"} 10\nh_bucket{le="+Inf"} 10\ng 3\n'
    )
    ev = Evaluator(scrape({"x": page0}), scrape({"x": page1}), 10.0)
    assert ev.eval("sum(rate(c_total[5m]))") == [({}, 3.0)]
    assert sorted(ev.eval("sum by (w) (increase(c_total[$__rate_interval]))"), key=lambda s: s[0]["w"]) == [
        ({"w": "a"}, 20.0),
        ({"w": "b"}, 10.0),
    ]
    assert ev.eval('sum(rate(c_total{w=~"b|z"}[1m])) / sum(rate(c_total[1m]))') == [
        ({}, pytest.approx(1 / 3))
    ]
    assert ev.eval("histogram_quantile(0.75, sum by (le) (rate(h_bucket[1m])))") == [({}, pytest.approx(1.5))]
    assert ev.eval("sum(rate(missing_total[1m])) or on() vector(0)") == [({}, 0.0)]
    assert ev.eval("(sum(g - g) / sum(g - g) >= 0) or on() sum(g)") == [({}, 3.0)]  # NaN: idle
    assert ev.eval("count(g == 0) or vector(0)") == [({}, 0.0)]
    assert [v for _, v in ev.eval("topk(1, max by (w) (c_total))")] == [30.0]
    with pytest.raises(PromQLError):
        ev.eval("deriv(g[1m])")


def _finite(result) -> bool:
    if isinstance(result, float):
        return math.isfinite(result)
    return any(math.isfinite(v) for _, v in result)


@pytest.mark.engine
def test_every_panel_returns_data_in_front_of_vllm(vllm_pair, vllm_model_dir, tmp_path):
    from radixfleet_tools.harness.vllm_router import admin_url, router_yaml, text

    port = free_port()
    cfg = tmp_path / "router.yaml"
    router_yaml(cfg, port, vllm_pair, vllm_model_dir)
    base = f"http://127.0.0.1:{port}"
    pages = {
        "router": admin_url(base) + "/metrics",
        **{f"vllm-{i}": s.url + "/metrics" for i, s in enumerate(vllm_pair)},
    }
    with (
        Proc(radixfleet_argv("router", "--config", str(cfg)), ready_url=base + "/health"),
        httpx.Client(timeout=60) as c,
    ):
        deadline = time.monotonic() + 120
        # ready: both workers routable, in vLLM's token space and following its KV
        # events from their history (the join's replay); the hot-prefix panels count
        # matches on index entries, which a request routed before the join finds none of
        while time.monotonic() < deadline:
            ws = c.get(admin_url(base) + "/admin/workers").json()["workers"]
            if c.get(base + "/readiness").status_code == 200 and all(
                w["routable"]
                and w.get("engine", {}).get("key_space", "").startswith("TokenSpace")
                and w.get("engine", {}).get("events", {}).get("in_sync")
                for w in ws
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the router was not ready in 120 s: {ws}")
        before = scrape({k: c.get(u).text for k, u in pages.items()})
        t0 = time.monotonic()
        system = text(1, 300)
        for i in range(12):  # conversations sharing a system prompt: streamed and not
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": text(100 + i % 4, 40)}]
            body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "stream": i % 2 == 0}
            r = c.post(base + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        r = c.post(base + "/v1/completions", json={"model": "tiny", "prompt": system, "max_tokens": 2})
        assert r.status_code == 200, r.text
        time.sleep(1.5)  # the next scrapes of the engines' pages and events
        after = scrape({k: c.get(u).text for k, u in pages.items()})
        dt = time.monotonic() - t0
    ev = Evaluator(before, after, dt)
    dash = json.loads(DASHBOARD.read_text())
    empty = []
    for p in panels(dash):
        if p["type"] == "row":
            continue
        results = [ev.eval(t["expr"]) for t in p["targets"]]
        if not any(_finite(r) for r in results) and p["title"] not in NO_DATA_IN_FRONT_OF_VLLM:
            empty.append(p["title"])
    assert not empty, f"panels without data in front of vLLM: {empty}"
    hit = ev.eval(
        next(p for p in panels(dash) if p["title"] == "Fleet prefix-cache hit rate")["targets"][0]["expr"]
    )
    assert 0.3 < hit[0][1] <= 1.0, hit  # the shared system prompt was found cached


AGENT_HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1, "success_threshold": 1}


def _rag(tag: str, model: str) -> dict:
    docs = "\n".join(f"[{i}] Document {i} of {tag}: " + f"fact {i} about {tag}. " * 20 for i in range(3))
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "You answer from the documents below, citing them. " * 6},
            {"role": "user", "content": f"{docs}\n\nQuestion: what does {tag} say?"},
        ],
        "max_tokens": 2,
    }


@pytest.mark.integration
async def test_tier_prefetch_and_pd_panels_return_data_in_front_of_agents():
    """Bounded: in-process agents, ~40 requests, each wait capped at 10 s."""
    import asyncio
    import os

    from aiohttp import web

    from radixfleet.config import parse_config
    from radixfleet.server.app import Router, RouterServer
    from radixfleet_tools.agent.dram_tier import DramConfig
    from radixfleet_tools.agent.server import AgentConfig, create_app

    async def until(pred, what: str) -> None:
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline, f"not reached in 10 s: {what}"
            await asyncio.sleep(0.05)

    router = Router(
        parse_config(
            {
                "health": AGENT_HEALTH,
                "policy": {"name": "prefix_load"},
                "disagg": {"colocate_below_tokens": 0},  # every "pd" request takes both legs
                "prefetch": {"share": 0.02, "window_s": 0.5},  # a small budget; wasted soon
                "response_headers": {"worker_id": True},
            }
        )
    )
    server = RouterServer(router, port=free_port(), admin_port=0)
    base = f"http://127.0.0.1:{await server.start()}"
    admin = f"http://127.0.0.1:{server.admin_port}"
    runners: dict[str, web.AppRunner] = {}
    pages = {"router": admin + "/metrics"}
    fleet = [
        ("t0", "m", "both", DramConfig(200_000)),
        ("t1", "m", "both", DramConfig(200_000)),
        ("p0", "pd", "prefill", None),
        ("d0", "pd", "decode", None),
    ]
    try:
        for wid, model, role, dram in fleet:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cfg = AgentConfig(kv_tokens=50_000, worker_id=wid, role=role, served_model_name=model, dram=dram)
            runner = runners[wid] = web.AppRunner(create_app(cfg, routers=[base], advertise_url=url))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            pages[wid] = url + "/metrics"
        await until(lambda: len(router.pool.views(time.monotonic())) == 4, "agents registered")
        async with httpx.AsyncClient(timeout=30) as c:
            frozen: dict[str, str] = {}  # a stopped agent's last page

            async def scrape_all():
                return scrape({k: frozen.get(k) or (await c.get(u)).text for k, u in pages.items()})

            before = await scrape_all()
            t0 = time.monotonic()
            for i in range(4):  # a shared system prompt on the DRAM-tier agents
                r = await c.post(base + "/v1/chat/completions", json=_rag(f"shared-{i % 2}", "m"))
                assert r.status_code == 200, r.text
            warmed, dropped = [], 0
            for _ in range(60):  # prefetches until the budget (or the load) drops one
                body = _rag(os.urandom(6).hex(), "m")
                r = await c.post(base + "/v1/prefetch", json=body)
                if r.status_code == 429:
                    dropped += 1
                    break
                assert r.status_code == 202, r.text
                warmed.append(body)
            assert dropped and len(warmed) >= 3, (dropped, len(warmed))
            await until(lambda: all(w.in_flight == 0 for w in router.pool), "prefetches answered")
            for body in warmed[:2]:  # used; the rest wasted once prefetch.window_s passes
                r = await c.post(base + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            for i in range(3):  # both legs: the decode agent pulls the prompt's KV
                r = await c.post(base + "/v1/chat/completions", json=_rag(f"pd-{i}", "pd"))
                assert r.status_code == 200, r.text
                assert r.headers["x-radixfleet-worker"] == "d0"
            frozen["d0"] = (await c.get(pages["d0"])).text  # its pulls, as last seen
            await runners.pop("d0").cleanup()
            await until(lambda: all(v.id != "d0" for v in router.pool.views(time.monotonic())), "d0 down")
            r = await c.post(base + "/v1/chat/completions", json=_rag("pd-late", "pd"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available", r.text
            await asyncio.sleep(0.6)  # past prefetch.window_s; DRAM write-downs reported
            r = await c.post(base + "/v1/chat/completions", json=_rag("sweep", "m"))  # sweeps the ledger
            assert r.status_code == 200, r.text
            after = await scrape_all()
            ev = Evaluator(before, after, time.monotonic() - t0)
    finally:
        for r in reversed(list(runners.values())):
            await r.cleanup()
        await server.aclose()
    dash = json.loads(DASHBOARD.read_text())
    row = row_panels(dash, AGENTS_ROW)
    assert len(row) >= 8
    empty = [p["title"] for p in row if not any(_finite(ev.eval(t["expr"])) for t in p["targets"])]
    assert not empty, f"panels without data in front of agents: {empty}"

    def by(expr: str, label: str) -> dict[str, float]:
        return {lb.get(label, ""): v for lb, v in ev.eval(expr)}

    assert by("sum by (tier) (radixfleet_worker_tier_blocks)", "tier")["cpu"] > 0  # the DRAM tier
    outcomes = by("sum by (outcome) (increase(radixfleet_prefetch_total[5m]))", "outcome")
    assert outcomes["warmed"] == len(warmed) and outcomes["used"] >= 1, outcomes
    assert outcomes.get("unused", 0) + outcomes.get("evicted", 0) >= 1, outcomes
    assert sum(by("sum by (cause) (increase(radixfleet_prefetch_dropped_total[5m]))", "cause").values()) == 1
    paths = by("sum by (path) (increase(radixfleet_pd_requests_total[5m]))", "path")
    assert paths["prefill"] == 3, paths
    assert by("sum by (outcome) (increase(radixfleet_pd_kv_handoffs_total[5m]))", "outcome") == {"params": 3}
    assert by("sum by (when) (increase(radixfleet_pd_no_decode_total[5m]))", "when") == {"before": 1}


@pytest.mark.integration
async def test_routing_quality_panels_return_data_in_front_of_agents():
    """Bounded: two in-process agents, 12 requests. Sessions share a system prompt
    (most of each prompt available somewhere, most of it on the chosen worker); every
    panel of the row returns data, and its ratios are those of the router's counters."""
    from tests.router.fleet import PROMPT, Fleet

    fleet = Fleet()
    try:
        await fleet.start({"policy": {"name": "prefix_load"}})
        for wid in ("q0", "q1"):
            await fleet.agent("m", worker_id=wid)
        await fleet.routable(2)
        pages = {"router": fleet.admin + "/metrics"}
        async with httpx.AsyncClient(timeout=30) as c:
            before = scrape({k: (await c.get(u)).text for k, u in pages.items()})
            t0 = time.monotonic()
            for i in range(12):
                body = {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": PROMPT * 4},
                        {"role": "user", "content": f"question {i} " * 10},
                    ],
                    "max_tokens": 2,
                    "stream": i % 2 == 0,
                }
                r = await c.post(fleet.base + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            after = scrape({k: (await c.get(u)).text for k, u in pages.items()})
            ev = Evaluator(before, after, time.monotonic() - t0)
    finally:
        await fleet.aclose()
    dash = json.loads(DASHBOARD.read_text())
    row = row_panels(dash, QUALITY_ROW)
    assert len(row) >= 3
    empty = [p["title"] for p in row if not all(_finite(ev.eval(t["expr"])) for t in p["targets"])]
    assert not empty, f"routing-quality panels without data in front of agents: {empty}"

    def total(name: str) -> float:
        return sum(v for _, v in ev.eval(f"sum(increase({name}[5m]))"))

    avail = total("radixfleet_available_cached_tokens_total")
    pred = total("radixfleet_predicted_cached_tokens_total")
    cached, prompt = total("radixfleet_cached_tokens_total"), total("radixfleet_prompt_tokens_total")
    assert 0 < pred <= avail <= prompt and cached > 0
    ratios = next(p for p in row if p["title"].startswith("Routing quality"))["targets"]
    assert ev.eval(ratios[0]["expr"])[0][1] == pytest.approx(pred / avail)
    assert ev.eval(ratios[1]["expr"])[0][1] == pytest.approx(cached / pred)
    lost = next(p for p in row if p["title"].startswith("Where prompt reuse"))["targets"]
    parts = [ev.eval(t["expr"])[0][1] for t in lost]
    # capacity loss + routing loss + prediction gap + delivered = the prompt tokens
    assert sum(parts) == pytest.approx(ev.eval("sum(rate(radixfleet_prompt_tokens_total[5m]))")[0][1])
