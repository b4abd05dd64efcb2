"""A reload never lowers security silently: a file that holds
no settings is never applied; a file that turns client authentication off, opens an
API, drops tenants' or keys' rules, rate limits or the ``limits`` section is refused
unless the reload asks for it, and logged at ERROR either way; the watcher applies a
file only once it is unchanged across two polls."""

from __future__ import annotations

import logging
import os

import pytest

from radixfleet.common.auth import BearerAuth
from radixfleet.config import load_config, parse_config
from radixfleet.config.reload import (
    ConfigWatch,
    EmptyConfigFile,
    SecurityDowngrade,
    failure_reason,
    prepare,
    security_downgrades,
)
from radixfleet.server.app import Router

KEYS = (
    "keys:\n"
    "  tenant:\n"
    "    source: api_key\n"
    "    api_keys:\n"
    "      - {tenant: acme, key: sk-acme, name: ka}\n"
    "      - {tenant: beta, key: sk-beta}\n"
)
TENANCY = (
    "tenancy:\n"
    "  tenants:\n"
    "    acme: {requests_per_s: 5, tokens_per_min: 6000}\n"
    "    beta: {priority: sheddable}\n"
    "  keys:\n"
    "    ka: {requests_per_s: 2}\n"
)
LIMITS = "limits: {max_concurrency: 64, max_body_bytes: 1048576}\n"
SECURED = KEYS + TENANCY + LIMITS


def _cfg(text: str):
    import yaml

    return parse_config(yaml.safe_load(text) or {})


# ------------------------------------------------------------- what is a downgrade


@pytest.mark.parametrize(
    "new, expected",
    [
        ("", "keys.tenant.source: api_key -> none (every request is served as one tenant"),
        (
            "keys: {tenant: {source: header}}\n" + TENANCY.split("  keys:")[0] + LIMITS,
            "keys.tenant.source: api_key -> header (the tenant is whatever the request's header claims)",
        ),
        (
            SECURED.replace("source: api_key\n", "source: api_key\n    require_key: false\n"),
            "keys.tenant.require_key: true -> false",
        ),
        (
            KEYS + TENANCY.replace("    beta: {priority: sheddable}\n", "") + LIMITS,
            "tenancy.tenants: beta removed (their class and rate limits)",
        ),
        (KEYS + TENANCY.split("  keys:")[0] + LIMITS, "tenancy.keys: ka removed"),
        (
            SECURED.replace(
                "acme: {requests_per_s: 5, tokens_per_min: 6000}", "acme: {tokens_per_min: 6000}"
            ),
            "tenancy.tenants.acme.requests_per_s: 5 -> none",
        ),
        (
            SECURED.replace("ka: {requests_per_s: 2}", "ka: {priority: critical}"),
            "tenancy.keys.ka.requests_per_s: 2 -> none",
        ),
        (
            KEYS + TENANCY,
            "limits: the section is gone, back to looser defaults (max_body_bytes 1048576 -> 8388608, "
            "max_concurrency 64 -> 1024)",
        ),
    ],
    ids=[
        "empty",
        "source-header",
        "require-key-off",
        "tenant-dropped",
        "key-rules-dropped",
        "tenant-rate-dropped",
        "key-rate-dropped",
        "limits-dropped",
    ],
)
def test_each_kind_of_downgrade_is_named_with_its_field(new, expected):
    found = security_downgrades(_cfg(SECURED), _cfg(new))
    assert any(d.startswith(expected) for d in found), found


def test_an_empty_config_over_a_secured_one_names_every_loss():
    found = security_downgrades(_cfg(SECURED), _cfg(""))
    assert [d.split(":")[0] for d in found] == [
        "keys.tenant.source",
        "tenancy.tenants",
        "tenancy.keys",
        "limits",
    ]
    # acme's and beta's clients are now served as the default tenant, unlimited
    assert "tenancy.tenants: acme, beta removed (their class and rate limits)" in found


def test_opening_the_admin_or_agent_api_is_a_downgrade(monkeypatch):
    monkeypatch.setenv("RF_ADMIN", "a-secret")
    monkeypatch.setenv("RF_AGENT", "b-secret")
    old = (BearerAuth("RF_ADMIN", "admin"), BearerAuth("RF_AGENT", "agent"))
    new = (BearerAuth("RF_UNSET_ADMIN", "admin"), BearerAuth("RF_AGENT", "agent"))
    cfg = _cfg("")
    assert security_downgrades(cfg, cfg, old, new) == [
        "auth.admin_token_env: the admin API opens ($RF_UNSET_ADMIN is unset or empty)"
    ]
    assert security_downgrades(cfg, cfg, new, old) == []  # a token set: an upgrade


@pytest.mark.parametrize(
    "old, new",
    [
        ("", SECURED),  # auth, tenants and limits turned on
        ("keys: {tenant: {source: header}}\n", KEYS),  # header -> api_key
        (SECURED, SECURED.replace("requests_per_s: 5", "requests_per_s: 50")),  # a limit raised
        (SECURED, SECURED.replace("max_concurrency: 64", "max_concurrency: 128")),  # a limit raised
        (SECURED, SECURED + "policy: {name: least_load}\n"),  # nothing about security
        # beta's key revoked and its rules with it: beta can no longer send
        (
            SECURED,
            SECURED.replace("      - {tenant: beta, key: sk-beta}\n", "").replace(
                "    beta: {priority: sheddable}\n", ""
            ),
        ),
        # the limits section dropped where the defaults are tighter
        ("limits: {max_concurrency: 4096}\n", ""),
    ],
    ids=["secured", "header-to-key", "rate-raised", "limit-raised", "neutral", "revoked", "tighter-defaults"],
)
def test_an_upgrade_or_a_neutral_change_is_no_downgrade(old, new):
    assert security_downgrades(_cfg(old), _cfg(new)) == []


