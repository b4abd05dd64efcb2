"""Oracle and pooled hit rates on hand-made cases, the prefix trie's invariants, the schema."""

from __future__ import annotations

import json
import random

import pytest

from radixfleet_tools.loadtest.client import Result
from radixfleet_tools.loadtest.prefix_trie import PrefixTrie, common_tokens
from radixfleet_tools.loadtest.report import (
    CacheReference,
    percentiles,
    render_table,
    summarize,
    validate,
    write_json,
    write_plots,
)
from radixfleet_tools.loadtest.workloads import RequestSpec


def tok(*words: str) -> bytes:
    """Token-aligned bytes: each word is one 4-byte token."""
    assert all(len(w) == 4 for w in words)
    return "".join(words).encode()


def test_common_tokens():
    assert common_tokens(b"aaaabbbb", b"aaaabbbb") == 2
    assert common_tokens(b"aaaabbbb", b"aaaabbbc") == 1
    assert common_tokens(b"aaaabbbb", b"aaaa") == 1
    assert common_tokens(b"xaaa", b"aaaa") == 0


def test_oracle_longest_prefix_with_any_earlier_request():
    t = PrefixTrie()
    assert t.serve(tok("sys1", "sys2", "q001")) == 0
    t.check()
    assert t.serve(tok("sys1", "sys2", "q002")) == 2  # system prompt shared
    assert t.serve(tok("sys1", "sys2", "q001", "more")) == 3  # extends request 1
    assert t.serve(tok("sys1", "xxxx")) == 1  # diverges inside a node: split
    t.check()
    assert t.serve(tok("sys1", "sys2", "q002")) == 3  # a repeat is fully cached
    assert t.serve(tok("new1")) == 0
    assert t.serve(b"sys1sy") == 1  # a partial last token is a token of its own
    t.check()
    assert t.tokens == 3 + 1 + 1 + 1 + 1 + 1  # sys1 sys2 q001 more q002 xxxx new1 'sy\0\0'
    assert t.match(tok("sys1", "sys2", "q001", "more", "tail")) == 4


def test_pooled_lru_evicts_least_recently_used_leaves():
    t = PrefixTrie(capacity=6)
    assert t.serve(tok("aaaa", "bbbb", "cccc")) == 0  # 3 tokens
    assert t.serve(tok("xxxx", "yyyy")) == 0  # 5 tokens
    assert t.serve(tok("aaaa", "bbbb", "dddd")) == 2  # 6 tokens: a-b-{c,d}, x-y
    t.check()
    # 8 tokens > 6: the LRU leaves are c (1 token), then x-y (2)
    assert t.serve(tok("aaaa", "zzzz", "wwww")) == 1
    t.check()
    assert t.evicted == 3 and t.tokens == 5
    assert t.match(tok("xxxx")) == 0 and t.match(tok("aaaa", "bbbb", "cccc")) == 2
    assert t.match(tok("aaaa", "bbbb", "dddd")) == 3  # used later than c: kept
    # re-inserting c makes d the LRU leaf
    assert t.serve(tok("aaaa", "bbbb", "cccc")) == 2
    assert t.serve(tok("qqqq", "rrrr")) == 0  # 8 -> evict d (1), then z-w (2)
    t.check()
    assert t.match(tok("aaaa", "bbbb", "dddd")) == 2
    assert t.match(tok("aaaa", "zzzz")) == 1
    assert t.match(tok("aaaa", "bbbb", "cccc")) == 3
    assert t.match(tok("qqqq", "rrrr")) == 2


def test_pooled_prompt_larger_than_capacity_stays_bounded():
    t = PrefixTrie(capacity=3)
    t.serve(tok("aaaa", "bbbb", "cccc", "dddd", "eeee"))
    t.check()
    assert t.tokens <= 3
    assert t.serve(tok("aaaa")) == 0


