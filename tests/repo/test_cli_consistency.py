"""One command line: every subcommand reads the same (contract 5).

The same flag means the same thing everywhere (``--model`` the request's model name,
``--agent-model`` the agents' preset, ``--agents`` their number, ``--skip-bad-lines``,
``-P/--policy-param [POLICY.]NAME=VALUE``, ``--log-level`` in any case); the old
spellings still work and warn; every option has help and shows its default; bad input
is one line on stderr and exit 2. Parsers only: nothing is started.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from radixfleet.cli import SUBCOMMANDS, build_parser
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.bench import BENCHMARKS


def _sub(*names: str) -> argparse.ArgumentParser:
    parser = build_parser(list(names))
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _all_parsers():
    for name in SUBCOMMANDS:
        if name == "bench":
            for b in BENCHMARKS:
                yield f"bench {b}", _sub("bench", b)
        else:
            yield name, _sub(name)


def _visible(parser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions if a.help is not argparse.SUPPRESS for o in a.option_strings}


def test_every_option_of_every_subcommand_has_help_and_its_default_shown():
    for name, parser in _all_parsers():
        missing = [a.option_strings for a in parser._actions if a.option_strings and a.help is None]
        assert not missing, (name, missing)
    text = _sub("demo").format_help()
    assert "--agents AGENTS       simulated agents (default: 4)" in text
    assert "the agents' GPU preset (default: h100)" in text
    # the workloads' -o options are in the help, not found by triggering an error
    for cmd in ("loadtest", "demo", "simulate"):
        assert "gsp: groups [64]" in _sub(cmd).format_help(), cmd
    assert "up --help" not in _sub("up").format_help()


def test_one_meaning_per_flag_across_subcommands():
    for name, parser in _all_parsers():
        opts = _visible(parser)
        if "--model" in opts:  # the request's model name, and only where requests are sent
            assert name == "loadtest", name
        assert "--skip-bad" not in opts, name
    for name in ("up", "demo", "simulate", "analyze", "agent"):
        assert "--agent-model" in _visible(_sub(name)), name
    for name in ("up", "demo", "loadtest", "simulate", "analyze"):
        opts = _visible(_sub(name))
        assert "--agents" in opts and "--workers" not in opts, name
    assert "--agent-model" in _visible(_sub("loadtest"))  # --ab's fleet
    for name in ("router", "simulate", "bench replicas"):
        parser = _sub(*name.split())
        assert {"-P", "--policy-param"} <= set(_visible(parser)), name
        assert "[POLICY.]NAME=VALUE" in parser.format_help(), name
    help_text = _sub("router").format_help()
    assert "prefix_load" in help_text and "round_robin" in help_text  # --policy lists them


def test_old_spellings_still_work_and_warn(capsys):
    cases = [
        (["simulate", "--workers", "3"], "workers", 3, "--workers is deprecated; use --agents"),
        (
            ["simulate", "--model", "llama-3-70b"],
            "model",
            "llama-3-70b",
            "--model is deprecated; use --agent-model",
        ),
        (
            ["analyze", "x.jsonl", "--skip-bad"],
            "skip_bad",
            True,
            "--skip-bad is deprecated; use --skip-bad-lines",
        ),
        (["analyze", "x.jsonl", "--workers", "2"], "workers", 2, "use --agents"),
        (["demo", "--model", "llama-3-70b"], "fleet_model", "llama-3-70b", "use --agent-model"),
        (["up", "--model", "llama-3-70b"], "model", "llama-3-70b", "use --agent-model"),
        (["agent", "--port", "1", "--model", "llama-3-70b"], "model", "llama-3-70b", "use --agent-model"),
    ]
    for argv, dest, value, warning in cases:
        args = build_parser(argv).parse_args(argv)
        assert getattr(args, dest) == value, argv
        err = capsys.readouterr().err
        assert warning in err and len(err.strip().splitlines()) == 1, (argv, err)
    # the new spellings set the same fields, silently
    args = build_parser(["simulate"]).parse_args(
        ["simulate", "--agents", "3", "--agent-model", "llama-3-70b"]
    )
    assert (args.workers, args.model) == (3, "llama-3-70b")
    args = build_parser(["simulate"]).parse_args(["simulate"])
    assert (args.workers, args.model) == (4, "llama-3-8b")  # an alias never hides the default
    assert capsys.readouterr().err == ""


def test_log_levels_are_case_insensitive_everywhere(capsys):
    for cmd, extra in (("router", []), ("agent", ["--port", "1"])):
        for given in ("debug", "Info", "WARNING"):
            args = build_parser([cmd]).parse_args([cmd, *extra, "--log-level", given])
            assert args.log_level == given.upper()
        with pytest.raises(SystemExit) as exc:
            build_parser([cmd]).parse_args([cmd, *extra, "--log-level", "loud"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "invalid choice: 'loud'" in err and len(err.strip().splitlines()) == 1


def test_policy_params_one_syntax_with_the_policy_prefix_optional():
    from radixfleet.server.cli import policy_params
    from radixfleet_tools.loadtest.simulator.cli import _policy_params

    assert policy_params(["footprint_room=0", "prefix_load.tie_s=0.5"], policy="prefix_load") == {
        "footprint_room": 0,
        "tie_s": 0.5,
    }
    with pytest.raises(ConfigError, match="is for policy 'round_robin', but the policy is 'prefix_load'"):
        policy_params(["round_robin.x=1"], policy="prefix_load")
    with pytest.raises(ConfigError, match=r"must be \[POLICY.\]NAME=VALUE"):
        policy_params(["novalue"])
    assert _policy_params(["tie_s=0", "prefix_load.min_match_tokens=64"], ["prefix_load", "cache_aware"]) == {
        "prefix_load": {"tie_s": 0, "min_match_tokens": 64},
        "cache_aware": {"tie_s": 0},
    }


@pytest.mark.integration  # runs the CLI as a child process
def test_version_and_the_top_level_help_lists_every_benchmark():
    p = subprocess.run(
        [sys.executable, "-m", "radixfleet.cli", "--version"], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0 and p.stdout.startswith("radixfleet ") and p.stdout.split()[1][0].isdigit()
    text = build_parser([]).format_help()
    for b in BENCHMARKS:
        assert b in text, b


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["router", "--log-level", "loud"], "argument --log-level: invalid choice"),
        (["agent", "--port", "x"], "argument --port"),
        (["simulate", "--agents", "x"], "argument --agents: invalid int value"),
        (["loadtest", "--rate", "2,four"], "argument --rate"),
        (["analyze"], "the following arguments are required: LOG"),
        (["bench", "nope"], "argument NAME: invalid choice"),
        (["nope"], "invalid choice"),
    ],
)
@pytest.mark.integration  # the CLI as a child process, as a user runs it
def test_bad_input_is_one_line_and_exit_2(argv, msg):
    p = subprocess.run(
        [sys.executable, "-m", "radixfleet.cli", *argv], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
