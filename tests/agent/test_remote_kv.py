"""Remote KV in the scheduler (radixfleet_tools.agent.scheduler, "Remote KV"): a decode leg of
vLLM's P/D protocol pulls the prompt's KV over the link instead of computing it,
priced by the cost model's own transfer functions, in virtual time."""

from __future__ import annotations

import pytest

from radixfleet_tools.agent import tokenizer as tk
from radixfleet_tools.agent.cost_model import DEFAULT_LINK, LINKS, CostModel
from radixfleet_tools.agent.kv_pool import KVPool
from radixfleet_tools.agent.radix_cache import RadixCache
from radixfleet_tools.agent.scheduler import SchedRequest, Scheduler, State, build_scheduler


def make(link: str = DEFAULT_LINK, capacity: int = 100_000) -> Scheduler:
    cache = RadixCache(hash_stride=16, capacity_tokens=capacity)
    return Scheduler(CostModel("llama-3-8b", "h100"), cache, KVPool(capacity, cache), link=LINKS[link])


def run(s: Scheduler, t: float = 0.0) -> float:
    for _ in range(10_000):
        if not s.has_work():
            return t
        t += s.step(t).duration_s
        s.check()
    raise AssertionError("did not drain")


def req(rid: int, prompt: list[int], remote: bool, max_new: int = 4) -> SchedRequest:
    r = SchedRequest(rid, "n", prompt, max_new, tk.generate(rid, max_new))
    r.remote = len(prompt) if remote else 0
    return r


def transfer_s(s: Scheduler, tokens: int) -> float:
    return s.link.transfer_s(s.cost.kv_transfer_bytes(tokens))


def test_remote_prompt_is_pulled_not_computed():
    s = make()
    prompt = list(range(4096))
    r = req(1, prompt, remote=True)
    s.submit(r, 0.0)
    run(s)
    n = len(prompt) - 1  # the last prompt token is computed: its logits give the first token
    assert r.state is State.FINISHED and r.transferred == n and r.cached == 0
    assert s.stats.prefill_tokens == 1 and s.stats.cached_tokens == 0
    assert s.stats.kv_transfers_in == 1 and s.stats.kv_transferred_in_tokens == n
    assert s.stats.kv_transferred_in_bytes == s.cost.kv_transfer_bytes(n)
    # the first token lands after the transfer plus one step computing one token over n
    one = s.cost.forward_s(s.cost.prefill_flops(1, n), n + 1)
    assert r.ttft == pytest.approx(transfer_s(s, n) + one, rel=1e-9)
    # the prompt joined the tree: a local repeat reuses it
    assert s.cache.peek("n", prompt) >= n


def test_only_what_is_not_held_locally_is_pulled():
    s = make()
    prefix = list(range(2048))
    run_first = req(1, prefix, remote=False)
    s.submit(run_first, 0.0)
    t = run(s)
    prompt = prefix + list(range(10_000, 11_024))
    r = req(2, prompt, remote=True)
    s.submit(r, t)
    run(s, t)
    assert r.cached == 2048  # local reuse, what cached_tokens reports
    assert r.transferred == len(prompt) - 1 - 2048
    assert s.stats.cached_tokens == 2048


def test_a_fully_held_prompt_pulls_nothing():
    s = make()
    prompt = list(range(1024))
    s.submit(req(1, prompt, remote=False), 0.0)
    t = run(s)
    r = req(2, prompt, remote=True)
    s.submit(r, t)
    run(s, t)
    assert r.transferred == 0 and r.cached == len(prompt) - 1
    assert s.stats.kv_transfers_in == 0


def test_transfers_queue_on_the_ingress():
    s = make()
    a = req(1, list(range(8192)), remote=True)
    b = req(2, list(range(20_000, 28_192)), remote=True)
    s.submit(a, 0.0)
    s.submit(b, 0.0)
    run(s)
    one = transfer_s(s, 8191)
    # b's transfer starts when a's ends: its first token is one transfer later
    assert b.ttft >= 2 * one and a.ttft < 2 * one


def test_the_link_preset_prices_the_transfer():
    slow, fast = make("rdma"), make("nvlink")
    for s in (slow, fast):
        s.submit(req(1, list(range(8192)), remote=True), 0.0)
        run(s)
    ratio = LINKS["nvlink"].bytes_per_s / LINKS["rdma"].bytes_per_s
    assert transfer_s(slow, 8191) == pytest.approx(ratio * transfer_s(fast, 8191))
    assert build_scheduler(kv_tokens=1000).link is LINKS[DEFAULT_LINK]


def test_cancel_while_the_kv_lands_frees_it():
    s = make()
    r = req(1, list(range(8192)), remote=True)
    s.submit(r, 0.0)
    s.step(0.0)  # admitted: the transfer is in flight
    assert r.state is State.PREFILL and r in s.loading
    s.cancel(r)
    s.check()
    assert s.pool.private == 0 and s.pool.reserved == 0 and not s.has_work()
