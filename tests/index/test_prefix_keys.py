"""Canonicalization and chained block hashes (contract 1, docs/DESIGN.md)."""

from __future__ import annotations

import pytest

from radixfleet.keys import (
    BYTES_PER_TOKEN,
    GENERATION_PROMPT,
    Endpoint,
    block_hashes,
    namespace_seed,
    request_key,
    routing_bytes,
)
from radixfleet.wire.errors import MalformedRequest

CHAT, COMP, GEN = Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.GENERATE


def chat(*msgs, **extra):
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in msgs], **extra}


def test_chain_shares_exactly_the_common_blocks():
    a = b"x" * 640
    b = a[:320] + b"y" + a[321:]  # one byte changed inside block 2 (of 64-byte blocks)
    seed = namespace_seed("m")
    ha, hb = block_hashes(a, seed, 64), block_hashes(b, seed, 64)
    assert len(ha) == len(hb) == 10
    assert ha[:5] == hb[:5]  # every earlier block keeps its hash
    assert all(x != y for x, y in zip(ha[5:], hb[5:]))  # the chain differs from there on


def test_equal_text_at_other_positions_never_collides():
    seed = namespace_seed("m")
    h = block_hashes(b"A" * 64 * 4, seed, 64)
    assert len(set(h)) == 4


def test_partial_tail_is_not_keyed():
    seed = namespace_seed("m")
    assert block_hashes(b"z" * 127, seed, 64) == block_hashes(b"z" * 64, seed, 64)
    assert len(block_hashes(b"z" * 63, seed, 64)) == 0


def test_tenants_adapters_models_never_share():
    body = {"model": "m", "prompt": "p" * 1024}
    base = request_key(COMP, body, tenant="a").hashes
    assert request_key(COMP, body, tenant="a").hashes == base
    assert set(request_key(COMP, body, tenant="b").hashes).isdisjoint(base)
    assert set(request_key(COMP, {**body, "lora_path": "ad1"}, tenant="a").hashes).isdisjoint(base)
    assert set(request_key(COMP, {**body, "model": "m2"}, tenant="a").hashes).isdisjoint(base)


def test_chat_keys_on_every_message_in_order_with_roles():
    a = routing_bytes(CHAT, chat(("system", "S"), ("user", "hello")))
    b = routing_bytes(CHAT, chat(("user", "S"), ("user", "hello")))
    c = routing_bytes(CHAT, chat(("user", "hello"), ("system", "S")))
    assert len({a, b, c}) == 3
    assert a.endswith(GENERATION_PROMPT)


def test_chat_history_is_a_prefix_of_the_next_turn():
    turn1 = chat(("system", "S" * 300), ("user", "q1"))
    answer = "abcd" * 10  # the agent's answers are whole 4-byte tokens
    turn2 = chat(("system", "S" * 300), ("user", "q1"), ("assistant", answer), ("user", "q2"))
    b1, b2 = routing_bytes(CHAT, turn1), routing_bytes(CHAT, turn2)
    assert b2.startswith(b1 + answer.encode())
    assert len(b1) % BYTES_PER_TOKEN == 0


def test_content_parts_render_like_a_string_and_media_by_digest():
    s = routing_bytes(CHAT, chat(("user", "hello world")))
    parts = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
            }
        ],
    }
    assert routing_bytes(CHAT, parts) == s
    img = lambda url: {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
    }
    assert routing_bytes(CHAT, img("a")) != routing_bytes(CHAT, img("b"))


def test_tools_come_first_and_are_canonicalized():
    t1 = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    t2 = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    a = routing_bytes(CHAT, chat(("user", "x"), tools=t1))
    b = routing_bytes(CHAT, chat(("user", "x"), tools=t2))
    assert a == b and a.startswith(b"<|tools|>")
    assert a != routing_bytes(CHAT, chat(("user", "x")))


def test_completions_prompt_forms():
    assert routing_bytes(COMP, {"prompt": "abc"}) == b"abc"
    assert routing_bytes(COMP, {"prompt": ["abc", "def"]}) == b"abc"  # keyed on the first
    ids = routing_bytes(COMP, {"prompt": [1, 2]})
    assert ids == (1).to_bytes(4, "little") + (2).to_bytes(4, "little")
    assert routing_bytes(COMP, {"prompt": [[1, 2], [3]]}) == ids
    # token ids key exactly like the bytes they encode
    text = "abcd" * 40
    as_ids = [int.from_bytes(text.encode()[i : i + 4], "little") for i in range(0, len(text), 4)]
    assert (
        request_key(COMP, {"model": "m", "prompt": as_ids}).hashes
        == request_key(COMP, {"model": "m", "prompt": text}).hashes
    )


def test_generate_text_and_input_ids():
    assert routing_bytes(GEN, {"text": "hi"}) == b"hi"
    assert routing_bytes(GEN, {"input_ids": [7]}) == (7).to_bytes(4, "little")
    assert request_key(GEN, {"text": "x" * 200}).model == ""


@pytest.mark.parametrize(
    "endpoint, body, field",
    [
        (COMP, [], None),
        (COMP, {"model": "m"}, "prompt"),
        (COMP, {"model": "m", "prompt": 5}, "prompt"),
        (COMP, {"model": "m", "prompt": []}, "prompt"),
        (COMP, {"model": "m", "prompt": [1, "a"]}, "prompt"),
        (COMP, {"model": "m", "prompt": [-1]}, "prompt"),
        (COMP, {"model": 3, "prompt": "x"}, "model"),
        (CHAT, {"model": "m"}, "messages"),
        (CHAT, {"model": "m", "messages": []}, "messages"),
        (CHAT, {"model": "m", "messages": ["hi"]}, "messages"),
        (CHAT, {"model": "m", "messages": [{"content": "x"}]}, "messages"),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content",
        ),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
        (GEN, {"sampling_params": {}}, "text"),
        (COMP, {"model": "m", "prompt": "x", "lora_path": 1}, "lora_path"),
    ],
)
def test_malformed_bodies_raise_one_typed_error_naming_the_field(endpoint, body, field):
    with pytest.raises(MalformedRequest) as ei:
        request_key(endpoint, body)
    if field is not None:
        top = field.split("[")[0].split(".")[0]
        assert ei.value.param.split("[")[0].split(".")[0] == top
        assert field in ei.value.message
    assert ei.value.status == 400
    assert ei.value.to_json()["error"]["message"] == ei.value.message


def test_unknown_part_type_lists_the_known_ones():
    with pytest.raises(MalformedRequest, match="is not one of text, refusal, image_url"):
        routing_bytes(CHAT, {"messages": [{"role": "user", "content": [{"type": "video"}]}]})
