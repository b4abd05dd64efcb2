"""How right the index is: predicted matched tokens against reported cached tokens.

For every response that reports ``cached_tokens``, the router compares what its
index predicted for the chosen worker at pick time (matched blocks in the worker's
key space, as tokens, capped the way the engine caps a hit — see
``predicted_tokens``) with what the worker says it served from cache. No peer
router publishes this; it is how an operator sees that the index is true.

Per worker ``PredictionStats`` keeps cumulative sums (mean absolute and signed
error, over- and under-predictions) and the last ``window`` absolute errors, so a
test or an operator can compare "before" and "after" a correction. Invariants
(``check()``): ``n >= over + under``; ``sum_abs >= |sum_signed|``; the window holds
at most ``window`` samples, each >= 0.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass


def predicted_tokens(matched_blocks: int, block_tokens: int, prompt_tokens: int, engine_blocks: bool) -> int:
    """The cached tokens a worker should report for a match of ``matched_blocks``.

    An engine with block-granular prefix caching (vLLM, SGLang with a page size)
    must compute at least the prompt's last token, so a hit stops at the last whole
    block before it: at most ``(prompt_tokens - 1) // block_tokens`` blocks.
    """
    m = matched_blocks * block_tokens
    if engine_blocks and prompt_tokens > 0 and block_tokens > 0:
        m = min(m, (prompt_tokens - 1) // block_tokens * block_tokens)
    return max(0, min(m, prompt_tokens)) if prompt_tokens > 0 else max(0, m)


@dataclass(frozen=True, slots=True)
class AccuracySummary:
    samples: int
    sum_abs_tokens: int
    sum_signed_tokens: int
    mean_abs_tokens: float
    mean_signed_tokens: float  # > 0: the index over-predicts (believes more is cached)
    mean_abs_blocks: float
    over: int  # predictions above the report
    under: int  # predictions below the report
    recent_mean_abs_tokens: float  # over the last window

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


class PredictionStats:
    """One worker's prediction accuracy (module docstring)."""

    __slots__ = ("block_tokens", "n", "sum_abs", "sum_signed", "over", "under", "recent", "window")

    def __init__(self, block_tokens: int = 32, window: int = 256) -> None:
        self.block_tokens = block_tokens  # for the error in blocks; the link updates it
        self.n = 0
        self.sum_abs = 0  # sum of |predicted - reported| tokens
        self.sum_signed = 0  # sum of (predicted - reported) tokens
        self.over = 0
        self.under = 0
        self.window = window
        self.recent: collections.deque[int] = collections.deque(maxlen=window)

    def record(self, predicted: int, reported: int) -> int:
        """Adds one response; returns predicted - reported."""
        err = predicted - reported
        a = -err if err < 0 else err
        self.n += 1
        self.sum_abs += a
        self.sum_signed += err
        if err > 0:
            self.over += 1
        elif err < 0:
            self.under += 1
        self.recent.append(a)
        return err

    def summary(self) -> AccuracySummary:
        n = self.n
        bt = max(1, self.block_tokens)
        r = self.recent
        return AccuracySummary(
            samples=n,
            sum_abs_tokens=self.sum_abs,
            sum_signed_tokens=self.sum_signed,
            mean_abs_tokens=self.sum_abs / n if n else 0.0,
            mean_signed_tokens=self.sum_signed / n if n else 0.0,
            mean_abs_blocks=self.sum_abs / n / bt if n else 0.0,
            over=self.over,
            under=self.under,
            recent_mean_abs_tokens=sum(r) / len(r) if r else 0.0,
        )

    def reset_recent(self) -> None:
        self.recent.clear()

    def check(self) -> None:
        assert self.n >= self.over + self.under, f"{self.n=} {self.over=} {self.under=}"
        assert self.sum_abs >= abs(self.sum_signed), f"{self.sum_abs=} {self.sum_signed=}"
        assert len(self.recent) <= self.window and all(a >= 0 for a in self.recent)
