"""The DRAM KV tier (radixfleet_tools.agent.dram_tier) under the agent's scheduler and in the simulator."""

from __future__ import annotations

from array import array

import msgpack
import pytest

from radixfleet.engines.kv_events import decode_batch
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.agent.cost_model import PCIE_GEN5_X16, CostModel
from radixfleet_tools.agent.dram_tier import (
    CHUNK_TOKENS,
    MEDIUM_CPU,
    DramConfig,
    chunk_digests,
    gpu_events_vllm,
    parse_dram_size,
)
from radixfleet_tools.agent.scheduler import SchedRequest, build_scheduler

STRIDE = 64  # tokens per router block in these tests
NS = ("m", "", None)


def prompt(n: int, base: int = 1000) -> array:
    return array("Q", range(base, base + n))


def hashes_for(n_tokens: int, base: int = 1) -> list[int]:
    return list(range(base, base + n_tokens // STRIDE))


def sched(dram_tokens: int | None = 64 * CHUNK_TOKENS, kv: int = 8192, admit_hits: int = 1):
    dram = DramConfig(dram_tokens, admit_hits=admit_hits) if dram_tokens else None
    return build_scheduler(kv_tokens=kv, hash_stride=STRIDE, dram=dram)


def run(s, reqs, t: float = 0.0) -> tuple[float, list[float]]:
    """Submits ``reqs`` at ``t`` and steps until idle; (end time, step durations)."""
    for r in reqs:
        s.submit(r, t)
    durations = []
    while s.has_work():
        res = s.step(t)
        durations.append(res.duration_s)
        t += res.duration_s
        s.check()
    return t, durations


def req(rid, n: int, max_new: int = 4, base: int = 1000) -> SchedRequest:
    return SchedRequest(rid, NS, prompt(n, base), max_new, hashes=hashes_for(n, base=base))


def test_write_down_is_in_whole_256_token_chunks_after_the_copy_lands():
    s = sched()
    t, _ = run(s, [req(1, 1000)])
    dram = s.dram
    s.dram.advance(t + 1.0)
    # 1000 prompt tokens: 3 whole chunks; the partial 4th stays in HBM only
    assert dram.held_tokens == 3 * CHUNK_TOKENS
    assert dram.stats.written_chunks == 3
    assert dram.match(chunk_digests(NS, prompt(1000))) == 3 * CHUNK_TOKENS
    # each chunk costs its bytes over PCIe on the D2H stream
    assert dram.d2h.busy_s == pytest.approx(3 * CostModel("llama-3-8b", "h100").pcie_s(CHUNK_TOKENS))


def test_a_write_is_not_matchable_before_its_copy_lands():
    s = sched()
    r = req(1, 512)
    s.submit(r, 0.0)
    res = s.step(0.0)  # prefill ends: the chunks are queued at the step's end
    end = res.duration_s
    assert s.dram.held_tokens == 0
    copy = s.cost.pcie_s(CHUNK_TOKENS)
    s.dram.advance(end + copy / 2)
    assert s.dram.held_tokens == 0  # the first copy is under way
    s.dram.advance(end + 1.5 * copy)
    assert s.dram.held_tokens == CHUNK_TOKENS  # the first landed, the second is in flight
    s.dram.advance(end + 2 * copy)
    assert s.dram.held_tokens == 2 * CHUNK_TOKENS


def test_read_back_adds_pcie_time_to_ttft():
    s = sched()
    t, _ = run(s, [req(1, 1000)])
    t += 1.0
    s.dram.advance(t)
    s.cache.evict(10**9)  # HBM drops it; the DRAM copy stays (inclusive)
    assert s.cache.total_tokens == 0 and s.dram.held_tokens == 768
    r = req(2, 1000)
    run(s, [r], t)
    cost = s.cost
    assert r.cached == 768 and r.cached_dram == 768
    read = cost.pcie_s(768)
    assert read == pytest.approx(768 * cost.model.kv_bytes_per_token / PCIE_GEN5_X16.bytes_per_s)
    compute = cost.forward_s(cost.prefill_flops(1000 - 768, 768), 1000)
    assert r.ttft == pytest.approx(read + compute)
    assert s.stats.dram_cached_tokens == 768
    # without the tier the same request computes everything
    s2 = sched(None)
    r2 = req(2, 1000)
    run(s2, [r2])
    assert r2.cached == 0 and r2.ttft == pytest.approx(cost.forward_s(cost.prefill_flops(1000), 1000))
    assert r.ttft < r2.ttft


def test_a_prefix_partly_in_hbm_reads_back_only_the_rest():
    s = sched()
    t, _ = run(s, [req(1, 1024)])
    s.dram.advance(t + 1.0)
    s.cache.evict(10**9)
    run(s, [req(2, 300)], t + 1.0)  # HBM holds 300 tokens of the prefix again
    r = req(3, 1024)
    run(s, [r], t + 2.0)
    assert r.cached == 1023  # one token is always computed
    assert r.cached_dram == 1023 - 300


def test_per_tier_eviction_dram_lru_and_cascade():
    s = sched(dram_tokens=4 * CHUNK_TOKENS)
    t, _ = run(s, [req(1, 512, base=10_000)])  # chunks a0, a1
    s.dram.advance(t + 1)
    t, _ = run(s, [req(2, 512, base=20_000)], t + 1)  # b0, b1: DRAM full
    s.dram.advance(t + 1)
    a = chunk_digests(NS, prompt(512, 10_000))
    b = chunk_digests(NS, prompt(512, 20_000))
    assert s.dram.match(a) == 512 and s.dram.match(b) == 512  # b touched last
    t, _ = run(s, [req(3, 256, base=30_000)], t + 1)
    s.dram.advance(t + 1)
    # a was least recently used: its leaf a1 goes, a0 stays (the chunks stay prefix-closed)
    assert s.dram.match(a) == 256 and s.dram.match(b) == 512
    s.dram._drop(a[0])  # a parent's eviction takes every chunk chained after it
    assert s.dram.match(a) == 0
    s.dram.check()
    # HBM eviction never touched DRAM, and DRAM eviction never touched HBM
    assert s.cache.peek(NS, prompt(512, 10_000)) == 512


def test_write_down_never_delays_a_decode_step():
    def workload():
        return [req(1, 2048, max_new=60), req(2, 1500, max_new=40, base=50_000)]

    _, with_tier = run(sched(), workload())
    _, without = run(sched(None), workload())
    assert with_tier == without  # the same steps, to the last bit
    s = sched()
    run(s, workload())
    assert s.dram.d2h.busy_s > 0  # and the copies did happen, on their own stream


def test_admission_gate_writes_down_only_after_n_requests():
    s = sched(admit_hits=2)
    t, _ = run(s, [req(1, 512)])
    s.dram.advance(t + 1)
    assert s.dram.held_tokens == 0 and s.dram.stats.gated > 0  # one request: HBM only
    t, _ = run(s, [req(2, 512)], t + 1)  # the second reaches it (an HBM hit)
    s.dram.advance(t + 1)
    assert s.dram.held_tokens == 512
    # a one-off prefix never gets in
    t, _ = run(s, [req(3, 512, base=90_000)], t + 1)
    s.dram.advance(t + 1)
    assert s.dram.match(chunk_digests(NS, prompt(512, 90_000))) == 0


def test_events_per_tier_in_vllm_shape():
    s = sched(dram_tokens=2 * CHUNK_TOKENS)
    r = req(1, 512)
    t, _ = run(s, [r])
    s.dram.advance(t + 1)
    cpu = s.dram.drain_events()
    h = r.hashes
    assert [e["type"] for e in cpu] == ["BlockStored", "BlockStored"]
    assert all(e["medium"] == MEDIUM_CPU for e in cpu)
    # the router blocks whose last token is in each chunk, chained to the one before
    assert cpu[0]["block_hashes"] == h[:4] and cpu[0]["parent_block_hash"] is None
    assert cpu[1]["block_hashes"] == h[4:] and cpu[1]["parent_block_hash"] == h[3]
    # GPU events, the same shape with medium GPU
    gpu = gpu_events_vllm(s.cache.drain_events(), STRIDE)
    assert gpu and {e["medium"] for e in gpu} == {"GPU"}
    # a DRAM eviction: BlockRemoved CPU
    t, _ = run(s, [req(2, 256, base=70_000)], t + 1)
    s.dram.advance(t + 1)
    removed = [e for e in s.dram.drain_events() if e["type"] == "BlockRemoved"]
    assert removed and removed[0]["medium"] == MEDIUM_CPU and removed[0]["block_hashes"] == h[4:]
    # the router's vLLM decoder reads them as vLLM's own, tier and all
    decoded = decode_batch(msgpack.packb([1.0, cpu + removed, 0]))
    assert [(type(e).__name__, e.medium) for e in decoded.events] == [
        ("EngineBlockStored", "CPU"),
        ("EngineBlockStored", "CPU"),
        ("EngineBlockRemoved", "CPU"),
    ][: len(decoded.events)] and len(decoded.events) == 2 + len(removed)
    # the contract-2 log the agent's reporter sends holds no CPU block
    assert all(getattr(e, "hashes", None) != h[4:] or e.type == "removed" for e in s.cache.drain_events())


def test_bad_sizes_are_refused():
    assert parse_dram_size("4x") == (None, 4.0)
    assert parse_dram_size("1000") == (1000, None)
    for bad in ("", "x", "0x", "-2x", "100", "lots", "nanx"):
        with pytest.raises(ValueError):
            parse_dram_size(bad)
    with pytest.raises(ValueError):
        DramConfig(4096, admit_hits=0)


def test_simulate_reports_hits_per_tier():
    from radixfleet_tools.loadtest.simulator import cli as simcli

    parser = simcli.argparse.ArgumentParser()
    simcli.configure(parser)
    args = parser.parse_args(
        ["--workload", "agent", "--requests", "120", "--policies", "prefix_load", "--dram-tokens", "4x"]
    )
    plans, workload, bounds, params = simcli.build(args)
    (out,) = simcli.simulate(plans, workload, bounds, params, seed=0)
    tiers = out.report["tiers"]
    assert tiers["dram_tokens_per_worker"] == 4 * out.report["sim"]["kv_tokens_per_worker"]
    assert tiers["gpu_hit_rate"] + tiers["dram_hit_rate"] == pytest.approx(out.report["hit_rate"])
    assert tiers["written_chunks"] > 0
    bad = parser.parse_args(["--workload", "agent", "--dram-tokens=-1x"])
    with pytest.raises(ConfigError, match="--dram-tokens"):
        simcli.build(bad)


def test_agent_flags_size_the_tier_and_refuse_bad_values():
    import argparse

    from radixfleet_tools.agent.cli import build_config, configure

    p = argparse.ArgumentParser()
    configure(p)
    cfg = build_config(p.parse_args(["--port", "9001", "--kv-tokens", "10000", "--dram-tokens", "4x"]))
    assert cfg.dram is not None and cfg.dram.capacity_tokens == 40_000 and cfg.dram.admit_hits == 1
    cfg = build_config(p.parse_args(["--port", "9001", "--dram-tokens", "5000", "--dram-admit-hits", "3"]))
    assert cfg.dram is not None and (cfg.dram.capacity_tokens, cfg.dram.admit_hits) == (5000, 3)
    assert build_config(p.parse_args(["--port", "9001"])).dram is None  # off by default
    for bad in ("0x", "12", "many"):
        with pytest.raises(ConfigError, match="--dram-tokens"):
            build_config(p.parse_args(["--port", "9001", f"--dram-tokens={bad}"]))
