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
import random
import sys

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}{% if p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|tool|>", "<|tools|>", "<|end|>"]

WORDS = ("the of and to in is was for on that with as by at from this be are an or it "
         "cache prefix token router worker engine request model block hash session turn "
         "system user assistant tool answer question document context memory batch queue "
         "prefill decode latency throughput fleet replica load policy index event").split()


def corpus(n: int = 4000) -> list[str]:
    rng = random.Random(1234)
    lines = []
    for _ in range(n):
        k = rng.randint(5, 30)
        words = [rng.choice(WORDS) if rng.random() < 0.8 else
                 "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(2, 8)))
                 for _ in range(k)]
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def main(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=SPECIALS[4:])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, bos_token_id=fast.bos_token_id,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                      tie_word_embeddings=False)
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
