"""InferencePool discovery (radixfleet/fleet/discovery/inference_pool.py): the pool's v1
spec read into a Pod selector and target ports, its pods' readiness into
endpoints, and the source end to end on fake API answers (no server, no cluster):
what it asks for and what it yields, as the list and a watch event change it."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from prometheus_client import CollectorRegistry

from radixfleet.config import K8sDiscoveryConfig, K8sSelectorSpec
from radixfleet.fleet.discovery.base import DiscoveryMetrics, SourceError
from radixfleet.fleet.discovery.inference_pool import InferencePoolSource, parse_pod, parse_pool
from tests.kube_fake import FakeInferenceAPIs, FakeKubeClient, make_pod


def pool_obj(labels=None, ports=(8000,)) -> dict:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "vllm", "namespace": "llm"},
        "spec": {
            "selector": {"matchLabels": labels if labels is not None else {"radixfleet.io/pool": "vllm"}},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "radixfleet-epp", "port": {"number": 9002}},
        },
    }


def test_parse_pool_reads_the_selector_and_target_ports():
    assert parse_pool(pool_obj({"b": "2", "a": "1"}, (8000, 8001))) == ("a=1,b=2", (8000, 8001))
    for bad, what in (
        (pool_obj({}), "matchLabels"),
        (pool_obj(ports=()), "targetPorts"),
        (pool_obj(ports=tuple(range(8000, 8009))), "targetPorts"),
        (pool_obj(ports=(8000, 8000)), "unique"),
        (pool_obj(ports=(0,)), "not a port"),
        ({"spec": "x"}, "no spec"),
    ):
        with pytest.raises(ValueError, match=what):
            parse_pool(bad)


def test_parse_pod_takes_ready_addressed_running_pods_one_endpoint_per_port():
    name, rv, eps = parse_pod(make_pod("vllm-a"), (8000,), "vllm")
    assert (name, rv) == ("vllm-a", "7")
    assert [(e.id, e.url, e.kind) for e in eps] == [("vllm-a", "http://10.0.0.5:8000", "vllm")]
    _, _, eps = parse_pod(make_pod("vllm-a", ip="fd00::5"), (8000, 8001), "vllm")
    assert [(e.id, e.url) for e in eps] == [
        ("vllm-a:8000", "http://[fd00::5]:8000"),
        ("vllm-a:8001", "http://[fd00::5]:8001"),
    ]
    for p in (make_pod("x", ready=False), make_pod("x", deleting=True), make_pod("x", ip="")):
        assert parse_pod(p, (8000,), "vllm")[2] == []
    for bad in ({"metadata": {}}, make_pod("x", ip="not-an-ip"), "pod"):
        with pytest.raises(ValueError):
            parse_pod(bad, (8000,), "vllm")


def source_on(apis: FakeInferenceAPIs, client: FakeKubeClient) -> InferencePoolSource:
    src = InferencePoolSource(
        K8sDiscoveryConfig(api_server="http://127.0.0.1:1"),
        DiscoveryMetrics(CollectorRegistry()),
        "vllm",
        namespace="llm",
        template=K8sSelectorSpec(label_selector="-", kind="vllm", model="qwen"),
        backoff_s=0.01,
    )
    src._client = lambda: (client, None)  # type: ignore[method-assign]
    src._apis = lambda c: (apis, apis)  # type: ignore[method-assign]
    return src


async def test_the_source_follows_the_pools_pods():
    pods = [
        make_pod("vllm-a", "10.0.0.5"),
        make_pod("vllm-b", "10.0.0.6", ready=False),
        make_pod("vllm-c", deleting=True),
    ]
    apis, client = FakeInferenceAPIs(pool_obj(), [*pods, {"metadata": "garbage"}]), FakeKubeClient()
    src = source_on(apis, client)
    async with contextlib.aclosing(src.snapshots()) as answers:
        first = await asyncio.wait_for(anext(answers), 5)
        assert {(e.id, e.url, e.kind, e.template.model) for e in first} == {
            ("vllm-a", "http://10.0.0.5:8000", "vllm", "qwen")
        }
        line = json.dumps({"type": "MODIFIED", "object": make_pod("vllm-b", "10.0.0.6", rv="10")}) + "\n"
        apis.watch_lines.put_nowait(line.encode())
        second = await asyncio.wait_for(anext(answers), 5)
        assert {e.id for e in second} == {"vllm-a", "vllm-b"}
    assert client.closed
    # the pool read in its own namespace, then its pods listed and watched by its selector
    assert apis.calls[:3] == [
        ("get", "inference.networking.k8s.io", "v1", "llm", "inferencepools", "vllm"),
        ("list", "llm", "radixfleet.io/pool=vllm"),
        ("watch", "llm", "radixfleet.io/pool=vllm"),
    ]


async def test_a_missing_or_malformed_pool_is_a_source_error():
    for pool, cause, what in ((None, "http_status", "not found"), (pool_obj({}), "garbage", "matchLabels")):
        src = source_on(FakeInferenceAPIs(pool, []), FakeKubeClient())
        with pytest.raises(SourceError, match=what) as err:
            async with contextlib.aclosing(src.snapshots()) as answers:
                await anext(answers)
        assert err.value.cause == cause


def test_the_config_names_the_pool_and_the_gateway_flags_override_it(tmp_path):
    """``workers.discovery.kubernetes.inference_pool`` builds the source (its engine
    settings on every pod found); ``radixfleet gateway --inference-pool*`` replace the
    file's values, and absent flags keep them."""
    from radixfleet.cli import build_parser
    from radixfleet.config import parse_config
    from radixfleet.fleet.discovery.manager import build_sources
    from radixfleet.gateway.envoy import build

    raw = {
        "workers": {
            "discovery": {
                "kubernetes": {
                    "api_server": "http://127.0.0.1:1",
                    "inference_pool": {"name": "vllm", "kind": "vllm", "block_size": 32, "model": "tiny"},
                }
            }
        }
    }
    cfg = parse_config(raw)
    assert cfg.discovery.enabled()
    (src,) = build_sources(cfg.discovery, DiscoveryMetrics(CollectorRegistry()))
    assert isinstance(src, InferencePoolSource) and src.pool == "vllm" and src.namespace == ""
    t = src.template
    assert (t.kind, t.block_size, t.model) == ("vllm", 32, "tiny")
    assert not build_sources(parse_config({}).discovery, DiscoveryMetrics(CollectorRegistry()))

    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(raw))  # YAML is a superset of JSON
    argv = ["gateway", "--config", str(path), "--no-envoy"]
    cfg, _ = build(build_parser(argv).parse_args(argv))
    assert (cfg.discovery.kubernetes.inference_pool.name, cfg.discovery.kubernetes.inference_pool.kind) == (
        "vllm",
        "vllm",
    )
    argv += [
        "--inference-pool",
        "other",
        "--inference-pool-namespace",
        "llm",
        "--inference-pool-kind",
        "sglang",
    ]
    cfg, overrides = build(build_parser(argv).parse_args(argv))
    p = cfg.discovery.kubernetes.inference_pool
    assert (p.name, p.namespace, p.kind, p.block_size) == ("other", "llm", "sglang", 32)
    assert overrides["discovery__kubernetes__inference_pool__name"] == "other"  # kept over reloads
