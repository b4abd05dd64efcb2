"""The per-worker prefill rate learned from (work ahead + own, TTFT): exact numbers."""

from __future__ import annotations

import math
import random

import pytest

from radixfleet.engines.prefill_rate import PrefillRateEstimator, SampleVerdict

ACCEPTED, LITTLE, INVALID = SampleVerdict.ACCEPTED, SampleVerdict.TOO_LITTLE_WORK, SampleVerdict.INVALID


def approx(x):
    return pytest.approx(x, rel=1e-12)


def test_the_prior_is_the_estimate_until_samples_arrive():
    e = PrefillRateEstimator(10_000.0)
    assert e.tokens_per_s == 10_000.0
    assert e.seconds_for(5_000) == approx(0.5)
    assert e.evidence_tokens(123.0) == 512.0
    e.check()


def test_samples_combine_as_a_ratio_of_decayed_sums():
    e = PrefillRateEstimator(10_000.0, prior_weight_tokens=512, half_life_s=30.0)
    # 1,000 tokens ahead + 1,000 own, first token after 0.5 s: a 4,000 tok/s sample
    assert e.observe(1_000, 1_000, 0.5, now=0.0) is ACCEPTED
    assert e.tokens_per_s == approx((512 + 2_000) / (0.0512 + 0.5))  # 4557.33
    # one half-life later: the earlier sums weigh half
    assert e.observe(0, 2_000, 1.0, now=30.0) is ACCEPTED
    assert e.tokens_per_s == approx((1_256 + 2_000) / (0.2756 + 1.0))  # 2552.53
    assert e.evidence_tokens(60.0) == approx(3_256 / 2)
    assert e.seconds_for(3_256) == approx(1.2756)
    assert (e.accepted, e.too_little_work, e.invalid) == (2, 0, 0)
    e.check()


def test_ratio_of_sums_weights_samples_by_their_work_not_a_mean_of_ratios():
    e = PrefillRateEstimator(10_000.0)
    e.observe(0, 10_000, 1.0, now=5.0)  # 10,000 tok/s
    e.observe(0, 1_000, 1.0, now=5.0)  # 1,000 tok/s
    assert e.tokens_per_s == approx(11_512 / 2.0512)  # 5612.32, not (10k + 1k) / 2
    e.check()


def test_the_estimate_holds_while_idle_and_the_memory_floor_keeps_its_weight():
    e = PrefillRateEstimator(10_000.0, prior_weight_tokens=512, half_life_s=30.0)
    e.observe(0, 2_048, 1.024, now=0.0)  # 2,000 tok/s
    rate = e.tokens_per_s
    assert rate == approx(2_560 / 1.0752)
    # an hour later the decay would leave 2^-120 of the evidence: the floor keeps 512
    assert e.evidence_tokens(3_600.0) == approx(512)
    assert e.tokens_per_s == rate  # no drift back to the prior while idle
    e.observe(0, 512, 0.128, now=3_600.0)  # one 4,000 tok/s sample
    assert e.tokens_per_s == approx((512 + 512) / (512 / rate + 0.128))  # midway-ish: 2,844
    e.check()


def test_too_little_work_is_ignored_at_the_threshold():
    e = PrefillRateEstimator(10_000.0, min_work_tokens=512)
    assert e.observe(0, 511, 0.01, now=1.0) is LITTLE
    assert e.observe(300, 211, 0.01, now=1.0) is LITTLE
    assert e.tokens_per_s == 10_000.0 and e.too_little_work == 2
    assert e.observe(300, 212, 0.512, now=1.0) is ACCEPTED  # 512: counts, 1,000 tok/s
    assert e.tokens_per_s == approx(1_024 / (0.0512 + 0.512))
    e.check()


@pytest.mark.parametrize(
    "sample",
    [
        (math.nan, 1_000, 0.5),
        (0, math.inf, 0.5),
        (0, 1_000, math.nan),
        (0, 1_000, math.inf),
        (-1, 1_000, 0.5),
        (0, -1_000, 0.5),
        (0, 1_000, 0.0),
        (0, 1_000, -0.1),
        (None, 1_000, 0.5),
        ("many", 1_000, 0.5),
    ],
)
def test_invalid_samples_are_refused_and_counted(sample):
    e = PrefillRateEstimator(10_000.0)
    assert e.observe(*sample, now=1.0) is INVALID
    assert e.observe(0, 1_000, 0.5, now=math.nan) is INVALID
    assert e.invalid == 2 and e.accepted == 0 and e.tokens_per_s == 10_000.0
    e.check()


