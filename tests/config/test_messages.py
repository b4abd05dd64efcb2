"""The messages of the declared router schema (``radixfleet.wire.settings``): every error of a
document at once, in document order, each with its dotted path, nested sections and
lists included; rules across fields run for documents only, never for objects code
builds."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from radixfleet.config import EventsSpec, WorkerSpec, load_config, parse_config, parse_section
from radixfleet.wire.errors import ConfigError


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_load(text))
    return [str(x) for x in e.value.errors]


def test_every_error_at_once_in_document_order():
    assert errors(
        "limits: {max_queue: -1, max_body_bytes: 0}\n"
        "health: {intervall_s: 1, timeout_s: x}\n"
        "workers: [{url: 'http://a:1', weight: 0}, {id: b}]\n"
        "bus: {storage: disk}\n"
    ) == [
        "limits.max_queue: expected an integer >= 0, got -1",
        "limits.max_body_bytes: expected an integer >= 1, got 0",
        "health.intervall_s: unknown key; valid: failure_threshold, interval_s, path, "
        "success_threshold, timeout_s",
        "health.timeout_s: expected a number > 0, got 'x'",
        "workers[0].weight: expected a number in [0.01, 100], got 0",
        "workers[1].url: required: the worker's base URL",
        "bus.storage: 'disk' is not one of memory, file",
    ]


def test_the_summary_names_every_error():
    with pytest.raises(ConfigError) as e:
        parse_config({"listen": {"port": -1}, "reload": {"watch": "yes"}})
    assert str(e.value) == (
        "2 errors: listen.port: expected an integer in [0, 65535], got -1; "
        "reload.watch: expected true or false, got 'yes'"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "workers: {static: [{url: 'http://a:1', kind: gpu}]}",
            "workers.static[0].kind: 'gpu' is not one of auto, agent, vllm, sglang, openai",
        ),
        ("workers: {static: 5}", "workers.static: expected a list, got int"),
        (
            "workers: {discovery: {dns: {services: [{name: svc}]}}}",
            "workers.discovery.dns.services[0].port: required: the workers' port (1-65535)",
        ),
        (
            "workers: {discovery: {kubernetes: {selectors: [{label_selector: a, kind: auto}]}}}",
            "workers.discovery.kubernetes.selectors[0].kind: 'auto' is not one of agent, vllm, "
            "sglang, openai",
        ),
        (
            "workers: {discovery: {backoff_s: 5, backoff_max_s: 1}}",
            "workers.discovery.backoff_max_s: expected a number >= workers.discovery.backoff_s (5.0)",
        ),
        (
            "models: {m: {events: {mode: sideways}}}",
            "models.m.events.mode: 'sideways' is not one of auto, bind, connect, off",
        ),
        (
            "models: {m: {metrics: {interval_s: 0.01}}}",
            "models.m.metrics.interval_s: expected a number >= 0.05, got 0.01",
        ),
        (
            "models: {m: {colour: red}}",
            "models.m.colour: unknown key; valid: block_size, "
            "chat_template, events, kv_capacity_tokens, metrics, priority_field, tokenizer",
        ),
        (
            "models: {m: {events: {endpoint: 'tcp://10.0.0.1:5557'}, tokenizer: x}}",
            "models.m.events.endpoint: 'tcp://10.0.0.1:5557' names one host",
        ),
        ("health: {1: 2}", "health: keys must be strings, got 1"),
        ("bus: {url: 'nats://h:4222', stream: 'a.b'}", "bus.stream: expected 1.."),
        (
            "bus: {url: 'nats://h:4222', heartbeat_s: 3}",
            "bus.replica_ttl_s: expected a number > bus.heartbeat_s (3.0)",
        ),
        ("bus: {url: 'nats://h:4222', auth: {password_env: P}}", "bus.auth."),
        (
            "traffic_log: {prefix: 'a/b'}",
            "traffic_log.prefix: expected a file name prefix without '/', got 'a/b'",
        ),
        (
            "autoscale: {min_workers: 5, max_workers: 2}",
            "autoscale.max_workers: expected an integer >= min_workers (5), got 2",
        ),
        ("index: {max_bytes: 1000000000.0}", "index.max_bytes: expected an integer >= 1, got 1000000000.0"),
        ("index: {half_life_s: '30'}", "index.half_life_s: expected a number > 0, got '30'"),
        ("index: {learn_capacity: null}", "index.learn_capacity: expected true or false, got None"),
        ("keys: null", "keys: expected a mapping, got null"),
        ("policy: {name: consistent_hash, params: {vnodes: 0}}", "policy.params.vnodes: expected an integer"),
        ("path: /etc/x", "path: unknown key; valid: admin, auth, autoscale, breaker,"),
    ],
)
def test_nested_messages(text, message):
    found = errors(text)
    assert len(found) == 1 and found[0].startswith(message), found


def test_numbers_keep_their_types():
    cfg = parse_config({"health": {"interval_s": 3}, "limits": {"max_queue": 7}})
    assert cfg.health.interval_s == 3.0 and type(cfg.health.interval_s) is float
    assert type(cfg.limits.max_queue) is int


def test_rules_across_fields_are_for_documents_only():
    # code may build what a document may not (a template without a url), and
    # dataclasses.replace keeps working on the frozen sections
    spec = WorkerSpec(kind="vllm")
    assert spec.url == "" and spec.id == ""
    assert dataclasses.replace(spec, url="http://h:1").url == "http://h:1"
    assert parse_section(WorkerSpec, {"kind": "vllm"}, "worker").kind == "vllm"
    with pytest.raises(ConfigError, match=r"^worker\.kind: 'x' is not one of"):
        parse_section(WorkerSpec, {"kind": "x"}, "worker")
    assert EventsSpec().mode == "auto"


def test_duplicate_keys_keep_their_yaml_lines_beside_schema_errors(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("listen:\n  port: 1\n  port: 2\nhealth:\n  timeout_s: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert [str(x) for x in e.value.errors] == [
        "listen.port: duplicate key at line 3 (also at line 2); remove one",
        "health.timeout_s: expected a number > 0, got 0",
    ]


def test_readme_key_tables_are_made_from_the_schema():
    from radixfleet.config.reference import BEGIN, END, tables

    with open("deploy/README.md", encoding="utf-8") as f:
        text = f.read()
    block = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert block == tables(), (
        "deploy/README.md's key tables are stale: run radixfleet config-reference --write deploy/README.md"
    )
    # every key the router accepts is in them, bounds included
    assert "| `index.learn_capacity` | `true` | true or false |" in block
    assert "| `limits.max_queue` | `4096` | an integer >= 0 |" in block
    assert "| `min_match_tokens` | `64` | an integer >= 0 |" in block


@pytest.mark.integration  # the CLI as a child process
def test_config_reference_cli(tmp_path):
    import subprocess

    from radixfleet_tools.harness.procs import radixfleet_argv

    p = tmp_path / "README.md"
    p.write_text("intro\n<!-- BEGIN config-reference -->\nold\n<!-- END config-reference -->\nend\n")
    r = subprocess.run(
        radixfleet_argv("config-reference", "--write", str(p)), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "no generated block" in r.stderr
    from radixfleet.config.reference import BEGIN, END

    p.write_text(f"intro\n{BEGIN}\nold\n{END}\nend\n")
    r = subprocess.run(
        radixfleet_argv("config-reference", "--write", str(p)), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    text = p.read_text()
    assert text.startswith(f"intro\n{BEGIN}") and text.endswith(f"{END}\nend\n")
    assert "| `listen.port` | `8000` | an integer in [0, 65535] | TCP port |" in text
