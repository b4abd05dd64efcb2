"""``models:``: the engine settings of every worker serving a model — configured,
discovered or self-registered — so a ``kind: vllm`` worker needs only its URL;
discovery selectors take the same settings. A models: tokenizer that cannot load is
refused at start, at reload (the running config stays) and by check-config, naming
``models.<name>.tokenizer``. Events endpoints on which both sides would bind (or
connect) are refused with which side binds and what to write; check-config knows
discovery."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import pytest
import yaml
from prometheus_client import CollectorRegistry

from radixfleet.config import load_config, parse_config, resolve_engine
from radixfleet.engines.keyspace import TokenSpace
from radixfleet.fleet.discovery.base import DiscoveryMetrics, Endpoint
from radixfleet.fleet.discovery.reconcile import Reconciler
from radixfleet.fleet.pool import Pool, Source
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.server.app import Router, RouterServer
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.bench.tiny_tokenizer import build as build_tokenizer
from radixfleet_tools.harness.procs import free_port, radixfleet_argv


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(str(d))
    return str(d)


@pytest.fixture
def broken_tok(tmp_path) -> str:
    """A folder that looks like a tokenizer (the static check passes) but does not load."""
    d = tmp_path / "broken-tokenizer"
    d.mkdir()
    (d / "tokenizer.json").write_text("{not json")
    (d / "tokenizer_config.json").write_text("{}")
    return str(d)


def test_a_worker_takes_its_models_settings_where_its_own_are_unset(tok):
    cfg = parse_config(
        yaml.safe_load(f"""
models:
  tiny:
    tokenizer: {tok}
    block_size: 32
    kv_capacity_tokens: 16384
    events: {{endpoint: "tcp://*:5557", topic: kv}}
    metrics: {{interval_s: 0.5}}
workers:
  - {{url: "http://10.0.0.1:8000", kind: vllm}}
  - {{url: "http://10.0.0.2:8000", kind: vllm, model: tiny, block_size: 64,
      metrics: {{path: /m}}}}
  - {{url: "http://10.0.0.3:8000", kind: vllm, model: other}}
""")
    )
    a, b, c = cfg.workers
    ra = resolve_engine(a, cfg.models, ("tiny",))  # the model its /v1/models names
    assert (ra.tokenizer, ra.block_size, ra.kv_capacity_tokens) == (tok, 32, 16384)
    assert (ra.events.endpoint, ra.events.topic, ra.events.mode) == ("tcp://*:5557", "kv", "auto")
    assert ra.metrics.interval_s == 0.5 and ra.url == a.url and ra.kind == "vllm"
    rb = resolve_engine(b, cfg.models, ())
    assert rb.block_size == 64 and rb.metrics.path == "/m" and rb.metrics.interval_s == 0.5
    assert resolve_engine(c, cfg.models, ("tiny",)) == c  # it says it serves another model
    assert resolve_engine(a, cfg.models, ()) == a  # its model not known yet


def test_models_and_selectors_are_validated_with_their_paths(tok):
    def err(text: str) -> str:
        with pytest.raises(ConfigError) as ei:
            parse_config(yaml.safe_load(text))
        return str(ei.value)

    assert err("models: {tiny: {tokenizr: x}}").startswith(
        "models.tiny.tokenizr: unknown key; valid: block_size, chat_template, events, "
        "kv_capacity_tokens, metrics, priority_field, tokenizer"
    )
    assert err(
        f"models: {{tiny: {{tokenizer: {tok}, events: {{endpoint: 'tcp://10.0.0.1:5557'}}}}}}"
    ).startswith("models.tiny.events.endpoint: 'tcp://10.0.0.1:5557' names one host")
    assert err("models: {tiny: {block_size: 32}}\ntokenizers: {discover: false}") == (
        "models.tiny.block_size: only used with a tokenizer (token keys)"
    )
    # events without a tokenizer anywhere (and none found from the engines)
    assert err(
        "workers: {discovery: {kubernetes: {selectors: [{label_selector: a=b, "
        "kind: vllm, events: {endpoint: 'tcp://*:5557'}}]}}}\ntokenizers: {discover: false}"
    ).startswith("workers.discovery.kubernetes.selectors[0].tokenizer: required with events.endpoint")
    # an entry in error is reported once, not again as "no tokenizer" where it is used
    assert err(
        "models: {tiny: {tokenizer: /nonexistent}}\nworkers: [{url: 'http://h:1', "
        "kind: vllm, events: {endpoint: 'tcp://*:5557'}}]"
    ) == ("models.tiny.tokenizer: tokenizer folder '/nonexistent' does not exist")
    # ... which a models: entry gives
    cfg = parse_config(
        yaml.safe_load(f"""
models: {{tiny: {{tokenizer: {tok}}}}}
workers:
  - {{url: "http://10.0.0.1:8000", kind: vllm, events: {{endpoint: "tcp://*:5557"}}}}
