"""The Grafana dashboard (deploy/grafana/radixfleet.json) shows only metrics that
exist: a real router and a real agent are started, their /metrics scraped, and
every metric name in every panel expression must be one of the series they export
(or a declared pending exception below)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.deploy_tools import ROOT
from tests.procs import Proc, free_port, radixfleet_argv

DASHBOARD = ROOT / "deploy" / "grafana" / "radixfleet.json"

#: Names a panel may use before any process exports them, each with its reason.
#: metrics a panel may name before anything exports them (none: the prediction-accuracy
#: histogram of the real-engine work is exported by every router now)
PENDING: set[str] = set()

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}


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
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def test_metric_names_parser():
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(x_bucket{a="b"}[5m])))') \
        == {"x_bucket"}
    assert metric_names("sum by (instance) (sglang:num_queue_reqs) / on(pod) y_total") == \
        {"sglang:num_queue_reqs", "y_total"}
    assert metric_names('count(min by (w) (h) == 0) or vector(0)') == {"h"}


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
    out |= {ln.split("{")[0].split(" ")[0] for ln in text.splitlines()
            if ln and not ln.startswith("#")}
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
    with Proc(radixfleet_argv("router", "--port", str(rp)),
              ready_url=f"http://127.0.0.1:{rp}/health"):
        with Proc(radixfleet_argv("agent", "--port", str(ap), "--router",
                                  f"http://127.0.0.1:{rp}", "--kv-tokens", "50000"),
                  ready_url=f"http://127.0.0.1:{ap}/health", timeout_s=30):
            with httpx.Client(timeout=10) as c:
                ok = False
                for _ in range(100):  # until the agent has registered
                    r = c.post(f"http://127.0.0.1:{rp}/v1/completions",
                               json={"model": "llama-3-8b", "prompt": "hi " * 60,
                                     "max_tokens": 2})
                    if r.status_code == 200:
                        ok = True
                        break
                    import time
                    time.sleep(0.05)
                assert ok, r.text
                router = c.get(f"http://127.0.0.1:{rp}/metrics").text
                agent = c.get(f"http://127.0.0.1:{ap}/metrics").text
    return exported(router) | exported(agent)


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


def test_dashboard_shape():
    dash = json.loads(DASHBOARD.read_text())
    ps = panels(dash)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"].lower() for p in ps)
    for topic in ("hit rate", "ttft", "in flight per worker", "index size",
                  "prediction accuracy", "retries", "breakers", "hot prefixes",
                  "replicas", "shed"):
        assert topic in titles, topic
    for p in ps:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24
