"""A worker's prefill speed, learned from its own responses (contract 10, docs/DESIGN.md).

The router prices a worker's queue as ``queue_s = tokens / rate``. Instead of a
configured constant, ``rate`` is learned per worker from what the router sees of
each request it sent there:

    at pick time      ahead = uncached prompt tokens already in flight on the worker
                      own   = this request's uncached prompt tokens
    at first token    ttft  = seconds from sending to the first content token

    one sample:       work = ahead + own       (what the worker had to prefill
                                                before this request's first token)
    estimate:         rate = sum(w_i * work_i) / sum(w_i * time_i)

so the router's own queue model, applied to the state it saw at pick time, predicts
the TTFTs it then observes. A worker that slows down under load (bigger batches,
decode interleaved with prefill) produces longer ``ttft`` for the same ``work`` and
so looks slower to the policy, which is the point.

Choices, and why:

- **Ratio of decayed sums, not a mean of per-sample ratios.** A mean of ratios
  lets a short request with a noisy TTFT count as much as a long one; the ratio of
  sums weights each sample by its work, and is the rate that makes the summed
  predictions equal the summed observations.
- **Time-based decay**, half-life ``half_life_s`` (default 30 s): every sample's
  weight halves each half-life, so a change of load shows within tens of seconds
  however many requests arrive. Both sums decay by the same factor, so *the estimate
  does not move while no samples arrive*: an idle worker keeps its last rate, it does
  not drift back to the configured one. Memory floor: decay never takes the summed
  work below ``prior_weight_tokens``, so after a long idle spell the old estimate
  still weighs as much as the prior did, and one new sample cannot overwrite it.
- **Prior**: the sums start as one pseudo-sample of ``prior_weight_tokens`` (512) of
  work at the configured ``prior_tokens_per_s``. It decays like real samples: it
  matters for the first few requests, then the worker's own evidence takes over.
- **Too little work is ignored**: a sample with ``work < min_work_tokens`` (512)
  is dropped. TTFT carries fixed costs that do not scale with prompt length (HTTP,
  tokenization, scheduling, the first decode step): ~20 ms measured here (a fully
  cached 1,200-token prompt on the CPU vLLM of ../shared/ENGINES.md answers in
  ~20 ms, prefill ~4,000 tokens/s). At 512 tokens those 20 ms are ~14% of the
  sample's TTFT at that rate; below that they dominate and the rate reads low.
- **Clamps**: each sample's time is clamped so its own rate lies in
  ``[min_tokens_per_s, max_tokens_per_s]`` (a 1 us TTFT from a clock glitch cannot
  make the worker look infinitely fast), so the estimate lies within them too.
- **Bad input is a verdict, not an exception**: NaN, infinite, negative values or a
  TTFT <= 0 are refused (``SampleVerdict.INVALID``) and counted; the figures come
  from peers (``cached_tokens``) and clocks.

Pure: no I/O, no clock of its own (``now`` is passed in, any monotonic seconds).

Invariants (``check()``): both sums are positive and finite; the summed work is at
least ``prior_weight_tokens``; the estimate lies within the clamps.
"""

from __future__ import annotations

import enum
import math

DEFAULT_HALF_LIFE_S = 30.0
DEFAULT_PRIOR_WEIGHT_TOKENS = 512.0
DEFAULT_MIN_WORK_TOKENS = 512
DEFAULT_MIN_TOKENS_PER_S = 10.0
DEFAULT_MAX_TOKENS_PER_S = 5_000_000.0


class SampleVerdict(str, enum.Enum):
    """What ``observe`` did with a sample (the value is a metric label)."""

    ACCEPTED = "accepted"
    TOO_LITTLE_WORK = "too_little_work"  # work < min_work_tokens: overheads dominate
    INVALID = "invalid"  # NaN, inf, negative, non-numeric, or ttft <= 0


