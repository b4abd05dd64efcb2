"""The continuous-batching scheduler in virtual time (radixfleet_tools.agent.scheduler)."""

from __future__ import annotations

import random

import pytest

from radixfleet.keys import Endpoint, request_key
from radixfleet.wire.errors import PromptTooLarge
from radixfleet.wire.events import Removed
from radixfleet_tools.agent import tokenizer as tk
from radixfleet_tools.agent.cost_model import CostModel
from radixfleet_tools.agent.kv_pool import KVPool
from radixfleet_tools.agent.radix_cache import AdmissionConfig, RadixCache
from radixfleet_tools.agent.scheduler import SchedRequest, Scheduler, SchedulerConfig, State


def make(capacity=100_000, mode="always", stride=16, **cfg):
    cache = RadixCache(hash_stride=stride, capacity_tokens=capacity, admission=AdmissionConfig(mode))
    pool = KVPool(capacity, cache)
    return Scheduler(CostModel("llama-3-8b", "h100"), cache, pool, SchedulerConfig(**cfg))


def run(s, t=0.0, limit=100_000):
    for _ in range(limit):
        if not s.has_work():
            return t
        res = s.step(t)
        t += res.duration_s
        s.check()
    raise AssertionError("did not drain")


def req(rid, prompt, max_new=4, ns="n", hashes=None):
    return SchedRequest(rid, ns, prompt, max_new, tk.generate(rid, max_new), hashes)


def test_cached_prompt_ttft_and_counters():
    s = make()
    prompt = list(range(2048))
    a = req(1, prompt)
    s.submit(a, 0.0)
    t = run(s)
    b = req(2, prompt)
    s.submit(b, t)
    run(s, t)
    assert a.cached == 0 and b.cached == 2047
    assert b.ttft <= 0.3 * a.ttft
    assert a.ttft == pytest.approx(s.cost.prefill_s(2048), rel=0.01)
    assert s.stats.prompt_tokens == 4096 and s.stats.cached_tokens == 2047
    assert a.state is b.state is State.FINISHED and a.generated == 4


def test_prompt_too_large_names_the_limit():
    s = make(capacity=1000)
    with pytest.raises(PromptTooLarge, match="KV pool holds 1000"):
        s.submit(req(1, list(range(990)), max_new=20), 0.0)
    assert not s.has_work()


def test_chunked_prefill_and_decode_batch():
    s = make(chunk_tokens=1000)
    r = req(1, list(range(2500)), max_new=3)
    s.submit(r, 0.0)
    sizes = []
    while s.has_work():
        res = s.step(0.0)
        sizes.append((res.prefill_tokens, res.decode_batch, len(res.started)))
    # three prefill slices, the first token with the last slice, two decode steps
    assert sizes == [(1000, 0, 0), (1000, 0, 0), (500, 0, 1), (0, 1, 0), (0, 1, 0)]


