"""The agent's --disable-radix-cache and --page-size, and `loadtest --ab radix|policy`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from aiohttp import ClientSession, ClientTimeout
from aiohttp.test_utils import TestServer

from radixfleet.wire.events import Removed, Stored
from radixfleet_tools.agent.server import AGENT_KEY, AgentConfig, create_app
from radixfleet_tools.loadtest.report import validate


async def _twice(**kw) -> tuple[list[int], object]:
    """Sends one prompt twice; returns both cached_tokens and the agent."""
    app = create_app(AgentConfig(kv_tokens=50_000, **kw))
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    try:
        async with ClientSession(base_url=str(srv.make_url("")), timeout=ClientTimeout(total=20)) as c:
            prompt = "x" * 4 * 203  # 203 tokens
            got = []
            for _ in range(2):
                r = await c.post(
                    "/v1/completions", json={"model": "llama-3-8b", "prompt": prompt, "max_tokens": 3}
                )
                body = await r.json()
                assert r.status == 200, body
                got.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            info = await (await c.get("/get_server_info")).json()
        agent = app[AGENT_KEY]
        agent.sched.check()
        return got, agent, info
    finally:
        await srv.close()


@pytest.mark.integration
async def test_page_size_matches_whole_pages():
    got, agent, info = await _twice(page_size=16)
    # the second request reuses all but its last token, in whole pages: 202 -> 192
    assert got == [0, 192] and info["page_size"] == 16 and not info["disable_radix_cache"]
    got, _, info = await _twice()
    assert got == [0, 202] and info["page_size"] == 1


@pytest.mark.integration
async def test_disable_radix_cache_keeps_nothing_and_says_so():
    got, agent, info = await _twice(disable_radix_cache=True)
    assert got == [0, 0] and info["disable_radix_cache"] is True
    assert agent.cache.total_tokens == 0 and agent.cache.stats.refusals >= 2


def test_disabled_cache_reports_refused_blocks_as_removed():
    from radixfleet_tools.agent.radix_cache import RadixCache

    c = RadixCache(hash_stride=4, capacity_tokens=100, disabled=True)
    held, node = c.insert("ns", list(range(12)), [11, 22, 33], admit_from=0)
    assert (held, node) == (0, None) and c.total_tokens == 0
    evs = c.drain_events()
    assert not any(isinstance(e, Stored) for e in evs)
    assert [h for e in evs if isinstance(e, Removed) for h in e.hashes] == [11, 22, 33]
    assert c.match_prefix("ns", list(range(12)))[0] == 0
    c.check()


@pytest.mark.integration
@pytest.mark.parametrize(
    "kind, names, extra",
    [
        ("radix", ["radix on (round_robin)", "radix off (round_robin)"], []),
        ("policy", ["prefix_load", "round_robin"], []),
        (
            "policy",
            ["prefix_load[replicate=false]", "round_robin"],
            ["--policies", "prefix_load[replicate=false],round_robin"],
        ),
    ],
)
def test_loadtest_ab_is_one_command(tmp_path, kind, names, extra):
    out = tmp_path / "ab.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixfleet.cli",
            "loadtest",
            "--ab",
            kind,
            *extra,
            "--agents",
            "2",
            "--kv-tokens",
            "8000",
            "--out",
            str(tmp_path / "fleet"),
            "--workload",
            "multiturn",
            "-o",
            "clients=6",
            "-o",
            "rounds=3",
            "-o",
            "question_tokens=128",
            "-o",
            "output_tokens=8",
            "--concurrency",
            "4",
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert p.returncode == 0, p.stderr + p.stdout
    doc = json.loads(out.read_text())
    validate(doc)
    runs = doc["runs"]
    assert [r["name"] for r in runs] == names
    for r in runs:
        assert r["requests"] == r["ok"] == 18 and r["cut"] is None
    if kind == "radix":
        assert runs[1]["hit_rate"] == 0.0 < runs[0]["hit_rate"]
        assert "--disable-radix-cache" in runs[1]["target"]
        assert "prefix caching: hit rate" in p.stdout
    else:
        assert f"{names[0]} over round_robin: hit rate" in p.stdout
    if extra:  # the arm's parameter reached its router
        assert "--policy-param replicate=false" in runs[0]["target"]
        log = tmp_path / "fleet" / "logs" / "router-prefix_load_replicate_false_.log"
        assert "Traceback" not in log.read_text()


@pytest.mark.integration
def test_ab_policy_runs_smg_beside_ours_in_front_of_plain_agents(tmp_path):
    """``--policies prefix_load,smg --plain-workers``: SGLang's gateway and ours in
    front of the same agents, which send nothing; hit rates from the agents' own
    counters for smg, from the router for ours."""
    out = tmp_path / "ab.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixfleet.cli",
            "loadtest",
            "--ab",
            "policy",
            "--policies",
            "prefix_load,smg",
            "--plain-workers",
            "--agents",
            "2",
            "--kv-tokens",
            "8000",
            "--out",
            str(tmp_path / "fleet"),
            "--workload",
            "multiturn",
            "-o",
            "clients=6",
            "-o",
            "rounds=3",
            "-o",
            "question_tokens=128",
            "-o",
            "output_tokens=8",
            "--concurrency",
            "4",
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert p.returncode == 0, p.stderr + p.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == ["prefix_load", "smg"]
    for r in runs:
        assert r["requests"] == r["ok"] == 18 and r["hit_rate"] > 0.3, r
        assert "no events" in r["target"]
    assert "SGLang's gateway" in runs[1]["target"]
    # ours in front of agents that send nothing: kind openai, the index from cached_tokens
    log = (tmp_path / "fleet" / "logs" / "router-prefix_load.log").read_text()
    assert "Traceback" not in log
    assert "prefix_load over smg: hit rate" in p.stdout


def test_ab_policies_accept_smg_and_refuse_unknown_names():
    from argparse import Namespace

    from radixfleet.wire.errors import ConfigError
    from radixfleet_tools.loadtest.ab import arms

    ns = Namespace(ab="policy", policies="prefix_load,smg", page_size=1)
    assert [a[1] for a in arms(ns)] == ["prefix_load", "smg"]
    with pytest.raises(ConfigError) as ei:
        arms(Namespace(ab="policy", policies="prefix_load,sgl", page_size=1))
    assert ei.value.path == "--policies[1].name" and ei.value.message.endswith(
        "round_robin, or smg (SGLang's gateway)"
    )


def test_ab_arms_carry_policy_parameters():
    """``policy[NAME=VALUE,...]``: two arms of one policy A/B a parameter; values are
    YAML, checked against the policy before anything starts."""
    from argparse import Namespace

    from radixfleet.wire.errors import ConfigError
    from radixfleet_tools.loadtest.ab import arms

    def plan(text):
        return arms(Namespace(ab="policy", policies=text, page_size=1))

    got = plan("prefix_load, prefix_load[footprint_room=0, replicate=false],smg")
    assert [(a[0], a[1], a[2]) for a in got] == [
        ("prefix_load", "prefix_load", {}),
        (
            "prefix_load[footprint_room=0, replicate=false]",
            "prefix_load",
            {"footprint_room": 0, "replicate": False},
        ),
        ("smg", "smg", {}),
    ]
    bad = {
        "prefix_load,prefix_load": ("--policies", "distinct"),
        "prefix_load,prefix_load[footprint_room=2]": ("--policies[1].params.footprint_room", "[0, 1]"),
        "prefix_load,prefix_load[nope=1]": ("--policies[1].params.nope", "unknown"),
        "prefix_load,round_robin[tie_s=0]": ("--policies[1].params.tie_s", "unknown"),
        "prefix_load,smg[policy=manual]": ("--policies[1].params.policy", "round_robin"),
        "prefix_load,smg[cache_threshold=2]": ("--policies[1].params.cache_threshold", "[0, 1]"),
        "prefix_load,smg[balance_abs_threshold=1.5]": (
            "--policies[1].params.balance_abs_threshold",
            "integer",
        ),
        "prefix_load,smg[tie_s=0]": ("--policies[1].params.tie_s", "unknown smg setting"),
        "prefix_load,prefix_load[tie_s]": ("--policies[1]", "NAME=VALUE"),
        "prefix_load,prefix_load[]": ("--policies[1]", "empty"),
        "prefix_load,prefix_load[tie_s=0": ("--policies", "unclosed"),
        "prefix_load,prefix_load]": ("--policies", "unbalanced"),
        "prefix_load,prefix_load[a=1][b=2]": ("--policies[1]", "one trailing"),
    }
    for text, (path, words) in bad.items():
        with pytest.raises(ConfigError) as ei:
            plan(text)
        assert ei.value.path == path and words in ei.value.message, (text, ei.value)


def test_smg_arms_choose_its_launch_settings():
    """``smg[policy=round_robin]`` beside ``round_robin``: the same policy through both
    routers, the paths compared; other settings map to smg's own flags."""
    from radixfleet_tools.loadtest.smg import launch_args

    assert launch_args({}) == ["--policy", "cache_aware"]
    assert launch_args({"policy": "round_robin"}) == ["--policy", "round_robin"]
    assert launch_args(
        {"cache_threshold": 0.5, "balance_abs_threshold": 32, "balance_rel_threshold": 1.2}
    ) == [
        "--policy",
        "cache_aware",
        "--cache-threshold",
        "0.5",
        "--balance-abs-threshold",
        "32",
        "--balance-rel-threshold",
        "1.2",
    ]


def test_router_quick_start_takes_policy_parameters():
    from argparse import Namespace

    from radixfleet.config import MISSING
    from radixfleet.server.cli import build_config
    from radixfleet.wire.errors import ConfigError

    def args(**kw):
        base = dict(
            config=None,
            worker=["http://127.0.0.1:9"],
            policy=MISSING,
            policy_param=[],
            host=MISSING,
            port=MISSING,
            worker_header=False,
            match_header=False,
        )
        return Namespace(**{**base, **kw})

    cfg, _ = build_config(args(policy_param=["footprint_room=0", "replicate=false"]))
    assert cfg.policy.name == "prefix_load"
    assert dict(cfg.policy.params) == {"footprint_room": 0, "replicate": False}
    with pytest.raises(ConfigError) as ei:
        build_config(args(policy="round_robin", policy_param=["tie_s=0"]))
    assert ei.value.path == "policy.params.tie_s"
    with pytest.raises(ConfigError) as ei:
        build_config(args(config="x.yaml", worker=[], policy_param=["tie_s=0"]))
    assert "--policy-param" in ei.value.message