class PrefillRateEstimator:
    """One worker's learned prefill rate in tokens/s. Not thread-safe (one event loop)."""

    __slots__ = (
        "half_life_s",
        "prior_tokens_per_s",
        "prior_weight_tokens",
        "min_work_tokens",
        "min_tokens_per_s",
        "max_tokens_per_s",
        "_work",
        "_time",
        "_t_last",
        "accepted",
        "too_little_work",
        "invalid",
    )

    def __init__(
        self,
        prior_tokens_per_s: float = 10_000.0,
        *,
        prior_weight_tokens: float = DEFAULT_PRIOR_WEIGHT_TOKENS,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        min_work_tokens: float = DEFAULT_MIN_WORK_TOKENS,
        min_tokens_per_s: float = DEFAULT_MIN_TOKENS_PER_S,
        max_tokens_per_s: float = DEFAULT_MAX_TOKENS_PER_S,
    ) -> None:
        if not (
            math.isfinite(min_tokens_per_s)
            and 0 < min_tokens_per_s < max_tokens_per_s
            and math.isfinite(max_tokens_per_s)
        ):
            raise ValueError(
                f"need 0 < min_tokens_per_s < max_tokens_per_s < inf, "
                f"got {min_tokens_per_s}, {max_tokens_per_s}"
            )
        if not (min_tokens_per_s <= prior_tokens_per_s <= max_tokens_per_s):
            raise ValueError(
                f"prior_tokens_per_s {prior_tokens_per_s} outside [{min_tokens_per_s}, {max_tokens_per_s}]"
            )
        if not (math.isfinite(prior_weight_tokens) and prior_weight_tokens > 0):
            raise ValueError(f"prior_weight_tokens must be positive, got {prior_weight_tokens}")
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        if not (math.isfinite(min_work_tokens) and min_work_tokens >= 0):
            raise ValueError(f"min_work_tokens must be >= 0, got {min_work_tokens}")
        self.half_life_s = half_life_s
        self.prior_tokens_per_s = prior_tokens_per_s
        self.prior_weight_tokens = prior_weight_tokens
        self.min_work_tokens = min_work_tokens
        self.min_tokens_per_s = min_tokens_per_s
        self.max_tokens_per_s = max_tokens_per_s
        self._work = prior_weight_tokens  # decayed sum of work (tokens), prior included
        self._time = prior_weight_tokens / prior_tokens_per_s  # decayed sum of seconds
        self._t_last: float | None = None  # time both sums were last decayed to
        self.accepted = 0  # samples taken into the sums
        self.too_little_work = 0  # samples ignored for too little work
        self.invalid = 0  # samples refused as invalid

    @property
    def tokens_per_s(self) -> float:
        """The current estimate. O(1); no ``now`` needed (decay does not move it)."""
        return self._work / self._time

    def seconds_for(self, tokens: float) -> float:
        """Predicted prefill seconds for ``tokens`` of uncached work at this rate."""
        return tokens * self._time / self._work

    def evidence_tokens(self, now: float) -> float:
        """Decayed work behind the estimate at ``now`` (prior included): how much
        it rests on. Starts at ``prior_weight_tokens``, never goes below it."""
        return self._work * self._decay(now)

    def blended(self, now: float, pool_tokens_per_s: float, pool_weight_tokens: float) -> float:
        """This worker's rate shrunk toward the fleet's: ``pool_weight_tokens`` of
        pseudo-evidence at ``pool_tokens_per_s`` added to its own decayed evidence.

        A worker with little evidence of its own reads as the fleet's measured rate,
        not as the configured prior: otherwise the first worker to be measured (at the
        engine's real, lower speed) looks slower than its still-unmeasured peers
        (at the prior) and every new session herds onto those. With evidence well
        above ``pool_weight_tokens`` its own rate dominates (heterogeneous fleets)."""
        w = self.evidence_tokens(now)
        t = w * self._time / self._work
        return (w + pool_weight_tokens) / (t + pool_weight_tokens / pool_tokens_per_s)

    def observe(self, ahead_tokens: float, own_tokens: float, ttft_s: float, now: float) -> SampleVerdict:
        """Adds one response's sample (see the module docstring). O(1)."""
        try:
            ahead, own, ttft, t = float(ahead_tokens), float(own_tokens), float(ttft_s), float(now)
        except (TypeError, ValueError):
            self.invalid += 1
            return SampleVerdict.INVALID
        if (
            not (math.isfinite(ahead) and math.isfinite(own) and math.isfinite(ttft) and math.isfinite(t))
            or ahead < 0
            or own < 0
            or ttft <= 0
        ):
            self.invalid += 1
            return SampleVerdict.INVALID
        work = ahead + own
        if work < self.min_work_tokens or work <= 0:
            self.too_little_work += 1
            return SampleVerdict.TOO_LITTLE_WORK
        # the sample's own rate within the clamps, by bounding its time
        secs = min(max(ttft, work / self.max_tokens_per_s), work / self.min_tokens_per_s)
        f = self._decay(t)
        if self._t_last is None or t > self._t_last:
            self._t_last = t
        self._work = self._work * f + work
        self._time = self._time * f + secs
        self.accepted += 1
        return SampleVerdict.ACCEPTED

    def _decay(self, now: float) -> float:
        """Factor that takes the sums from ``_t_last`` to ``now``: 2^(-dt/half-life),
        1 for a time not after the last sample, floored so the work sum stays at least
        ``prior_weight_tokens`` (the memory floor)."""
        last = self._t_last
        if last is None or not now > last:
            return 1.0
        f = 2.0 ** (-(now - last) / self.half_life_s)
        floor = self.prior_weight_tokens / self._work
        return f if f >= floor else min(1.0, floor)

    def check(self) -> None:
        """Asserts the invariants in the module docstring."""
        w, s = self._work, self._time
        assert math.isfinite(w) and math.isfinite(s) and w > 0 and s > 0, f"{w=} {s=}"
        assert w >= self.prior_weight_tokens * (1 - 1e-12), f"{w=} below the memory floor"
        r = w / s
        lo, hi = self.min_tokens_per_s, self.max_tokens_per_s
        assert lo * (1 - 1e-12) <= r <= hi * (1 + 1e-12), f"rate {r} outside [{lo}, {hi}]"

    def __repr__(self) -> str:
        return (
            f"PrefillRateEstimator({self.tokens_per_s:.1f} tok/s, "
            f"{self.accepted} samples, evidence {self._work:.0f} tokens)"
        )


