"""bench/vllm_ab.py's router configs per mode, its ``--variant`` grammar and the cache-
pressure sizing (radixfleet_tools/harness/pressure.py) on hand-made inputs. No engines are started."""

from __future__ import annotations

import json
import types

import pytest

from radixfleet_tools.harness.pressure import CpuBurner, kv_bytes_per_token, pressure_kv_bytes
from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def ab():
    return load_script("vllm_ab.py")


SERVERS = [
    types.SimpleNamespace(url=f"http://127.0.0.1:{9001 + i}", events_port=5557 + i, replay_port=5567 + i)
    for i in range(2)
]


def test_quick_start_is_the_workers_urls_only(ab, tmp_path):
    cfg = ab.router_config(8000, SERVERS, tmp_path, **ab.MODES["quick_start"])
    assert cfg["workers"] == [
        {"url": "http://127.0.0.1:9001", "id": "vllm-a"},
        {"url": "http://127.0.0.1:9002", "id": "vllm-b"},
    ]
    assert "policy" not in cfg and "tokenizers" not in cfg


def test_approximate_and_bytes_modes_turn_events_off(ab, tmp_path):
    # a vLLM worker with no events: section follows /kv_event_sources (precise mode)
    approx = ab.router_config(8000, SERVERS, tmp_path, **ab.MODES["prefix_load_approx"])
    assert all(w["events"] == {"mode": "off"} and w["tokenizer"] == str(tmp_path) for w in approx["workers"])
    assert "tokenizers" not in approx
    byte = ab.router_config(8000, SERVERS, tmp_path, **ab.MODES["prefix_load_bytes"])
    assert all(w["events"] == {"mode": "off"} and "tokenizer" not in w for w in byte["workers"])
    assert byte["tokenizers"] == {"discover": False, "engine_tokenize": False}
    precise = ab.router_config(8000, SERVERS, tmp_path, **ab.MODES["prefix_load"])
    assert precise["workers"][1]["events"]["endpoint"] == "tcp://*:5558"


def test_a_variant_names_its_base_mode(ab):
    assert ab.parse_variant("x:warmup.enabled=false") == ("x", ("prefix_load", {"warmup.enabled": False}))
    name, (base, sets) = ab.parse_variant("qs@quick_start:tokenizers.discover=false,a.b=3")
    assert (name, base, sets) == ("qs", "quick_start", {"tokenizers.discover": False, "a.b": 3})
    for bad in ("qs@nope:a=1", "round_robin:a=1", "x:a", "x:"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad)


def test_kv_bytes_per_token_and_the_pressure_size(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2}
        )
    )
    assert kv_bytes_per_token(tmp_path) == 2 * 2 * 2 * 32 * 2  # K and V, layers, heads, dim, bf16
    import radixfleet_tools.harness.pressure as pressure

    monkeypatch.setattr(pressure, "working_set_tokens", lambda model_dir, **w: 1000 * w["clients"])
    kv, ws = pressure_kv_bytes(tmp_path, 1.3, clients=32)
    assert ws == 32_000
    # 1.3 x 32,000 over two servers = 20,800 tokens, whole 32-token blocks
    assert kv == 20_800 * 512
    with pytest.raises(ValueError):
        pressure_kv_bytes(tmp_path, 0)
    with pytest.raises(ValueError):
        CpuBurner(-1)