def test_trie_randomized_against_brute_force():
    rng = random.Random(7)
    seen: list[bytes] = []
    t = PrefixTrie()
    for _ in range(300):
        if seen and rng.random() < 0.7:
            base = rng.choice(seen)
            cut = rng.randint(0, len(base) // 4) * 4
            data = base[:cut] + bytes(rng.choice(b"ab") for _ in range(4 * rng.randint(0, 5)))
        else:
            data = bytes(rng.choice(b"ab") for _ in range(4 * rng.randint(1, 8)))
        expect = max((common_tokens(data, s) for s in seen), default=0)
        assert t.serve(data) == expect
        seen.append(data)
        t.check()
    bounded = PrefixTrie(capacity=40)
    for data in seen:
        bounded.serve(data)
        bounded.check()


def _spec(i: int, text: str) -> RequestSpec:
    return RequestSpec(f"s{i}.0", "completions", {"prompt": text}, 4, f"s{i}", 0)


def test_cache_reference_counts_tokens_of_the_prompt_as_sent():
    ref = CacheReference(kv_capacity_tokens=None)
    assert ref.observe(_spec(0, "aaaabbbbcccc")) == (3, 0, 0)
    assert ref.observe(_spec(1, "aaaabbbbdd")) == (3, 2, 0)
    ref.check()
    pooled = CacheReference(kv_capacity_tokens=4)
    pooled.observe(_spec(0, "aaaabbbbcccc"))
    pooled.observe(_spec(1, "xxxxyyyy"))  # evicts the 3-token leaf
    assert pooled.observe(_spec(2, "aaaabbbbcccc"))[2] == 0
    pooled.check()
    # oracle still remembers everything; pooled had to evict
    ref2 = CacheReference(kv_capacity_tokens=4)
    outs = [ref2.observe(_spec(i, t)) for i, t in enumerate(["aaaabbbbcccc", "xxxxyyyy", "aaaabbbbcccc"])]
    assert outs[2] == (3, 3, 0)


def _result(i, worker, prompt, cached, ok=True, kind=None):
    r = Result(
        f"r{i}",
        f"s{i}",
        0,
        start=i * 0.1,
        ok=ok,
        error_kind=kind,
        ttft_s=0.01 * (i + 1),
        itl_s=[0.002, 0.004],
        e2e_s=0.05,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=10,
        worker=worker,
        est_prompt_tokens=prompt,
        oracle_cached=cached + 1,
        pooled_cached=cached,
    )
    return r


def test_summarize_and_schema(tmp_path):
    results = [
        _result(0, "w0", 100, 0),
        _result(1, "w1", 100, 50),
        _result(2, "w0", 200, 150),
        _result(3, None, 50, 0, ok=False, kind="http_500"),
    ]
    run = summarize(
        "ours", "http://x", {"name": "zipf", "seed": 0, "params": {}}, results, kv_capacity_tokens=1000
    )
    assert run["requests"] == 4 and run["ok"] == 3 and run["errors"] == 1
    assert run["errors_by_kind"] == {"http_500": 1}
    assert run["hit_rate"] == pytest.approx(200 / 400)
    assert run["oracle_hit_rate"] == pytest.approx(203 / 400)
    assert run["pooled_hit_rate"] == pytest.approx(200 / 400)
    assert run["workers"]["w0"] == {
        "requests": 2,
        "prompt_tokens": 300,
        "cached_tokens": 150,
        "output_tokens": 20,
    }
    assert run["load_imbalance"] == pytest.approx(300 / 200)
    assert run["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert run["itl_ms"]["p99"] == pytest.approx(4.0)
    assert run["throughput"]["output_tokens_per_s"] > 0
    path = tmp_path / "r.json"
    write_json(str(path), [run])
    doc = json.loads(path.read_text())
    validate(doc)
    assert doc["runs"][0]["name"] == "ours"
    broken = json.loads(path.read_text())
    del broken["runs"][0]["hit_rate"]
    with pytest.raises(ValueError, match=r"runs\[0\].hit_rate is missing"):
        validate(broken)
    broken = json.loads(path.read_text())
    broken["runs"][0]["oracle_hit_rate"] = 1.5
    with pytest.raises(ValueError, match="oracle_hit_rate must be in"):
        validate(broken)
    no_cap = summarize("x", "u", {}, results, kv_capacity_tokens=None)
    assert no_cap["pooled_hit_rate"] is None
    validate({"runs": [no_cap]})
    unknown = summarize("smg", "u", {}, [_result(0, None, 10, 0)], kv_capacity_tokens=None)
    assert unknown["load_imbalance"] is None and "unknown" in unknown["workers"]


def test_percentiles_nearest_rank():
    xs = [i / 1000 for i in range(1, 101)]
    p = percentiles(xs)
    assert (p["p50"], p["p90"], p["p99"]) == pytest.approx((50, 90, 99))
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_percentile_is_the_nearest_rank_of_any_order():
    from radixfleet_tools.loadtest.report import percentile

    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(xs, q) for q in (0.01, 0.2, 0.5, 0.99, 1.0)] == [1, 1, 3, 5, 5]
    assert percentile(sorted(xs), 0.41, presorted=True) == 3.0  # ceil(0.41 * 5) = 3rd
    assert percentile([], 0.5) is None and percentile([7.0], 0.99) == 7.0


def test_table_and_plots(tmp_path):
    import io

    runs = [
        summarize(n, "u", {}, [_result(0, "w0", 100, c), _result(1, "w1", 80, 0)], kv_capacity_tokens=500)
        for n, c in (("rr", 10), ("pl", 90))
    ]
    runs[0]["errors"] += 0
    buf = io.StringIO()
    render_table(runs, file=buf)
    assert "rr" in buf.getvalue() and "pl" in buf.getvalue()
    # an arm with parameters is named in brackets, which rich would read as markup
    runs[1]["name"] = "pl[tie_s=0]"
    buf = io.StringIO()
    render_table(runs, file=buf)
    assert "pl[tie_s=0]" in buf.getvalue()
    paths = write_plots(runs, str(tmp_path / "plots"), {"rr": [1.0, 2.0], "pl": [0.5, 3.0]})
    assert len(paths) == 3
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_pooled_agent_cache_agrees_with_the_trie_lru():
    """The pooled reference (the agent's RadixCache) evicts exactly as PrefixTrie's LRU."""
    from radixfleet_tools.loadtest.report import AgentLRU

    rng = random.Random(3)
    seen: list[bytes] = []
    trie, agent = PrefixTrie(60), AgentLRU(60)
    for _ in range(600):
        if seen and rng.random() < 0.7:
            base = rng.choice(seen)
            cut = rng.randint(0, len(base) // 4) * 4
            data = base[:cut] + bytes(rng.choice(b"ab") for _ in range(4 * rng.randint(0, 5)))
        else:
            data = bytes(rng.choice(b"ab") for _ in range(4 * rng.randint(1, 8)))
        seen.append(data)
        assert agent.serve(data) == trie.serve(data)
    trie.check()
    agent.check()


def test_references_cache_answers_like_an_engine():
    ref = CacheReference(kv_capacity_tokens=1000)
    first = RequestSpec("c.0", "chat", {"messages": [{"role": "user", "content": "hi  "}]}, 4, "c", 0)
    ref.observe(first)
    ref.observe_answer(first, " abc def")
    nxt = RequestSpec(
        "c.1",
        "chat",
        {
            "messages": [
                {"role": "user", "content": "hi  "},
                {"role": "assistant", "content": " abc def"},
                {"role": "user", "content": "more"},
            ]
        },
        4,
        "c",
        1,
    )
    est, oracle, pooled = ref.observe(nxt)
    # history through the answer's tokens is cached: everything but '<|end|>\n' onwards
    from radixfleet_tools.loadtest.report import prompt_bytes

    head = prompt_bytes(first) + b" abc def"
    assert oracle == pooled == len(head) // 4
    ref.check()


def test_progress_bar_quiet_off_a_tty_and_live_on_one(capsys):
    from radixfleet_tools.loadtest.report import Progress

    with Progress("x", 3) as bar:  # pytest's stderr is not a TTY
        assert not bar.enabled
        bar.advance(0)
    assert capsys.readouterr().err == ""
    with Progress("run", 3, enabled=True) as bar:
        for i in range(3):
            bar.advance(i)
