"""Exact token keys, offline (radixfleet.engines.token_keys and its parts).

The token ids are checked against vLLM 0.32's own answers, recorded in
``tests/data/vllm_token_ids.json`` by tests/engines/test_token_keys_vllm.py (which
re-checks them against a live vLLM in the engine tests). The tokenizer is the tiny
test model's, rebuilt here without torch (radixfleet_tools.bench.tiny_tokenizer); its
tokenizer.json must hash to what the recording engine served.
"""

from __future__ import annotations

import json
import os
import random
import stat
from array import array

import pytest

from radixfleet.engines.chat_render import ChatTemplate, detect_content_format
from radixfleet.engines.piece_encoder import PieceEncoder, piecewise_blocker
from radixfleet.engines.token_keys import TokenizerLoadError, TokenKey, TokenKeyer
from radixfleet.keys import Endpoint, token_block_hashes, token_namespace_seed
from radixfleet.wire.errors import ConfigError, MalformedRequest
from radixfleet_tools.bench.tiny_tokenizer import TOKENIZER_JSON_SHA256, build, tokenizer_json_sha256
from tests.engines.token_cases import FIXTURE, check_case

with open(FIXTURE, encoding="utf-8") as _f:
    RECORDED = json.load(_f)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    d = build(str(tmp_path_factory.mktemp("tiny-tokenizer")))
    assert tokenizer_json_sha256(d) == RECORDED["tokenizer_json_sha256"] == TOKENIZER_JSON_SHA256, (
        "the rebuilt tokenizer is not the one vLLM served when the fixture was recorded"
    )
    return d


def _have_fastokens() -> bool:
    from importlib.util import find_spec

    return find_spec("fastokens") is not None


@pytest.fixture(scope="module", params=["tokenizers", "fastokens"])
def keyer(tiny_dir, request) -> TokenKeyer:
    """Both tokenizing backends must give vLLM's ids (fastokens is optional)."""
    if request.param == "fastokens" and not _have_fastokens():
        pytest.skip("fastokens (optional backend) not installed")
    k = TokenKeyer.load(tiny_dir, max_model_len=4096, tokenizer_backend=request.param)
    assert k.encoder.backend == request.param
    return k


@pytest.fixture()
def fresh(tiny_dir) -> TokenKeyer:
    return TokenKeyer.load(tiny_dir, max_model_len=4096)


def _chat(content: str = "hello there", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


# ------------------------------------------------------- identity with vLLM


@pytest.mark.parametrize("name", [c["name"] for c in RECORDED["cases"]])
def test_ids_equal_recorded_vllm_ids(keyer, name):
    check_case(keyer, next(c for c in RECORDED["cases"] if c["name"] == name))
    keyer.check()


def test_recorded_cases_in_any_order_with_a_tiny_cache(tiny_dir):
    """The piece cache never changes an answer: every case, shuffled, through a keyer
    whose cache evicts all the time, still gives vLLM's ids."""
    k = TokenKeyer.load(tiny_dir, max_model_len=4096, cache_bytes=2_000)
    cases = list(RECORDED["cases"]) * 2
    random.Random(7).shuffle(cases)
    for c in cases:
        check_case(k, c)
        k.check()
    assert k.encoder.cost <= 2_000


# ------------------------------------------------ identity with transformers


def _random_text(rng: random.Random, specials: list[str]) -> str:
    alphabet = [
        "a",
        "b",
        "the",
        " ",
        "  ",
        "\n",
        "\t",
        "é",
        "中",
        "🎉",
        "e\u0301",
        "<",
        "|",
        ">",
        "s",
        "end",
        "\r\n",
        "x" * 40,
        "1234",
        "!?",
        "\u00a0",
    ]
    out = []
    for _ in range(rng.randint(0, 40)):
        out.append(rng.choice(specials) if rng.random() < 0.15 else rng.choice(alphabet))
    return "".join(out)


def test_piece_encoder_equals_transformers_on_random_text(keyer):
    tok = keyer.tokenizer
    specials = [t.content for t in tok._tokenizer.get_added_tokens_decoder().values()]
    specials += ["<|end", "|>", "<s", "<|user|", "</s>"]
    enc = PieceEncoder(tok, max_cache_bytes=50_000, backend=keyer.encoder.backend)
    assert enc.piecewise is None  # the tiny tokenizer is piece-local
    rng = random.Random(1)
    for i in range(600):
        text = _random_text(rng, specials)
        for special in (False, True):
            want = tok(text, add_special_tokens=special)["input_ids"]
            assert list(enc.encode(text, special)) == want, (text, special)
        if i % 50 == 0:
            enc.check(sample=50)
    assert enc.hits > 0 and enc.misses > 0
    enc.check(sample=10_000)


def test_chat_template_render_equals_transformers(keyer):
    """The compiled template called directly renders what apply_chat_template does
    (on conversations both treat alike: no None values, no reasoning)."""
    tok = keyer.tokenizer
    t = keyer.default_template
    convs = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u é 🎉"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
            {"role": "user", "content": "<|end|> again"},
        ],
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
                ],
            }
        ],
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}]
    for conv in convs:
        for agp in (True, False):
            for tl in (None, tools):
                want = tok.apply_chat_template(conv, tools=tl, add_generation_prompt=agp, tokenize=False)
                got = t.render(
                    [dict(m) for m in conv],
                    tools=tl,
                    documents=None,
                    add_generation_prompt=agp,
                    continue_final_message=False,
                    kwargs=dict(tok.special_tokens_map),
                )
                assert got == want
    conv = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "Sure, "}]
    want = tok.apply_chat_template(conv, continue_final_message=True, tokenize=False)
    got = t.render(
        [dict(m) for m in conv],
        tools=None,
        documents=None,
        add_generation_prompt=False,
        continue_final_message=True,
        kwargs=dict(tok.special_tokens_map),
    )
    assert got == want


