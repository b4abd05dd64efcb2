"""Builds a tiny random Llama with a locally trained tokenizer and chat template.

Run with the vLLM venv's interpreter (it needs torch and transformers)::

    python make_tiny_llama.py OUT_DIR

Nothing is downloaded: the weights are random (hidden 128, 2 layers, 4 heads, 2 KV
heads), the tokenizer is a byte-level BPE trained here on generated text, and the
chat template is a small Jinja template of the usual ``<|role|>`` shape with system
prompts and tools. Outputs are gibberish; the KV cache, prefix caching, events and
metrics of an engine serving it are real. Deterministic for a given OUT_DIR content:
the training text and the weight seed are fixed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The tokenizer recipe is shared with the offline tests and `bench routing`, which
# rebuild it without torch (byte-identical tokenizer.json, pinned there).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from radixfleet_tools.bench.tiny_tokenizer import build as build_tokenizer  # noqa: E402


def main(out: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    build_tokenizer(out)
    fast = AutoTokenizer.from_pretrained(out)

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    with open(os.path.join(out, "radixfleet_tiny.json"), "w") as f:
        json.dump({"what": "tiny random llama for engine tests", "vocab": len(fast)}, f)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: make_tiny_llama.py OUT_DIR", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1])
