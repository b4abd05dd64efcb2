"""The tiny test model's tokenizer and chat template, built here without torch.

The same recipe as ``tests/engines/make_tiny_llama.py`` (which also builds the random
weights, and needs torch): a byte-level BPE of 2,048 tokens trained on generated
text, the special tokens ``<|system|>`` ... ``<|end|>``, and a ``<|role|>`` chat
template with system prompts and tools. Deterministic: the files are byte for byte
those the vLLM test fixture serves (``TOKENIZER_JSON_SHA256`` pins it; the token-key
tests check it), so token ids recorded from that vLLM hold for this tokenizer.

Used by ``radixfleet bench routing`` and the token-key tests; about 2 s to build.
"""

from __future__ import annotations

import hashlib
import os
import random

#: sha256 of the tokenizer.json this recipe produces (tokenizers 0.23).
TOKENIZER_JSON_SHA256 = "2457a0cb26cd"

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

SPECIALS = [
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|tools|>",
    "<|end|>",
]

WORDS = (
    "the of and to in is was for on that with as by at from this be are an or it "
    "cache prefix token router worker engine request model block hash session turn "
    "system user assistant tool answer question document context memory batch queue "
    "prefill decode latency throughput fleet replica load policy index event"
).split()


def corpus(n: int = 4000) -> list[str]:
    """The fixed training text (seeded)."""
    rng = random.Random(1234)
    lines = []
    for _ in range(n):
        k = rng.randint(5, 30)
        words = [
            rng.choice(WORDS)
            if rng.random() < 0.8
            else "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(2, 8)))
            for _ in range(k)
        ]
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def build(out: str) -> str:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into
    ``out`` (created if needed); returns ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)
    return out


def tokenizer_json_sha256(folder: str) -> str:
    """The first 12 hex digits of the sha256 of ``folder``/tokenizer.json."""
    with open(os.path.join(folder, "tokenizer.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]
