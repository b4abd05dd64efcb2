"""bench/sim_seeds.py: a simulation at several seeds, its TTFTs pooled per arm. Runs
the simulator in process (virtual time, ~1 s)."""

from __future__ import annotations

import argparse
import json

import pytest

from radixfleet_tools.loadtest.report import percentile
from radixfleet_tools.loadtest.simulator import cli as sim_cli
from tests.bench.scripts import load_script

_FLAGS = [
    "--agents",
    "2",
    "--workload",
    "agent",
    "-o",
    "sessions=4",
    "-o",
    "steps=3",
    "--policies",
    "prefix_load,round_robin",
]


@pytest.fixture(scope="module")
def seeds():
    return load_script("sim_seeds.py")


def test_every_seeds_requests_are_pooled_per_arm(seeds, tmp_path, capsys):
    out = tmp_path / "pooled.json"
    assert seeds.main(["--seeds", "3,5-6", "--json", str(out), "--", *_FLAGS]) == 0
    got = {a["arm"]: a for a in json.loads(out.read_text())["arms"]}
    assert got.keys() == {"prefix_load", "round_robin"}
    # the same runs one by one: the pooled figures are theirs together
    sp = argparse.ArgumentParser()
    sim_cli.configure(sp)
    for arm in got.values():
        ttfts, p99s = [], []
        for s in (3, 5, 6):
            plans, workload, bounds, params = sim_cli.build(sp.parse_args([*_FLAGS, "--seed", str(s)]))
            (o,) = [
                o
                for o in sim_cli.simulate(plans, workload, bounds, params, seed=s)
                if o.report["name"] == arm["arm"]
            ]
            ttfts += o.ttft_ms
            p99s.append(percentile(o.ttft_ms, 0.99))
        assert arm["requests"] == len(ttfts) == 3 * 12
        assert arm["ttft_p99_ms"] == percentile(ttfts, 0.99)
        assert arm["ttft_max_ms"] == max(ttfts)
        assert arm["p99_per_seed_ms"] == p99s
    assert "p99 per seed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--seeds", "x", "--", *_FLAGS],
        ["--seeds", "5-3", "--", *_FLAGS],
        ["--seeds", "1", "--", *_FLAGS, "--seed", "2"],
        ["--seeds", "1", "--", "--policies", "nope"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(seeds, argv, capsys):
    try:
        rc = seeds.main(argv)
    except SystemExit as exc:  # argparse's own
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
