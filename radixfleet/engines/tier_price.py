"""The price of a colder-tier hit: seconds per token to bring a block back, learned
per worker and tier from its answers, seeded from the link's bandwidth.

An engine that offloads KV (vLLM's CPU offloading, a disk store) can serve a prefix
it evicted from GPU memory by loading it back instead of prefilling it. Such a hit
is worth the prefill it saves minus the load::

    value(w, tier) = saved prefill - load back   per token
                   = 1 / rate_w - load_s(w, tier)
    fraction       = value / (1 / rate_w) = 1 - load_s(w, tier) * rate_w   in [0, 1]

``rate_w`` is the worker's learned prefill speed (``radixfleet.engines.prefill_rate``);
a colder hit of n tokens counts as ``n * fraction`` tokens of GPU hit in the policy
(``MatchResult.colder``). A fast link and a slow prefill make a CPU hit almost as
good as a GPU one; a slow disk under a fast prefill may be worth nothing. No fixed
weights: the fraction moves with both measured speeds.

Seed (what a worker's price is before it has answered): the model's KV bytes per
token over the tier's link bandwidth, constants below with their sources. The
router does not know the served model's KV geometry, so the seed assumes
``SEED_KV_BYTES_PER_TOKEN``; the learned price replaces it within a few answers.

Learning, from each answer that reports ``cached_tokens`` (engines count tokens
loaded back from an offload tier as cached: vLLM's external hits)::

    at pick time   g = the worker's GPU prefix (blocks), e = the colder extension
                   (blocks, one tier), as the index saw them (``match_tiers``)
    answer         c = cached tokens, ttft, and the queue model's prediction
                   p = (ahead + prompt - c) / rate
    sample         loaded = min(e * block_tokens, c - g * block_tokens)  tokens
                   seconds = max(0, ttft - p)                       (the residual)
    estimate       load_s = sum(w_i * seconds_i) / sum(w_i * loaded_i)

the ratio of time-decayed sums with a prior pseudo-sample, as the prefill rate is
learned (and for the same reasons: a long load weighs more than a short noisy one;
an idle worker keeps its estimate). Only answers whose extension lay in one tier
are samples (a mix cannot be split from one TTFT), and only with at least
``MIN_LOADED_TOKENS`` loaded (fixed costs dominate below). An answer that loaded
blocks back is no prefill-rate sample: its TTFT shows only the sum of prefill and
load, and fed to both estimators it has no unique split (a rate read slow makes the
load read cheap, and the two settle anywhere); the rate is learned from the answers
without a colder load, the price from the residual over it. The residual carries the
queue model's error too; it averages out over samples where the prediction is
unbiased, which is what the prefill rate is fitted for.

What the price leaves out: memory. A block loaded back becomes the request's own KV,
as a prefilled one would, so where the worker's running requests leave no room the
request waits for one to finish before its load starts. That wait is no property of
the link: prefix_load judges it from the worker's in-flight KV (its ``colder_room``)
rather than the price. A wait the policy did not foresee still lands in an answer's
residual and makes the learned price dearer for a while (the half-life forgets it).

Pure: no I/O, no clock (``now`` is passed in). Not thread-safe (one event loop).

Invariants (``check()``): both sums positive and finite, the summed tokens at least
the prior's weight, the estimate within [0, ``MAX_LOAD_S_PER_TOKEN``].
"""

from __future__ import annotations

import math

from radixfleet.index.prefix_index import COLDER_TIERS

#: Seed KV bytes per token: Llama-3.1-8B in bf16, 2 (K and V) x 32 layers x 8 KV
#: heads x 128 head dim x 2 bytes = 131,072 (its config.json). A 70B model (80
#: layers) is 2.5x that; the learned price corrects the seed either way.
SEED_KV_BYTES_PER_TOKEN = 131_072
#: Host memory to GPU: PCIe Gen5 x16, 32 GT/s per lane with 128b/130b encoding,
#: ~63 GB/s per direction (PCI-SIG, PCI Express Base Specification 5.0); H100/H200
#: hosts measure ~55 GB/s pinned in practice.
PCIE_GEN5_X16_BYTES_PER_S = 64e9
#: Local NVMe to host: a PCIe Gen4 x4 SSD's sequential read, ~7 GB/s (e.g. Samsung
#: 990 PRO datasheet: 7,450 MB/s); the disk tier's load also crosses PCIe to the
#: GPU, which is ~9x faster and ignored.
NVME_BYTES_PER_S = 7e9
#: each colder tier's seed bandwidth, bytes/s
SEED_BYTES_PER_S = {"cpu": PCIE_GEN5_X16_BYTES_PER_S, "disk": NVME_BYTES_PER_S}

#: a sample must have loaded this many tokens (fixed per-request costs dominate below)
MIN_LOADED_TOKENS = 256
#: the prior's weight in tokens: a few answers' worth
PRIOR_WEIGHT_TOKENS = 2048.0
DEFAULT_HALF_LIFE_S = 60.0
#: the largest load price a sample may show (1 ms per token: ~100x a slow disk's)
MAX_LOAD_S_PER_TOKEN = 1e-3


