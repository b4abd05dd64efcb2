"""Token keys against a real vLLM 0.32: the ids the router computes are the ids the
engine serves, request for request (radixfleet.engines.token_keys).

The oracle is the engine's own answer: ``prompt_token_ids`` of a one-token
``/v1/chat/completions`` or ``/v1/completions`` (``return_token_ids``) — the exact
serving path — and ``/tokenize`` for a few shapes. Every case says what the router
must do: ``exact`` (the engine answers 200; the ids are equal), ``malformed`` (the
engine answers 400; the keyer raises ``MalformedRequest``) or ``unkeyed`` (a valid
request the router does not reproduce; it routes it by load).

The cases and the engine's answers are recorded in ``tests/data/vllm_token_ids.json``
for the offline test (tests/engines/test_token_keys.py). Re-record after changing a
case, with the vLLM test server up::

    python -m tests.engines.test_token_keys_vllm http://127.0.0.1:PORT

The engine must serve the tiny model of tests/engines/make_tiny_llama.py as ``tiny``.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import pytest

from radixfleet.engines.token_keys import TokenKeyer
from radixfleet.keys import Endpoint
from tests.engines.token_cases import FIXTURE, MODEL, check_case

pytestmark = pytest.mark.engine

_WORDS = (
    "the cache prefix token router worker engine request model block hash session "
    "turn system user assistant tool answer question"
).split()


@pytest.fixture(scope="module")
def vllm_url(vllm_pair) -> str:
    """A managed vLLM test server (tests/conftest.py), or the one the environment names
    (``RADIXFLEET_TEST_VLLM_URL``) when re-recording against another engine."""
    url = os.environ.get("RADIXFLEET_TEST_VLLM_URL", "")
    return url.rstrip("/") if url else vllm_pair[0].url


def _text(n_words: int, seed: int) -> str:
    return " ".join(_WORDS[(seed * 7 + i * 13) % len(_WORDS)] for i in range(n_words))


def _conversation(turns: int, words: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a careful assistant. " + _text(40, 1)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {t}: " + _text(words, t)})
        msgs.append({"role": "assistant", "content": f"answer {t}: " + _text(words, t + 50)})
    msgs.append({"role": "user", "content": "and finally?"})
    return msgs


U = [{"role": "user", "content": "hello there"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'},
}

# (name, endpoint, body, expectation): endpoint chat | completions | tokenize
CASES: list[tuple[str, str, dict, str]] = [
    # --- chat: conversations
    ("user", "chat", {"messages": U}, "exact"),
    ("system_multiturn", "chat", {"messages": _conversation(3, 20)}, "exact"),
    ("long_multiturn", "chat", {"messages": _conversation(12, 120)}, "exact"),
    (
        "unicode",
        "chat",
        {
            "messages": [
                {"role": "system", "content": "Réponds en français — s'il te plaît. 中文 日本語 한국어"},
                {"role": "user", "content": "emoji 🎉👩\u200d💻, RTL שלום, combining e\u0301, NBSP\u00a0x"},
            ]
        },
        "exact",
    ),
    (
        "whitespace",
        "chat",
        {"messages": [{"role": "user", "content": "  leading\n\n\ttabs\r\nCRLF  trailing   "}]},
        "exact",
    ),
    (
        "empty_content",
        "chat",
        {
            "messages": [
                {"role": "user", "content": ""},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "x"},
            ]
        },
        "exact",
    ),
    (
        "special_tokens_in_content",
        "chat",
        {"messages": [{"role": "user", "content": "fake <|end|>\n<|assistant|>\nturn <s></s> <|tools|>"}]},
        "exact",
    ),
    (
        "custom_role",
        "chat",
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "", "content": "y"}]},
        "exact",
    ),
    ("name_field", "chat", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "exact"),
    ("last_assistant", "chat", {"messages": U + [{"role": "assistant", "content": "a"}]}, "exact"),
    # --- chat: content parts
    (
        "parts_text",
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": " second"}],
                }
            ]
        },
        "exact",
    ),
    (
        "parts_extras",
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "cached", "cache_control": {"type": "ephemeral"}}],
                }
            ]
        },
        "exact",
    ),
    (
        "parts_text_like",
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "refusal", "refusal": "b"},
                        {"type": "thinking", "thinking": "c"},
                        {"type": "input_text", "text": "d"},
                        {"type": "output_text", "text": "e"},
                    ],
                }
            ]
        },
        "exact",
    ),
    (
        "parts_system_list",
        "chat",
        {"messages": [{"role": "system", "content": [{"type": "text", "text": "sys"}]}] + U},
        "exact",
    ),
    ("parts_empty_list", "chat", {"messages": [{"role": "user", "content": []}] + U}, "exact"),
    (
        "billing_header",
        "chat",
        {
            "messages": [
                {"role": "system", "content": "x-anthropic-billing-header: cch=42\nreal system"},
                {"role": "user", "content": "u"},
            ]
        },
        "exact",
    ),
    (
        "billing_header_only",
        "chat",
        {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=42"}] + U},
        "exact",
    ),
    # --- chat: tools and tool calls
    ("tools", "chat", {"messages": U, "tools": [TOOL], "tool_choice": "none"}, "exact"),
    (
        "tools_minimal",
        "chat",
        {"messages": U, "tools": [{"function": {"name": "f"}}], "tool_choice": "none"},
        "exact",
    ),
    (
        "tools_strict_defer",
        "chat",
        {
            "messages": U,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "strict": "yes", "extra": 1},
                    "defer_loading": True,
                    "junk": 2,
                }
            ],
            "tool_choice": "none",
        },
        "exact",
    ),
    ("tools_empty", "chat", {"messages": U, "tools": [], "tool_choice": "none"}, "malformed"),
    (
        "tool_calls",
        "chat",
        {
            "messages": U
            + [
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                {"role": "user", "content": "thanks"},
            ],
            "tools": [TOOL],
            "tool_choice": "none",
        },
        "exact",
    ),
    (
        "tool_calls_key_order",
        "chat",
        {
            "messages": U
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "function": {"arguments": '{"b": 1, "a": [1, {"z": null}]}', "name": "f", "x": 1},
                            "type": "function",
                            "id": "c9",
                            "z": 2,
                        }
                    ],
                }
            ]
        },
        "exact",
    ),
    (
        "tool_calls_multi",
        "chat",
        {
            "messages": U
            + [
                {
                    "role": "assistant",
                    "content": "calling",
                    "tool_calls": [
                        CALL,
                        {**CALL, "id": "call_2", "function": {"name": "g", "arguments": ""}},
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
                },
                {"role": "tool", "tool_call_id": None, "content": "r3"},
            ]
        },
        "exact",
    ),
    (
        "tool_calls_bad_json",
        "chat",
        {
            "messages": U
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {**CALL, "function": {"name": "f", "arguments": "{not json"}},
                        {**CALL, "id": "c2", "function": {"name": "f", "arguments": "[1, 2]"}},
                    ],
                }
            ]
        },
        "exact",
    ),
    (
        "tool_calls_empty",
        "chat",
        {"messages": U + [{"role": "assistant", "content": "x", "tool_calls": []}]},
        "exact",
    ),
    (
        "reasoning",
        "chat",
        {
            "messages": U
            + [
                {"role": "assistant", "content": "a", "reasoning_content": "thought"},
                {"role": "assistant", "content": "b", "reasoning": "r", "reasoning_content": "rc"},
                {"role": "assistant", "content": "c", "reasoning": 5},
            ]
        },
        "exact",
    ),
    # --- chat: roles vLLM rewrites
    (
        "developer",
        "chat",
        {
            "messages": [
                {"role": "developer", "content": "dev rules"},
                {"role": "user", "content": "u"},
                {"role": "system", "content": "late system"},
            ]
        },
        "exact",
    ),
    (
        "developer_list",
        "chat",
        {
            "messages": [
                {"role": "system", "content": "sys"},
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "d1"}, {"type": "text", "text": "d2"}],
                },
            ]
            + U
        },
        "exact",
    ),
    (
        "two_systems",
        "chat",
        {
            "messages": [
                {"role": "system", "content": "s1"},
                {"role": "user", "content": "u"},
                {"role": "system", "content": "s2"},
            ]
        },
        "exact",
    ),
    # --- chat: flags
    ("no_generation_prompt", "chat", {"messages": U, "add_generation_prompt": False}, "exact"),
    ("generation_prompt_lax", "chat", {"messages": U, "add_generation_prompt": "false"}, "exact"),
    (
        "continue_final",
        "chat",
        {
            "messages": U + [{"role": "assistant", "content": "Sure, "}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        "exact",
    ),
    (
        "continue_final_parts",
        "chat",
        {
            "messages": U
            + [
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two "}],
                }
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        "exact",
    ),
    ("add_special_tokens", "chat", {"messages": U, "add_special_tokens": True}, "exact"),
    ("kwargs_unused", "chat", {"messages": U, "chat_template_kwargs": {"foo": 1}}, "exact"),
    ("kwargs_tools", "chat", {"messages": U, "chat_template_kwargs": {"tools": [{"x": 1}]}}, "exact"),
    (
        "kwargs_generation_prompt",
        "chat",
        {"messages": U, "chat_template_kwargs": {"add_generation_prompt": False}},
        "exact",
    ),
    ("kwargs_bos_token", "chat", {"messages": U, "chat_template_kwargs": {"bos_token": "XX"}}, "exact"),
    ("kwargs_tokenize", "chat", {"messages": U, "chat_template_kwargs": {"tokenize": True}}, "exact"),
    (
        "kwargs_none_auto",
        "chat",
        {"messages": U, "chat_template_kwargs": {"add_generation_prompt": None, "tools": "auto"}},
        "exact",
    ),
    ("documents", "chat", {"messages": U, "documents": [{"title": "t", "text": "x"}]}, "exact"),
    ("reasoning_effort", "chat", {"messages": U, "reasoning_effort": "low"}, "exact"),
    ("cache_salt", "chat", {"messages": U, "cache_salt": "tenant-a"}, "exact"),
    ("truncate", "chat", {"messages": _conversation(2, 10), "truncate_prompt_tokens": 7}, "exact"),
    (
        "truncate_right",
        "chat",
        {"messages": _conversation(2, 10), "truncate_prompt_tokens": 7, "truncation_side": "right"},
        "exact",
    ),
    (
        "kv_transfer_ids",
        "chat",
        {"messages": U, "kv_transfer_params": {"prompt_token_ids": [1, 2, 3, 4]}},
        "exact",
    ),
    # --- chat: what vLLM refuses
    ("empty_messages", "chat", {"messages": []}, "malformed"),
    ("messages_not_list", "chat", {"messages": "hi"}, "malformed"),
    ("content_int", "chat", {"messages": [{"role": "user", "content": 5}]}, "malformed"),
    ("no_role", "chat", {"messages": [{"content": "x"}]}, "malformed"),
    ("string_parts", "chat", {"messages": [{"role": "user", "content": ["a", "b"]}]}, "malformed"),
    (
        "part_text_null",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        "malformed",
    ),
    ("part_no_type", "chat", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "malformed"),
    (
        "part_bad_type",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]},
        "malformed",
    ),
    ("name_null", "chat", {"messages": [{"role": "user", "content": "x", "name": None}]}, "malformed"),
    (
        "tool_call_no_type",
        "chat",
        {
            "messages": U
            + [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "malformed",
    ),
    (
        "tool_call_dict_args",
        "chat",
        {
            "messages": U
            + [
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}],
                }
            ]
        },
        "malformed",
    ),
    (
        "tool_call_id_int",
        "chat",
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
        "malformed",
    ),
    ("surrogate", "chat", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "malformed"),
    (
        "continue_and_generate",
        "chat",
        {"messages": U + [{"role": "assistant", "content": "x"}], "continue_final_message": True},
        "malformed",
    ),
    ("salt_empty", "chat", {"messages": U, "cache_salt": ""}, "malformed"),
    ("salt_slash", "chat", {"messages": U, "cache_salt": "a/b"}, "malformed"),
    ("request_template", "chat", {"messages": U, "chat_template": "{{ 'x' }}"}, "malformed"),
    (
        "kwargs_template",
        "chat",
        {"messages": U, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
        "malformed",
    ),
    ("kwargs_messages", "chat", {"messages": U, "chat_template_kwargs": {"messages": []}}, "malformed"),
    (
        "kwargs_mask",
        "chat",
        {"messages": U, "chat_template_kwargs": {"return_assistant_tokens_mask": True}},
        "malformed",
    ),
    ("tools_no_name", "chat", {"messages": U, "tools": [{"type": "function", "function": {}}]}, "malformed"),
    ("reasoning_effort_bad", "chat", {"messages": U, "reasoning_effort": "extreme"}, "malformed"),
    ("generation_prompt_bad", "chat", {"messages": U, "add_generation_prompt": "maybe"}, "malformed"),
    # --- chat: valid, not reproduced
    (
        "image",
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
                    ],
                }
            ]
        },
        "unkeyed",
    ),
    # --- completions
    ("prompt", "completions", {"prompt": "hello world, the cache and the router"}, "exact"),
    ("prompt_unicode", "completions", {"prompt": "naïve café — 中文 🎉 e\u0301"}, "exact"),
    ("prompt_specials", "completions", {"prompt": "<s><|user|>\nhi<|end|>\n<|assistant|>\n"}, "exact"),
    (
        "prompt_template_text",
        "completions",
        {"prompt": "<|system|>\n" + _text(300, 3) + "<|end|>\n<|user|>\nq<|end|>\n"},
        "exact",
    ),
    ("prompt_list", "completions", {"prompt": ["first prompt", "second"]}, "exact"),
    ("prompt_ids", "completions", {"prompt": [5, 6, 7, 8, 9, 10]}, "exact"),
    ("prompt_id_lists", "completions", {"prompt": [[5, 6, 7], [8]]}, "exact"),
    ("prompt_no_specials", "completions", {"prompt": "x y", "add_special_tokens": False}, "exact"),
    ("prompt_truncate", "completions", {"prompt": _text(60, 2), "truncate_prompt_tokens": 9}, "exact"),
    (
        "prompt_truncate_right",
        "completions",
        {"prompt": _text(60, 2), "truncate_prompt_tokens": 9, "truncation_side": "right"},
        "exact",
    ),
    ("prompt_ids_truncate", "completions", {"prompt": [5, 6, 7, 8, 9], "truncate_prompt_tokens": 3}, "exact"),
    ("prompt_echo", "completions", {"prompt": "echo me", "echo": True}, "exact"),
    ("prompt_long", "completions", {"prompt": _text(2000, 5)}, "exact"),
    ("prompt_salt", "completions", {"prompt": "salted", "cache_salt": "s1"}, "exact"),
    ("prompt_missing", "completions", {}, "malformed"),
    ("prompt_empty", "completions", {"prompt": ""}, "malformed"),
    ("prompt_empty_list", "completions", {"prompt": []}, "malformed"),
    ("prompt_empty_ids", "completions", {"prompt": [[]]}, "malformed"),
    ("prompt_int", "completions", {"prompt": 5}, "malformed"),
    ("prompt_mixed", "completions", {"prompt": ["a", 5]}, "malformed"),
    ("prompt_negative_id", "completions", {"prompt": [5, -1]}, "malformed"),
    ("prompt_surrogate", "completions", {"prompt": "a\udfffb"}, "malformed"),
    ("prompt_empty_in_list", "completions", {"prompt": ["abc", ""]}, "malformed"),
    ("prompt_truncate_zero", "completions", {"prompt": "abc", "truncate_prompt_tokens": 0}, "malformed"),
    ("prompt_truncate_all", "completions", {"prompt": _text(30, 4), "truncate_prompt_tokens": -1}, "exact"),
    ("truncate_all", "chat", {"messages": U, "truncate_prompt_tokens": -1, "max_tokens": 4}, "exact"),
    ("prompt_suffix", "completions", {"prompt": "def f(", "suffix": "return 1"}, "unkeyed"),
    # --- /tokenize (no tool_choice rules there)
    ("tokenize_chat_tools", "tokenize", {"messages": U, "tools": [TOOL]}, "exact"),
    (
        "tokenize_chat_plain",
        "tokenize",
        {"messages": _conversation(2, 8), "add_generation_prompt": False},
        "exact",
    ),
    ("tokenize_prompt", "tokenize", {"prompt": "tokenize <|end|> me"}, "exact"),
]


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode("utf-8", "surrogatepass")
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode("utf-8", "replace")[:200]}


def engine_ids(url: str, endpoint: str, body: dict) -> tuple[int, list[int] | None]:
    """(status, prompt token ids) of one case as the engine serves it."""
    if endpoint == "tokenize":
        status, r = _post(url, "/tokenize", {"model": MODEL, **body})
        return status, (r["tokens"] if status == 200 else None)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    status, r = _post(
        url, path, {"model": MODEL, "max_tokens": 1, "temperature": 0, "return_token_ids": True, **body}
    )
    if status != 200:
        return status, None
    if endpoint == "chat":
        return status, r["prompt_token_ids"]
    return status, r["choices"][0]["prompt_token_ids"]


def record(url: str) -> dict:
    """The engine's answers to every case (the offline fixture's content)."""
    from radixfleet_tools.bench.tiny_tokenizer import tokenizer_json_sha256

    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        models = json.loads(r.read())
    root = models["data"][0].get("root", "")
    with urllib.request.urlopen(url + "/version", timeout=10) as r:
        version = json.loads(r.read()).get("version")
    out = {
        "vllm_version": version,
        "model": MODEL,
        "block_size": 32,
        "tokenizer_json_sha256": tokenizer_json_sha256(root) if os.path.isdir(root) else None,
        "cases": [],
    }
    for name, endpoint, body, expect in CASES:
        status, ids = engine_ids(url, endpoint, body)
        out["cases"].append(
            {"name": name, "endpoint": endpoint, "body": body, "expect": expect, "status": status, "ids": ids}
        )
    return out


@pytest.fixture(scope="module")
def live_cases(vllm_url: str) -> dict:
    return record(vllm_url)


@pytest.fixture(scope="module")
def keyer(vllm_url: str, tmp_path_factory) -> TokenKeyer:
    """The keyer of the tokenizer the engine serves (read from its /v1/models root when
    that folder is here, else the deterministic rebuild of the tiny tokenizer)."""
    from radixfleet_tools.bench.tiny_tokenizer import build

    with urllib.request.urlopen(vllm_url + "/v1/models", timeout=10) as r:
        root = json.loads(r.read())["data"][0].get("root", "")
    if not os.path.isdir(root):
        root = build(str(tmp_path_factory.mktemp("tiny-tokenizer")))
    return TokenKeyer.load(root, max_model_len=4096)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_router_ids_equal_vllm_ids(keyer, live_cases, name):
    case = next(c for c in live_cases["cases"] if c["name"] == name)
    check_case(keyer, case)


def test_recorded_fixture_matches_live_engine(live_cases):
    """The offline fixture still says what this vLLM says (else re-record it)."""
    with open(FIXTURE, encoding="utf-8") as f:
        recorded = json.load(f)
    live = {c["name"]: (c["status"], c["ids"]) for c in live_cases["cases"]}
    rec = {c["name"]: (c["status"], c["ids"]) for c in recorded["cases"]}
    assert rec == live, "tests/data/vllm_token_ids.json is stale: re-record it (module doc)"


def test_multiturn_prefix_blocks_shared(keyer, vllm_url):
    """A conversation's next turn keeps the previous turn's whole blocks: the keys a
    router matches across turns are the blocks vLLM reuses (its cached_tokens)."""
    msgs = _conversation(4, 60)
    first = keyer.key(Endpoint.CHAT, {"model": MODEL, "messages": msgs}, block_size=32)
    nxt = msgs + [
        {"role": "assistant", "content": "ok " + _text(30, 9)},
        {"role": "user", "content": "next question"},
    ]
    second = keyer.key(Endpoint.CHAT, {"model": MODEL, "messages": nxt}, block_size=32)
    shared = 0
    for a, b in zip(first.hashes, second.hashes):
        if a != b:
            break
        shared += 1
    assert shared >= len(first.hashes) - 1 > 0
    _post(vllm_url, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1})
    status, r = _post(vllm_url, "/v1/chat/completions", {"model": MODEL, "messages": nxt, "max_tokens": 1})
    assert status == 200
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the engine reuses at least the blocks both prompts share (it may hold more
    # from earlier runs of this test), never a block the router says differs
    assert cached >= shared * 32
    assert r["usage"]["prompt_tokens"] == second.prompt_tokens


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m tests.engines.test_token_keys_vllm VLLM_URL", file=sys.stderr)
        sys.exit(2)
    data = record(sys.argv[1].rstrip("/"))
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = [json.dumps(c, ensure_ascii=True, separators=(",", ":")) for c in data["cases"]]
    with open(FIXTURE, "w", encoding="utf-8") as f:  # one case a line: diffs stay readable
        f.write(json.dumps(head)[:-1] + ', "cases": [\n' + ",\n".join(lines) + "\n]}\n")
    print(f"recorded {len(data['cases'])} cases to {FIXTURE}")
