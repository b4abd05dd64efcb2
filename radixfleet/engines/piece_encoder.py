"""An exact, cached text -> token ids encoder for one Hugging Face fast tokenizer.

``PieceEncoder.encode(text, add_special_tokens)`` returns exactly the ids of
``tokenizer(text, add_special_tokens=...)["input_ids"]`` (what vLLM's renderer calls),
but tokenizes each *piece* of the text only once while it stays in a bounded LRU.

Why pieces are exact. A ``tokenizers`` pipeline first cuts the raw text at its added
tokens (``<|user|>``, ``<|im_start|>``, ...; leftmost-longest match), and then
normalizes, pre-tokenizes and runs the model on each piece *separately*; the
post-processor finally adds BOS/EOS around the whole::

    text   = "<s><|user|>\\nhello<|end|>\\n<|assistant|>\\n"
    pieces =  <s> | <|user|> | "\\nhello" | <|end|> | "\\n" | <|assistant|> | "\\n"
    ids    =  prefix + [id(<s>), id(<|user|>)] + enc("\\nhello") + ... + suffix

so ``enc(text) == prefix + concat(enc(piece) or id(token)) + suffix``, provided every
stage is piece-local. That holds for the usual components and is *checked* when the
encoder is built (``piecewise``); anything else (an added token that strips
whitespace or matches normalized text, Metaspace's ``prepend_scheme: first``, BPE
dropout, a stage this module does not know) makes the encoder tokenize whole texts,
still exactly, only without the cache. A conversation's next turn then costs the
tokenization of its new messages: the history's pieces are cached.

Backends. Pieces that miss are tokenized by ``fastokens`` when it is installed and
gives the same ids as the model's ``tokenizers`` pipeline on a probe set at load
(it is the drop-in backend vLLM itself offers, ``VLLM_USE_FASTOKENS``; some 50x
faster on long text here), else by ``tokenizers`` directly (``encode_batch_fast``:
no offsets), else, for a slow tokenizer, by its ``__call__``. ``backend`` says which.

Invariants (``check()``):

* ``cost == sum(_cost(piece, ids) for every cached piece) <= max_cache_bytes``;
* every cached ``ids`` is an ``array('I')`` equal to the whole-text encoding of its
  piece (checked on a sample);
* ``piecewise`` is None exactly when ``_pattern`` is set (pieces are used).

Not thread-safe: one encoder per event loop (the router's request path).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from array import array
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)

#: Normalizers applied to each piece on its own (all of ``tokenizers``' except none).
_PIECE_LOCAL_NORMALIZERS = frozenset(
    {
        "NFC",
        "NFD",
        "NFKC",
        "NFKD",
        "Lowercase",
        "Strip",
        "StripAccents",
        "Replace",
        "Prepend",
        "BertNormalizer",
        "Nmt",
        "Precompiled",
        "ByteLevel",
    }
)
#: Pre-tokenizers that see each piece on its own (Metaspace is checked separately).
_PIECE_LOCAL_PRE_TOKENIZERS = frozenset(
    {
        "ByteLevel",
        "Whitespace",
        "WhitespaceSplit",
        "BertPreTokenizer",
        "Punctuation",
        "Digits",
        "Split",
        "UnicodeScripts",
        "CharDelimiterSplit",
        "Metaspace",
    }
)
#: Post-processors that only add fixed ids around the sequence (or change offsets).
_AFFIX_POST_PROCESSORS = frozenset(
    {
        "TemplateProcessing",
        "BertProcessing",
        "RobertaProcessing",
        "ByteLevel",
    }
)
_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})

#: Per-entry bookkeeping counted against the cache budget (dict slot, array header).
_ENTRY_OVERHEAD = 160
BACKENDS = ("auto", "fastokens", "tokenizers")
_PROBES = (
    "",
    "a",
    " ",
    "  x  ",
    "hello world",
    "Hello, World! 123 4567",
    "\n\n\t x\r\n",
    "naïve café — 中文 日本語 🎉👩\u200d💻 e\u0301 \u00a0x",
    "'s 're 've don't I'M",
    "x" * 300,
    "ab " * 200,
    "The cache, the router; the worker: 3.14 and 2,718!",
)


def _cost(piece: str, ids: array) -> int:
    return len(piece) + 4 * len(ids) + _ENTRY_OVERHEAD


def _components(node: Any) -> list[dict]:
    """Flattens a normalizer / pre-tokenizer / post-processor tree ("Sequence")."""
    if node is None:
        return []
    out: list[dict] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, dict):
            return [{"type": "?"}]
        if n.get("type") == "Sequence":
            subs = n.get("normalizers") or n.get("pretokenizers") or n.get("processors") or []
            stack.extend(subs)
        else:
            out.append(n)
    return out


def piecewise_blocker(config: dict, encode_special_tokens: bool) -> str | None:
    """Why the tokenizer described by ``config`` (its tokenizer.json) cannot be encoded
    piece by piece; None when it can (module docstring)."""
    if encode_special_tokens:
        return "encode_special_tokens is set (added tokens are not split out)"
    for tok in config.get("added_tokens") or []:
        if tok.get("normalized"):
            return f"added token {tok.get('content')!r} matches normalized text"
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
            return f"added token {tok.get('content')!r} strips whitespace or is single-word"
    for n in _components(config.get("normalizer")):
        if n.get("type") not in _PIECE_LOCAL_NORMALIZERS:
            return f"normalizer {n.get('type')!r}"
    for p in _components(config.get("pre_tokenizer")):
        kind = p.get("type")
        if kind not in _PIECE_LOCAL_PRE_TOKENIZERS:
            return f"pre-tokenizer {kind!r}"
        if kind == "Metaspace" and p.get("prepend_scheme", "always") not in ("always", "never"):
            # "first" prepends only to the piece at offset 0 of the whole text
            return "Metaspace prepend_scheme 'first'"
    model = config.get("model") or {}
    if model.get("type") not in _MODELS:
        return f"model {model.get('type')!r}"
    if model.get("dropout"):
        return "BPE dropout"
    for p in _components(config.get("post_processor")):
        if p.get("type") not in _AFFIX_POST_PROCESSORS:
            return f"post-processor {p.get('type')!r}"
    return None


class PieceEncoder:
    """Exact ``tokenizer(text)`` ids with a bounded LRU of pieces (module docstring)."""

    __slots__ = (
        "_hf",
        "_rust",
        "_fast",
        "backend",
        "_pattern",
        "_token_ids",
        "_affix",
        "piecewise",
        "_cache",
        "cost",
        "max_cache_bytes",
        "hits",
        "misses",
    )

    def __init__(self, hf_tokenizer: Any, *, max_cache_bytes: int = 64 << 20, backend: str = "auto") -> None:
        """``hf_tokenizer``: a loaded transformers tokenizer. A fast one (with a
        ``tokenizers.Tokenizer`` inside) is called directly; a slow one through its
        ``__call__``, whole texts only. ``backend``: ``auto`` (fastokens if installed
        and identical on the probes, else tokenizers), ``fastokens`` (required: raises
        ``RuntimeError`` if it cannot be used) or ``tokenizers``."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self._hf = hf_tokenizer
        rust = getattr(hf_tokenizer, "_tokenizer", None)
        self._rust = rust if hasattr(rust, "encode_batch_fast") else None
        self._fast: Any = None  # a fastokens.Tokenizer, when used
        #: which tokenizer encodes the pieces: fastokens, tokenizers or transformers
        self.backend = "transformers" if self._rust is None else "tokenizers"
        self._pattern: re.Pattern | None = None
        self._token_ids: dict[str, int] = {}
        #: (prefix, suffix) ids the post-processor adds with add_special_tokens=True;
        #: None: such texts are encoded whole
        self._affix: tuple[array, array] | None = None
        #: None when pieces are used; else why texts are encoded whole
        self.piecewise: str | None = "not a fast tokenizer"
        self._cache: OrderedDict[str, array] = OrderedDict()  # piece -> ids, LRU first
        self.cost = 0  # bytes counted against max_cache_bytes (see _cost)
        self.max_cache_bytes = max_cache_bytes
        self.hits = 0
        self.misses = 0
        if self._rust is None:
            if backend == "fastokens":
                raise RuntimeError("fastokens needs a fast tokenizer (tokenizer.json)")
            self._affix = self._probe_affix()
            return
        # the file may ask for truncation or padding; transformers' __call__ turns
        # them off unless asked, and so do we (vLLM asks only for over-long prompts)
        self._rust.no_truncation()
        self._rust.no_padding()
        source = self._rust.to_str()
        if backend != "tokenizers":
            why = self._use_fastokens(source)
            if why is not None and backend == "fastokens":
                raise RuntimeError(f"fastokens cannot be used: {why}")
        config = json.loads(source)
        self._affix = self._probe_affix()
        self.piecewise = piecewise_blocker(config, bool(self._rust.encode_special_tokens))
        if self.piecewise is not None:
            return
        added = {
            t["content"]: t["id"]
            for t in config.get("added_tokens") or []
            if isinstance(t.get("content"), str) and t["content"]
        }
        self._token_ids = added
        if added:
            # longest first: at each position the regex tries the longest token first,
            # and scans positions left to right = aho-corasick's leftmost-longest
            alts = sorted(added, key=len, reverse=True)
            self._pattern = re.compile("(" + "|".join(map(re.escape, alts)) + ")")
        else:
            self._pattern = re.compile("(?!)")  # never matches: one piece

    def _use_fastokens(self, source: str) -> str | None:
        """Switches to fastokens if it loads this tokenizer and agrees with tokenizers
        on the probes (with and without special tokens); else says why not."""
        assert self._rust is not None, "fastokens is tried on tokenizers' backend only"
        try:
            import fastokens
        except ImportError:
            return "not installed"
        if sys.byteorder != "little" or array("I").itemsize != 4 or array("Q").itemsize != 8:
            return "its flat buffers are little-endian uint32/uint64"  # read as arrays
        try:
            fast = fastokens.Tokenizer.from_json_str(source)
        except Exception as exc:  # a pipeline it does not implement
            return f"cannot load this tokenizer ({exc})"
        added = [t.content for t in self._rust.get_added_tokens_decoder().values()]
        probes = list(_PROBES) + [f"{a}x {a}\n{p}{a}" for a in added[:64] for p in _PROBES[4:7]]
        for special in (False, True):
            want = [e.ids for e in self._rust.encode_batch_fast(probes, add_special_tokens=special)]
            try:
                got = [e.ids for e in fast.encode_batch(probes, add_special_tokens=special)]
            except Exception as exc:
                return f"fails where tokenizers does not ({exc})"
            if got != want:
                bad = next(p for p, g, w in zip(probes, got, want) if g != w)
                return f"ids differ from tokenizers on {bad[:40]!r}"
        self._fast = fast
        self.backend = "fastokens"
        return None

    # ------------------------------------------------------------------ encode

    def _many(self, texts: list[str], add_special_tokens: bool) -> list[array]:
        """Whole-text ids of each of ``texts`` (the backend's batch call)."""
        if self._fast is not None:
            try:
                flat, offs = self._fast.encode_batch_flat(texts, add_special_tokens=add_special_tokens)
            except Exception as exc:
                self._fastokens_failed(texts, add_special_tokens, exc)
            else:
                ids = array("I")
                ids.frombytes(flat)
                bounds = array("Q")
                bounds.frombytes(offs)
                return [ids[bounds[i] : bounds[i + 1]] for i in range(len(texts))]
        if self._rust is not None:
            encs = self._rust.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
            return [array("I", e.ids) for e in encs]
        return [array("I", self._hf(t, add_special_tokens=add_special_tokens)["input_ids"]) for t in texts]

    def _fastokens_failed(self, texts: list[str], add_special_tokens: bool, exc: Exception) -> None:
        """fastokens refused a text: if tokenizers takes it, fastokens is not a
        drop-in for this tokenizer after all and is dropped (logged once); if
        tokenizers refuses it too, the text is bad (its error propagates)."""
        assert self._rust is not None, "fastokens is used on tokenizers' backend only"
        self._rust.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        log.warning(
            "fastokens failed where tokenizers did not (%s): tokenizing with tokenizers from now on", exc
        )
        self._fast = None
        self.backend = "tokenizers"

    def _whole(self, text: str, add_special_tokens: bool) -> array:
        return self._many([text], add_special_tokens)[0]

    def _probe_affix(self) -> tuple[array, array] | None:
        """The fixed ids the post-processor puts around a sequence, if that is all it
        does (checked on three probes)."""
        probes = ("a", "b c", "")
        bare = self._whole(probes[0], False)
        full = self._whole(probes[0], True)
        n = len(bare)
        for i in range(len(full) - n + 1):
            if full[i : i + n] == bare:
                prefix, suffix = full[:i], full[i + n :]
                break
        else:
            return None
        for p in probes[1:]:
            if self._whole(p, True) != prefix + self._whole(p, False) + suffix:
                return None
        return prefix, suffix

    def encode(self, text: str, add_special_tokens: bool = False) -> array:
        """The ids of ``text``, as ``tokenizer(text, add_special_tokens=...)`` gives.

        O(len(text)) for the split, plus the tokenization of the pieces not cached.
        Side effect: caches the new pieces, evicting the least recently used ones
        beyond ``max_cache_bytes``. Raises what the tokenizer raises (a ``TypeError``
        or ``UnicodeError`` for text that is not valid UTF-8, e.g. a lone surrogate).
        """
        pattern = self._pattern
        if pattern is None or (add_special_tokens and self._affix is None):
            return self._whole(text, add_special_tokens)
        parts = pattern.split(text)  # text, token, text, token, ..., text
        cache = self._cache
        texts = [p for p in parts[::2] if p]
        missing = [p for p in texts if p not in cache]
        if missing:
            fresh = list(dict.fromkeys(missing))  # unique, in order
            for piece, ids in zip(fresh, self._many(fresh, False)):
                cache[piece] = ids
                self.cost += _cost(piece, ids)
            self.misses += len(fresh)
        affix = self._affix if add_special_tokens else None  # (not None then: see above)
        out = array("I", affix[0]) if affix is not None else array("I")
        token_ids = self._token_ids
        move = cache.move_to_end
        for i, p in enumerate(parts):
            if i & 1:
                out.append(token_ids[p])
            elif p:
                out.extend(cache[p])
                move(p)
        if affix is not None:
            out.extend(affix[1])
        self.hits += len(texts) - len(missing)
        if self.cost > self.max_cache_bytes:
            self._evict()
        return out

    @property
    def affix(self) -> tuple[array, array] | None:
        """(prefix, suffix): the ids ``add_special_tokens`` puts around a text, when the
        post-processor does only that; None otherwise."""
        return self._affix

    def _evict(self) -> None:
        cache = self._cache
        while self.cost > self.max_cache_bytes and cache:
            piece, ids = cache.popitem(last=False)
            self.cost -= _cost(piece, ids)

    def clear(self) -> None:
        self._cache.clear()
        self.cost = 0

    def __len__(self) -> int:
        return len(self._cache)

    def check(self, sample: int = 8) -> None:
        """Asserts the invariants of the module docstring (the identity on a sample)."""
        assert (self.piecewise is None) == (self._pattern is not None), f"{self.piecewise=}"
        total = sum(_cost(p, ids) for p, ids in self._cache.items())
        assert total == self.cost, f"{total=} {self.cost=}"
        assert self.cost <= self.max_cache_bytes, f"{self.cost=} {self.max_cache_bytes=}"
        for i, (p, ids) in enumerate(self._cache.items()):
            if i >= sample:
                break
            assert isinstance(ids, array) and ids.typecode == "I", f"{p=}"
            assert ids == self._whole(p, False), f"cached piece differs: {p[:80]!r}"
            if self._rust is not None:
                want = self._rust.encode_batch_fast([p], add_special_tokens=False)[0].ids
                assert list(ids) == want, f"{self.backend} differs from tokenizers: {p[:80]!r}"