def seed_load_s_per_token(tier: str, kv_bytes_per_token: float = SEED_KV_BYTES_PER_TOKEN) -> float:
    """Seconds per token to load ``tier``'s blocks back, before any answer."""
    return kv_bytes_per_token / SEED_BYTES_PER_S[tier]


class TierPrice:
    """One worker's learned load price for one colder tier (module docstring)."""

    __slots__ = ("half_life_s", "prior_weight_tokens", "_tokens", "_secs", "_t_last", "observations")

    def __init__(
        self,
        seed_s_per_token: float,
        *,
        prior_weight_tokens: float = PRIOR_WEIGHT_TOKENS,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
    ) -> None:
        if not (math.isfinite(seed_s_per_token) and 0 < seed_s_per_token <= MAX_LOAD_S_PER_TOKEN):
            raise ValueError(
                f"seed_s_per_token must be in (0, {MAX_LOAD_S_PER_TOKEN}], got {seed_s_per_token}"
            )
        if not (math.isfinite(prior_weight_tokens) and prior_weight_tokens > 0):
            raise ValueError(f"prior_weight_tokens must be positive, got {prior_weight_tokens}")
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self.prior_weight_tokens = prior_weight_tokens
        self._tokens = prior_weight_tokens  # decayed loaded tokens, prior included
        self._secs = prior_weight_tokens * seed_s_per_token  # decayed load seconds
        self._t_last: float | None = None
        self.observations = 0  # samples taken

    @property
    def load_s_per_token(self) -> float:
        return self._secs / self._tokens

    def fraction(self, prefill_tokens_per_s: float) -> float:
        """The share of a GPU hit one token of this tier is worth at that prefill
        speed: 1 - load_s * rate, within [0, 1]."""
        f = 1.0 - self._secs / self._tokens * prefill_tokens_per_s
        return 0.0 if not f > 0.0 else (f if f < 1.0 else 1.0)

    def observe(self, loaded_tokens: float, seconds: float, now: float) -> bool:
        """One answer's sample: ``loaded_tokens`` brought back in ``seconds`` (the
        TTFT's residual over the queue model). False: refused (too few tokens, or
        not a finite number)."""
        try:
            n, s, t = float(loaded_tokens), float(seconds), float(now)
        except (TypeError, ValueError):
            return False
        if not (math.isfinite(n) and math.isfinite(s) and math.isfinite(t)) or n < MIN_LOADED_TOKENS:
            return False
        s = min(max(s, 0.0), n * MAX_LOAD_S_PER_TOKEN)
        f = self._decay(t)
        if self._t_last is None or t > self._t_last:
            self._t_last = t
        self._tokens = self._tokens * f + n
        self._secs = self._secs * f + s
        self.observations += 1
        return True

    def _decay(self, now: float) -> float:
        """2^(-dt/half-life) since the last sample, floored so the summed tokens stay
        at least the prior's weight (an idle spell leaves the estimate and its weight)."""
        last = self._t_last
        if last is None or not now > last:
            return 1.0
        f = 2.0 ** (-(now - last) / self.half_life_s)
        floor = self.prior_weight_tokens / self._tokens
        return f if f >= floor else min(1.0, floor)

    def check(self) -> None:
        n, s = self._tokens, self._secs
        assert math.isfinite(n) and math.isfinite(s) and n > 0 and s >= 0, f"{n=} {s=}"
        assert n >= self.prior_weight_tokens * (1 - 1e-12), f"{n=} below the prior's weight"
        assert 0 <= s / n <= MAX_LOAD_S_PER_TOKEN * (1 + 1e-12), f"price {s / n} out of range"


class TierPrices:
    """A worker's load prices, one ``TierPrice`` per colder tier."""

    __slots__ = ("by_tier",)

    def __init__(self, kv_bytes_per_token: float = SEED_KV_BYTES_PER_TOKEN) -> None:
        self.by_tier = {t: TierPrice(seed_load_s_per_token(t, kv_bytes_per_token)) for t in COLDER_TIERS}

    def fraction(self, tier: str, prefill_tokens_per_s: float) -> float:
        return self.by_tier[tier].fraction(prefill_tokens_per_s)

    def load_s(self, ext: dict[str, int], block_tokens: int) -> float:
        """Predicted seconds to load an extension ({tier: blocks}) back."""
        return sum(self.by_tier[t].load_s_per_token * b * block_tokens for t, b in ext.items())

    def observe(
        self,
        ext: dict[str, int],
        gpu_tokens: int,
        cached_tokens: int,
        block_tokens: int,
        residual_s: float,
        now: float,
    ) -> str | None:
        """One answer (module docstring, "Learning"): the tier it taught, or None."""
        if len(ext) != 1:
            return None
        ((tier, blocks),) = ext.items()
        loaded = min(blocks * block_tokens, cached_tokens - gpu_tokens)
        return tier if self.by_tier[tier].observe(loaded, residual_s, now) else None

    def describe(self, prefill_tokens_per_s: float) -> dict:
        return {
            t: {
                "load_s_per_token": p.load_s_per_token,
                "observations": p.observations,
                "gpu_hit_fraction": round(p.fraction(prefill_tokens_per_s), 4),
            }
            for t, p in self.by_tier.items()
        }

    def check(self) -> None:
        for p in self.by_tier.values():
            p.check()