def with_prior(prior_tokens_per_s: float) -> PrefillRateEstimator:
    """An estimator whose prior is a configured rate: only a prior, held within the
    clamps."""
    return PrefillRateEstimator(
        min(max(prior_tokens_per_s, DEFAULT_MIN_TOKENS_PER_S), DEFAULT_MAX_TOKENS_PER_S)
    )


class FleetRates:
    """What a fleet's engine links learn together from their answers. The router's
    ``Engines`` owns it; each link reports its answers here (``answered``, the only
    writer) and reads the pooled rate back (``blended``).

    pooled               every engine worker's samples together: the rate a worker
                         with little evidence of its own is assumed to have
    mean_request_tokens  decayed mean uncached prompt tokens per request: what one
                         waiting request an engine reports is assumed to weigh
    """

    __slots__ = ("pooled", "mean_request_tokens")

    #: pseudo-evidence (tokens) of the pooled rate in each worker's own (``blended``).
    #: Large: the rate a worker measures depends on how busy it is (a CPU or GPU engine
    #: prefilling several prompts in one batch reads faster per token), so the busier
    #: of two identical vLLM servers measured 9,200-12,400 tokens/s and the other
    #: 2,700-3,000, and misses herded onto the "faster" one (bench/vllm_ab.py,
    #: approximate mode: imbalance 1.75, hit below round robin's). At 64k tokens of
    #: pool weight the busy one's evidence dominated; at 512k the two read 3,800 and
    #: 4,300. A worker's own rate dominates only under sustained heavy prefill (decayed
    #: evidence saturates at ~43 s of its work), so a fleet of unequal GPUs should say
    #: so in ``workers[].prefill_tokens_per_s`` (the prior).
    POOL_WEIGHT_TOKENS = 524288.0

    def __init__(self) -> None:
        self.pooled = with_prior(10_000.0)
        self.mean_request_tokens = 0.0

    def answered(
        self, own_tokens: int, ahead_tokens: int, ttft_s: float | None, now: float, engine: bool
    ) -> None:
        """One answer: its uncached prompt ``own_tokens`` and, where ``ttft_s``
        measured it, an engine's (``engine``) prefill-rate sample."""
        self.mean_request_tokens += 0.05 * (own_tokens - self.mean_request_tokens)
        if engine and ttft_s is not None and ttft_s > 0:
            self.pooled.observe(ahead_tokens, own_tokens, ttft_s, now)

    def blended(self, own: PrefillRateEstimator, now: float) -> float:
        """``own``'s rate shrunk toward the pooled one (``PrefillRateEstimator.blended``)."""
        return own.blended(now, self.pooled.tokens_per_s, self.POOL_WEIGHT_TOKENS)
