"""The router YAML schema: every validation message, defaults, overrides, check-config."""

from __future__ import annotations

import glob
import subprocess

import pytest
import yaml

from radixfleet.config import (
    MISSING,
    Config,
    load_config,
    parse_config,
    with_overrides,
)
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.harness.procs import radixfleet_argv

POLICY_NAMES = "cache_aware, consistent_hash, least_load, power_of_two, prefix_load, random, round_robin"


def err(raw) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_load(raw) if isinstance(raw, str) else raw)
    return str(e.value)


def test_defaults_are_a_valid_config():
    cfg = parse_config({})
    assert cfg == Config()
    assert cfg.policy.name == "prefix_load" and cfg.listen.port == 8000
    assert cfg.keys.block_bytes == 128 and cfg.keys.tenant.source == "none"
    assert cfg.auth.admin_token_env == "RADIXFLEET_ADMIN_TOKEN"
    assert cfg.auth.agent_token_env == "RADIXFLEET_AGENT_TOKEN"
    assert parse_config(None) == Config()


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            "polcy: {name: x}",
            "polcy: unknown key; valid: admin, auth, autoscale, breaker, bus, decisions, disagg, gateway, "
            "health, index, keys, limits, listen, load, models, policy, prefetch, registration, reload, "
            "response_headers, retries, tenancy, timeouts, tokenizers, tracing, traffic_log, warmup, workers",
        ),
        (
            "health: {intervall_s: 1}",
            "health.intervall_s: unknown key; valid: failure_threshold, "
            "interval_s, path, success_threshold, timeout_s",
        ),
        ("health: [1]", "health: expected a mapping, got list"),
        ("listen: {port: x}", "listen.port: expected an integer in [0, 65535], got 'x'"),
        ("listen: {port: 70000}", "listen.port: expected an integer in [0, 65535], got 70000"),
        ("listen: {host: 5}", "listen.host: expected a string, got 5"),
        ("limits: {max_queue: true}", "limits.max_queue: expected an integer >= 0, got True"),
        ("limits: {max_queue: -1}", "limits.max_queue: expected an integer >= 0, got -1"),
        ("health: {failure_threshold: 2.5}", "health.failure_threshold: expected an integer >= 1, got 2.5"),
        ("health: {interval_s: 0}", "health.interval_s: expected a number > 0, got 0"),
        ("health: {interval_s: .nan}", "health.interval_s: expected a number > 0, got nan"),
        ("retries: {max_attempts: null}", "retries.max_attempts: expected an integer in [1, 16], got None"),
        (
            "retries: {backoff_s: 0.5, backoff_max_s: 0.1}",
            "retries.backoff_max_s: expected a number >= retries.backoff_s (0.5)",
        ),
        ("warmup: {enabled: 1}", "warmup.enabled: expected true or false, got 1"),
        ("keys: {block_bytes: 30}", "keys.block_bytes: expected a multiple of 4, got 30"),
        ("keys: {block_bytes: 0}", "keys.block_bytes: expected an integer >= 4, got 0"),
        ("keys: {tenant: {source: jwt}}", "keys.tenant.source: 'jwt' is not one of none, api_key, header"),
        ("keys: {tenant: {source: api_key}}", "keys.tenant.api_keys: source api_key needs at least one key"),
        (
            "keys: {tenant: {source: header, header: ''}}",
            "keys.tenant.header: source header needs a header name",
        ),
        (
            "keys: {tenant: {source: api_key, api_keys: [{tenant: a}]}}",
            "keys.tenant.api_keys[0]: expected exactly one of key, key_env",
        ),
        (
            "keys: {tenant: {source: api_key, api_keys: [{tenant: a, key: k, key_env: E}]}}",
            "keys.tenant.api_keys[0]: expected exactly one of key, key_env",
        ),
        (
            "keys: {tenant: {source: api_key, api_keys: [{key: k}]}}",
            "keys.tenant.api_keys[0].tenant: required: a non-empty tenant name",
        ),
        ("keys: {tenant: {api_keys: {a: b}}}", "keys.tenant.api_keys: expected a list, got dict"),
        ("policy: {name: cache-aware}", f"policy.name: 'cache-aware' is not one of {POLICY_NAMES}"),
        ("policy: {name: 3}", "policy.name: expected a string, got 3"),
        (
            "policy: {name: prefix_load, params: {min_match_tokens: -3}}",
            "policy.params.min_match_tokens: expected an integer >= 0, got -3",
        ),
        (
            "policy: {name: round_robin, params: {foo: 1}}",
            "policy.params.foo: unknown parameter of round_robin; valid: (none)",
        ),
        ("policy: {params: [1]}", "policy.params: expected a mapping, got list"),
        ("policy: {seed: -1}", "policy.seed: expected an integer >= 0, got -1"),
        (
            "workers: {url: x}",
            "workers.url: unknown key; valid: discovery, static (or give workers as a list)",
        ),
        ("workers: 7", "workers: expected a list, got int"),
        ("workers: null", "workers: expected a list, got null"),
        ("workers: [{id: a}]", "workers[0].url: required: the worker's base URL"),
        (
            "workers: [{url: 'ftp://h:1'}]",
            "workers[0].url: expected an http:// URL with a host, got 'ftp://h:1'",
        ),
        ("workers: [{url: 'https://h:1'}]", "workers[0].url: https workers are not supported"),
        ("workers: [{url: 'http://h:99999'}]", "workers[0].url: invalid port in 'http://h:99999'"),
        ("workers: [{url: 'http://h:1/?a=b'}]", "workers[0].url: a worker URL takes no query"),
        (
            "workers: [{url: 'http://h:1', weight: 0}]",
            "workers[0].weight: expected a number in [0.01, 100], got 0",
        ),
        (
            "workers: [{url: 'http://h:1', colour: red}]",
            "workers[0].colour: unknown key; valid: block_size, bootstrap_port, chat_template, events, id, "
            "kind, kv_capacity_tokens, "
            "metrics, model, prefill_tokens_per_s, priority_field, role, tokenizer, url, weight",
        ),
        (
            "workers: ['http://h:1', {url: 'http://h:2', id: 'h:1'}]",
            "workers[1].id: duplicate worker id 'h:1' (also workers[0])",
        ),
        (
            "workers: ['http://h:1', {url: 'http://h:1/', id: b}]",
            "workers[1].url: duplicate worker url 'http://h:1' (also workers[0])",
        ),
        ("workers: [5]", "workers[0]: expected a mapping, got int"),
        ({1: 2}, "keys must be strings, got 1"),
    ],
)
def test_every_validation_message(raw, message):
    assert err(raw).startswith(message) or message in err(raw), err(raw)