# ---------------------------------------------------------------- the keys


def test_hashes_chain_token_block_hashes_and_skip_the_tail(keyer):
    body = {"model": "tiny", "prompt": list(range(5, 5 + 100))}
    key = keyer.key(Endpoint.COMPLETIONS, body, block_size=32)
    assert isinstance(key, TokenKey) and key.exact and key.unkeyed is None
    assert key.token_ids == array("I", range(5, 105)) and key.prompt_tokens == 100
    assert key.block_tokens == 32 and len(key.hashes) == 3  # 100 = 3 * 32 + 4: tail unkeyed
    seed = token_namespace_seed("tiny", "", None, 32)
    assert key.hashes == token_block_hashes(list(range(5, 105)), 32, seed)
    # each hash fingerprints its whole prefix: change token 0, every hash changes
    other = keyer.key(
        Endpoint.COMPLETIONS, {"model": "tiny", "prompt": [6] + list(range(6, 105))}, block_size=32
    )
    assert all(a != b for a, b in zip(key.hashes, other.hashes))
    # the tail never matters
    longer = keyer.key(
        Endpoint.COMPLETIONS, {"model": "tiny", "prompt": list(range(5, 5 + 127))}, block_size=32
    )
    assert longer.hashes == key.hashes
    short = keyer.key(Endpoint.COMPLETIONS, {"model": "tiny", "prompt": [1] * 31}, block_size=32)
    assert short.hashes == [] and short.prompt_tokens == 31


def test_chat_hashes_are_the_hashes_of_the_engine_ids(keyer):
    case = next(c for c in RECORDED["cases"] if c["name"] == "long_multiturn")
    key = keyer.key(Endpoint.CHAT, {"model": "tiny", **case["body"]}, block_size=32)
    seed = token_namespace_seed("tiny", "", None, 32)
    assert key.hashes == token_block_hashes(case["ids"], 32, seed)
    assert len(key.hashes) == len(case["ids"]) // 32


