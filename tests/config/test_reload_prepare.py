"""radixfleet.config.reload.prepare: a reload's validation half builds everything from the new
file before the running router changes, keeps what did not change (the policy
object and its state, the tenant salts and their caches), and raises ConfigError —
naming the field — for anything invalid."""

from __future__ import annotations

import pytest

from radixfleet.common.tenancy import TenantSalts
from radixfleet.config import build_policy_from, load_config
from radixfleet.config.reload import config_file_version, prepare
from radixfleet.wire.errors import ConfigError


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _running(path: str):
    cfg = load_config(path)
    salts = TenantSalts.from_env(cfg.keys.tenant_salt_env, b"")
    return cfg, salts, build_policy_from(cfg.policy)


def test_an_unchanged_policy_and_salt_secret_are_kept_as_objects(tmp_path, monkeypatch):
    monkeypatch.setenv("RF_TEST_SALT", "s3cret")
    p = _write(tmp_path / "r.yaml", "keys: {tenant_salt_env: RF_TEST_SALT}\npolicy: {name: prefix_load}\n")
    cfg, salts, policy = _running(p)
    _write(
        tmp_path / "r.yaml",
        "keys: {tenant_salt_env: RF_TEST_SALT}\npolicy: {name: prefix_load}\nindex: {max_bytes: 1000000}\n",
    )
    out = prepare(p, {}, salts=salts, policy_cfg=cfg.policy, policy=policy)
    assert out.policy is policy  # hot roots and rates survive the reload
    assert out.tenants.salts is salts  # so do the salt caches
    assert out.cfg.index.max_bytes == 1_000_000


def test_a_changed_policy_or_salt_is_built_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("RF_TEST_SALT", "one")
    p = _write(tmp_path / "r.yaml", "keys: {tenant_salt_env: RF_TEST_SALT}\npolicy: {name: prefix_load}\n")
    cfg, salts, policy = _running(p)
    monkeypatch.setenv("RF_TEST_SALT", "two")
    _write(tmp_path / "r.yaml", "keys: {tenant_salt_env: RF_TEST_SALT}\npolicy: {name: least_load}\n")
    out = prepare(p, {}, salts=salts, policy_cfg=cfg.policy, policy=policy)
    assert out.policy is not policy and out.policy.name == "least_load"
    assert not out.tenants.salts.same_keys(salts)
    assert out.tenants.salts.salt("acme") != salts.salt("acme")


def test_overrides_keep_winning_over_the_file(tmp_path):
    p = _write(tmp_path / "r.yaml", "policy: {name: prefix_load}\n")
    cfg, salts, policy = _running(p)
    out = prepare(p, {"index__max_bytes": 123_456}, salts=salts, policy_cfg=cfg.policy, policy=policy)
    assert out.cfg.index.max_bytes == 123_456


@pytest.mark.parametrize(
    "text, field",
    [
        ("policy: {name: cache-aware}\n", "policy.name"),
        ("listen: {host: 10.0.0.1}\n", "auth.agent_token_env"),  # the agent API off loopback
        ("admin: {host: 10.0.0.1}\n", "auth.admin_token_env"),  # the admin API off loopback
        ("index: {max_bytes: -1}\n", "index.max_bytes"),
    ],
)
def test_an_invalid_file_raises_with_its_field(tmp_path, text, field):
    p = _write(tmp_path / "r.yaml", "policy: {name: prefix_load}\n")
    cfg, salts, policy = _running(p)
    _write(tmp_path / "r.yaml", text)
    with pytest.raises(ConfigError) as e:
        prepare(p, {}, salts=salts, policy_cfg=cfg.policy, policy=policy)
    assert str(e.value).startswith(field), e.value


def test_the_file_version_changes_with_content_and_is_none_when_missing(tmp_path):
    p = _write(tmp_path / "r.yaml", "policy: {name: prefix_load}\n")
    v1 = config_file_version(p)
    _write(tmp_path / "r.yaml", "policy: {name: least_load}\n")
    assert v1 is not None and config_file_version(p) != v1
    assert config_file_version(str(tmp_path / "gone.yaml")) is None
