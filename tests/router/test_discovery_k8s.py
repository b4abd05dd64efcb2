"""Kubernetes discovery against a protocol-faithful fake API server
(``tests/kube_fake.py``: list + watch of EndpointSlices with resourceVersions,
bookmarks, 410 Gone, pagination, dropped connections) on loopback."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
import yaml
from prometheus_client import CollectorRegistry

from radixfleet.config import parse_config
from radixfleet.fleet.discovery import Discovery
from radixfleet.fleet.discovery.base import Endpoint
from radixfleet.fleet.discovery.k8s import own_namespace, parse_slice
from radixfleet.fleet.pool import Pool, Source
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.harness.procs import free_port
from tests.kube_fake import FakeKubeAPI, make_slice, selector_matches

NS = "inference"
SEL = "radixfleet.io/pool=vllm"
LABELS = {"radixfleet.io/pool": "vllm"}


def k8s_cfg(api: FakeKubeAPI, token_file, **extra):
    k = {
        "api_server": api.url,
        "token_file": str(token_file),
        "namespace": NS,
        "watch_timeout_s": 30,
        "selectors": [{"label_selector": SEL, "port_name": "http", "kind": "vllm"}],
    }
    k.update(extra)
    return {"workers": {"discovery": {"backoff_s": 0.05, "backoff_max_s": 0.2, "kubernetes": k}}}


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text("test-token\n")
    return p


def vllm_slice(name: str, eps: list[tuple], **kw) -> dict:
    return make_slice(name, service="vllm", endpoints=eps, labels=LABELS, **kw)


def discovered(pool: Pool) -> dict[str, str]:
    return {w.id: w.url for w in pool if w.source is Source.DISCOVERY}


async def until(pred, timeout_s=5.0, what="condition", step=0.0005):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        await asyncio.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def errors(registry: CollectorRegistry, cause: str, source: str = "kubernetes") -> float:
    return (
        registry.get_sample_value("radixfleet_discovery_errors_total", {"source": source, "cause": cause})
        or 0.0
    )


# ------------------------------------------------------------------ units


def test_parse_slice_takes_ready_endpoints_on_the_named_port():
    s = vllm_slice(
        "v-1",
        [
            ("10.0.0.1", True, "vllm-0"),
            ("10.0.0.2", False, "vllm-1"),
            ("10.0.0.3", None, "vllm-2"),
            ("10.0.0.4", True, None),
        ],
    )
    s["ports"].append({"name": "metrics", "protocol": "TCP", "port": 9090})
    name, rv, eps, bad = parse_slice(s, "http", "vllm")
    assert (name, bad) == ("v-1", 0)
    assert eps == [
        Endpoint("vllm-0", "http://10.0.0.1:8000", "vllm"),
        Endpoint("vllm-2", "http://10.0.0.3:8000", "vllm"),  # ready unset: ready
        Endpoint("10.0.0.4:8000", "http://10.0.0.4:8000", "vllm"),
    ]
    assert parse_slice(s, "grpc", "vllm")[2] == []  # no such port in this slice
    assert parse_slice(s, "", "vllm")[2] == []  # two ports and no name: ambiguous
    v6 = vllm_slice("v-2", [("fd00::1", True, "vllm-0")], address_type="IPv6")
    assert parse_slice(v6, "http", "agent")[2] == [Endpoint("vllm-0", "http://[fd00::1]:8000", "agent")]


def test_parse_slice_counts_malformed_endpoints_and_rejects_malformed_slices():
    s = vllm_slice("v-1", [("10.0.0.1", True, "a"), ("not-an-ip", True, "b"), ("fd00::9", True, "c")])
    s["endpoints"].append("garbage")
    s["endpoints"].append({"addresses": [], "conditions": {}})
    _, _, eps, bad = parse_slice(s, "http", "vllm")
    assert [e.id for e in eps] == ["a"] and bad == 4
    for broken in (
        [],
        {"metadata": {}},
        {**s, "ports": "x"},
        {**s, "endpoints": {}},
        {**s, "ports": [{"name": "http", "port": 70000}]},
    ):
        with pytest.raises(ValueError):
            parse_slice(broken, "http", "vllm")
    empty = {**s, "endpoints": None}  # how a slice with no endpoints serializes
    assert parse_slice(empty, "http", "vllm")[2] == []


def test_fake_selector_grammar():
    labels = {"app": "vllm", "tier": "gpu"}
    assert selector_matches("app=vllm,tier in (gpu, cpu)", labels)
    assert selector_matches("app==vllm,!missing,tier", labels)
    assert not selector_matches("app!=vllm", labels)
    assert not selector_matches("tier notin (gpu)", labels)


def test_own_namespace_comes_from_the_service_account(tmp_path):
    from radixfleet.fleet.discovery.base import SourceError

    p = tmp_path / "namespace"
    p.write_text("inference\n")
    assert own_namespace(str(p)) == "inference"
    with pytest.raises(SourceError, match="namespace"):
        own_namespace(str(tmp_path / "absent"))


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            "workers: {discovery: {kubernetes: {selectors: [{label_selector: a=b, kind: tgi}]}}}",
            "workers.discovery.kubernetes.selectors[0].kind: 'tgi' is not one of agent, vllm, sglang, openai",
        ),
        (
            "workers: {discovery: {kubernetes: {selectors: [{port_name: http}]}}}",
            "workers.discovery.kubernetes.selectors[0].label_selector: required",
        ),
        (
            "workers: {discovery: {kubernetes: {api_server: 'ftp://x'}}}",
            "workers.discovery.kubernetes.api_server: expected an http(s):// URL",
        ),
        (
            "workers: {discovery: {kubernetes: {watch_timeout_s: 0}}}",
            "workers.discovery.kubernetes.watch_timeout_s",
        ),
        (
            "workers: {discovery: {dns: {services: [{name: x}]}}}",
            "workers.discovery.dns.services[0].port: required",
        ),
        (
            "workers: {discovery: {backoff_s: 2, backoff_max_s: 1}}",
            "workers.discovery.backoff_max_s: expected a number >= workers.discovery.backoff_s",
        ),
        (
            "workers: {discovery: {kubernets: {}}}",
            "workers.discovery.kubernets: unknown key; valid: backoff_max_s, backoff_s, dns, "
            "kubernetes, max_workers",
        ),
        ("workers: {statics: []}", "workers.statics: unknown key; valid: discovery, static"),
        ("workers: {static: [{url: 'ftp://x'}]}", "workers.static[0].url: expected an http://"),
    ],
)
def test_discovery_config_errors_name_the_field(raw, message):
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_load(raw))
    assert message in str(e.value)


def test_workers_mapping_keeps_the_static_list():
    cfg = parse_config(
        yaml.safe_load(
            "workers: {static: [http://127.0.0.1:9001], discovery: {kubernetes: {selectors: "
            "[{label_selector: 'app=vllm', port_name: http, kind: vllm}]}}}"
        )
    )
    assert [w.id for w in cfg.workers] == ["127.0.0.1:9001"]
    assert cfg.discovery.enabled() and cfg.discovery.kubernetes.selectors[0].kind == "vllm"
    assert not parse_config({"workers": ["http://127.0.0.1:9001"]}).discovery.enabled()


# --------------------------------------------------------- against the fake


@pytest.mark.integration
async def test_ready_and_unready_pods_reach_routing_within_a_second(token_file):
    """Two real agents (127.0.0.2 and .3, one port) behind EndpointSlices; pods flip
    ready/unready and are added and deleted. Each change must be in the pool within
    1 s of the fake server writing its watch event (it takes milliseconds)."""
    import httpx

    from radixfleet.server.app import Router, RouterServer
    from radixfleet_tools.harness.procs import Proc, radixfleet_argv

    ap = free_port()
    agents = [
        Proc(
            radixfleet_argv("agent", "--host", h, "--port", str(ap), "--kv-tokens", "50000"),
            ready_url=f"http://{h}:{ap}/health",
            timeout_s=30,
        )
        for h in ("127.0.0.2", "127.0.0.3")
    ]
    membership: list[float] = []
    routable: list[float] = []
    try:
        for a in agents:
            a.__enter__()
        async with FakeKubeAPI() as api:
            api.put_slice(
                NS,
                vllm_slice(
                    "vllm-abc", [("127.0.0.2", True, "vllm-0"), ("127.0.0.3", False, "vllm-1")], port=ap
                ),
            )
            api.put_slice(
                NS, make_slice("other", service="other", endpoints=[("127.0.0.4", True, "other-0")], port=ap)
            )  # not selected
            raw = k8s_cfg(api, token_file)
            raw.update(
                {
                    "listen": {"port": 0},
                    "health": {"interval_s": 0.5},
                    "response_headers": {"worker_id": True},
                }
            )
            router = Router(parse_config(raw))
            pool = router.pool
            now = time.monotonic
            async with RouterServer(router, port=0, admin_port=0) as srv:
                await until(lambda: set(discovered(pool)) == {"vllm-0"}, 10, "first list")
                await until(
                    lambda: [w.id for w in pool.routable_workers(now())] == ["vllm-0"], 5, "vllm-0 routable"
                )
                await api.wait_watchers()
                for _ in range(6):
                    # vllm-1 becomes ready ...
                    rv = api.put_slice(
                        NS,
                        vllm_slice(
                            "vllm-abc",
                            [("127.0.0.2", True, "vllm-0"), ("127.0.0.3", True, "vllm-1")],
                            port=ap,
                        ),
                    )
                    t = await until(lambda: "vllm-1" in discovered(pool), 1.0, "ready pod")
                    membership.append(t - api.sent_at[rv])
                    t = await until(
                        lambda: any(w.id == "vllm-1" for w in pool.routable_workers(now())),
                        1.0,
                        "ready pod routable",
                    )
                    routable.append(t - api.sent_at[rv])
                    # ... and unready again (a failing readiness probe, or terminating)
                    rv = api.put_slice(
                        NS,
                        vllm_slice(
                            "vllm-abc",
                            [("127.0.0.2", True, "vllm-0"), ("127.0.0.3", False, "vllm-1")],
                            port=ap,
                        ),
                    )
                    t = await until(lambda: "vllm-1" not in discovered(pool), 1.0, "unready pod removed")
                    membership.append(t - api.sent_at[rv])
                # a new slice (scale-up) and its deletion (scale-down)
                rv = api.put_slice(NS, vllm_slice("vllm-def", [("127.0.0.3", True, "vllm-1")], port=ap))
                t = await until(lambda: "vllm-1" in discovered(pool), 1.0, "new slice")
                membership.append(t - api.sent_at[rv])
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}") as c:
                    await until(lambda: len(pool.routable_workers(now())) == 2, 2, "both")
                    seen = set()
                    for i in range(8):
                        r = await c.post(
                            "/v1/completions",
                            json={"model": "llama-3-8b", "prompt": f"request {i} " * 30, "max_tokens": 2},
                        )
                        assert r.status_code == 200, r.text
                        seen.add(r.headers["x-radixfleet-worker"])
                    assert seen <= {"vllm-0", "vllm-1"} and seen
                    rv = api.delete_slice(NS, "vllm-def")
                    t = await until(lambda: "vllm-1" not in discovered(pool), 1.0, "deleted")
                    membership.append(t - api.sent_at[rv])
                    text = (await c.get(f"http://127.0.0.1:{srv.admin_port}/metrics")).text
                    assert 'radixfleet_discovery_endpoints{source="kubernetes"} 1.0' in text
                router.discovery.reconciler.check()
                pool.check()
    finally:
        for a in agents:
            a.stop()
    ms = sorted(x * 1000 for x in membership)
    print(
        f"\nk8s discovery: watch event -> pool membership over {len(ms)} changes: "
        f"median {statistics.median(ms):.2f} ms, max {ms[-1]:.2f} ms; -> routable "
        f"(health check passed) median {statistics.median(routable) * 1000:.2f} ms, "
        f"max {max(routable) * 1000:.2f} ms"
    )
    assert ms[-1] < 1000


@pytest.mark.integration
async def test_bookmarks_410_gone_and_dropped_watches(token_file):
    async with FakeKubeAPI(bookmark_interval_s=0.05) as api:
        api.put_slice(NS, vllm_slice("a", [("127.0.0.2", True, "p0")]))
        cfg = parse_config(k8s_cfg(api, token_file))
        pool = Pool(cfg, PrefixIndex(1 << 20, 30.0))
        registry = CollectorRegistry()
        restarts = lambda r: registry.get_sample_value(  # noqa: E731
            "radixfleet_discovery_watch_restarts_total", {"source": "kubernetes", "reason": r}
        )
        lists = lambda: sum(1 for q in api.requests if "watch" not in q)  # noqa: E731
        watches = lambda: [q for q in api.requests if "watch" in q]  # noqa: E731
        async with Discovery(cfg.discovery, pool, registry) as disc:
            await until(lambda: set(discovered(pool)) == {"p0"}, 5, "list")
            await api.wait_watchers()
            first = watches()[-1]
            assert first["allowWatchBookmarks"].lower() == "true"
            assert first["resourceVersion"] == str(api.rv)  # from the list
            # Other objects move the store's resourceVersion; bookmarks carry it.
            api.put_slice(NS, make_slice("x", service="x", endpoints=[]))
            bookmark_rv = str(api.rv)
            await asyncio.sleep(0.3)  # several bookmarks
            # A dropped connection resumes the watch from the bookmark, no relist.
            api.drop_watches()
            await api.wait_watchers()
            assert watches()[-1]["resourceVersion"] == bookmark_rv
            assert lists() == 1 and restarts("dropped") + (restarts("closed") or 0) >= 1
            # Changes made while the watch was down are replayed on resume.
            api.drop_watches()
            api.put_slice(NS, vllm_slice("a", [("127.0.0.2", True, "p0"), ("127.0.0.3", True, "p1")]))
            await until(lambda: set(discovered(pool)) == {"p0", "p1"}, 5, "replayed")
            assert lists() == 1
            # Compaction: the resumed watch gets 410 Gone and relists.
            await api.wait_watchers()
            api.drop_watches()
            api.put_slice(NS, vllm_slice("b", [("127.0.0.4", True, "p2")]))
            api.compact()  # before the client comes back: its resourceVersion is too old
            await until(lambda: set(discovered(pool)) == {"p0", "p1", "p2"}, 5, "relisted")
            assert lists() == 2 and restarts("expired") == 1
            # A watch cache that falls behind sends ERROR 410 on an open watch.
            await api.wait_watchers()
            api.expire_watches()
            await until(lambda: lists() == 3, 5, "relist after ERROR 410")
            assert restarts("expired") == 2
            # timeoutSeconds ends a watch cleanly: it resumes (reason closed).
            disc.reconciler.check()
        assert set(discovered(pool)) == {"p0", "p1", "p2"}  # aclose leaves the workers


@pytest.mark.integration
async def test_watch_timeout_resumes_and_pagination_lists_everything(token_file):
    async with FakeKubeAPI() as api:
        for i in range(23):
            api.put_slice(NS, vllm_slice(f"s{i:02d}", [(f"127.0.1.{i + 1}", True, f"p{i}")]))
        cfg = parse_config(k8s_cfg(api, token_file, page_size=5, watch_timeout_s=1))
        pool = Pool(cfg, PrefixIndex(1 << 20, 30.0))
        registry = CollectorRegistry()
        async with Discovery(cfg.discovery, pool, registry):
            await until(lambda: len(discovered(pool)) == 23, 5, "paginated list")
            pages = [q for q in api.requests if "watch" not in q]
            assert len(pages) == 5 and all(q["limit"] == "5" for q in pages)
            assert "continue" not in pages[0] and all("continue" in q for q in pages[1:])
            await until(
                lambda: (
                    (
                        registry.get_sample_value(
                            "radixfleet_discovery_watch_restarts_total",
                            {"source": "kubernetes", "reason": "closed"},
                        )
                        or 0
                    )
                    >= 1
                ),
                5,
                "timeout resume",
            )
            api.delete_slice(NS, "s00")
            await until(lambda: len(discovered(pool)) == 22, 5, "after resume")
            assert len([q for q in api.requests if "watch" not in q]) == 5  # no relist


@pytest.mark.integration
async def test_unreachable_garbage_and_refused_keep_what_was_known(token_file, caplog):
    async with FakeKubeAPI() as api:
        api.put_slice(NS, vllm_slice("a", [("127.0.0.2", True, "p0"), ("127.0.0.3", True, "p1")]))
        cfg = parse_config(k8s_cfg(api, token_file))
        pool = Pool(cfg, PrefixIndex(1 << 20, 30.0))
        pool.add("admin-w", "http://127.0.0.9:1", Source.ADMIN)
        registry = CollectorRegistry()
        async with Discovery(cfg.discovery, pool, registry):
            await until(lambda: set(discovered(pool)) == {"p0", "p1"}, 5, "list")
            known = discovered(pool)
            await api.wait_watchers()
            # garbage on the watch stream: counted, relisted after backoff
            api.inject(b"this is not json\n")
            await until(lambda: errors(registry, "garbage") >= 1, 5, "garbage line")
            api.inject(b'{"type": "ERROR", "object": {"code": 500, "message": "etcd"}}\n')
            # lists answer garbage, then 500, then an event without an object
            api.list_override = (200, b"<html>proxy error</html>")
            await until(lambda: errors(registry, "garbage") >= 3, 5, "garbage lists")
            api.list_override = (500, b'{"kind": "Status", "message": "internal", "code": 500}')
            await until(lambda: errors(registry, "http_status") >= 2, 5, "500s")
            api.list_override = (200, b'{"kind": "EndpointSliceList", "items": 7}')
            await until(lambda: errors(registry, "garbage") >= 5, 5, "wrong shape")
            assert discovered(pool) == known  # through all of it
            # a malformed slice inside a valid list is skipped; the rest applies
            api.list_override = None
            api.objects[(NS, "zz")] = {
                "metadata": {"name": "zz", "labels": LABELS, "resourceVersion": "1"},
                "addressType": "IPv4",
                "ports": "nonsense",
            }
            api.put_slice(NS, vllm_slice("a", [("127.0.0.2", True, "p0")]))
            await until(lambda: set(discovered(pool)) == {"p0"}, 5, "valid part applied")
            assert errors(registry, "invalid_object") >= 1
            known = discovered(pool)
        # an unreachable API server (nothing listens any more)
        port = free_port()
        raw = k8s_cfg(api, token_file)
        raw["workers"]["discovery"]["kubernetes"]["api_server"] = f"http://127.0.0.1:{port}"
        cfg2 = parse_config(raw)
        registry2 = CollectorRegistry()
        async with Discovery(cfg2.discovery, pool, registry2) as disc2:
            await until(lambda: errors(registry2, "unreachable") >= 3, 5, "unreachable")
            assert discovered(pool) == known and pool.get("admin-w") is not None
            disc2.reconciler.check()
    # a wrong token: 401 is counted as an answer status, not a crash
    async with FakeKubeAPI(token="other") as api:
        cfg3 = parse_config(k8s_cfg(api, token_file))
        registry3 = CollectorRegistry()
        async with Discovery(cfg3.discovery, Pool(cfg3, PrefixIndex(1 << 20, 30.0)), registry3):
            await until(lambda: errors(registry3, "http_status") >= 2, 5, "401")
    # each cause is logged once per outage, however many retries counted it
    lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lines) == 1, lines


@pytest.mark.integration
async def test_thousands_of_endpoints_are_paged_capped_and_counted(token_file):
    async with FakeKubeAPI() as api:
        for s in range(40):
            api.put_slice(
                NS,
                vllm_slice(
                    f"big-{s:02d}", [(f"127.2.{s}.{i + 1}", True, f"pod-{s}-{i}") for i in range(100)]
                ),
            )
        raw = k8s_cfg(api, token_file, page_size=7)
        raw["workers"]["discovery"]["max_workers"] = 3000
        cfg = parse_config(raw)
        pool = Pool(cfg, PrefixIndex(1 << 20, 30.0))
        registry = CollectorRegistry()
        async with Discovery(cfg.discovery, pool, registry) as disc:
            await until(lambda: len(discovered(pool)) == 3000, 20, "3000 workers")
            assert (
                registry.get_sample_value("radixfleet_discovery_endpoints", {"source": "kubernetes"}) == 4000
            )
            assert errors(registry, "too_many", source="reconcile") >= 1
            disc.reconciler.check()
            pool.check()
            # one more pod: still 3000, still consistent, applied in one diff
            await api.wait_watchers()
            api.put_slice(NS, vllm_slice("big-40", [("127.2.40.1", True, "pod-40-0")]))
            await until(
                lambda: (
                    registry.get_sample_value("radixfleet_discovery_endpoints", {"source": "kubernetes"})
                    == 4001
                ),
                5,
                "4001",
            )
            assert len(discovered(pool)) == 3000
            disc.reconciler.check()