# ------------------------------------------------------------- empty files


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "null\n", "---\n", "{}\n"])
def test_prepare_refuses_a_file_that_holds_no_settings(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text("policy: {name: prefix_load}\n")
    running = load_config(str(p))
    p.write_text(text)
    with pytest.raises(EmptyConfigFile) as e:
        prepare(str(p), {}, salts=None, policy_cfg=running.policy, policy=None)
    assert "holds no settings: a reload never applies an empty file" in str(e.value)
    assert failure_reason(e.value) == "empty"


def test_failure_reasons():
    assert failure_reason(SecurityDowngrade(["x"])) == "downgrade"
    from radixfleet.wire.errors import ConfigError

    assert failure_reason(ConfigError("policy.name", "nope")) == "invalid"


# ------------------------------------------------------------- the router's reload


def _failures(router: Router) -> dict[str, float]:
    return {
        r: router.metrics.reload_failures.labels(reason=r)._value.get()
        for r in ("invalid", "empty", "downgrade")
    }


async def test_a_downgrade_is_refused_at_error_and_applied_only_when_asked(tmp_path, caplog):
    p = tmp_path / "router.yaml"
    p.write_text("reload: {watch: false}\n" + SECURED)
    router = Router(load_config(str(p)))
    before = router.cfg
    p.write_text("reload: {watch: false}\npolicy: {name: least_load}\n")
    with caplog.at_level(logging.INFO, logger="radixfleet"):
        ok, msg, _, _ = await router.reload()
    assert not ok and msg.startswith("the new file lowers security: keys.tenant.source: api_key -> none"), msg
    assert 'POST /admin/reload with {"allow_security_downgrade": true}' in msg
    assert router.cfg is before and router.tenants.source == "api_key"
    assert _failures(router) == {"invalid": 0, "empty": 0, "downgrade": 1}
    (rec,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert rec.levelno == logging.ERROR and "lowers security" in rec.getMessage()
    caplog.clear()

    with caplog.at_level(logging.INFO, logger="radixfleet"):
        ok, msg, _, _ = await router.reload(allow_security_downgrade=True)
    assert ok, msg
    assert router.cfg.policy.name == "least_load" and router.tenants.source == "none"
    assert router.metrics.reloads._value.get() == 1
    (rec,) = [r for r in caplog.records if "lowers security" in r.getMessage()]
    assert rec.levelno == logging.ERROR
    assert (
        "applied as asked (allow_security_downgrade): keys.tenant.source: api_key -> none" in rec.getMessage()
    )


async def test_an_empty_file_is_refused_whatever_the_reload_asks(tmp_path):
    p = tmp_path / "router.yaml"
    p.write_text("reload: {watch: false}\n" + SECURED)
    router = Router(load_config(str(p)))
    before = router.cfg
    p.write_text("")
    ok, msg, _, _ = await router.reload(allow_security_downgrade=True)
    assert not ok and "holds no settings" in msg, msg
    assert router.cfg is before
    assert _failures(router) == {"invalid": 0, "empty": 1, "downgrade": 0}


async def test_an_upgrade_applies_without_asking(tmp_path, caplog):
    p = tmp_path / "router.yaml"
    p.write_text("reload: {watch: false}\n")
    router = Router(load_config(str(p)))
    p.write_text("reload: {watch: false}\n" + SECURED)
    with caplog.at_level(logging.INFO, logger="radixfleet"):
        ok, msg, _, _ = await router.reload()
    assert ok, msg
    assert router.tenants.source == "api_key" and router.cfg.limits.max_concurrency == 64
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ------------------------------------------------------------- the watcher


def _bump(path, text: str) -> None:
    """Writes ``text`` with an mtime that differs from the last write's (coarse clocks)."""
    st = os.stat(path) if os.path.exists(path) else None
    path.write_text(text)
    if st is not None:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_the_watcher_applies_a_file_once_it_is_unchanged_across_two_polls(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("policy: {name: prefix_load}\n")
    w = ConfigWatch(str(p))
    assert not w.due()  # the file the router started with
    _bump(p, "")  # truncated ...
    assert not w.due()
    _bump(p, "policy: {name: least_load}\n")  # ... and written before the next poll
    assert not w.due()  # changed since the last poll: perhaps still being written
    assert w.due()  # unchanged for a poll: whole
    w.loading()  # the reload reads it
    assert not w.due() and not w.due()  # applied once


def test_the_watcher_never_reloads_a_missing_file_and_sighup_resets_it(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("policy: {name: prefix_load}\n")
    w = ConfigWatch(str(p))
    p.unlink()
    assert not w.due() and not w.due()
    p.write_text("policy: {name: least_load}\n")
    assert not w.due()
    w.loading()  # a SIGHUP or /admin/reload read it first
    assert not w.due() and not w.due()
