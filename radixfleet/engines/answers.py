"""What one finished request teaches its worker's link (contracts 7 and 9, docs/DESIGN.md).

``learn`` takes the pick (``radixfleet.route.core.Placement``), the usage the worker reported
(prompt and cached tokens, if any) and its time to first token, and feeds:

    prediction   predicted vs reported cached tokens (radixfleet.engines.accuracy)
    prefill      one prefill-rate sample, the worker's and (but for a worker that
                 reports its own, ``EngineAdapter.pushes``) the fleet's
                 (radixfleet.engines.prefill_rate)
    tiers        a colder-tier hit's load-back price instead, where blocks were
                 loaded back (radixfleet.engines.tier_price)
    correction   in the approximate mode, the entries an eviction must have taken
                 (radixfleet.engines.capacity.correct)

It changes only what the link's own estimators and the index let it change through
their methods; it assigns none of the link's fields.
"""

from __future__ import annotations

from typing import Any, Protocol

from radixfleet.engines.accuracy import PredictionStats, predicted_tokens
from radixfleet.engines.adapters import EngineAdapter, Truth
from radixfleet.engines.capacity import correct
from radixfleet.engines.prefill_rate import PrefillRateEstimator
from radixfleet.engines.tier_price import TierPrices
from radixfleet.route.core import Placement
from radixfleet.wire.events import MAX_LOAD_COUNT


class Learner(Protocol):
    """What of a worker's link (radixfleet.engines.link.EngineLink) its answers feed."""

    engines: Any  # LinkHost: rates, index, prom
    worker: Any  # radixfleet.fleet.pool.Worker: id
    ranks: int
    learned: Any  # LearnedCapacity | None
    stats: PredictionStats
    rate: PrefillRateEstimator
    tier_prices: TierPrices

    @property
    def adapter(self) -> EngineAdapter: ...
    @property
    def in_sync(self) -> bool: ...
    def rank_truth(self, rank: int) -> Truth: ...
    def holder(self, rank: int | None) -> str: ...
    def prefill_rate(self, now: float) -> float: ...


def learn(
    link: Learner, pick: Placement, usage: tuple[int, int] | None, ttft_s: float | None, now: float
) -> None:
    """One finished request on ``link``'s worker (on data-parallel ``pick.rank``, if any).

    ``usage``: (prompt_tokens, cached_tokens) it reported, if any: records the
    prediction error. ``ttft_s`` with the uncached tokens ahead of it at pick
    time and its own is one prefill-rate sample; its own are the uncached tokens
    the worker reported where it did (``pick.own``, the prediction, otherwise).

    Correction (approximate mode): ``pick.touches`` are the matched blocks'
    last-use times before this request. If the worker reports fewer cached tokens than
    predicted, its first missing block j was evicted; an engine evicts least
    recently used blocks first, so every entry of this worker last used before
    ``touches[j]`` is gone too, and leaves the index. The request's own chain
    stays: its prefill has just stored it again. The learned cap follows each
    answer with a match (``radixfleet.engines.capacity``, ``index.learn_capacity``).
    """
    sk, matched_blocks, own_tokens, ahead_tokens, touches, rank, colder = pick
    eng, adapter = link.engines, link.adapter
    if usage is not None:
        # The engine's own count of what it prefilled, not the index's prediction:
        # in approximate mode a prediction that missed cached blocks priced the
        # request's prefill too high, its short TTFT read as a fast worker (one of
        # two equal vLLMs learned 12,400 tokens/s, the other 3,000), and misses
        # herded onto it.
        own_tokens = min(usage[0] - usage[1], MAX_LOAD_COUNT)  # usage_of: 0 <= c <= p
        if colder and ttft_s is not None and ttft_s > 0:
            if _learn_load(link, pick, usage[1], own_tokens, ttft_s, now):
                ttft_s = None  # a load-price sample, not a prefill-rate one
    eng.rates.answered(own_tokens, ahead_tokens, ttft_s, now, engine=not adapter.pushes)
    if ttft_s is not None and ttft_s > 0:
        link.rate.observe(ahead_tokens, own_tokens, ttft_s, now)
    if usage is None:
        return
    prompt, cached = usage
    bt = sk.block_tokens
    if not sk.exact and sk.prompt_tokens:
        # byte space: its blocks in this prompt's real tokens
        bt = max(1, round(bt * prompt / sk.prompt_tokens))
    # tokens loaded back from a colder tier count as cached (vLLM's external hits)
    cold = sum(colder.values()) if colder else 0
    pred = predicted_tokens(matched_blocks + cold, bt, prompt, adapter.whole_block_hits)
    err = link.stats.record(pred, cached)
    eng.prom.prediction(link.worker.id, err)
    if rank is not None and link.ranks:
        truth = link.rank_truth(rank)  # one rank's own: its events in sync, or its hints
    else:
        truth, rank = adapter.truth(link.in_sync), None
    if truth is Truth.APPROXIMATE:
        n = correct(eng.index, link.holder(rank), link.learned, matched_blocks, pred, cached, bt, touches)
        if n:
            eng.prom.corrected.labels(link.worker.id).inc(n)


def _learn_load(link: Learner, pick: Placement, cached: int, own: int, ttft_s: float, now: float) -> bool:
    """One answer whose match extended into a colder tier: a load-price sample
    (radixfleet.engines.tier_price). True when it loaded blocks back: its TTFT then
    mixes load and prefill (only their sum is seen), so it is no prefill-rate
    sample; the rate is learned from the other answers, the price from this
    one's residual over it."""
    ext = pick.colder
    assert ext, "called for a colder match only"
    bt = pick.key.block_tokens
    gpu = pick.blocks * bt
    if min(sum(ext.values()) * bt, cached - gpu) <= 0:
        return False  # nothing was loaded back: the colder copy went unused
    residual = ttft_s - (pick.ahead + own) / link.prefill_rate(now)
    tier = link.tier_prices.observe(ext, gpu, cached, bt, residual, now)
    if tier is not None:
        link.engines.prom.tier_samples.labels(link.worker.id, tier).inc()
    return True
