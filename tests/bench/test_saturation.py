"""``radixfleet bench saturation`` end to end at a tiny size: calibration, every arm
on its own fresh fleet (SGLang's gateway among them), every arm's figures in the
``--json`` object. Not a timing test: the figures are only checked to be there."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from radixfleet.wire.errors import ConfigError
from radixfleet_tools.bench.saturation import ARMS, check, configure
from radixfleet_tools.loadtest.smg import find_smg, missing_message

TINY = [
    "--agents",
    "1",
    "--gpu",
    "h100",
    "--kv-tokens",
    "4000",
    "--groups",
    "4",
    "--system-tokens",
    "256",
    "--suffix-tokens",
    "16",
    "--output-tokens",
    "4",
    "--calibrate-s",
    "1.5",
    "--duration",
    "1",
    "--drain",
    "2",
    "--repeats",
    "1",
]


def _bench(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixfleet.cli", "bench", "saturation", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.integration
def test_bench_saturation_runs_every_arm_and_reports_its_fields():
    # the smg arm needs SGLang's binary: missing fails here with how to install it
    assert find_smg() is not None, missing_message()
    p = _bench(*TINY, "--json")
    assert p.returncode == 0, p.stderr + p.stdout
    out = json.loads(p.stdout)
    assert out["calibrated"] and out["capacity_rps"] > 0
    assert out["rate_rps"] == pytest.approx(1.5 * out["capacity_rps"], rel=1e-3)
    assert [r["arm"] for r in out["runs"]] == list(ARMS)
    for r in out["runs"]:
        assert r["offered"] > 0 and r["served"] > 0, r
        assert r["offered"] == r["served"] + r["shed_429"] + r["failed_other"], r
        assert 0.0 <= r["hit_rate"] <= 1.0, r
        assert set(r["ttft_ms"]) == {"p50", "p90", "p99"} and r["ttft_ms"]["p50"] is not None, r
        assert r["goodput_rps"] == pytest.approx(r["good"] / out["duration_s"], abs=1e-3), r
    for arm, s in out["summary"]["arms"].items():
        assert s["goodput_rps"] is not None and s["hit_rate"] is not None, arm
    assert out["summary"]["prefix_load_over_smg_goodput"] is not None


def test_bench_saturation_refuses_bad_flags_before_starting_anything():
    parser = argparse.ArgumentParser()
    configure(parser)
    for argv, path, says in (
        (["--arms", "prefix_load,nope"], "--arms", "unknown arm 'nope'"),
        (["--arms", "smg,smg"], "--arms", "distinct arms"),
        (["--load", "0"], "--load", "must be > 0"),
        (["--capacity", "-1"], "--capacity", "must be > 0"),
        (["--agents", "0"], "--agents", "[1, 64]"),
    ):
        with pytest.raises(ConfigError) as exc:
            check(parser.parse_args(argv))
        assert exc.value.path == path and says in exc.value.message, argv
