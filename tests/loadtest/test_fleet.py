"""`radixfleet up` configuration: YAML and flags, and clear errors for bad values."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from radixfleet.wire.errors import ConfigError
from radixfleet_tools.loadtest.local_fleet import Fleet, FleetConfig, config_from_args, configure, load_config


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure(p)
    return p.parse_args(list(argv))


def test_yaml_with_flag_overrides(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text(
        "agents: 3\nmodel: llama-3-70b\nkv_tokens: 5000\n"
        "router: {port: 8123, policy: cache_aware, args: ['--log-level', 'warning']}\n"
    )
    cfg = load_config(str(f))
    assert (cfg.agents, cfg.model, cfg.kv_tokens, cfg.router_port, cfg.policy) == (
        3,
        "llama-3-70b",
        5000,
        8123,
        "cache_aware",
    )
    assert cfg.router_args == ["--log-level", "warning"]
    cfg = config_from_args(_args("--config", str(f), "--agents", "2", "--policy", "round_robin"))
    assert (cfg.agents, cfg.policy, cfg.model) == (2, "round_robin", "llama-3-70b")


@pytest.mark.parametrize(
    "text, match",
    [
        ("agents: 0\n", "agents: must be an integer in"),
        ("agents: four\n", "agents: must be an integer"),
        ("agentz: 2\n", "agentz: unknown key"),
        ("router: {polcy: x}\n", "router.polcy: unknown key"),
        ("router: 3\n", "router: must be a mapping"),
        ("kv_tokens: -1\n", "kv_tokens: must be a non-negative"),
        ("router: {port: 70000}\n", "router_port: must be a port"),
        ("agents: [\n", "not valid YAML"),
        ("- 1\n", "top level must be a mapping"),
    ],
)
def test_bad_yaml_names_the_field(tmp_path, text, match):
    f = tmp_path / "fleet.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(str(f))


@pytest.mark.integration
def test_missing_file_and_cli_exit_2(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        load_config(str(tmp_path / "nope.yaml"))
    p = subprocess.run(
        [sys.executable, "-m", "radixfleet.cli", "up", "--agents", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "agents: must be an integer in [1, 64]" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_fleet_argv_for_agents_and_router(tmp_path):
    cfg = FleetConfig(agents=2, kv_tokens=1234, agent_base_port=9400, router_port=8400, policy="cache_aware")
    fleet = Fleet(cfg, log_dir=str(tmp_path))
    assert fleet.agent_urls == ["http://127.0.0.1:9400", "http://127.0.0.1:9401"]
    assert fleet.router_url == "http://127.0.0.1:8400"
    fleet.stop()  # nothing started: a no-op, and idempotent
    fleet.stop()
