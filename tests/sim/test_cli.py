"""``radixfleet simulate`` end to end: report document, sweeps and plots, bad input."""

from __future__ import annotations

import json
import os

import pytest

from radixfleet.cli import main
from radixfleet_tools.loadtest.report import validate

GSP = [
    "--workload",
    "gsp",
    "-o",
    "groups=4",
    "-o",
    "prompts_per_group=4",
    "-o",
    "system_tokens=256",
    "-o",
    "question_tokens=32",
    "-o",
    "output_tokens=8",
]


def test_simulate_json_one_run_per_policy(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(
        ["simulate", *GSP, "--agents", "3", "--policies", "round_robin,prefix_load", "--json", str(out)]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert [r["name"] for r in doc["runs"]] == ["round_robin", "prefix_load"]
    for r in doc["runs"]:
        assert r["target"] == "simulated" and r["ok"] == 16
        assert r["wall_s"] > 0 and r["sim_requests_per_s"] > 0
        assert set(r["workers"]) <= {"w0", "w1", "w2"}
    assert "prefix_load" in capsys.readouterr().out


def test_slo_adds_the_load_generators_goodput_to_each_run(tmp_path, capsys):
    """``--slo`` as ``radixfleet loadtest`` reads it: each run reports the ok requests
    within every bound (none under a bound below any TTFT, all under a generous one)
    per second of the run, and the table shows the column."""

    def runs(slo: str) -> list[dict]:
        out = tmp_path / f"{slo.replace(':', '_')}.json"
        argv = ["simulate", *GSP, "--agents", "2", "--policies", "round_robin,prefix_load"]
        assert main([*argv, "--slo", slo, "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        validate(doc)
        return doc["runs"]

    for r in runs("ttft:600000,tpot_ms=600000"):
        g = r["goodput"]
        assert g["slo"] == {"ttft_ms": 600000.0, "tpot_ms": 600000.0}
        assert g["requests"] == r["ok"] == 16 and g["share"] == 1.0
        assert g["requests_per_s"] == pytest.approx(16 / r["duration_s"])
    assert "goodput req/s" in capsys.readouterr().out
    for r in runs("ttft_ms=0.001"):
        assert r["goodput"]["requests"] == 0 and r["goodput"]["requests_per_s"] == 0.0
    # between the two: exactly the requests whose TTFT is within the bound
    out = tmp_path / "plain.json"
    assert main(["simulate", *GSP, "--agents", "2", "--policies", "prefix_load", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["runs"][0]
    assert "goodput" not in r  # no --slo, no goodput (as the load generator)
    mid = r["ttft_ms"]["p50"]
    g = runs(f"ttft_ms={mid}")[1]["goodput"]
    assert 8 <= g["requests"] < 16, g


def test_sweep_kv_tokens_shape_and_plots(tmp_path):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    rc = main(
        [
            "simulate",
            *GSP,
            "--agents",
            "2",
            "--policies",
            "round_robin,cache_aware",
            "--sweep",
            "kv_tokens=400,1200,5000",
            "--json",
            str(out),
            "--plots",
            str(plots),
        ]
    )
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 6
    assert [(r["sweep"]["value"], r["name"]) for r in runs] == [
        (v, p) for v in (400, 1200, 5000) for p in ("round_robin", "cache_aware")
    ]
    assert all(r["sweep"]["param"] == "kv_tokens" for r in runs)
    assert [r["kv_capacity_tokens"] for r in runs[::2]] == [800, 2400, 10000]
    assert [r["sim"]["kv_tokens_per_worker"] for r in runs[::2]] == [400, 1200, 5000]
    # more cache never hurts much in this workload; the largest holds every prefix
    rr = [r["hit_rate"] for r in runs if r["name"] == "round_robin"]
    assert rr[-1] >= rr[0]
    files = sorted(os.listdir(plots))
    assert files == ["sweep_kv_tokens_hit_rate.png", "sweep_kv_tokens_ttft.png"]
    assert all((plots / f).stat().st_size > 1000 for f in files)


def test_sweep_workers_and_rate(tmp_path):
    out = tmp_path / "w.json"
    assert (
        main(["simulate", *GSP, "--policies", "least_load", "--sweep", "workers=1,4", "--json", str(out)])
        == 0
    )
    runs = json.loads(out.read_text())["runs"]
    assert [len(r["workers"]) for r in runs] == [1, 4]
    out2 = tmp_path / "r.json"
    assert (
        main(["simulate", *GSP, "--policies", "least_load", "--sweep", "rate=5,50", "--json", str(out2)]) == 0
    )
    runs = json.loads(out2.read_text())["runs"]
    assert [r["sweep"]["value"] for r in runs] == [5.0, 50.0]
    assert runs[0]["duration_s"] > runs[1]["duration_s"]


def test_feedback_ablation_in_one_call(tmp_path):
    out = tmp_path / "fb.json"
    assert (
        main(
            [
                "simulate",
                *GSP,
                "--policies",
                "prefix_load",
                "--kv-tokens",
                "600",
                "--feedback",
                "none,events",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == ["prefix_load+none", "prefix_load+events"]
    assert [r["sim"]["feedback"] for r in runs] == ["none", "events"]


def test_plain_plots(tmp_path):
    plots = tmp_path / "p"
    assert main(["simulate", *GSP, "--policies", "round_robin", "--plots", str(plots)]) == 0
    assert "hit_rate.png" in os.listdir(plots)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--policies", "nope"], "'nope' is not one of"),
        (["--sweep", "cache=1,2"], "--sweep"),
        (["--sweep", "kv_tokens=1,x"], "not a whole number"),
        (["--feedback", "sometimes"], "--feedback"),
        (["--agents", "0"], "--agents"),
        (["--kv-tokens", "-5"], "--kv-tokens"),
        (["--gpu", "tpu9"], "unknown preset 'tpu9'"),
        (["-o", "groups=abc"], "groups"),
        (["-P", "prefix_load.nosuch=1"], "nosuch"),
        (["--repeat", "3"], "--repeat"),
        (["--jobs", "-1"], "--jobs"),
        (["--slo", "latency=5"], "--slo: 'latency=5' must be KEY=MS"),
        (["--slo", "ttft_ms=0"], "the bound must be > 0 ms"),
        (["--router-config", "/nonexistent/router.yaml"], "cannot read /nonexistent/router.yaml"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    rc = main(["simulate", *GSP, *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert needle in err and len(err.splitlines()) == 1, err


def test_router_config_file_sets_the_simulated_routers_settings(tmp_path, capsys):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("warmup: {enabled: false}\nload: {report_stale_s: 0.5}\n")
    hot = [
        "--workload",
        "gsp",
        "-o",
        "groups=1",
        "-o",
        "prompts_per_group=100",
        "-o",
        "system_tokens=256",
        "-o",
        "question_tokens=32",
        "-o",
        "output_tokens=8",
        "--rate",
        "200",
        "--policies",
        "prefix_load",
        "-P",
        "prefix_load.warm_ahead=true",
        "-P",
        "prefix_load.hot_min_rate=0.5",
        "-P",
        "prefix_load.holder_max_rate=0.5",
    ]
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    assert main(["simulate", *hot, "--agents", "4", "--json", str(on)]) == 0
    assert main(["simulate", *hot, "--agents", "4", "--router-config", str(cfg), "--json", str(off)]) == 0
    warm = [json.loads(f.read_text())["runs"][0]["sim"]["warmups"] for f in (on, off)]
    assert warm[0] > 0 and warm[1] == 0
    cfg.write_text("warmup: {min_interval_s: -1}\n")
    assert main(["simulate", *GSP, "--router-config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert "warmup.min_interval_s" in err and len(err.splitlines()) == 1, err


def test_missing_trace_is_one_line(tmp_path, capsys):
    assert main(["simulate", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_simulate_runs_the_demos_fleet_and_load_by_default():
    """With no flags, ``simulate`` plans what ``demo`` runs live: the same workload,
    agents, per-agent KV, open-loop rate and policies (one set of defaults)."""
    import argparse

    from radixfleet_tools.loadtest import demo
    from radixfleet_tools.loadtest.arrivals import Poisson
    from radixfleet_tools.loadtest.simulator import cli as sim_main

    def parsed(configure, argv=()):
        p = argparse.ArgumentParser()
        configure(p)
        return p.parse_args(list(argv))

    d = parsed(demo.configure)
    plans, workload, _, _ = sim_main.build(parsed(sim_main.configure))
    assert workload.name == d.workload
    # the demo's own options for it (radixfleet_tools.loadtest.defaults), a user's -o first
    assert workload.params.max_parallel == demo.defaults.WORKLOAD_OPTIONS["max_parallel"]
    _, own, _, _ = sim_main.build(parsed(sim_main.configure, ["-o", "max_parallel=5"]))
    assert own.params.max_parallel == 5
    # a named --workload is that workload as its defaults are (the seeded results' runs)
    _, named, _, _ = sim_main.build(parsed(sim_main.configure, ["--workload", "mixed"]))
    assert named.params.max_parallel == type(named.params)().max_parallel
    assert [p.name for p in plans] == d.policies.split(",")
    for p in plans:
        assert p.cfg.workers == d.agents and p.cfg.engine.kv_tokens == d.kv_tokens
        assert isinstance(p.arrivals, Poisson) and p.arrivals.rate == demo.defaults.RATE
    p = argparse.ArgumentParser()
    sim_main.configure(p)
    assert "Defaults are the demo's" in p.format_help()  # --help says so


@pytest.mark.integration
def test_same_seed_same_document_across_processes(tmp_path):
    """String hashing is randomized per process; no decision may depend on it."""
    import subprocess
    import sys

    docs = []
    for hs in ("1", "2"):
        out = tmp_path / f"d{hs}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "radixfleet.cli",
                "simulate",
                *GSP,
                "--agents",
                "3",
                "--policies",
                "cache_aware,prefix_load,power_of_two",
                "--kv-tokens",
                "600",
                "--seed",
                "4",
                "--json",
                str(out),
            ],
            check=True,
            capture_output=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": hs},
        )
        doc = json.loads(out.read_text())
        for r in doc["runs"]:
            del r["wall_s"], r["sim_requests_per_s"]
        docs.append(doc)
    assert docs[0] == docs[1]


def test_trace_repeat_block_level(tmp_path):
    from tests.sim.traces import _trace

    path = _trace(tmp_path, n=20)
    out = tmp_path / "t.json"
    assert (
        main(
            [
                "simulate",
                "--trace",
                path,
                "-o",
                "block_tokens=16",
                "--repeat",
                "3",
                "--requests",
                "1000",
                "--duration",
                "1e6",
                "--policies",
                "prefix_load",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (r,) = json.loads(out.read_text())["runs"]
    assert r["requests"] == r["ok"] == 60 and r["sim"]["level"] == "block"
    assert r["workload"]["name"] == "trace"


@pytest.mark.integration
def test_jobs_run_in_processes_with_identical_reports(tmp_path):
    """--jobs N runs the independent runs in N processes: same runs, same order, same
    figures but for the wall-clock ones."""
    docs = []
    for jobs in ("1", "3"):
        out = tmp_path / f"j{jobs}.json"
        assert (
            main(
                [
                    "simulate",
                    *GSP,
                    "--agents",
                    "3",
                    "--policies",
                    "round_robin,cache_aware,prefix_load",
                    "--sweep",
                    "kv_tokens=300,3000",
                    "--seed",
                    "2",
                    "--jobs",
                    jobs,
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        doc = json.loads(out.read_text())
        validate(doc)
        for r in doc["runs"]:
            assert r["wall_s"] > 0
            del r["wall_s"], r["sim_requests_per_s"]
        docs.append(doc)
    assert len(docs[0]["runs"]) == 6
    assert docs[0] == docs[1]


def test_bench_sim_floor_row_splits_a_request_into_its_library_calls(capsys):
    assert main(["bench", "sim", "--rows", "gsp_floor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["rows"]
    assert row["row"] == "gsp_floor" and row["requests"] == 1024 and row["workers"] == 8
    parts = row["parts_us"]
    assert set(parts) == {"keying", "references", "router_pick", "agent_cache", "feedback"}
    assert all(v > 0 for v in parts.values())
    assert row["floor_us_per_request"] == pytest.approx(sum(parts.values()), abs=0.1)
    ceiling = row["ceiling_sim_requests_per_s"] * row["floor_us_per_request"] / 1e6
    assert ceiling == pytest.approx(1.0, rel=0.01)


def test_bench_sim_rejects_an_unknown_row(capsys):
    assert main(["bench", "sim", "--rows", "gsp_9w"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "radixfleet bench: error: --rows: unknown row 'gsp_9w'; rows: gsp_8w, "
        "gsp_light_8w, trace_100k, long_5k, gsp_500w, gsp_floor"
    ]


def test_unwritable_outputs_fail_before_the_run(tmp_path, capsys):
    """A bad --json or --plots is refused up front (exit 2, one line), not with a
    traceback once the results exist; an existing report is left as it was."""
    blocker = tmp_path / "a-file"
    blocker.write_text("keep")
    cases = [
        (["--json", str(blocker / "sim.json")], "--json: cannot write"),
        (["--plots", str(blocker / "plots")], "--plots: cannot write into"),
        (["--json", str(tmp_path)], "is a directory"),
    ]
    for argv, needle in cases:
        assert main(["simulate", *GSP, "--agents", "2", *argv]) == 2
        out, err = capsys.readouterr()
        assert needle in err and len(err.strip().splitlines()) == 1, err
        assert "radixfleet simulate" not in out  # no table: nothing ran
    assert blocker.read_text() == "keep"
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    from radixfleet_tools.loadtest.report import check_outputs

    check_outputs(files=[("--json", str(existing))], dirs=[("--plots", str(tmp_path / "p"))])
    assert existing.read_text() == "{}" and (tmp_path / "p").is_dir()
    assert sorted(x.name for x in (tmp_path / "p").iterdir()) == []


def test_simulate_takes_loadtests_arrival_shapes():
    """``--burstiness`` and ``--rate`` with a ``--concurrency`` cap mean in ``simulate``
    what they mean in ``loadtest``: the same arrivals, kept across a rate sweep."""
    import argparse

    from radixfleet_tools.loadtest.arrivals import Poisson
    from radixfleet_tools.loadtest.cli import build_load
    from radixfleet_tools.loadtest.cli import configure as loadtest_configure
    from radixfleet_tools.loadtest.simulator import cli as sim_main

    def parsed(configure, argv):
        p = argparse.ArgumentParser()
        configure(p)
        return p.parse_args(argv)

    flags = ["--workload", "zipf", "--rate", "20", "--burstiness", "0.25", "--concurrency", "3"]
    plans, _, _, _ = sim_main.build(parsed(sim_main.configure, [*flags, "--policies", "round_robin"]))
    live = parsed(loadtest_configure, flags)
    live.rate = live.rate[0]  # loadtest runs each rate of its list through build_load
    assert [p.arrivals for p in plans] == [build_load(live)[1]] == [Poisson(20.0, 0.25, 3)]
    swept, _, _, _ = sim_main.build(
        parsed(sim_main.configure, [*flags, "--policies", "round_robin", "--sweep", "rate=5,40"])
    )
    assert [p.arrivals for p in swept] == [Poisson(5.0, 0.25, 3), Poisson(40.0, 0.25, 3)]
