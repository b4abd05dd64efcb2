"""The peers' datasets as workloads: ``--dataset random`` and ``--dataset sharegpt``.

Both are single-shot workloads (``radixfleet_tools.loadtest.workloads.Workload``), pure functions of
their parameters and seed, sent in the order listed::

    random     vllm bench serve's random dataset: ``requests`` prompts whose input
               and output lengths are drawn uniformly from [L*(1-r), L*(1+r)]
               (``--input-len``, ``--output-len``, ``--range-ratio`` r in [0, 1)),
               each opening with the same ``--prefix-len`` tokens (a shared system
               prompt; 0: unrelated prompts)
    sharegpt   a ShareGPT-format file: a JSON list (or JSONL, one per line) of
               ``{"conversations": [{"from": "human", "value": ...},
               {"from": "gpt", "value": ...}, ...]}``. As vLLM does, each entry's first
               turn is the prompt and the length of its second the output length
               (``--output-len`` overrides it); entries whose prompt or answer is
               under 4 tokens, or whose prompt is over 1024 tokens or prompt + answer
               over 2048 (when the answer sets the length), are left out

Each dataset's parameters are a settings class (``radixfleet.wire.settings``: type, bounds
and doc declared once); ``make_dataset`` validates the flags' values against it and
raises one ``WorkloadError`` naming every bad value by its flag::

    --range-ratio: expected a number in [0, 1), got 1.0

Token counts are the byte-chunk tokenizer's (``radixfleet.keys``: 4 bytes a
token), which the agents use; a real engine's tokenizer counts the same text
differently, and its usage figures are the ones reported.

A file that cannot be read, is not JSON, holds no usable entry, or an entry without
the fields above raises ``WorkloadError`` naming the file, line and field.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from radixfleet.wire.errors import ConfigError, WorkloadError
from radixfleet.wire.settings import from_flags, setting, settings
from radixfleet_tools.loadtest.workloads import (
    API_COMPLETIONS,
    Api,
    RequestSpec,
    Session,
    SingleShot,
    Workload,
    token_count,
)

DATASETS = ("random", "sharegpt")

#: vLLM's ShareGPT filter (benchmark_dataset.is_valid_sequence)
_MIN_TOKENS, _MAX_PROMPT, _MAX_TOTAL = 4, 1024, 2048


@settings
class RandomParams:
    requests: int = setting(1000, "prompts to send (--requests)", lo=1)
    input_len: int = setting(1024, "prompt tokens after the prefix, L of the range (--input-len)", lo=1)
    output_len: int = setting(128, "output tokens, L of the range (--output-len)", lo=1)
    range_ratio: float = setting(
        0.0,
        "lengths uniform in [L*(1-r), L*(1+r)] (--range-ratio; vLLM's --random-range-ratio)",
        lo=0,
        hi=1,
        hi_open=True,
    )
    prefix_len: int = setting(
        0, "tokens every prompt opens with (--prefix-len; vLLM's --random-prefix-len)", lo=0
    )
    api: Api = setting(API_COMPLETIONS, "endpoint the requests go to (--dataset-api)")


def _spread(rng: random.Random, length: int, ratio: float) -> int:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(lo, hi) if hi > lo else lo


def _body(api: str, text: str) -> dict:
    return {"prompt": text} if api == API_COMPLETIONS else {"messages": [{"role": "user", "content": text}]}


class RandomDataset(Workload):
    """Random-length prompts after an optional shared prefix."""

    name = "random"
    Params = RandomParams

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        prefix = self.text(p.prefix_len, "prefix")
        out: list[Session] = []
        for i in range(p.requests):
            n_in = _spread(rng, p.input_len, p.range_ratio)
            n_out = _spread(rng, p.output_len, p.range_ratio)
            text = prefix + self.text(n_in, f"prompt/{i}")
            sid = f"r{i}"
            out.append(
                SingleShot(
                    RequestSpec(
                        f"{sid}.0", p.api, _body(p.api, text), n_out, sid, 0, None, p.prefix_len + n_in
                    )
                )
            )
        return out


@settings
class ShareGPTParams:
    path: str = setting("", "the ShareGPT-format file (--dataset-path)")
    output_len: int = setting(
        0, "fixed output length for every request (--output-len; 0: the answer's length in the file)", lo=0
    )
    requests: int = setting(0, "first N usable entries only (0: all)", lo=0)
    api: Api = setting(API_COMPLETIONS, "endpoint the requests go to (--dataset-api)")


class ShareGPT(Workload):
    """The first turn of each ShareGPT conversation, in file order."""

    name = "sharegpt"
    Params = ShareGPTParams

    def prepare(self) -> None:
        p = self.params
        if not p.path:
            raise WorkloadError("--dataset sharegpt needs --dataset-path FILE")
        self.pairs = load_sharegpt(p.path, p.output_len, p.requests)

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        return [
            SingleShot(
                RequestSpec(
                    f"s{i}.0", p.api, _body(p.api, prompt), n_out, f"s{i}", 0, None, token_count(prompt)
                )
            )
            for i, (prompt, n_out) in enumerate(self.pairs)
        ]


def _entries(path: str) -> list[tuple[int, object]]:
    """(line, entry) pairs of a JSON list or a JSONL file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise WorkloadError(f"{path}: the file is empty")
    if text.lstrip().startswith("["):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}: line {exc.lineno}: not JSON ({exc.msg})") from None
        # line of each entry is unknown inside one document: report its index instead
        return [(-(i + 1), e) for i, e in enumerate(doc)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise WorkloadError(
                f"{path}: line {n}: not JSON ({exc.msg}); a ShareGPT file "
                "is a JSON list or one conversation per line"
            ) from None
    return out


def load_sharegpt(path: str, output_len: int = 0, limit: int = 0) -> list[tuple[str, int]]:
    """(prompt, output tokens) of each usable entry of a ShareGPT file, in order."""
    pairs: list[tuple[str, int]] = []
    entries = _entries(path)
    for where, entry in entries:
        at = f"{path}: line {where}" if where > 0 else f"{path}: entry {-where - 1}"
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if conv is None and isinstance(entry, dict):
            conv = entry.get("conversation")
        if not isinstance(conv, list):
            raise WorkloadError(
                f"{at}: field 'conversations' missing or not a list (is this a ShareGPT file?)"
            )
        if len(conv) < 2:
            continue  # vLLM skips conversations without an answer
        texts = []
        for k in (0, 1):
            turn = conv[k]
            value = turn.get("value") if isinstance(turn, dict) else None
            if not isinstance(value, str):
                raise WorkloadError(f"{at}: field 'conversations[{k}].value' missing or not a string")
            texts.append(value)
        n_in, n_ans = token_count(texts[0]), token_count(texts[1])
        n_out = output_len or n_ans
        if n_in < _MIN_TOKENS or n_out < _MIN_TOKENS:
            continue
        if not output_len and (n_in > _MAX_PROMPT or n_in + n_out > _MAX_TOTAL):
            continue
        pairs.append((texts[0], n_out))
        if limit and len(pairs) >= limit:
            break
    if not pairs:
        raise WorkloadError(
            f"{path}: no usable conversation among {len(entries)} entries "
            "(each needs a prompt and an answer of >= 4 tokens)"
        )
    return pairs


#: the ``radixfleet loadtest`` flag that sets each dataset parameter
FLAGS = {
    "requests": "--requests",
    "input_len": "--input-len",
    "output_len": "--output-len",
    "range_ratio": "--range-ratio",
    "prefix_len": "--prefix-len",
    "api": "--dataset-api",
    "path": "--dataset-path",
}


def make_dataset(name: str, params: Mapping[str, Any], seed: int = 0) -> Workload:
    """``--dataset NAME`` with its flags' values (parameter name -> value); raises
    ``WorkloadError`` naming every bad value by its flag (``FLAGS``)."""
    cls: type[Workload]
    if name == "random":
        cls = RandomDataset
    elif name == "sharegpt":
        cls = ShareGPT
    else:
        raise WorkloadError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    try:
        checked = from_flags(cls.Params, params, FLAGS)
    except ConfigError as exc:
        raise WorkloadError(str(exc)) from None
    return cls(checked, seed)
