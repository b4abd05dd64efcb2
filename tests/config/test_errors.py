"""A router config with duplicate keys is refused with every error reported at once;
check-config warns about a fleet with no workers."""

from __future__ import annotations

import subprocess

import pytest

from radixfleet.config import ConfigError, load_config
from radixfleet_tools.harness.procs import radixfleet_argv


def test_config_refuses_duplicate_keys_and_reports_every_error(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(
        "workers:\n  - url: http://a:1\n    weight: 2\n    weight: 3\n"
        "limits:\n  max_queue: -1\n  max_body_bytes: 0\n"
        "policy:\n  name: nope\npolicy:\n  name: round_robin\n"
    )
    with pytest.raises(ConfigError) as ei:
        load_config(str(p))
    paths = [e.path for e in ei.value.errors]
    assert paths == ["workers[0].weight", "policy", "limits.max_queue", "limits.max_body_bytes"]
    assert "duplicate key at line 4 (also at line 3)" in str(ei.value)
    assert str(ei.value).startswith("4 errors: ")


@pytest.mark.integration
def test_check_config_warns_on_an_empty_fleet(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    out = subprocess.run(radixfleet_argv("check-config", str(p)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "OK:" in out.stdout
    assert "warning:" in out.stderr and "no workers listed" in out.stderr