def test_namespaces_model_salt_adapter_block_size(keyer):
    body = {"model": "tiny", "prompt": list(range(200))}
    base = keyer.key(Endpoint.COMPLETIONS, body, block_size=32).hashes
    variants = [
        keyer.key(Endpoint.COMPLETIONS, body, block_size=32, model="other").hashes,
        keyer.key(Endpoint.COMPLETIONS, body, block_size=32, salt="s").hashes,
        keyer.key(Endpoint.COMPLETIONS, {**body, "cache_salt": "s2"}, block_size=32).hashes,
        keyer.key(Endpoint.COMPLETIONS, body, block_size=32, adapter="lora-a").hashes,
        keyer.key(Endpoint.COMPLETIONS, {**body, "lora_path": "lora-b"}, block_size=32).hashes,
        keyer.key(Endpoint.COMPLETIONS, body, block_size=64).hashes,
    ]
    firsts = {base[0]} | {v[0] for v in variants}
    assert len(firsts) == 1 + len(variants)  # every namespace has its own first block
    # an explicit salt/adapter/model wins over the body's
    assert keyer.key(Endpoint.COMPLETIONS, {**body, "cache_salt": "s"}, block_size=32, salt="").hashes == base
    # length-ambiguous tuples never share a seed
    tuples = [
        ("ab", "c", None, 32),
        ("a", "bc", None, 32),
        ("a", "b", "c", 32),
        ("a", "bc", "d", 32),
        ("a", "", "bc", 32),
        ("", "a", "bc", 32),
        ("a", "b", "", 32),
        ("a3", "", None, 2),
        ("a", "", None, 32),
        ("a", "", None, 3),
        ("a\x00", "", None, 32),
        ("a", "\x00", None, 32),
    ]
    seeds = [token_namespace_seed(*t) for t in tuples]
    assert len(set(seeds)) == len(seeds)
    # no adapter is no adapter, however it is spelled
    assert token_namespace_seed("a", "b", None, 32) == token_namespace_seed("a", "b", "", 32)


def test_key_reads_model_salt_adapter_from_the_body(keyer):
    k = keyer.key(Endpoint.CHAT, _chat("word " * 40, cache_salt="t1", lora_adapter="sql"), block_size=32)
    assert (k.model, k.salt, k.adapter) == ("tiny", "t1", "sql") and k.hashes
    assert k.hashes == token_block_hashes(k.token_ids, 32, token_namespace_seed("tiny", "t1", "sql", 32))


def test_next_turn_reuses_cached_pieces_and_keeps_its_blocks(fresh):
    msgs = [{"role": "system", "content": "rules " * 300}]
    for t in range(4):
        msgs.append({"role": "user", "content": f"question {t} " * 40})
        msgs.append({"role": "assistant", "content": f"answer {t} " * 40})
    first = fresh.key(Endpoint.CHAT, {"model": "tiny", "messages": msgs}, block_size=32)
    misses = fresh.encoder.misses
    nxt = msgs + [{"role": "user", "content": "one more"}]
    second = fresh.key(Endpoint.CHAT, {"model": "tiny", "messages": nxt}, block_size=32)
    assert fresh.encoder.misses - misses <= 2  # only the new message's pieces
    assert second.hashes[: len(first.hashes) - 1] == first.hashes[:-1]
    plain = fresh.tokenizer.apply_chat_template(nxt, add_generation_prompt=True, tokenize=False)
    assert list(second.token_ids) == fresh.tokenizer(plain, add_special_tokens=False)["input_ids"]
    fresh.check()


def test_generate_text_and_input_ids(keyer):
    text = "<|user|>\nhello<|end|>\n"
    g = keyer.key(Endpoint.GENERATE, {"text": text}, block_size=32, model="tiny")
    c = keyer.key(Endpoint.COMPLETIONS, {"model": "tiny", "prompt": text}, block_size=32)
    assert g.token_ids == c.token_ids  # SGLang adds special tokens, as completions do
    assert list(g.token_ids) == keyer.tokenizer(text)["input_ids"]
    i = keyer.key(Endpoint.GENERATE, {"input_ids": [[3, 4, 5], [6]]}, block_size=32, model="m")
    assert list(i.token_ids) == [3, 4, 5]
    lst = keyer.key(Endpoint.GENERATE, {"text": ["ab", "cd"]}, block_size=32, model="m")
    assert list(lst.token_ids) == keyer.tokenizer("ab")["input_ids"]


def test_unkeyable_requests_are_values_not_errors(keyer):
    media = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                ],
            }
        ],
    }
    k = keyer.key(Endpoint.CHAT, media, block_size=32)
    assert not k.exact and k.hashes == [] and "media" in k.unkeyed and k.prompt_tokens > 0
    e = keyer.key(Endpoint.COMPLETIONS, {"model": "m", "prompt_embeds": "AAAA"}, block_size=32)
    assert e.hashes == [] and "embeds" in e.unkeyed
    t = TokenKeyer.load(keyer.source).key(  # truncate -1 needs max_model_len
        Endpoint.COMPLETIONS, {"model": "m", "prompt": [1, 2], "truncate_prompt_tokens": -1}, block_size=32
    )
    assert t.unkeyed and "max_model_len" in t.unkeyed
    tk = keyer.key(
        Endpoint.CHAT,
        _chat(chat_template_kwargs={"tokenize": True, "truncation": True, "max_length": 3}),
        block_size=32,
    )
    assert tk.unkeyed and "truncation" in tk.unkeyed


