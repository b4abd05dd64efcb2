"""deploy/k8s/overlays/gie: radixfleet as the endpoint picker of a Gateway API
Inference Extension gateway. The InferencePool validates against the GIE CRD's v1
schema (``schemas/inferencepool-v1-spec.json``, vendored: its source and licence
in its ``$comment``), with unknown fields refused as ``kubectl apply``'s strict field
validation refuses them and the CRD's two CEL rules evaluated here; the rendered
overlay validates against the Kubernetes schemas as the other overlays do
(test_k8s.py); the pieces fit: the pool's picker reference reaches the EPP's gRPC
port, the pool's selector selects the example vLLM pods, the EPP's arguments name
the pool and parse as ``radixfleet gateway``, its RBAC allows what the discovery
calls, and its ConfigMap's YAML, with the pool's own object and pods served by
fake API answers, makes a router whose pool holds the ready pods."""

from __future__ import annotations

import asyncio
import copy
import json
import pathlib
import subprocess
import time
from typing import Any

import pytest
import yaml

from radixfleet.config import MISSING, load_config, parse_config
from tests.deploy_tools import ROOT, tools_venv
from tests.kube_fake import FakeInferenceAPIs, FakeKubeClient, make_pod, selector_matches

OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "gie"
SCHEMA = pathlib.Path(__file__).parent / "schemas" / "inferencepool-v1-spec.json"
KUBE_VERSIONS = ("1.30.0", "1.37.0")
#: kinds kubernetes-validate has no built-in schema for (CRDs), each checked here
CRD_KINDS = {"InferencePool", "ServiceMonitor"}


#: jsonschema runs in the tools venv (kubernetes-validate's dependency), as the
#: ServiceMonitor's models do in test_k8s.py: specs on stdin, problems per spec out.
#: Every object that lists its properties is closed to others first: the API
#: server's strict field validation (kubectl's default) refuses unknown fields.
_VALIDATE_SPECS = r"""
import json, sys
import jsonschema
def strict(s):
    if isinstance(s, dict):
        out = {k: strict(v) for k, v in s.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(s, list):
        return [strict(v) for v in s]
    return s
schema, specs = json.load(sys.stdin)
v = jsonschema.Draft202012Validator(strict(schema))
print(json.dumps([
    [f"spec.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(spec)]
    for spec in specs
]))
"""


