"""A real-engine test bed under cache pressure: KV caches sized to the working set, and
a CPU burner beside the engines.

``pressure_kv_bytes`` sizes each of N vLLM servers' ``--kv-cache-memory-bytes`` so that
their caches together hold ``ratio`` times the multiturn workload's final working set
(every session's last prompt, in the tiny model's tokens through its chat template,
plus every answer's ``output_tokens``). bench/vllm_ab.py's ``--kv 16M`` (2 x 32,768 tokens for
32 sessions x 5 turns of 128-token questions) is 1.26 times it.

``CpuBurner`` runs ``procs`` processes that spin on the CPU beside the engines (a router
shares its host with other work): each ends by itself after ``max_s`` (a bound should
the caller die without stopping it) and ``stop()`` ends them all now.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: the bench's and the tests' multiturn defaults (bench/vllm_ab.py)
MULTITURN = {"clients": 32, "rounds": 5, "question_tokens": 128, "output_tokens": 16}


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token takes in the model of ``model_dir`` (keys and values of
    every layer's KV heads, bf16)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def working_set_tokens(
    model_dir: Path,
    *,
    clients: int,
    rounds: int,
    question_tokens: int,
    output_tokens: int,
    seed: int = 0,
) -> int:
    """The multiturn workload's final working set in the model's tokens: each session's
    last prompt (its questions, empty answers, through the chat template) plus every
    answer's ``output_tokens``."""
    from transformers import AutoTokenizer  # the project's tokenizer extra

    from radixfleet_tools.loadtest.workloads import text_of

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    total = 0
    for c in range(clients):
        msgs: list[dict] = []
        for r in range(rounds):
            msgs.append({"role": "user", "content": text_of(question_tokens, f"multiturn/q/{c}/{r}", seed)})
            if r < rounds - 1:
                msgs.append({"role": "assistant", "content": ""})
        ids: Any = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        n = len(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else len(ids)
        total += n + rounds * output_tokens
    return total


def pressure_kv_bytes(
    model_dir: Path, ratio: float, servers: int = 2, block_size: int = 32, **workload
) -> tuple[int, int]:
    """(bytes for each server's ``--kv-cache-memory-bytes``, the working set in tokens):
    the servers' caches together ``ratio`` times the working set, whole blocks."""
    if ratio <= 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    ws = working_set_tokens(model_dir, **(MULTITURN | workload))
    tokens = math.ceil(ratio * ws / servers / block_size) * block_size
    return tokens * kv_bytes_per_token(model_dir), ws


_SPIN = "import time\nend = time.monotonic() + {max_s}\nwhile time.monotonic() < end:\n    pass\n"


class CpuBurner:
    """``procs`` processes spinning on the CPU (module docstring); a context manager."""

    def __init__(self, procs: int = 1, max_s: float = 3600.0) -> None:
        if procs < 0 or max_s <= 0:
            raise ValueError(f"procs must be >= 0 and max_s > 0, got {procs}, {max_s}")
        self.n = procs
        self.max_s = max_s
        self.procs: list[subprocess.Popen] = []

    def start(self) -> CpuBurner:
        code = _SPIN.format(max_s=self.max_s)
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.n)]
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def __enter__(self) -> CpuBurner:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
