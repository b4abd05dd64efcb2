"""Cost-model arithmetic (radixfleet_tools.agent.cost_model) and the byte-chunk tokenizer."""

from __future__ import annotations

import random

import pytest

from radixfleet.keys import BYTES_PER_TOKEN, Endpoint, routing_bytes
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.agent import tokenizer as tk
from radixfleet_tools.agent.cost_model import GPUS, MODELS, CostModel


def test_design_figures():
    c = CostModel("llama-3-70b", "h100", mfu=0.6)
    # 2 x 70.6e9 x 2048 / (989e12 x 0.6); docs/DESIGN.md's 0.48 s uses 70e9
    assert c.prefill_linear_s(2048) == pytest.approx(2 * 70.6e9 * 2048 / (989e12 * 0.6))
    assert c.prefill_linear_s(2048) == pytest.approx(0.48, rel=0.02)
    assert MODELS["llama-3-70b"].kv_bytes_per_token == 327_680 == 2 * 80 * 8 * 128 * 2
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 131_072
    # MLA: layers x (kv_lora_rank + rope dim) x 2 bytes, ~70 KB for DeepSeek-V3
    assert MODELS["deepseek-v3"].kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert MODELS["deepseek-v2-lite"].kv_bytes_per_token == 27 * 576 * 2


def test_presets_and_sources():
    assert set(GPUS) >= {"a100-80g", "h100", "h200", "l4"}
    assert set(MODELS) >= {"llama-3-8b", "llama-3-70b", "qwen2.5-32b"}
    assert any(m.is_mla for m in MODELS.values())
    assert GPUS["h100"].peak_flops == 989e12
    assert all(x.source for x in (*GPUS.values(), *MODELS.values()))


def test_kv_capacity_formula_and_tp():
    c = CostModel("llama-3-8b", "h100")
    assert c.kv_capacity_tokens() == int((80e9 * 0.9 - 8.03e9 * 2) // 131_072)
    c2 = CostModel("llama-3-70b", "h100", tp=4)
    assert c2.kv_capacity_tokens() == int((80e9 * 0.9 - 70.6e9 * 2 / 4) // (327_680 / 4))
    # MLA's latent KV is replicated across TP ranks
    c3 = CostModel("deepseek-v3", "h200", tp=8)
    assert c3.kv_bytes_per_token_per_gpu() == 70_272
    with pytest.raises(ConfigError, match="do not fit"):
        CostModel("llama-3-70b", "h100").kv_capacity_tokens()
    with pytest.raises(ConfigError, match="unknown gpu preset 'v100'.*h100"):
        CostModel("llama-3-8b", "v100")
    with pytest.raises(ConfigError):
        CostModel("llama-3-8b", "h100", tp=0)


def test_prefill_and_decode_times():
    c = CostModel("llama-3-8b", "h100")
    rate = 989e12 * 0.6
    attn = 2 * 32 * 256 * 32
    assert c.prefill_s(1000, 500) == pytest.approx((2 * 8.03e9 * 1000 + attn * 1000 * (500 + 500)) / rate)
    # decode is memory-bound: weights + KV over bandwidth
    assert c.decode_step_s(8, 10_000) == pytest.approx((16.06e9 + 131_072 * 10_000) / 3.35e12)
    # huge batches become compute-bound
    assert c.decode_step_s(100_000, 0) == pytest.approx(2 * 8.03e9 * 100_000 / rate)
    # a forward pass never beats reading the weights once
    assert c.forward_s(c.prefill_flops(1, 2047), 2048) >= 16.06e9 / 3.35e12
    assert c.forward_s(c.prefill_flops(2048), 2048) == pytest.approx(c.prefill_s(2048))
    # cached context makes prefill of the suffix cheaper than the whole prompt
    assert c.prefill_s(48, 2000) < 0.1 * c.prefill_s(2048)


def test_tokenizer_prefix_stable_and_partial_tail():
    a = b"abcdefgh"
    assert tk.encode(a + b"ijkl")[:2] == tk.encode(a)
    assert tk.encode(b"ab") != tk.encode(b"abcd")[:1]
    assert tk.encode(b"ab")[0] >= tk.PARTIAL and not tk.is_aligned(tk.encode(b"ab"))
    for data in (b"", b"x", b"hello world", bytes(range(256))):
        assert tk.decode(tk.encode(data)) == data
    ids = [1, 2**32 - 1, 77]
    assert tk.encode(routing_bytes(Endpoint.COMPLETIONS, {"prompt": ids})) == ids


def test_generated_text_is_deterministic_and_aligned():
    g = tk.generate(42, 20)
    assert g == tk.generate(42, 20) and g[:5] == tk.generate(42, 5) and g != tk.generate(43, 20)
    text = tk.decode(g)
    assert len(text) == 20 * BYTES_PER_TOKEN and text.isascii()
    assert tk.encode(text) == g
    # the next chat turn re-tokenizes the answer exactly as cached
    turn1 = {"messages": [{"role": "user", "content": "hi"}]}
    p1 = routing_bytes(Endpoint.CHAT, turn1)
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": text.decode()},
            {"role": "user", "content": "more"},
        ]
    }
    t2 = tk.encode(routing_bytes(Endpoint.CHAT, turn2))
    assert t2[: len(tk.encode(p1)) + 20] == tk.encode(p1) + g


def test_encode_key_is_encode_as_a_cache_key():
    from array import array

    rng = random.Random(3)
    for n in list(range(0, 13)) + [4097]:
        data = bytes(rng.randrange(256) for _ in range(n))
        key = tk.encode_key(data)
        assert type(key) is array and key.typecode == "Q"
        assert key.tolist() == tk.encode(data)
