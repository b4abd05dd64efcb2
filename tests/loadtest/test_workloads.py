"""Workloads: prefix structure as claimed, determinism by seed, growth per turn, bad input."""

from __future__ import annotations

import json

import annotated_types
import pytest

from radixfleet.keys import BYTES_PER_TOKEN
from radixfleet.wire.errors import WorkloadError
from radixfleet.wire.settings import keys_of
from radixfleet_tools.loadtest.prefix_trie import as_tokens, common_tokens
from radixfleet_tools.loadtest.report import prompt_bytes
from radixfleet_tools.loadtest.workloads import (
    WORKLOADS,
    ChatSession,
    SingleShot,
    make_workload,
    parse_options,
    synthetic_answer,
    text_of,
    token_count,
)


def shared_tokens(a, b) -> int:
    return common_tokens(as_tokens(prompt_bytes(a)), as_tokens(prompt_bytes(b)))


def all_specs(workload, answer_tokens=8):
    """Every turn of every session, answering each with a synthetic answer."""
    out = []
    for s in workload.sessions():
        spec = s.first()
        while spec is not None:
            out.append(spec)
            spec = s.follow(synthetic_answer(spec, answer_tokens))
    return out


def test_text_is_exact_length_deterministic_and_key_separated():
    t = text_of(100, "k", 1)
    assert len(t.encode()) == 100 * BYTES_PER_TOKEN and token_count(t) == 100
    assert t == text_of(100, "k", 1)
    assert text_of(30, "k", 1) == t[: 30 * BYTES_PER_TOKEN]  # a shorter run is a prefix
    assert common_tokens(text_of(100, "k", 2).encode(), t.encode()) < 3
    assert common_tokens(text_of(100, "j", 1).encode(), t.encode()) < 3
    assert "<|" not in t


@pytest.mark.parametrize("name", [n for n in WORKLOADS if n != "trace"])
def test_every_workload_is_deterministic_by_seed(name):
    small = {
        "gsp": {"groups": 3, "prompts_per_group": 2},
        "multiturn": {"clients": 3, "rounds": 2},
        "zipf": {"requests": 20},
        "rag": {"requests": 10},
        "agent": {"sessions": 2, "steps": 3},
        "mixed": {"sessions": 5},
        "pollution": {"requests": 20, "fraction": 0.2},
    }[name]
    a = [(s.id, s.body, s.max_tokens) for s in all_specs(make_workload(name, small, seed=3))]
    b = [(s.id, s.body, s.max_tokens) for s in all_specs(make_workload(name, small, seed=3))]
    c = [(s.id, s.body, s.max_tokens) for s in all_specs(make_workload(name, small, seed=4))]
    assert a == b
    assert a != c
    assert len({i for i, _, _ in a}) == len(a)  # ids unique


def test_gsp_groups_share_exactly_their_system_prompt():
    w = make_workload(
        "gsp",
        {
            "groups": 4,
            "prompts_per_group": 3,
            "system_tokens": 256,
            "question_tokens": 32,
            "order": "ordered",
        },
    )
    specs = all_specs(w)
    assert len(specs) == 12
    assert [s.session for s in specs[:3]] == ["g0p0", "g0p1", "g0p2"]  # ordered
    for s in specs:
        assert token_count(s.body["prompt"]) == 256 + 32 + 1  # + "\n\n" rounded up
    same = shared_tokens(specs[0], specs[1])
    assert 256 <= same < 256 + 3  # the system prompt (and the "\n\n"), no more
    assert shared_tokens(specs[0], specs[3]) < 3  # another group: nothing
    shuffled = all_specs(make_workload("gsp", {"groups": 4, "prompts_per_group": 3}))
    assert [s.session for s in shuffled] != sorted(s.session for s in shuffled)


def test_gsp_range_ratio_draws_lengths_in_range():
    w = make_workload(
        "gsp",
        {
            "groups": 8,
            "prompts_per_group": 4,
            "system_tokens": 400,
            "question_tokens": 100,
            "output_tokens": 50,
            "range_ratio": 0.5,
        },
    )
    specs = all_specs(w)
    assert {s.max_tokens for s in specs} <= set(range(25, 51))
    assert len({s.max_tokens for s in specs}) > 3