# ------------------------------------------------------------- bad input


BAD = [
    (Endpoint.CHAT, [1, 2], None),
    (Endpoint.CHAT, {"model": "tiny"}, "messages"),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}]}, "model"),
    (Endpoint.CHAT, {"model": 5, "messages": []}, "model"),
    (Endpoint.CHAT, _chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (Endpoint.CHAT, _chat(chat_template=5), "chat_template"),
    (Endpoint.CHAT, _chat(tools={"a": 1}), "tools"),
    (Endpoint.CHAT, _chat(tools=[5]), "tools"),
    (Endpoint.CHAT, _chat(tools=[{"type": "custom", "function": {"name": "f"}}]), "tools"),
    (Endpoint.CHAT, _chat(tools=[{"function": {"name": "f", "strict": "maybe"}}]), "tools"),
    (Endpoint.CHAT, _chat(tools=[{"function": {"name": "f", "parameters": []}}]), "tools"),
    (Endpoint.CHAT, _chat(documents="doc"), "documents"),
    (Endpoint.CHAT, _chat(documents=[{"t": 1}]), "documents"),
    (Endpoint.CHAT, _chat(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (Endpoint.CHAT, _chat(truncate_prompt_tokens="5"), "truncate_prompt_tokens"),
    (Endpoint.CHAT, _chat(truncation_side="middle"), "truncation_side"),
    (Endpoint.CHAT, _chat(cache_salt=5), "cache_salt"),
    (Endpoint.CHAT, _chat(cache_salt="x" * 129), "cache_salt"),
    (Endpoint.CHAT, _chat(add_special_tokens=[]), "add_special_tokens"),
    (Endpoint.CHAT, _chat(lora_path=5), "lora_path"),
    (Endpoint.CHAT, _chat(kv_transfer_params={"prompt_token_ids": []}), "kv_transfer_params"),
    (Endpoint.CHAT, _chat(kv_transfer_params={"prompt_token_ids": [1, "a"]}), "kv_transfer_params"),
    (Endpoint.CHAT, {"model": "tiny", "messages": [5]}, "messages"),
    (Endpoint.CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [5]}]}, "messages"),
    (Endpoint.CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": 5}]}]}, "messages"),
    (
        Endpoint.CHAT,
        {"model": "tiny", "messages": [{"role": "assistant", "content": "x", "tool_calls": {"a": 1}}]},
        "messages",
    ),
    (
        Endpoint.CHAT,
        {
            "model": "tiny",
            "messages": [
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": "f"}]}
            ],
        },
        "messages",
    ),
    (
        Endpoint.CHAT,
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": 5, "arguments": "{}"}}
                    ],
                }
            ],
        },
        "messages",
    ),
    (
        Endpoint.CHAT,
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                }
            ],
        },
        "messages",
    ),
    (Endpoint.CHAT, {"model": "tiny", "messages": [{"role": "assistant", "tool_calls": [5]}]}, "messages"),
    (
        Endpoint.CHAT,
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        "messages",
    ),
    (
        Endpoint.CHAT,
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": []}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        "messages",
    ),
    (Endpoint.CHAT, _chat("a\udc80", name="n"), "messages"),
    (
        Endpoint.CHAT,
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"function": {"name": "f\ud800"}}],
            "tool_choice": "none",
        },
        "tools",
    ),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": [[1], [2, 2**32]]}, "prompt"),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": [True, 2]}, "prompt"),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": [1.5]}, "prompt"),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": {"a": 1}}, "prompt"),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a", None]}, "prompt"),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": [[1], 5]}, "prompt"),
    (Endpoint.GENERATE, {}, "text"),
    (Endpoint.GENERATE, {"text": 5}, "text"),
    (Endpoint.GENERATE, {"text": [[1, 2]]}, "text"),
    (Endpoint.GENERATE, {"input_ids": "abc"}, "input_ids"),
    (Endpoint.GENERATE, {"input_ids": [-1]}, "input_ids"),
    (Endpoint.GENERATE, {"text": "a\ud800"}, "text"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_malformed_request_naming_the_field(keyer, endpoint, body, param):
    with pytest.raises(MalformedRequest) as ei:
        keyer.key(endpoint, body, block_size=32)
    assert ei.value.param == param, ei.value.message
    assert ei.value.status == 400


def test_deep_nesting_and_template_failures_are_malformed(tiny_dir):
    deep = "1"
    for _ in range(5000):
        deep = "[" + deep + "]"
    k = TokenKeyer.load(tiny_dir, trust_request_chat_template=True)
    nested: dict = {}
    cur = nested
    for _ in range(3000):
        cur["a"] = {}
        cur = cur["a"]
    cases = [
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": ' + deep + "}"},
                        }
                    ],
                }
            ],
        },
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"function": {"name": "f", "parameters": nested}}],
            "tool_choice": "none",
        },
        _chat(chat_template="{{ raise_exception('no thanks') }}"),
        _chat(chat_template="{{ messages[0].content.__class__ }}{{ ''.__class__.mro() }}"),
        _chat(chat_template="{% for m in messages %}{{ m.content + 5 }}{% endfor %}"),
        _chat(chat_template="{% if %}"),
    ]
    for body in cases:
        with pytest.raises(MalformedRequest) as ei:
            k.key(Endpoint.CHAT, body, block_size=32)
        assert ei.value.param in ("messages", "chat_template", "tools"), ei.value.message
    with pytest.raises(MalformedRequest, match="no thanks"):
        k.key(Endpoint.CHAT, cases[2], block_size=32)