def pool_problems(tools: pathlib.Path, docs: list[dict]) -> list[list[str]]:
    """What the API server would refuse in each InferencePool of ``docs``: its group
    and version, the spec against the CRD schema, the CRD's two CEL rules."""
    schema = json.loads(SCHEMA.read_text())
    r = subprocess.run(
        [str(tools / "python"), "-c", _VALIDATE_SPECS],
        input=json.dumps([schema, [d.get("spec", {}) for d in docs]]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return [_with_cel(schema, d, found) for d, found in zip(docs, json.loads(r.stdout))]


def _with_cel(schema: dict, doc: dict, problems: list[str]) -> list[str]:
    """``problems`` plus the group/version's and the CRD's CEL rules' own."""
    if doc.get("apiVersion") != "inference.networking.k8s.io/v1" or doc.get("kind") != "InferencePool":
        problems.append(f"not an inference.networking.k8s.io/v1 InferencePool: {doc.get('apiVersion')}")
    spec = doc.get("spec", {})
    assert schema["properties"]["endpointPickerRef"]["x-cel"] == ["self.kind != 'Service' || has(self.port)"]
    ref = spec.get("endpointPickerRef") if isinstance(spec, dict) else None
    if isinstance(ref, dict) and ref.get("kind", "Service") == "Service" and "port" not in ref:
        problems.append("spec.endpointPickerRef: port is required when kind is 'Service' or unspecified")
    assert schema["properties"]["targetPorts"]["x-cel"] == [
        "self.all(p1, self.exists_one(p2, p1.number==p2.number))"
    ]
    ports = spec.get("targetPorts") if isinstance(spec, dict) else None
    if isinstance(ports, list):
        numbers = [p.get("number") for p in ports if isinstance(p, dict)]
        if len(numbers) != len(set(numbers)):
            problems.append("spec.targetPorts: port number must be unique")
    return problems


@pytest.fixture(scope="module")
def tools() -> pathlib.Path:
    return tools_venv()


@pytest.mark.integration
@pytest.mark.timeout(1200)  # the first test of a fresh machine installs the tools
def test_the_inferencepool_validates_against_the_gie_crd_schema(tools):
    (doc,) = [d for d in yaml.safe_load_all((OVERLAY / "inferencepool.yaml").read_text()) if d]
    assert pool_problems(tools, [doc]) == [[]]
    # and the check really refuses: a typo, a CEL rule each, a bad enum, a bad label
    bad = []
    for path, value in (
        (("spec", "targetPorts", 0, "numbr"), 8000),
        (("spec", "endpointPickerRef", "failureMode"), "Open"),
        (("spec", "selector", "matchLabels", "radixfleet.io/pool"), "-vllm-"),
        (("spec", "targetPorts"), [{"number": 8000}, {"number": 8000}]),
    ):
        d = copy.deepcopy(doc)
        node = d
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        bad.append(d)
    no_port = copy.deepcopy(doc)
    del no_port["spec"]["endpointPickerRef"]["port"]
    bad.append(no_port)
    old = copy.deepcopy(doc)
    old["apiVersion"] = "inference.networking.x-k8s.io/v1alpha2"
    bad.append(old)
    found = pool_problems(tools, bad)
    assert all(len(p) == 1 for p in found), found
    assert "numbr" in found[0][0] and "Open" in found[1][0] and "unique" in found[3][0], found
    assert "port is required" in found[4][0], found


@pytest.fixture(scope="module")
def rendered(tools) -> tuple[pathlib.Path, list[dict], str]:
    r = subprocess.run(
        [str(tools / "kubectl"), "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"kustomize gie: {r.stderr}"
    return tools, [d for d in yaml.safe_load_all(r.stdout) if d], r.stdout


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


@pytest.mark.integration
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_the_overlay_validates_against_the_kubernetes_schemas(rendered, tmp_path, version):
    tools, docs, text = rendered
    path = tmp_path / "gie.yaml"
    path.write_text(text)
    r = subprocess.run(
        [str(tools / "kubernetes-validate"), "--strict", "-k", version, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ERROR" not in out, out
    crds = [d for d in docs if d["kind"] in CRD_KINDS]
    assert sorted(d["kind"] for d in crds) == ["InferencePool", "ServiceMonitor"]
    assert out.count(" passed for resource ") == len(docs) - len(crds), out
    warns = [ln for ln in out.splitlines() if ln.startswith("WARN")]
    assert len(warns) == len(crds) and all(any(k in w for k in CRD_KINDS) for w in warns), warns
    # the rendered pool (namespace and labels added) is still valid
    assert pool_problems(tools, [one(docs, "InferencePool", "vllm")]) == [[]]


def epp_args(docs: list[dict]) -> tuple[dict, Any]:
    """The EPP container and its arguments parsed by ``radixfleet gateway``'s parser."""
    from radixfleet.cli import build_parser

    dep = one(docs, "Deployment", "radixfleet-epp")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "command" not in c  # the image's ENTRYPOINT: radixfleet
    args = build_parser(c["args"]).parse_args(c["args"])
    return c, args


def epp_raw(docs: list[dict], tokenizer: str | None = None) -> dict:
    raw = yaml.safe_load(one(docs, "ConfigMap", "radixfleet-epp-config")["data"]["router.yaml"])
    if tokenizer is not None:
        for entry in raw["models"].values():
            entry["tokenizer"] = tokenizer
    return raw


@pytest.mark.integration
def test_the_pool_the_epp_and_the_workers_fit(rendered, tmp_path, monkeypatch):
    _, docs, _ = rendered
    pool = one(docs, "InferencePool", "vllm")
    ns = pool["metadata"]["namespace"]
    # the picker reference: the EPP Service's port, to the container's gRPC port, the
    # one router.yaml's gateway.picker_port binds on every address
    ref = pool["spec"]["endpointPickerRef"]
    svc = one(docs, "Service", ref["name"])
    assert svc["metadata"]["namespace"] == ns and ref.get("kind", "Service") == "Service"
    (sport,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert sport["appProtocol"] == "http2"  # gRPC: the gateway speaks HTTP/2 to it
    dep = one(docs, "Deployment", "radixfleet-epp")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    c, args = epp_args(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    raw = epp_raw(docs)
    assert ports[sport["targetPort"]] == raw["gateway"]["picker_port"]
    assert raw["gateway"]["picker_host"] == "0.0.0.0" and raw["listen"]["host"] == "0.0.0.0"
    assert ports["http"] == raw["listen"]["port"]
    for probe, service in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        assert c[probe]["grpc"] == {"port": raw["gateway"]["picker_port"], "service": service}
    # the command: the picker alone, its config where the ConfigMap is; the config
    # names this pool (no flag overrides it)
    assert args.command == "gateway" and args.no_envoy
    assert args.inference_pool is MISSING and args.inference_pool_kind is MISSING
    named = raw["workers"]["discovery"]["kubernetes"]["inference_pool"]
    assert named["name"] == pool["metadata"]["name"] and named["kind"] == "vllm"
    assert named.get("namespace", "") in ("", ns)  # "": the pod's own
    mount = next(m for m in c["volumeMounts"] if args.config.startswith(m["mountPath"] + "/"))
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert vol["configMap"]["name"] == "radixfleet-epp-config"
    assert args.state_dir.startswith("/tmp/") and any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])
    # the pool selects the vLLM pods (and not the EPP's), on their OpenAI port
    vllm = one(docs, "Deployment", "vllm")
    vlabels = vllm["spec"]["template"]["metadata"]["labels"]
    sel = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    assert selector_matches(sel, vlabels) and not selector_matches(sel, labels)
    (vc,) = vllm["spec"]["template"]["spec"]["containers"]
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= {p["containerPort"] for p in vc["ports"]}
    # the models: entry's events endpoint is the one the engines bind
    (kv,) = [a for a in vc["args"] if a.startswith("--kv-events-config=")]
    (entry,) = raw["models"].values()
    assert json.loads(kv.split("=", 1)[1])["endpoint"] == entry["events"]["endpoint"]
    assert [a for a in vc["args"] if a.startswith("--served-model-name=")] == [
        f"--served-model-name={next(iter(raw['models']))}"
    ]
    # RBAC: the EPP's account may get the pool and list + watch pods, in its namespace
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    one(docs, "ServiceAccount", sa)
    rb = one(docs, "RoleBinding", "radixfleet-epp")
    assert {"kind": "ServiceAccount", "name": sa, "namespace": ns} in rb["subjects"]
    rules = one(docs, "Role", rb["roleRef"]["name"])["rules"]

    def allowed(group: str, resource: str, verbs: set[str]) -> bool:
        return any(
            group in r["apiGroups"] and resource in r["resources"] and verbs <= set(r["verbs"]) for r in rules
        )

    assert allowed("inference.networking.k8s.io", "inferencepools", {"get"})
    assert allowed("", "pods", {"list", "watch"})
    # tokens from the generated Secret; the YAML is a valid router config
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    secret = one(docs, "Secret", refs["RADIXFLEET_ADMIN_TOKEN"]["name"])
    assert {r["key"] for r in refs.values()} <= set(secret["data"])
    p = tmp_path / "router.yaml"
    p.write_text(
        yaml.safe_dump({**raw, "models": {k: {**v, "tokenizer": ""} for k, v in raw["models"].items()}})
    )
    cfg = load_config(str(p))
    assert cfg.gateway.cluster == "original_dst"
    d = cfg.discovery  # the pool's pods are the only workers
    assert d.kubernetes.inference_pool.name == "vllm" and not d.kubernetes.selectors and not d.dns.services


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from radixfleet_tools.bench.tiny_tokenizer import build

    d = tmp_path_factory.mktemp("tokenizer")
    build(str(d))
    return str(d)


@pytest.mark.integration
async def test_the_epp_config_discovers_the_pools_ready_pods(rendered, tmp_path, tokenizer_dir, monkeypatch):
    """``radixfleet gateway`` as the Deployment runs it (its arguments, the
    ConfigMap's router.yaml), with the rendered InferencePool and its pods served by
    fake API answers: the router's pool holds the ready pods on the pool's target
    port, as vLLM workers."""
    from radixfleet.fleet.discovery.inference_pool import InferencePoolSource
    from radixfleet.fleet.pool import Source
    from radixfleet.gateway.envoy import Gateway

    _, docs, _ = rendered
    pool = one(docs, "InferencePool", "vllm")
    ns = pool["metadata"]["namespace"]
    raw = epp_raw(docs, tokenizer_dir)
    # where a pod's world differs from a test's: loopback ports, the API server
    raw["listen"] = {"host": "127.0.0.1", "port": 0}
    raw["gateway"].update({"picker_host": "127.0.0.1", "picker_port": 0})
    raw["reload"] = {"watch": False}
    raw["workers"]["discovery"]["kubernetes"].update({"api_server": "http://127.0.0.1:1", "namespace": ns})
    labels = pool["spec"]["selector"]["matchLabels"]
    apis = FakeInferenceAPIs(
        pool,
        [
            make_pod("vllm-6d4f9-abcde", "127.0.0.2", labels=labels),
            make_pod("vllm-6d4f9-fghij", "127.0.0.3", ready=False, labels=labels),
        ],
    )
    monkeypatch.setattr(InferencePoolSource, "_client", lambda self: (FakeKubeClient(), None))
    monkeypatch.setattr(InferencePoolSource, "_apis", lambda self, client: (apis, apis))
    gw = Gateway(
        parse_config(raw),
        envoy=None,
        boot_path=str(tmp_path / "envoy.json"),
        endpoints_path=str(tmp_path / "endpoints.json"),
        admin_port=0,
        state=str(tmp_path),
    )
    try:
        await gw.start()
        deadline = time.monotonic() + 5
        while not any(w.source is Source.DISCOVERY for w in gw.router.pool):
            assert time.monotonic() < deadline, "nothing discovered"
            await asyncio.sleep(0.01)
        port = pool["spec"]["targetPorts"][0]["number"]
        assert {w.id: (w.url, w.spec.kind) for w in gw.router.pool} == {
            "vllm-6d4f9-abcde": (f"http://127.0.0.2:{port}", "vllm")
        }
    finally:
        await gw.aclose()
    sel = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    assert apis.calls[:2] == [
        ("get", "inference.networking.k8s.io", "v1", ns, "inferencepools", "vllm"),
        ("list", ns, sel),
    ]