def test_policy_params_unknown_names_the_valid_ones():
    msg = err("policy: {name: prefix_load, params: {foo: 1}}")
    assert msg.startswith("policy.params.foo: unknown parameter of prefix_load; valid: ")
    assert "min_match_tokens" in msg


def test_workers_shorthand_and_default_ids():
    cfg = parse_config(
        yaml.safe_load("workers: ['http://10.0.0.1:30000/', {url: 'http://h:2', id: w2, weight: 2}]")
    )
    assert [(w.id, w.url, w.weight) for w in cfg.workers] == [
        ("10.0.0.1:30000", "http://10.0.0.1:30000", 1.0),
        ("w2", "http://h:2", 2.0),
    ]


def test_overrides_use_a_sentinel_not_none():
    cfg = parse_config({"listen": {"port": 9000}})
    assert with_overrides(cfg, listen__port=MISSING) == cfg
    assert with_overrides(cfg, listen__port=9001).listen.port == 9001
    assert with_overrides(cfg, listen__host="::1").listen == cfg.listen.__class__("::1", 9000)
    assert not MISSING and repr(MISSING) == "MISSING"


def test_load_config_file_errors(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("policy: {name: x\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+, column \d+"):
        load_config(str(p))
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level, got list"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="cannot read .*missing.yaml"):
        load_config(str(tmp_path / "missing.yaml"))
    p.write_text("")
    assert load_config(str(p)).path == str(p)


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    from radixfleet_tools.bench.tiny_tokenizer import build

    d = tmp_path_factory.mktemp("tokenizer")
    build(str(d))
    return str(d)


@pytest.mark.parametrize("path", sorted(glob.glob("deploy/examples/*.yaml")))
def test_examples_validate(path, tmp_path, tiny_tokenizer_dir):
    """Each example loads as written, but for a models: entry's tokenizer folder (a
    path on the operator's machine), here a small tokenizer of the same kind."""
    raw = yaml.safe_load(open(path))
    for entry in (raw.get("models") or {}).values():
        entry["tokenizer"] = tiny_tokenizer_dir
    p = tmp_path / "example.yaml"
    p.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(p))
    assert cfg.workers


def test_the_disaggregated_example_has_both_sides_of_one_model(tmp_path, tiny_tokenizer_dir):
    raw = yaml.safe_load(open("deploy/examples/disaggregated.yaml"))
    (entry,) = raw["models"].values()
    entry["tokenizer"] = tiny_tokenizer_dir
    p = tmp_path / "pd.yaml"
    p.write_text(yaml.safe_dump(raw))
    roles = sorted(w.role for w in load_config(str(p)).workers)
    assert roles == ["decode", "decode", "prefill", "prefill"]
    # a side missing is refused, naming the entry
    raw["workers"] = [w for w in raw["workers"] if w["role"] == "prefill"]
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"workers\[0\]\.role: .*needs at least one decode worker"):
        load_config(str(p))


def test_examples_cover_the_four_setups():
    names = {p.rsplit("/", 1)[1] for p in glob.glob("deploy/examples/*.yaml")}
    assert {
        "round_robin.yaml",
        "sglang_cache_aware.yaml",
        "prefix_load.yaml",
        "tenant_isolated.yaml",
    } <= names
    assert load_config("deploy/examples/sglang_cache_aware.yaml").policy.name == "cache_aware"
    t = load_config("deploy/examples/tenant_isolated.yaml").keys.tenant
    assert t.source == "api_key" and len(t.api_keys) == 2


@pytest.mark.integration
def test_check_config_cli(tmp_path):
    ok = subprocess.run(
        radixfleet_argv("check-config", "deploy/examples/prefix_load.yaml"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OK: deploy/examples/prefix_load.yaml: policy prefix_load, 2 worker(s)")
    assert ok.stdout.count("\n") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy:\n  name: cache-aware\n")
    r = subprocess.run(radixfleet_argv("check-config", str(bad)), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr == (
        f"radixfleet check-config: error: policy.name: 'cache-aware' is not one of {POLICY_NAMES}\n"
    )
    r = subprocess.run(radixfleet_argv("check-config"), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