def test_caller_misuse_raises_value_error(keyer):
    for bs in (0, -32, 32.0, "32", True):
        with pytest.raises(ValueError):
            keyer.key(Endpoint.CHAT, _chat(), block_size=bs)
    with pytest.raises(ValueError):
        TokenKeyer(keyer.tokenizer, source="x", content_format="html")


# ------------------------------------------------------------- templates


def test_request_template_honoured_only_when_trusted(tiny_dir):
    body = _chat(chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    with pytest.raises(MalformedRequest) as ei:
        TokenKeyer.load(tiny_dir).key(Endpoint.CHAT, body, block_size=32)
    assert ei.value.param == "chat_template"
    k = TokenKeyer.load(tiny_dir, trust_request_chat_template=True)
    key = k.key(Endpoint.CHAT, body, block_size=32)
    assert list(key.token_ids) == k.tokenizer("[hello there]", add_special_tokens=False)["input_ids"]
    k.key(Endpoint.CHAT, body, block_size=32)
    assert len(k._request_templates) == 1  # compiled once
    k.check()


def test_server_chat_template_replaces_the_tokenizers(tiny_dir, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    for value in (str(f), f.read_text()):
        k = TokenKeyer.load(tiny_dir, chat_template=value)
        assert k.chat_prompt(_chat("x")).text == "<<x>>"
    with pytest.raises(TokenizerLoadError, match="does not compile"):
        TokenKeyer.load(tiny_dir, chat_template="{% for %}")


def test_string_content_format_joins_text_parts_with_newlines(tiny_dir):
    k = TokenKeyer.load(tiny_dir, trust_request_chat_template=True)
    tmpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    body = {
        "model": "tiny",
        "chat_template": tmpl,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "developer", "content": "d"},
        ],
    }
    text = k.chat_prompt(body).text
    # string format: parts joined by "\n"; developer -> system merged to the front
    assert text == "<system>d<user>a\nb"


@pytest.mark.parametrize(
    "template,fmt",
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{{ p }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for m in messages %}{% for p in m.content | selectattr('type') %}{{ p }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{{ p }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ r(m['content']) }}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for x in m['tool_calls'] %}{{ x }}{% endfor %}{% endfor %}", "string"),
    ],
)
def test_content_format_detection(template, fmt):
    t = ChatTemplate(template)
    assert t.content_format == fmt
    assert detect_content_format(t.compiled.environment.parse(template)) == fmt


# ------------------------------------------------------------ the encoder