def test_multiturn_history_grows_by_answer_and_question():
    w = make_workload("multiturn", {"clients": 2, "rounds": 3, "question_tokens": 40, "output_tokens": 8})
    session = w.sessions()[0]
    s0 = session.first()
    s1 = session.follow("ANSWER ONE")
    s2 = session.follow("ANSWER TWO")
    assert session.follow("x") is None
    assert [m["role"] for m in s2.body["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert s1.body["messages"][1]["content"] == "ANSWER ONE"
    b0, b1, b2 = (prompt_bytes(s) for s in (s0, s1, s2))
    # each turn's prompt extends the previous prompt (minus the generation marker)
    gen = len(b"<|assistant|>\n  ")
    assert b1.startswith(b0[:-gen]) and b2.startswith(b1[:-gen])
    assert len(b2) > len(b1) > len(b0)
    other = w.sessions()[1].first()
    assert shared_tokens(s0, other) < 5  # clients share nothing but the template


def test_zipf_popularity_is_skewed_and_prefixes_shared():
    w = make_workload(
        "zipf", {"prompts": 10, "alpha": 1.2, "requests": 500, "system_tokens": 128, "suffix_tokens": 16}
    )
    specs = all_specs(w)
    systems = [s.body["messages"][0]["content"] for s in specs]
    counts = sorted((systems.count(x) for x in set(systems)), reverse=True)
    assert counts[0] > 4 * counts[-1]
    suffixes = {s.body["messages"][1]["content"] for s in specs}
    assert len(suffixes) == 500


def test_rag_requests_pick_k_distinct_chunks_after_shared_header():
    w = make_workload(
        "rag", {"documents": 20, "k": 3, "requests": 30, "header_tokens": 64, "chunk_tokens": 32}
    )
    for s in all_specs(w):
        ctx = s.body["messages"][1]["content"]
        docs = [int(x.split("]")[0]) for x in ctx.split("[doc ")[1:]]
        assert len(docs) == 3 == len(set(docs))
    a, b = all_specs(w)[:2]
    assert a.body["messages"][0] == b.body["messages"][0]


def test_agent_trajectory_grows_and_tools_prefix_is_shared():
    w = make_workload("agent", {"sessions": 2, "steps": 3, "tools_tokens": 256, "tools": 4})
    sa, sb = w.sessions()
    a0 = sa.first()
    a1 = sa.follow("call tool_1")
    a2 = sa.follow("call again")
    # as the OpenAI API requires: each tool message answers the call the assistant
    # message before it made (SGLang's gateway refused 16 of 32 requests without)
    for spec in (a1, a2):
        tool, answered = spec.body["messages"][-1], spec.body["messages"][-2]
        assert tool["role"] == "tool" and answered["role"] == "assistant"
        (call,) = answered["tool_calls"]
        assert tool["tool_call_id"] == call["id"] and call["type"] == "function"
        assert call["function"]["name"].startswith("tool_")
        json.loads(call["function"]["arguments"])
    assert a1.body["messages"][-2]["content"] == "call tool_1"
    assert a2.body["messages"][: len(a1.body["messages"])] == a1.body["messages"]
    assert a1.body["messages"][-1]["tool_call_id"] != a2.body["messages"][-1]["tool_call_id"]
    assert prompt_bytes(a1).startswith(prompt_bytes(a0)[:-16])
    assert shared_tokens(a0, sb.first()) >= 256  # the tool schema


def test_mixed_sessions_share_system_prompts_and_respect_parallelism():
    w = make_workload("mixed", {"sessions": 40, "system_prompts": 4, "max_parallel": 5})
    assert w.max_active_sessions == 5
    firsts = [s.first() for s in w.sessions()]
    systems = {f.body["messages"][0]["content"] for f in firsts}
    assert len(systems) <= 4
    assert all(isinstance(s, ChatSession) for s in w.sessions())


def test_pollution_mixes_in_one_off_long_documents():
    w = make_workload("pollution", {"base": "zipf", "requests": 90, "fraction": 0.1, "doc_tokens": 500})
    sessions = w.sessions()
    docs = [s for s in sessions if s.id.startswith("doc")]
    assert len(docs) == 10 and len(sessions) == 100
    texts = [d.first().body["messages"][0]["content"] for d in docs]
    assert len(set(texts)) == 10 and all(token_count(t) == 500 for t in texts)
    assert w.describe()["params"]["base_options"]["requests"] == 90


def _trace(tmp_path, lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_trace_shared_hash_ids_are_shared_text(tmp_path):
    path = _trace(
        tmp_path,
        [
            json.dumps({"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}),
            json.dumps({"timestamp": 500, "input_length": 1024, "output_length": 7, "hash_ids": [1, 2]}),
            json.dumps({"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [1, 9]}),
            json.dumps({"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": [4]}),
        ],
    )
    w = make_workload("trace", {"path": path, "time_scale": "0.5"})
    a, b, c, d = all_specs(w)
    assert [token_count(s.body["prompt"]) for s in (a, b, c, d)] == [1100, 1024, 600, 10]
    assert shared_tokens(a, b) == 1024
    assert 512 <= shared_tokens(a, c) < 515
    assert shared_tokens(a, d) < 3
    assert [s.arrival_s for s in (a, b, c, d)] == [0.0, 0.25, 0.75, 1.0]
    assert (a.max_tokens, b.max_tokens) == (5, 7)
    capped = make_workload("trace", {"path": path, "max_requests": 2})
    assert len(capped.sessions()) == 2


def test_trace_malformed_line_names_its_number(tmp_path):
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})
    path = _trace(tmp_path, [good, good, '{"timestamp": 1, "input_length": "x"}', good])
    with pytest.raises(WorkloadError, match=r"line 3: 'input_length'.*--skip-bad-lines"):
        make_workload("trace", {"path": path})
    path2 = _trace(tmp_path, [good, "not json", good], "t2.jsonl")
    with pytest.raises(WorkloadError, match="line 2: not JSON"):
        make_workload("trace", {"path": path2})
    w = make_workload("trace", {"path": path, "skip_bad_lines": "true"})
    assert len(w.sessions()) == 3 and w.skipped == [3]


def test_trace_block_count_must_match_input_length(tmp_path):
    path = _trace(
        tmp_path, [json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]})]
    )
    with pytest.raises(WorkloadError, match="line 1: 'hash_ids' has 1 ids"):
        make_workload("trace", {"path": path})


def test_shared_mooncake_trace_loads():
    w = make_workload("trace", {"max_requests": 50})
    specs = all_specs(w)
    assert len(specs) == 50
    assert all(s.arrival_s is not None for s in specs)
    assert specs == sorted(specs, key=lambda s: s.arrival_s)


def test_bad_names_and_options_are_clear_errors(tmp_path):
    with pytest.raises(WorkloadError, match="unknown workload 'nope'; choose one of gsp"):
        make_workload("nope")
    with pytest.raises(WorkloadError, match=r"gsp\.grups: unknown option; valid: api, groups, "):
        make_workload("gsp", {"grups": "3"})
    with pytest.raises(WorkloadError, match="gsp.groups: expected an integer >= 1, got 'x'"):
        make_workload("gsp", {"groups": "x"})
    with pytest.raises(WorkloadError, match="gsp.order: 'random' is not one of shuffled, ordered"):
        make_workload("gsp", {"order": "random"})
    with pytest.raises(WorkloadError, match="pollution.base: 'trace' is not one of gsp, multiturn"):
        make_workload("pollution", {"base": "trace"})
    with pytest.raises(WorkloadError, match=r"zipf\.bogus: unknown option"):
        make_workload("pollution", {"base": "zipf", "bogus": "1"})
    with pytest.raises(WorkloadError, match="No such file"):
        make_workload("trace", {"path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(WorkloadError, match="NAME=VALUE"):
        parse_options(["groups"])
    assert parse_options(["prompts-per-group=2"]) == {"prompts_per_group": "2"}


def test_single_shot_sessions_have_one_turn():
    s = make_workload("zipf", {"requests": 3}).sessions()[0]
    assert isinstance(s, SingleShot)
    assert s.follow("x") is None


# ------------------------------------------------------- options from the schema -----


def _first(name: str, test) -> str:
    """The first option of workload ``name`` whose field passes ``test``."""
    return next(k for k, f in keys_of(WORKLOADS[name].Params).items() if test(f))


def _lower_bound(f) -> float | None:
    return next((m.ge for m in f.metadata if isinstance(m, annotated_types.Ge)), None)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_workload_refuses_an_unknown_option_naming_its_path_and_the_valid_ones(name):
    # pollution hands options it does not know to its base workload (zipf)
    owner = "zipf" if name == "pollution" else name
    valid = ", ".join(sorted(keys_of(WORKLOADS[owner].Params)))
    with pytest.raises(WorkloadError) as exc:
        make_workload(name, {"nosuch": "1"})
    assert str(exc.value) == f"workload option {owner}.nosuch: unknown option; valid: {valid}"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_workload_refuses_a_wrong_type_naming_the_option(name):
    key = _first(name, lambda f: f.annotation is int)
    pattern = rf"^workload option {name}\.{key}: expected an integer[^;]*, got 'x'$"
    with pytest.raises(WorkloadError, match=pattern):
        make_workload(name, {key: "x"})
    with pytest.raises(WorkloadError, match=rf"^workload option {name}\.{key}: expected an integer"):
        make_workload(name, {key: 2.0})  # typed values: a float is never an int


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_workload_refuses_an_out_of_bounds_value_naming_the_option_and_bound(name):
    key = _first(name, lambda f: f.annotation is int and _lower_bound(f) is not None)
    lo = int(_lower_bound(keys_of(WORKLOADS[name].Params)[key]))
    with pytest.raises(WorkloadError) as exc:
        make_workload(name, {key: str(lo - 1)})
    assert str(exc.value) == f"workload option {name}.{key}: expected an integer >= {lo}, got {lo - 1}"


def test_bad_options_are_reported_all_at_once_and_rules_across_options_name_one():
    with pytest.raises(WorkloadError) as exc:
        make_workload("gsp", {"groups": "0", "range_ratio": "1.5", "api": "grpc"})
    assert str(exc.value) == (
        "workload options: 3 errors: gsp.groups: expected an integer >= 1, got 0; "
        "gsp.range_ratio: expected a number in (0, 1], got 1.5; "
        "gsp.api: 'grpc' is not one of chat, completions"
    )
    with pytest.raises(WorkloadError, match=r"^workload option rag\.k: must be <= documents \(3\), got 4$"):
        make_workload("rag", {"documents": "3", "k": "4"})
    with pytest.raises(WorkloadError, match=r"^workload option mixed\.min_turns: must be <= max_turns"):
        make_workload("mixed", {"min_turns": "5", "max_turns": "2"})
    with pytest.raises(WorkloadError, match=r"^workload option agent\.tools_tokens: must be >= tools"):
        make_workload("agent", {"tools": "8", "tools_tokens": "4"})
    with pytest.raises(WorkloadError, match=r"pollution\.fraction: expected a number in \[0, 1\), got 1\.0"):
        make_workload("pollution", {"fraction": "1"})
    with pytest.raises(WorkloadError, match=r"trace\.skip_bad_lines: expected true or false, got 'maybe'"):
        make_workload("trace", {"skip_bad_lines": "maybe", "max_requests": "5"})
    w = make_workload("trace", {"skip_bad_lines": "yes", "max_requests": "5", "time_scale": 2})
    assert w.params.skip_bad_lines is True and w.params.time_scale == 2.0


def test_a_bad_option_on_the_command_line_is_one_line_and_exit_2(capsys):
    from radixfleet.cli import main

    argv = ["loadtest", "--workload", "mixed", "-o", "sessions=-1", "-o", "alpha=x"]
    assert main([*argv, "--target", "a=http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "radixfleet loadtest: error: workload options: 2 errors: mixed.sessions: expected an integer "
        ">= 1, got -1; mixed.alpha: expected a number >= 0, got 'x'\n"
    )


def test_the_workload_listing_is_generated_from_each_schema(monkeypatch):
    from radixfleet.wire.settings import setting, settings
    from radixfleet_tools.loadtest.cli import list_workloads, workload_options_help
    from radixfleet_tools.loadtest.workloads import Workload

    @settings
    class EchoParams:
        loudness: float = setting(0.5, "how loud the echo is", lo=0, hi=1)

    class Echo(Workload):
        """Echoes."""

        name = "echo"
        Params = EchoParams

    monkeypatch.setitem(WORKLOADS, "echo", Echo)
    listing = list_workloads().splitlines()
    i = listing.index("echo")
    assert listing[i + 1 : i + 4] == [
        "  Echoes",
        "  -o options: loudness [0.5]",
        "    loudness  a number in [0, 1]; default 0.5: how loud the echo is",
    ]
    assert "  echo: loudness [0.5]" in workload_options_help().splitlines()
    # every declared option of every built-in workload is listed with its doc
    text = "\n".join(listing)
    for name, cls in WORKLOADS.items():
        for key, f in keys_of(cls.Params).items():
            assert f"    {key}" in text and f.description in text, (name, key)
