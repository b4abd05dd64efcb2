"""The Grafana dashboard (deploy/grafana/radixfleet.json) shows only metrics that
exist: a real router and a real agent are started, their /metrics scraped, and
every metric name in every panel expression must be one of the series they export,
a live vLLM page's (tests/data/vllm_metrics.txt), or a declared exception below.

In front of real vLLM servers (``engine``), every panel's queries are evaluated
(tests/promql.py: a small PromQL evaluator over two scrapes of the router's and the
engines' pages, as a Prometheus would take them) and each panel must return data,
except those whose subject a plain vLLM pool does not have (``NO_DATA_IN_FRONT_OF_VLLM``)."""

from __future__ import annotations

import json
import math
import re
import time

import httpx
import pytest

from tests.deploy_tools import ROOT
from tests.procs import Proc, free_port, radixfleet_argv
from tests.promql import Evaluator, PromQLError, scrape

DASHBOARD = ROOT / "deploy" / "grafana" / "radixfleet.json"

#: metrics a panel may name that neither the router, the agent nor vLLM exports here:
#: SGLang's own TTFT histogram (srt/metrics/collector.py; SGLang is not installed here),
#: the dashboard's fallback for an SGLang pool without streamed traffic
PENDING: set[str] = {"sglang:time_to_first_token_seconds_bucket"}

#: panels that show nothing in front of a plain vLLM pool, with the reason
NO_DATA_IN_FRONT_OF_VLLM = {
    "Discovered endpoints": "no discovery source is configured",
    "Discovery problems": "no discovery source is configured",
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


@pytest.fixture(scope="module")
def scraped() -> set[str]:
    rp, ap = free_port(), free_port()
    with Proc(radixfleet_argv("router", "--port", str(rp)), ready_url=f"http://127.0.0.1:{rp}/health"):
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
                router = c.get(f"http://127.0.0.1:{rp}/metrics").text
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
    from tests.engines.vllm_router import router_yaml, text

    port = free_port()
    cfg = tmp_path / "router.yaml"
    router_yaml(cfg, port, vllm_pair, vllm_model_dir)
    base = f"http://127.0.0.1:{port}"
    pages = {
        "router": base + "/metrics",
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
            ws = c.get(base + "/admin/workers").json()["workers"]
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