def test_each_samples_rate_is_clamped_so_the_estimate_stays_in_bounds():
    e = PrefillRateEstimator(
        1_000.0, prior_weight_tokens=100, min_tokens_per_s=10.0, max_tokens_per_s=100_000.0
    )
    e.observe(0, 1_000, 1e-9, now=0.0)  # a glitch: counted as 100,000 tok/s, 0.01 s
    assert e.tokens_per_s == approx(1_100 / (0.1 + 0.01))
    e.observe(0, 1_000, 1e6, now=0.0)  # a stall: counted as 10 tok/s, 100 s
    assert e.tokens_per_s == approx(2_100 / (0.11 + 100.0))
    e.check()


def test_a_worker_that_slows_under_load_looks_slower():
    e = PrefillRateEstimator(10_000.0, half_life_s=30.0)
    now = 0.0
    for _ in range(30):  # light load: own 2,000 tokens in 0.5 s
        now += 1.0
        e.observe(0, 2_000, 0.5, now)
    # the prior (decayed since the first sample at t=1) still weighs a little
    w = [2 ** (-(30 - k) / 30) for k in range(1, 31)]
    p = 2 ** (-29 / 30)
    light = (512 * p + 2_000 * sum(w)) / (0.0512 * p + 0.5 * sum(w))
    assert e.tokens_per_s == pytest.approx(light, rel=1e-9)
    assert 4_000 < light < 4_015
    seen = []
    for _ in range(60):  # loaded: 8,000 ahead + 2,000 own, first token after 10 s
        now += 1.0
        e.observe(8_000, 2_000, 10.0, now)
        seen.append(e.tokens_per_s)
    assert seen == sorted(seen, reverse=True)  # falls every sample
    assert seen[-1] < 1_250 and e.seconds_for(10_000) > 8.0
    e.check()


def test_samples_out_of_time_order_do_not_decay_backwards():
    e = PrefillRateEstimator(10_000.0, half_life_s=10.0)
    e.observe(0, 1_000, 1.0, now=10.0)
    e.observe(0, 1_000, 1.0, now=5.0)  # an older timestamp: added undecayed
    assert e.tokens_per_s == approx(2_512 / 2.0512)
    e.observe(0, 1_000, 0.5, now=20.0)  # decays from 10.0, the latest
    assert e.tokens_per_s == approx((1_256 + 1_000) / (1.0256 + 0.5))
    e.check()


@pytest.mark.parametrize(
    "kw",
    [
        dict(prior_tokens_per_s=0.0),
        dict(prior_tokens_per_s=math.nan),
        dict(half_life_s=0.0),
        dict(prior_weight_tokens=0.0),
        dict(min_work_tokens=-1),
        dict(min_tokens_per_s=0.0),
        dict(min_tokens_per_s=100.0, max_tokens_per_s=50.0),
        dict(max_tokens_per_s=math.inf),
        dict(prior_tokens_per_s=1e9),
    ],
)
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        PrefillRateEstimator(**kw)


@pytest.mark.parametrize("seed", range(5))
def test_check_after_seeded_random_samples(seed):
    rng = random.Random(seed)
    e = PrefillRateEstimator(rng.uniform(100, 50_000), half_life_s=rng.uniform(1, 60))
    now = 0.0
    for _ in range(2_000):
        now += rng.expovariate(1.0) * rng.choice([0.01, 1, 100, 10_000])
        ahead = rng.choice([0, rng.randrange(20_000), -1, math.nan])
        own = rng.choice([rng.randrange(4_000), rng.randrange(100)])
        ttft = rng.choice([rng.uniform(1e-4, 20), 0.0, 1e-12, math.inf])
        e.observe(ahead, own, ttft, now)
        e.check()
    assert e.accepted + e.too_little_work + e.invalid == 2_000
    assert e.accepted > 100


# ------------------------------------------------------------- the fleet's rates


def test_fleet_rates_pool_engine_samples_and_average_every_answer():
    from radixfleet.engines.prefill_rate import FleetRates, with_prior

    r = FleetRates()
    assert r.mean_request_tokens == 0.0 and r.pooled.tokens_per_s == 10_000.0
    r.answered(1_000, 0, 0.5, now=0.0, engine=False)  # an agent's: its rate is its own
    assert r.pooled.accepted == 0 and r.mean_request_tokens == approx(50.0)
    r.answered(1_000, 1_000, 0.5, now=0.0, engine=True)  # a 4,000 tok/s sample
    assert r.pooled.accepted == 1 and r.mean_request_tokens == approx(50.0 + 0.05 * 950)
    r.answered(3_000, 0, None, now=0.0, engine=True)  # no TTFT: no sample
    assert r.pooled.accepted == 1
    own = with_prior(1e12)  # a configured rate is a prior held within the clamps
    assert own.tokens_per_s == own.max_tokens_per_s
    blended = r.blended(own, 0.0)
    assert r.pooled.tokens_per_s < blended < own.tokens_per_s
    assert blended == own.blended(0.0, r.pooled.tokens_per_s, r.POOL_WEIGHT_TOKENS)