""")
    )
    assert cfg.workers[0].tokenizer == ""
    sel = parse_config(
        yaml.safe_load(f"""
workers:
  discovery:
    kubernetes:
      selectors:
        - {{label_selector: "radixfleet.io/pool=vllm", kind: vllm, model: tiny,
            tokenizer: {tok}, block_size: 32, events: {{endpoint: "tcp://*:5557"}}}}
""")
    ).discovery.kubernetes.selectors[0]
    assert (sel.tokenizer, sel.block_size, sel.model) == (tok, 32, "tiny")


def test_a_discovered_worker_carries_its_selectors_settings(tok):
    cfg = parse_config(
        {
            "workers": {
                "discovery": {
                    "kubernetes": {
                        "selectors": [
                            {
                                "label_selector": "a=b",
                                "kind": "vllm",
                                "tokenizer": tok,
                                "block_size": 32,
                                "events": {"endpoint": "tcp://*:5557"},
                            }
                        ]
                    }
                }
            }
        }
    )
    from radixfleet.config import selector_template

    template = selector_template(cfg.discovery.kubernetes.selectors[0])
    pool = Pool(cfg, PrefixIndex(1 << 20, 30.0))
    rec = Reconciler(pool, DiscoveryMetrics(CollectorRegistry()), 10)
    rec.apply([Endpoint("vllm-0", "http://10.0.0.9:8000", "vllm", template)])
    (w,) = list(pool)
    assert w.source is Source.DISCOVERY
    assert (w.spec.url, w.spec.id, w.spec.kind) == ("http://10.0.0.9:8000", "vllm-0", "vllm")
    assert (w.spec.tokenizer, w.spec.block_size, w.spec.events.endpoint) == (tok, 32, "tcp://*:5557")


@pytest.mark.integration
async def test_a_vllm_worker_listed_by_url_only_is_keyed_with_its_models_tokenizer(tok):
    """The link learns the model (here: configured), takes the models: entry and
    moves to the engine's token space with the tokenizer loaded at start."""
    cfg = parse_config(
        {
            "models": {"tiny": {"tokenizer": tok, "block_size": 32}},
            "workers": [{"url": f"http://127.0.0.1:{free_port()}", "kind": "vllm", "model": "tiny"}],
            "listen": {"port": 0},
        }
    )
    router = Router(cfg)
    assert list(router.engines.model_keyers) == [(tok, "")]
    async with RouterServer(router, port=0, admin_port=0):
        (w,) = list(router.pool)
        deadline = time.monotonic() + 10
        while not isinstance(getattr(w.engine, "space", None), TokenSpace):
            assert time.monotonic() < deadline, "never keyed in the token space"
            await asyncio.sleep(0.02)
        link = w.engine
        assert link.spec.tokenizer == tok and link.block_size == 32
        assert link.keyer is router.engines.model_keyers[(tok, "")]  # loaded once, at start