def _tokenizer_dir(tmp_path, name, *, pre, added_kwargs, template=True):
    """A small fast tokenizer built here (tokenizers + transformers, no download)."""
    from tokenizers import AddedToken, Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"])
    tok.train_from_iterator(["hello world the cache router " * 20] * 50, trainer=trainer)
    tok.add_special_tokens([AddedToken("<|sep|>", **added_kwargs)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    if template:
        fast.chat_template = "{% for m in messages %}<|sep|>{{ m['content'] }}{% endfor %}"
    out = str(tmp_path / name)
    fast.save_pretrained(out)
    return out


def test_backend_choice(tiny_dir, tmp_path):
    from tokenizers import pre_tokenizers

    auto = TokenKeyer.load(tiny_dir)
    assert auto.encoder.backend == ("fastokens" if _have_fastokens() else "tokenizers")
    with pytest.raises(ValueError):
        TokenKeyer.load(tiny_dir, tokenizer_backend="sentencepiece")
    # a tokenizer fastokens refuses (a byte without a token): auto falls back,
    # and asking for fastokens is a load error naming the cause
    d = _tokenizer_dir(
        tmp_path,
        "holes",
        pre=pre_tokenizers.ByteLevel(add_prefix_space=False),
        added_kwargs={"normalized": False},
    )
    k = TokenKeyer.load(d)
    assert k.encoder.backend == "tokenizers"
    if _have_fastokens():
        with pytest.raises(TokenizerLoadError, match="fastokens"):
            TokenKeyer.load(d, tokenizer_backend="fastokens")


def test_fastokens_dropped_when_it_fails_where_tokenizers_does_not(keyer):
    if keyer.encoder.backend != "fastokens":
        pytest.skip("the fastokens keyer only")
    enc = PieceEncoder(keyer.tokenizer, backend="fastokens")

    class Refusing:
        def encode_batch_flat(self, texts, add_special_tokens=False):
            raise ValueError("model error")

    enc._fast = Refusing()
    text = "<|user|>\nhello<|end|>\n"
    assert list(enc.encode(text)) == keyer.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert enc.backend == "tokenizers" and enc._fast is None
    with pytest.raises((TypeError, UnicodeError)):  # bad text stays bad
        enc.encode("a\ud800")


@pytest.mark.parametrize(
    "name,pre,added,blocked",
    [
        ("metaspace_first", "metaspace_first", {}, "Metaspace"),
        ("lstrip", "bytelevel", {"lstrip": True}, "strips whitespace"),
        ("normalized", "bytelevel", {"normalized": True, "special": False}, "normalized"),
        ("metaspace_always", "metaspace_always", {}, None),
    ],
)
def test_encoder_falls_back_to_whole_texts_when_pieces_are_not_exact(tmp_path, name, pre, added, blocked):
    from tokenizers import pre_tokenizers

    pres = {
        "metaspace_first": pre_tokenizers.Metaspace(prepend_scheme="first"),
        "metaspace_always": pre_tokenizers.Metaspace(prepend_scheme="always"),
        "bytelevel": pre_tokenizers.ByteLevel(add_prefix_space=False),
    }
    k = TokenKeyer.load(
        _tokenizer_dir(tmp_path, name, pre=pres[pre], added_kwargs={"normalized": False, **added})
    )
    if blocked is None:
        assert k.encoder.piecewise is None
    else:
        assert blocked in k.encoder.piecewise
    rng = random.Random(3)
    for _ in range(200):
        text = _random_text(rng, ["<|sep|>", " <|sep|> ", "<|sep|>  x"])
        for special in (False, True):
            want = k.tokenizer(text, add_special_tokens=special)["input_ids"]
            assert list(k.encoder.encode(text, special)) == want, (name, text)
    k.check()


def test_bos_eos_post_processor_and_truncation_match_transformers(tmp_path):
    """A tokenizer whose post-processor adds BOS and EOS: completions keep them, and
    ``truncate_prompt_tokens`` cuts as vLLM's tokenizer call does (left side, room kept
    for the special tokens), or after the fact when a side is given."""
    from tokenizers import pre_tokenizers, processors

    d = _tokenizer_dir(
        tmp_path,
        "bos",
        pre=pre_tokenizers.ByteLevel(add_prefix_space=False),
        added_kwargs={"normalized": False},
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    bos, eos = tok.convert_tokens_to_ids("<s>"), tok.convert_tokens_to_ids("<unk>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A <unk>", special_tokens=[("<s>", bos), ("<unk>", eos)]
    )
    tok.save_pretrained(d)
    k = TokenKeyer.load(d, max_model_len=64)
    assert k.encoder.affix == (array("I", [bos]), array("I", [eos]))
    ref = AutoTokenizer.from_pretrained(d, truncation_side="left")
    text = "hello world <|sep|> the cache router " * 3
    full = ref(text)["input_ids"]
    assert full[0] == bos and full[-1] == eos
    body = {"model": "m", "prompt": text}
    assert list(k.key(Endpoint.COMPLETIONS, body, block_size=4).token_ids) == full
    for side in (None, "left", "right"):
        with pytest.raises(MalformedRequest) as ei:  # nothing left: vLLM's 400 too
            k.key(
                Endpoint.COMPLETIONS,
                {**body, "truncate_prompt_tokens": 0, "truncation_side": side},
                block_size=4,
            )
        assert ei.value.param == "truncate_prompt_tokens"
    for n in (1, 2, 3, 7, len(full) - 1, len(full), len(full) + 5):
        # vLLM: the tokenizer truncates, then what is still too long is cut (left)
        want = ref(text, truncation=True, max_length=n)["input_ids"]
        want = want[len(want) - n :] if n < len(want) else want
        got = k.key(Endpoint.COMPLETIONS, {**body, "truncate_prompt_tokens": n}, block_size=4).token_ids
        assert list(got) == want, n
        left = k.key(
            Endpoint.COMPLETIONS,
            {**body, "truncate_prompt_tokens": n, "truncation_side": "left"},
            block_size=4,
        )
        right = k.key(
            Endpoint.COMPLETIONS,
            {**body, "truncate_prompt_tokens": n, "truncation_side": "right"},
            block_size=4,
        )
        assert list(left.token_ids) == full[len(full) - min(n, len(full)) :]
        assert list(right.token_ids) == full[:n]
    # -1: the model's length (minus one when output tokens are asked for)
    long = {"model": "m", "prompt": text * 5, "truncate_prompt_tokens": -1}
    assert k.key(Endpoint.COMPLETIONS, long, block_size=4).prompt_tokens == 64
    assert k.key(Endpoint.COMPLETIONS, {**long, "max_tokens": 8}, block_size=4).prompt_tokens == 63


def test_piecewise_blocker_names_the_cause():
    base = {
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel"},
        "model": {"type": "BPE"},
        "post_processor": None,
    }
    assert piecewise_blocker(base, False) is None
    assert "encode_special_tokens" in piecewise_blocker(base, True)
    assert "normalizer" in piecewise_blocker({**base, "normalizer": {"type": "Weird"}}, False)
    assert "dropout" in piecewise_blocker({**base, "model": {"type": "BPE", "dropout": 0.1}}, False)
    assert "post-processor" in piecewise_blocker(
        {**base, "post_processor": {"type": "Sequence", "processors": [{"type": "Custom"}]}}, False
    )
    assert "model" in piecewise_blocker({**base, "model": {"type": "Neural"}}, False)


def test_cache_is_bounded_lru(keyer):
    enc = PieceEncoder(keyer.tokenizer, max_cache_bytes=3_000)
    texts = [f"<|user|>\npiece number {i} " + "word " * 50 for i in range(40)]
    for t in texts:
        assert list(enc.encode(t)) == keyer.tokenizer(t, add_special_tokens=False)["input_ids"]
        enc.check(sample=100)
    assert enc.cost <= 3_000 and 0 < len(enc) < 40
    assert texts[-1].split("<|user|>")[1] in enc._cache  # most recent kept
    enc.clear()
    assert len(enc) == 0 and enc.cost == 0


# ------------------------------------------------------------- loading


def test_load_errors_name_the_source_and_cause(tmp_path, tiny_dir):
    cases = []
    cases.append((str(tmp_path / "missing"), "no such folder"))
    f = tmp_path / "file.txt"
    f.write_text("x")
    cases.append((str(f), "not a folder"))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((str(empty), "holds no tokenizer"))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text("{not json")
    (corrupt / "tokenizer_config.json").write_text("{}")
    cases.append((str(corrupt), ""))
    cases.append(("nobody/not-a-cached-model", "local Hugging Face cache"))
    cases.append(("", "empty"))
    for source, cause in cases:
        with pytest.raises(TokenizerLoadError) as ei:
            TokenKeyer.load(source)
        assert isinstance(ei.value, ConfigError)
        assert ei.value.source == source and cause in ei.value.cause, str(ei.value)
        assert repr(source) in str(ei.value)


def test_unreadable_folder(tmp_path, tiny_dir):
    import shutil

    d = tmp_path / "locked"
    shutil.copytree(tiny_dir, d)
    if os.geteuid() != 0:
        os.chmod(d, 0)
        try:
            with pytest.raises(TokenizerLoadError, match="not readable"):
                TokenKeyer.load(str(d))
        finally:
            os.chmod(d, stat.S_IRWXU)
    # as root permissions are not enforced: a tokenizer.json that cannot be read as a
    # file is the unreadable case here
    os.remove(d / "tokenizer.json")
    os.mkdir(d / "tokenizer.json")
    with pytest.raises(TokenizerLoadError) as ei:
        TokenKeyer.load(str(d))
    assert "tokenizer.json" in ei.value.cause and ei.value.source == str(d)


def test_chat_template_required_unless_told(tmp_path):
    from tokenizers import pre_tokenizers

    d = _tokenizer_dir(
        tmp_path,
        "notemplate",
        pre=pre_tokenizers.ByteLevel(),
        added_kwargs={"normalized": False},
        template=False,
    )
    with pytest.raises(TokenizerLoadError, match="no chat template"):
        TokenKeyer.load(d)
    k = TokenKeyer.load(d, require_chat_template=False)
    assert k.key(Endpoint.COMPLETIONS, {"model": "m", "prompt": "hello"}, block_size=4).exact
    with pytest.raises(MalformedRequest) as ei:
        k.key(Endpoint.CHAT, _chat(), block_size=4)
    assert ei.value.param == "messages"


def test_models_vllm_renders_with_its_own_code_are_unkeyed_for_chat(tmp_path, tiny_dir):
    import shutil

    d = tmp_path / "harmony"
    shutil.copytree(tiny_dir, d)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    k = TokenKeyer.load(str(d))
    key = k.key(Endpoint.CHAT, _chat(), block_size=32)
    assert key.hashes == [] and "harmony" in key.unkeyed
    assert k.key(Endpoint.COMPLETIONS, {"model": "m", "prompt": "x " * 40}, block_size=32).exact
    with pytest.raises(MalformedRequest):
        k.key(Endpoint.CHAT, {"model": "m", "messages": [5]}, block_size=32)


# ------------------------------------------------------------- benchmark CLI


def test_bench_routing_token_rows_json(capsys):
    from radixfleet.cli import main as cli_main

    assert (
        cli_main(
            [
                "bench",
                "routing",
                "--requests",
                "50",
                "--token-requests",
                "30",
                "--policies",
                "prefix_load",
                "--tokenizer-backends",
                "tokenizers",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["prefix_load"]
    rows = out["token_results"]
    assert [(r["backend"], r["workload"]) for r in rows] == [
        ("tokenizers", "cold"),
        ("tokenizers", "shared"),
        ("tokenizers", "multiturn"),
    ]
    for r in rows:
        assert r["requests"] == 30 and r["workers"] == 16 and r["prompt_tokens_mean"] > 100
        assert 0 < r["keyer"]["p50_us"] <= r["routing"]["p50_us"]
        # the route core placed every pick's hint: the index holds the token blocks
        assert r["index_nodes"] >= r["blocks_mean"] > 0
        assert r["piece_cache"]["piecewise"]
    assert rows[0]["prompt_bytes_mean"] > 8000 and rows[1]["prompt_bytes_mean"] > 8000
    assert rows[2]["piece_cache"]["hits"] > rows[2]["piece_cache"]["misses"]


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--tokenizer", "/nonexistent/tok"], "no such folder"),
        (["--tokenizer-backends", "sentencepiece"], "unknown backend"),
        (["--block-size", "0"], "expected an integer >= 1"),
        (["--token-requests", "-1"], "expected an integer >= 0"),
    ],
)
def test_bench_routing_bad_input_is_one_line_and_exit_2(capsys, argv, msg):
    from radixfleet.cli import main as cli_main

    try:
        code = cli_main(
            [
                "bench",
                "routing",
                "--requests",
                "5",
                "--policies",
                "prefix_load",
                "--token-requests",
                "5",
                *argv,
            ]
        )
    except SystemExit as exc:  # argparse
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) in (1, 2) and msg in err[-1] and "Traceback" not in "".join(err)