def test_growth_during_decode_next_turn_finds_history():
    s = make(stride=16)
    turn1 = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse. " * 20},
            {"role": "user", "content": "hello"},
        ],
    }
    k1 = request_key(Endpoint.CHAT, turn1, block_bytes=64)
    p1 = tk.encode(k1.data)
    out = tk.generate(7, 40)
    hashes = request_key(Endpoint.CHAT, turn1, block_bytes=64).hashes
    from radixfleet.keys import block_hashes, namespace_seed

    seed = namespace_seed("m")
    full_hashes = block_hashes(k1.data + tk.decode(out), seed, 64)
    assert full_hashes[: len(hashes)] == hashes
    r1 = SchedRequest(1, "ns", p1, 40, out, full_hashes)
    s.submit(r1, 0.0)
    t = run(s)
    turn2 = {
        "model": "m",
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": tk.decode(out).decode()},
            {"role": "user", "content": "again"},
        ],
    }
    k2 = request_key(Endpoint.CHAT, turn2, block_bytes=64)
    p2 = tk.encode(k2.data)
    r2 = SchedRequest(2, "ns", p2, 4, tk.generate(8, 4), k2.hashes)
    s.submit(r2, t)
    run(s, t)
    assert r2.cached == len(p1) + 39  # the whole history but the last sampled token
    # every router block inside that history was reported stored, in the router's key space
    held = {h for h, _ in s.cache.snapshot_blocks()}
    assert set(k2.hashes[: (len(p1) + 39) // 16]) <= held


def test_pool_contention_evicts_cold_then_waits():
    s = make(capacity=2800)
    s.submit(req(1, list(range(1000)), max_new=1), 0.0)
    t = run(s)
    assert s.cache.total_tokens == 1000
    big_a = req(2, list(range(10_000, 11_500)), max_new=500)
    big_b = req(3, list(range(20_000, 21_500)), max_new=500)
    s.submit(big_a, t)
    s.submit(big_b, t)
    s.step(t)
    # a needs 2,000 of 1,800 free: the cold 1,000-token leaf goes; b cannot fit and waits
    assert s.cache.stats.evicted_tokens == 1000
    assert big_a.state is State.RUNNING and big_b.state is State.WAITING and s.stats.kv_waits >= 1
    s.check()
    run(s, t)
    assert big_b.state is State.FINISHED and big_b.first_token_at >= big_a.finished_at


def test_longest_prefix_first_order():
    s = make(order="lpm", chunk_tokens=64)
    shared = list(range(500))
    s.submit(req(1, shared + [9], max_new=1), 0.0)
    t = run(s)
    cold = req(2, list(range(5000, 5100)), max_new=1)
    warm = req(3, shared + [7] * 10, max_new=1)
    s.submit(cold, t)
    s.submit(warm, t)
    run(s, t)
    assert warm.finished_at < cold.finished_at
    # fcfs keeps arrival order
    s2 = make(order="fcfs", chunk_tokens=64)
    s2.submit(req(1, shared + [9], max_new=1), 0.0)
    t = run(s2)
    cold, warm = req(2, list(range(5000, 5100)), max_new=1), req(3, shared + [7] * 10, max_new=1)
    s2.submit(cold, t)
    s2.submit(warm, t)
    run(s2, t)
    assert cold.finished_at <= warm.finished_at  # warm rides in the slice where cold ends


def test_cancel_frees_kv_and_reports_unheld_blocks():
    s = make(stride=4)
    prompt = list(range(100))
    hs = list(range(1, 26))
    r = req(1, prompt, max_new=50, hashes=hs)
    s.submit(r, 0.0)
    s.step(0.0)
    assert r.state is State.RUNNING and s.pool.reserved > 0
    s.cancel(r)
    s.cancel(r)  # idempotent
    s.check()
    assert s.pool.private == s.pool.reserved == 0 and s.cache.locked_tokens == 0
    w = req(2, list(range(500, 600)), hashes=list(range(100, 125)))
    s.cache.drain_events()
    s.submit(w, 0.0)
    s.cancel(w)
    ev = s.cache.drain_events()
    assert ev == [Removed(list(range(100, 125)))]
    assert not s.has_work()


def test_second_hit_pollution_scheduler_level():
    """A one-off 100k-token prompt must not flush a hot system prompt under second_hit."""

    def hot_survives(mode):
        s = make(capacity=110_000, mode=mode, chunk_tokens=16384)
        system = list(range(2000))
        t = 0.0
        for i in range(3):
            s.submit(req(i, system + [10**6 + i] * 8, max_new=2), t)
            t = run(s, t)
        for j in range(2):
            s.submit(req(100 + j, [2 * 10**6 + j * 200_000 + k for k in range(100_000)], max_new=2), t)
            t = run(s, t)
        probe = req(999, system + [5] * 8, max_new=1)
        s.submit(probe, t)
        run(s, t)
        return probe.cached

    assert hot_survives("always") == 0
    assert hot_survives("second_hit") == 2000


def test_random_workload_keeps_invariants():
    rng = random.Random(3)
    s = make(capacity=6000, chunk_tokens=512, order="lpm")
    stems = [list(range(k * 1000, k * 1000 + 800)) for k in range(5)]
    live = []
    t = 0.0
    for i in range(300):
        if rng.random() < 0.5:
            p = rng.choice(stems)[: rng.randrange(1, 800)] + [
                rng.randrange(50) for _ in range(rng.randrange(0, 60))
            ]
            r = req(i, p, max_new=rng.randrange(0, 30), hashes=list(range(len(p) // 16)))
            s.submit(r, t)
            live.append(r)
        if live and rng.random() < 0.1:
            s.cancel(live.pop(rng.randrange(len(live))))
        if s.has_work():
            t += s.step(t).duration_s
        s.check()
    run(s, t)
    assert s.pool.private == s.pool.reserved == 0 and s.cache.locked_tokens == 0
    assert s.stats.finished + s.stats.cancelled == s.stats.submitted


def test_max_running_caps_admissions_per_step():
    s = make(max_running=3)
    for i in range(10):
        s.submit(req(i, [i + 1] * 10, max_new=5), 0.0)
    res = s.step(0.0)
    assert len(res.started) == 3 and len(s.waiting) == 7
    res = s.step(0.0)
    assert res.decode_batch == 3 and not res.started
    run(s)
    assert s.stats.finished == 10


def test_kv_pool_reserve_evicts_only_when_it_can_fit():
    cache = RadixCache()
    pool = KVPool(100, cache)
    cache.insert("n", list(range(60)))
    _, node = cache.match_prefix("n", list(range(30)))
    cache.inc_lock_ref(node)  # 30 locked, 30 evictable
    assert not pool.reserve(80)  # 40 free + 30 evictable < 80: nothing is evicted for nothing
    assert cache.total_tokens == 60
    assert pool.reserve(70) and cache.total_tokens == 30 and pool.available == 0
    pool.commit(70)
    pool.check()
    pool.release(70, 0)
    assert pool.available == 70
    with pytest.raises(ValueError):
        KVPool(0, cache)


def test_page_size_growth_and_block_id_keys():
    """The simulator's use: page_size = block size, keys = block ids, no events."""
    cache = RadixCache(page_size=4, capacity_tokens=1000, record_events=False)
    s = Scheduler(CostModel("llama-3-8b", "h100"), cache, KVPool(1000, cache))
    r1 = SchedRequest(1, "n", list(range(10)), 6, list(range(100, 106)))
    s.submit(r1, 0.0)
    t = run(s)
    # prompt 10 -> 8 whole pages cached; prompt + 5 answer tokens = 15 -> 12 kept
    assert cache.total_tokens == 12 and cache.drain_events() == []
    r2 = SchedRequest(2, "n", list(range(10)) + list(range(100, 106)) + [7], 1)
    s.submit(r2, t)
    run(s, t)
    assert r2.cached == 12


def test_measured_prefill_rate_ignores_tiny_prefills():
    s = make()
    model_rate = s.prefill_tokens_per_s()
    s.submit(req(1, list(range(4000)), max_new=1), 0.0)
    t = run(s)
    measured = s.prefill_tokens_per_s()
    assert measured == pytest.approx(4000 / s.cost.forward_s(s.cost.prefill_flops(4000), 4000))
    for i in range(20):  # fully cached repeats: 1-token prefills bound by the weight read
        s.submit(req(2 + i, list(range(4000)), max_new=1), t)
        t = run(s, t)
    assert s.prefill_tokens_per_s() == pytest.approx(measured)
    assert 0.5 * model_rate < measured < 2 * model_rate
    assert s.load().prefill_tokens_per_s == pytest.approx(measured)


def _snapshot(s):
    return (
        [(r.rid, r.generated, r.reserved, r.private, r.state) for r in s.running],
        s.pool.private,
        s.pool.reserved,
        s.stats.decode_tokens,
        s.stats.steps,
    )


@pytest.mark.parametrize("queued", [False, True])
def test_decode_many_equals_k_decode_steps(queued):
    # two schedulers in the same state; one steps k times, the other calls decode_many(k)
    def build():
        s = make(max_running=3 if queued else 256)
        for i in range(3):
            s.submit(req(i, list(range(100 * i, 100 * i + 64)), max_new=10 + 5 * i), 0.0)
        t = 0.0
        while s.prefilling or len(s.running) < 3:
            t += s.step(t).duration_s
        if queued:  # the batch is full: a queued request cannot be admitted before a finish
            s.submit(req(9, list(range(900, 964)), max_new=4), t)
        return s, t

    a, t = build()
    b, _ = build()
    k, ctx = a.decode_window()
    assert k == min(r.max_new - r.generated for r in a.running) - 1 > 0
    assert ctx == sum(len(r.prompt) + r.generated for r in a.running)
    total = 0.0
    for _ in range(k):
        res = a.step(t + total)
        assert res.prefill_tokens == 0 and not res.finished and res.decode_batch == 3
        total += res.duration_s
    b.decode_many(k, total)
    a.check()
    b.check()
    assert _snapshot(a) == _snapshot(b)
    assert a.stats.busy_s == pytest.approx(b.stats.busy_s)
    assert b.decode_window() == (0, 0)  # the next step finishes a request: a real step()
    with pytest.raises(ValueError, match="finishing step"):
        b.decode_many(1, 0.01)


def test_decode_window_is_zero_while_anything_can_be_admitted_or_prefills():
    s = make()
    assert s.decode_window() == (0, 0)  # nothing running
    s.submit(req(1, list(range(64)), max_new=8), 0.0)
    s.step(0.0)
    assert s.decode_window()[0] > 0
    s.submit(req(2, list(range(64, 128)), max_new=8), 0.0)
    assert s.decode_window() == (0, 0)  # the queued request is admitted by the next step
    s.step(0.0)
    s.check()


def test_a_waiting_request_reports_only_its_uncached_prompt_and_evictions_raise_it():
    """The load report's ``queued_prefill_tokens`` is the prefill the waiting queue
    needs: a request whose prefix the tree holds counts only the rest; when that
    prefix is evicted while it waits, the next report counts it whole, and a
    re-insert lowers it again. ``queued_tokens`` counts the prompt whole throughout."""
    s = make(max_running=1)
    system = list(range(2048))
    s.submit(req(1, system), 0.0)
    t = run(s)
    busy = req(2, list(range(10_000, 10_500)), max_new=1000)  # holds the one batch slot
    s.submit(busy, t)
    t += s.step(t).duration_s
    assert busy.state is State.RUNNING
    waiting = req(3, system + list(range(50_000, 50_064)))
    s.submit(waiting, t)
    s.check()
    assert waiting.state is State.WAITING
    ld = s.load()
    assert (ld.queued_prefill_tokens, ld.queued_tokens, ld.queued_requests) == (64, 2048 + 64, 1)
    assert s.cache.evict(10**6) >= 2048  # the system prompt goes; the running one is locked
    s.check()
    assert s.load().queued_prefill_tokens == 2048 + 64
    s.check()
    s.cache.insert("n", system)
    assert s.load().queued_prefill_tokens == 64
    s.check()
    s.cancel(waiting)
    assert (s.load().queued_prefill_tokens, s.load().queued_tokens) == (0, 0)
    s.check()


def test_a_waiting_request_of_a_fully_cached_prompt_counts_its_last_token():
    # admission computes the last prompt token (its logits give the first token)
    s = make(max_running=1)
    prompt = list(range(1024))
    s.submit(req(1, prompt), 0.0)
    t = run(s)
    s.submit(req(2, list(range(10_000, 10_100)), max_new=1000), t)
    t += s.step(t).duration_s
    s.submit(req(3, prompt), t)
    assert s.load().queued_prefill_tokens == 1
    s.check()


def test_a_request_a_steps_budget_deep_in_the_queue_counts_its_whole_prompt():
    """Past ``chunk_tokens`` of prefill ahead a request waits steps, in which its
    cached prefix may be evicted: it counts whole, as it will likely cost."""
    s = make(max_running=1)  # chunk_tokens 8,192
    system = list(range(2048))
    s.submit(req(1, system), 0.0)
    t = run(s)
    s.submit(req(2, list(range(10_000, 10_500)), max_new=1000), t)  # holds the batch slot
    t += s.step(t).duration_s
    cold = [req(10 + i, list(range(20_000 + 5000 * i, 25_000 + 5000 * i))) for i in range(2)]
    late = req(3, system + list(range(50_000, 50_064)))
    for r in (*cold, late):
        s.submit(r, t)
    ld = s.load()
    # 0 ahead: 5,000; 5,000 ahead: 5,000; 10,000 ahead (>= 8,192): 2,112 whole, not 64
    assert (ld.queued_prefill_tokens, ld.queued_tokens) == (5000 + 5000 + 2112, 5000 + 5000 + 2112)
    s.cancel(cold[1])
    assert s.load().queued_prefill_tokens == 5000 + 64  # now 5,000 ahead of it
    s.check()
