"""Worker roles (prefill / decode / both) in the router's config, discovery selectors
and agent registration: a model served by prefill workers without a decode worker
(or the other way round) is refused at load, check-config and reload, naming the
field."""

from __future__ import annotations

import subprocess

import pytest

from radixfleet.config import ConfigError, PolicyConfig, load_config, parse_config, selector_template
from radixfleet.config.reload import prepare
from radixfleet.wire import events as ev
from radixfleet.wire.errors import MalformedRequest
from radixfleet_tools.harness.procs import radixfleet_argv

P = {"url": "http://10.0.0.1:8000", "role": "prefill", "model": "m"}
D = {"url": "http://10.0.0.2:8000", "role": "decode", "model": "m"}
B = {"url": "http://10.0.0.3:8000", "model": "m"}


def _error(raw) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        parse_config(raw)
    return ei.value


def test_roles_default_to_both_and_a_prefill_decode_fleet_loads():
    cfg = parse_config({"workers": [P, D, B], "disagg": {"colocate_below_tokens": 64}})
    assert [w.role for w in cfg.workers] == ["prefill", "decode", "both"]
    assert cfg.disagg.colocate_below_tokens == 64 and cfg.disagg.decode_step_s == 0.025


def test_an_unknown_role_is_refused_at_its_field():
    e = _error({"workers": [{**P, "role": "prefil"}, D]})
    assert any(x.path == "workers[0].role" for x in e.errors), e


@pytest.mark.parametrize(
    ("workers", "path", "missing"),
    [
        ([P, B], "workers[0].role", "decode"),
        ([B, D], "workers[1].role", "prefill"),
        ([P, {**D, "model": "other"}], "workers[0].role", "decode"),  # per model
    ],
)
def test_a_model_with_one_side_only_is_refused_naming_the_entry(workers, path, missing):
    e = _error({"workers": workers})
    err = e.errors[0]  # (per model: the other model's entry is named too)
    assert err.path == path and f"at least one {missing} worker" in err.message


def test_the_static_form_and_selectors_are_named_too():
    e = _error({"workers": {"static": [B, P]}})
    assert e.errors[0].path == "workers.static[1].role"
    sel = {"label_selector": "app=p", "role": "prefill", "model": "m"}
    e = _error({"workers": {"static": [B], "discovery": {"kubernetes": {"selectors": [sel]}}}})
    assert e.errors[0].path == "workers.discovery.kubernetes.selectors[0].role"
    dns = {"name": "d.svc", "port": 8000, "role": "decode", "model": "m"}
    cfg = parse_config({"workers": {"static": [P], "discovery": {"dns": {"services": [dns]}}}})
    assert selector_template(cfg.discovery.dns.services[0]).role == "decode"


@pytest.mark.integration  # runs the CLI
def test_check_config_and_reload_refuse_a_one_sided_fleet(tmp_path):
    p = tmp_path / "router.yaml"
    p.write_text("workers:\n  - {url: 'http://10.0.0.1:8000', role: prefill, model: m}\n")
    out = subprocess.run(radixfleet_argv("check-config", str(p)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "workers[0].role" in out.stderr + out.stdout
    with pytest.raises(ConfigError, match=r"workers\[0\]\.role"):
        load_config(str(p))
    with pytest.raises(ConfigError, match=r"workers\[0\]\.role"):
        prepare(str(p), {}, salts=None, policy_cfg=PolicyConfig(), policy=None)


def test_an_agent_registers_its_role():
    reg = ev.parse_registration({"worker_id": "a", "url": "http://h:1", "epoch": "e", "role": "prefill"})
    assert reg.role == "prefill"
    assert ev.parse_registration({"worker_id": "a", "url": "http://h:1", "epoch": "e"}).role == "both"
    with pytest.raises(MalformedRequest) as ei:
        ev.parse_registration({"worker_id": "a", "url": "http://h:1", "epoch": "e", "role": "x"})
    assert ei.value.param == "role"


def test_a_registered_agent_keeps_its_role_and_a_reload_changes_a_configured_one():
    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex

    cfg = parse_config({"workers": [P, D]})
    pool = Pool(cfg, PrefixIndex(), clock=lambda: 0.0)
    w = pool.register("agent-1", "http://10.0.0.9:8000", "e1", ["m"], None, "prefill")
    assert w.role == "prefill" and w.describe(0.0)["role"] == "prefill"
    assert pool.get("10.0.0.2:8000").role == "decode"
    pool.sync_config(parse_config({"workers": [{**P, "role": "both"}, {**D, "role": "both"}]}).workers)
    assert pool.get("10.0.0.1:8000").role == "both"


def test_the_prefill_leg_asks_for_one_token_and_the_kv_kept_for_a_remote_decode():
    from radixfleet.route.pd import PREFILL_PARAMS, prefill_body

    client = {"model": "m", "prompt": "x", "max_tokens": 9, "max_completion_tokens": 9, "stream": True}
    leg = prefill_body({**client, "stream_options": {"include_usage": True}})
    assert leg == {
        "model": "m",
        "prompt": "x",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    assert client["max_tokens"] == 9  # the client's body is not touched


def test_the_colocate_threshold_is_one_decode_step_of_the_learned_prefill_rate():
    from types import SimpleNamespace

    from radixfleet.fleet.pool import Pool
    from radixfleet.index.prefix_index import PrefixIndex
    from radixfleet.route.pd import PrefillDecode

    cfg = parse_config({"workers": [P, {**D, "prefill_tokens_per_s": 8000}]})
    pool = Pool(cfg, PrefixIndex(), clock=lambda: 0.0)
    d = pool.get("10.0.0.2:8000")
    pd = PrefillDecode(SimpleNamespace(cfg=cfg, pool=pool))
    assert pd.threshold(d, 0.0) == 200  # 8000 tokens/s x 25 ms
    fixed = parse_config({"workers": [P, D], "disagg": {"colocate_below_tokens": 7}})
    assert PrefillDecode(SimpleNamespace(cfg=fixed, pool=pool)).threshold(d, 0.0) == 7


def test_an_agent_on_the_bus_registers_its_role():
    from radixfleet.wire.bus_wire import build_agent, parse_agent, worker_token
    from radixfleet.wire.events import EventBatch, Snapshot

    batch = EventBatch("w1", "http://10.0.0.9:8000", "e1", 0, [Snapshot([])])
    m = parse_agent(build_agent(batch, ["m"], 128, "decode"), worker_token("w1"))
    assert m.register and m.role == "decode"
    assert parse_agent(build_agent(batch, ["m"], 128), worker_token("w1")).role == "both"