@pytest.mark.integration
def test_check_config_and_start_refuse_a_models_tokenizer_that_cannot_load(tmp_path, tok, broken_tok):
    p = tmp_path / "r.yaml"
    p.write_text(
        f"models:\n  good: {{tokenizer: {tok}}}\n  bad: {{tokenizer: {broken_tok}}}\n"
        "workers: ['http://127.0.0.1:9']\n"
    )
    r = subprocess.run(radixfleet_argv("check-config", str(p)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    # (transformers may print its own notice first)
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("radixfleet")]
    assert line.startswith(
        f"radixfleet check-config: error: models.bad.tokenizer: {broken_tok!r} cannot be loaded: "
    ), r.stderr
    with pytest.raises(ConfigError) as ei:
        Router(load_config(str(p)))
    assert ei.value.path == "models.bad.tokenizer"


async def test_a_reload_whose_models_tokenizer_cannot_load_keeps_the_running_config(
    tmp_path, tok, broken_tok
):
    p = tmp_path / "r.yaml"
    p.write_text(f"models: {{tiny: {{tokenizer: {tok}}}}}\nreload: {{watch: false}}\n")
    router = Router(load_config(str(p)))
    before = router.cfg
    p.write_text(f"models: {{tiny: {{tokenizer: {broken_tok}}}}}\nreload: {{watch: false}}\n")
    ok, msg, _, _ = await router.reload()
    assert not ok and msg.startswith(f"models.tiny.tokenizer: {broken_tok!r} cannot be loaded: "), msg
    assert router.cfg is before and router.engines.model_keyers.keys() == {(tok, "")}
    p.write_text(f"models: {{tiny: {{tokenizer: {tok}, block_size: 32}}}}\nreload: {{watch: false}}\n")
    ok, msg, _, _ = await router.reload()
    assert ok, msg
    assert router.cfg.models["tiny"].block_size == 32


@pytest.mark.parametrize(
    "events, message",
    [
        (
            "{endpoint: 'tcp://*:5557', mode: bind}",
            "workers[0].events.mode: the engine binds tcp://*:5557 itself (a wildcard or ipc:// "
            "endpoint), so the router must connect: remove mode: bind (auto connects)",
        ),
        (
            "{endpoint: 'ipc:///tmp/kv', mode: bind}",
            "workers[0].events.mode: the engine binds ipc:///tmp/kv itself",
        ),
        (
            "{endpoint: 'tcp://10.0.0.1:5557', mode: connect}",
            "workers[0].events.mode: given tcp://10.0.0.1:5557, a concrete host, the engine connects "
            "to it, so the router must bind it",
        ),
    ],
)
def test_both_sides_binding_or_connecting_is_refused(tok, events, message):
    with pytest.raises(ConfigError) as ei:
        parse_config(
            yaml.safe_load(
                f"workers: [{{url: 'http://10.0.0.1:8000', kind: vllm, tokenizer: {tok}, events: {events}}}]"
            )
        )
    assert str(ei.value).startswith(message), str(ei.value)


@pytest.mark.integration
def test_an_endpoint_the_engine_already_binds_is_refused_with_what_to_write(tmp_path, tok):
    """The engine was given tcp://*:P and holds P; the operator wrote 127.0.0.1:P, on
    which the router would bind too (before: a ZMQ 'Address already in use' traceback
    in the router's log)."""
    engine = socket.socket()
    engine.bind(("0.0.0.0", 0))
    engine.listen()
    port = engine.getsockname()[1]
    try:
        p = tmp_path / "r.yaml"
        p.write_text(
            f"workers: [{{url: 'http://127.0.0.1:8000', kind: vllm, tokenizer: {tok},"
            f" events: {{endpoint: 'tcp://127.0.0.1:{port}'}}}}]\n"
        )
        r = subprocess.run(
            radixfleet_argv("check-config", str(p)), capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 2
        assert r.stderr.splitlines()[-1] + "\n" == (
            f"radixfleet check-config: error: workers[0].events.endpoint: "
            f"tcp://127.0.0.1:{port} is a concrete host, so the router would bind it (vLLM "
            f"connects to a concrete endpoint), but another process already holds the port: "
            f"the engine binds it (it was given tcp://*:{port}). Write tcp://*:{port} here: "
            "the router then connects to the worker's host\n"
        ), r.stderr
        with pytest.raises(ConfigError) as ei:
            Router(load_config(str(p)))
        assert ei.value.path == "workers[0].events.endpoint"
        p.write_text(
            f"workers: [{{url: 'http://127.0.0.1:8000', kind: vllm, tokenizer: {tok},"
            f" events: {{endpoint: 'tcp://192.0.2.7:{port}'}}}}]\n"
        )
        r = subprocess.run(
            radixfleet_argv("check-config", str(p)), capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 2 and "192.0.2.7 is not an address of this host" in r.stderr
    finally:
        engine.close()


@pytest.mark.integration
def test_check_config_knows_discovery(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(
        "workers:\n  discovery:\n    kubernetes:\n      selectors:\n"
        "        - {label_selector: 'radixfleet.io/pool=agent', kind: agent}\n"
    )
    r = subprocess.run(radixfleet_argv("check-config", str(p)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no "no workers listed": discovery finds them
    assert "0 worker(s) + discovery" in r.stdout


@pytest.mark.integration
async def test_a_reload_that_adds_a_models_entry_rekeys_the_running_workers(tmp_path, tok):
    """A worker already running on routing bytes takes the new entry: a new link,
    keyed with the tokenizer the reload loaded."""
    url = f"http://127.0.0.1:{free_port()}"
    p = tmp_path / "r.yaml"
    base = (
        f"workers: [{{url: '{url}', kind: vllm, model: tiny}}]\n"
        "listen: {port: 0}\nreload: {watch: false}\n"
    )
    p.write_text(base)
    router = Router(load_config(str(p)))
    async with RouterServer(router, port=0, admin_port=0):
        (w,) = list(router.pool)
        first = w.engine
        await asyncio.sleep(0.2)
        assert not isinstance(first.space, TokenSpace)
        p.write_text(base + f"models: {{tiny: {{tokenizer: {tok}, block_size: 32}}}}\n")
        ok, msg, _, _ = await router.reload()
        assert ok, msg
        deadline = time.monotonic() + 10
        while not isinstance(getattr(w.engine, "space", None), TokenSpace):
            assert time.monotonic() < deadline, "the running worker was never re-keyed"
            await asyncio.sleep(0.02)
        assert w.engine is not first and w.engine.spec.tokenizer == tok
        assert w.engine.keyer is router.engines.model_keyers[(tok, "")]
