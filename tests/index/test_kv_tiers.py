"""Colder KV tiers: the index's tier sets, vLLM-shape events with a colder
``medium``, the learned load price, and policies reading the priced match."""

from __future__ import annotations

import dataclasses
import logging
import random
from types import SimpleNamespace

import msgpack
import pytest

from radixfleet.engines import block_map as block_map_mod
from radixfleet.engines.block_map import EngineBlockMap, tier_of
from radixfleet.engines.kv_events import decode_batch
from radixfleet.engines.tier_price import (
    MIN_LOADED_TOKENS,
    PCIE_GEN5_X16_BYTES_PER_S,
    SEED_KV_BYTES_PER_TOKEN,
    TierPrice,
    TierPrices,
    seed_load_s_per_token,
)
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import token_block_hashes, token_namespace_seed
from radixfleet.policies.base import MatchResult, Reason, RouteRequest, WorkerView
from radixfleet.policies.cache_aware import CacheAware
from radixfleet.policies.prefix_load import PrefixLoad

MODEL = "tiny"
BS = 4


def seed_of(adapter, salt, block_size):
    return token_namespace_seed(MODEL, salt, adapter, block_size)


def keys_of(tokens):
    return token_block_hashes(tokens, BS, seed_of(None, "", BS))


def new_map(worker="w0", index=None):
    index = index if index is not None else PrefixIndex()
    return EngineBlockMap(worker, index, seed_of, block_size=BS), index


# vLLM 0.32's map form (tests/engines/test_events.py builds the same shapes)
def stored(hashes, parent, tokens, medium="GPU"):
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": BS if tokens else 0,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": 0}


def apply(bmap, events, now=1.0):
    bmap.apply(decode_batch(msgpack.packb([1.5e9, events, 0])).events, now)
    bmap.index.check()
    bmap.check(exclusive=True)


def tiers(index, hashes, worker="w0"):
    m = index.match(hashes, 2.0, count=False)
    return m.blocks.get(worker, 0), index.match_tiers(hashes, m).get(worker, {})


# --------------------------------------------------------------------- the index


def test_tier_sets_keep_their_invariants_and_extend_the_gpu_prefix():
    idx = PrefixIndex()
    h = list(range(1, 9))
    idx.insert("w", h[:2], 1.0)
    assert idx.tier_add("w", "cpu", h[:5]) == 5  # inclusive: blocks 0-1 in both
    assert idx.tier_add("w", "disk", h[4:7]) == 3
    idx.check()
    m = idx.match(h, 2.0)
    # GPU 2, then blocks 2-4 in CPU (4 is in disk too: the warmer tier counts), 5-6 disk
    assert idx.match_tiers(h, m) == {"w": {"cpu": 3, "disk": 2}}
    assert idx.tier_entries("w") == {"cpu": 5, "disk": 3}
    # a gap stops the walk
    idx.tier_discard("w", "cpu", [h[3]])
    assert idx.match_tiers(h, idx.match(h, 2.0)) == {"w": {"cpu": 1}}
    # a data-parallel part goes with its worker; clear() leaves the tiers, clear_tiers not
    idx.tier_add("w#1", "cpu", h[:1])
    idx.clear("w")
    assert idx.tier_entries("w")["cpu"] == 4
    assert idx.match_tiers(h, idx.match(h, 2.0)) == {"w": {"cpu": 3}, "w#1": {"cpu": 1}}
    idx.check()
    assert idx.drop_worker("w") == 4 + 3 + 1
    assert idx.match_tiers(h, idx.match(h, 2.0)) == {}
    idx.check()
    # the audit catches a broken count and an empty set
    idx.tier_add("x", "cpu", [1])
    idx._tier_entries += 1
    with pytest.raises(AssertionError):
        idx.check()
    idx._tier_entries -= 1
    idx._tiers["cpu"]["y"] = set()
    with pytest.raises(AssertionError):
        idx.check()


@pytest.mark.parametrize("used", [("cpu",), ("cpu", "disk")])
def test_tier_match_agrees_with_a_brute_force_model_under_random_operations(used):
    rng = random.Random(11)
    idx = PrefixIndex()
    hashes = list(range(500, 520))
    workers = ["a", "b", "c", "d#0", "d#1"]
    model: dict[tuple[str, str], set[int]] = {}  # (tier, worker) -> keys
    for step in range(1500):
        w = rng.choice(workers)
        t = rng.choice(used)
        op = rng.random()
        ks = rng.sample(hashes, rng.randint(1, 6))
        if op < 0.3:
            idx.tier_add(w, t, ks)
            model.setdefault((t, w), set()).update(ks)
        elif op < 0.55:
            idx.tier_discard(w, t, ks)
            model.setdefault((t, w), set()).difference_update(ks)
        elif op < 0.6:
            idx.clear_tiers(w)
            for tt in ("cpu", "disk"):
                model.pop((tt, w), None)
        elif op < 0.63:
            idx.drop_worker("d")
            for tt in ("cpu", "disk"):
                for ww in ("d", "d#0", "d#1"):
                    model.pop((tt, ww), None)
        elif op < 0.85:
            idx.insert(w, hashes[: rng.randint(1, 20)], float(step))
        else:
            idx.remove(w, [rng.choice(hashes)])
        idx.check()
        req = hashes[: rng.randint(1, 20)]
        m = idx.match(req, float(step), count=False)
        want = {}
        for ww in workers:
            i, ext = m.blocks.get(ww, 0), {}
            while i < len(req):
                tier = next((tt for tt in ("cpu", "disk") if req[i] in model.get((tt, ww), ())), None)
                if tier is None:
                    break
                ext[tier] = ext.get(tier, 0) + 1
                i += 1
            if ext:
                want[ww] = ext
        assert idx.match_tiers(req, m) == want, f"step {step}"


def test_no_tiers_cost_nothing_on_the_match():
    idx = PrefixIndex()
    idx.insert("w", [1, 2], 1.0)
    assert idx.match_tiers([1, 2, 3], idx.match([1, 2, 3], 1.0)) == {}


# ---------------------------------------------------------- vLLM-shape events


def test_block_offloaded_to_cpu_outlives_its_gpu_copy():
    """vLLM's CPU offloading reports an offloaded block without tokens or parent, under
    its GPU hash; the GPU copy is evicted later, the CPU copy stays a hit."""
    bmap, index = new_map()
    toks = list(range(4 * BS))
    ours = keys_of(toks)
    apply(bmap, [stored([11, 12, 13, 14], None, toks)])
    apply(bmap, [stored([11, 12, 13, 14], None, [], medium="CPU")])  # offloaded, inclusive
    assert tiers(index, ours) == (4, {})  # all on GPU: nothing for the CPU to add
    assert index.tier_entries("w0") == {"cpu": 4, "disk": 0}
    # the GPU evicts the tail (leaves first, as vLLM does): the CPU still holds it
    apply(bmap, [removed([14]), removed([13])])
    assert tiers(index, ours) == (2, {"cpu": 2})
    # the GPU evicts the root too: its GPU descendants go, the CPU copies stay
    apply(bmap, [removed([11])])
    assert tiers(index, ours) == (0, {"cpu": 4})
    # the CPU evicts block 2: the extension stops before it
    apply(bmap, [removed([13], medium="CPU")])
    assert tiers(index, ours) == (0, {"cpu": 2})
    st = bmap.stats()
    assert st.cold_stored_blocks == 4 and st.cold_removed_blocks == 1 and st.cold_mapped == 3
    # a re-store of the prefix on GPU (loaded back) and a gap: everything goes
    apply(bmap, [stored([11, 12], None, toks[: 2 * BS])])
    assert tiers(index, ours) == (2, {})
    bmap.on_gap(5, 7)
    assert tiers(index, ours) == (0, {}) and index.tier_entries("w0") == {"cpu": 0, "disk": 0}
    bmap.check(exclusive=True)
    index.check()


def test_random_offloading_keeps_the_map_and_the_tier_sets_true():
    """A small model of vLLM with CPU offloading: chains stored on GPU (a child only
    under a parent the GPU holds), offloaded to CPU (no tokens, inclusive), evicted
    from GPU (any block) and from CPU. After every batch both invariant audits hold
    and the CPU tier the index holds is exactly the engine's, in the router's keys."""
    rng = random.Random(5)
    bmap, index = new_map()
    root = seed_of(None, "", BS)
    gpu: dict[int, int] = {}  # engine hash -> its key (the model's own keying)
    cpu: set[int] = set()
    key: dict[int, int] = {}
    nxt = 1
    for step in range(400):
        evs = []
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.4 or not gpu:
                parent = rng.choice([None, *gpu]) if gpu else None
                n = rng.randint(1, 3)
                toks = [rng.randrange(50) for _ in range(n * BS)]
                hs = list(range(nxt, nxt + n))
                nxt += n
                ks = token_block_hashes(toks, BS, root if parent is None else key[parent])
                for e, k in zip(hs, ks):
                    gpu[e] = key[e] = k
                evs.append(stored(hs, parent, toks))
            elif op < 0.65:
                hs = rng.sample(sorted(gpu), min(len(gpu), rng.randint(1, 3)))
                cpu.update(hs)
                evs.append(stored(hs, None, [], medium="CPU"))
            elif op < 0.85:
                e = rng.choice(sorted(gpu))
                del gpu[e]
                evs.append(removed([e]))
            elif cpu:
                e = rng.choice(sorted(cpu))
                cpu.discard(e)
                evs.append(removed([e], medium="CPU"))
        apply(bmap, evs, now=float(step))
        assert index._tiers["cpu"].get("w0", set()) == {key[e] for e in cpu}, f"step {step}"
    st = bmap.stats()
    assert st.cold_unmapped_blocks == 0 and st.unknown_removed == 0 and st.cold_stored_blocks > 100


def test_recorded_vllm_shape_cpu_events_both_wire_forms():
    """A batch as vLLM publishes it with CPU offloading on (map form), and the tagged
    array form of older publishers: the CPU tier is keyed and matched."""
    toks = list(range(3 * BS))
    ours = keys_of(toks)
    payload = msgpack.packb(
        [
            1.7e9,
            [
                stored([21, 22, 23], None, toks),
                # the offloading connector's events: no tokens, no parent, medium "CPU"
                stored([21, 22, 23], None, [], medium="CPU"),
                removed([23, 22], medium="GPU"),
            ],
            0,
        ]
    )
    bmap, index = new_map()
    bmap.apply(decode_batch(payload).events, 1.0)
    bmap.check(exclusive=True)
    assert tiers(index, ours) == (1, {"cpu": 2})
    tagged = msgpack.packb(
        [
            1.7e9,
            [
                ["BlockStored", [21, 22, 23], None, toks, BS, None, "GPU", None, None, 0],
                ["BlockStored", [21, 22, 23], None, [], 0, None, "CPU", None, None, 0],
                ["BlockRemoved", [23, 22], "GPU", 0],
                ["BlockStored", [24], 23, list(range(100, 100 + BS)), BS, None, "DISK", None, None, 0],
            ],
        ]
    )
    bmap2, index2 = new_map()
    bmap2.apply(decode_batch(tagged).events, 1.0)
    bmap2.check(exclusive=True)
    index2.check()
    longer = token_block_hashes(toks + list(range(100, 100 + BS)), BS, seed_of(None, "", BS))
    # a disk block with tokens is keyed from them, below its CPU-held parent
    assert tiers(index2, longer) == (1, {"cpu": 2, "disk": 1})


def test_unknown_medium_is_counted_logged_once_and_ignored(caplog, monkeypatch):
    monkeypatch.setattr(block_map_mod, "_last_unknown_log", [-1e18])
    bmap, index = new_map()
    toks = list(range(2 * BS))
    with caplog.at_level(logging.WARNING, logger="radixfleet.engines"):
        apply(bmap, [stored([1, 2], None, toks, medium="TAPE")])
        apply(bmap, [stored([3], None, [], medium="HOLOGRAM"), removed([1], medium="TAPE")])
    st = bmap.stats()
    assert st.unknown_medium_blocks == 4 and st.stored_blocks == 0 and st.cold_stored_blocks == 0
    assert not bmap.stats().mapped and index.tier_entries("w0") == {"cpu": 0, "disk": 0}
    lines = [r for r in caplog.records if "unknown medium" in r.getMessage()]
    assert len(lines) == 1 and "TAPE" in lines[0].getMessage()
    assert tier_of("cpu") == "cpu" and tier_of("STORAGE") == "disk" and tier_of(None) == "gpu"
    assert tier_of("TAPE") is None


def test_unknown_medium_reaches_the_metric_with_its_cause():
    from prometheus_client import CollectorRegistry

    from radixfleet.engines.manager import EnginePrometheus
    from radixfleet.engines.wiring import _LinkConsumer

    r = CollectorRegistry()
    prom = EnginePrometheus(r)
    bmap, _ = new_map()
    link = SimpleNamespace(
        worker=SimpleNamespace(id="w0"),
        block_size=BS,
        events_synced=lambda rank: None,
        learn_block_size=lambda bs: None,
    )
    c = _LinkConsumer(link, bmap, prom, None)
    c.on_batch(0, decode_batch(msgpack.packb([1.0, [stored([1], None, range(BS), medium="TAPE")], 0])))
    got = r.get_sample_value(
        "radixfleet_engine_event_ignored_blocks_total", {"worker": "w0", "cause": "unknown_medium"}
    )
    assert got == 1.0


def test_a_removed_workers_tier_series_leave_the_metrics_page():
    from prometheus_client import CollectorRegistry

    from radixfleet.engines.manager import EnginePrometheus

    r = CollectorRegistry()
    prom = EnginePrometheus(r)
    for wid in ("w0", "w1"):
        prom.tier_blocks.labels(wid, "gpu").set(3)
        prom.tier_blocks.labels(wid, "cpu").set(5)
        prom.tier_load.labels(wid, "cpu").set(2e-6)
        prom.tier_fraction.labels(wid, "cpu").set(0.9)
    prom.forget("w0")
    for name in ("radixfleet_worker_tier_blocks", "radixfleet_worker_tier_gpu_hit_fraction"):
        assert r.get_sample_value(name, {"worker": "w0", "tier": "cpu"}) is None
        assert r.get_sample_value(name, {"worker": "w1", "tier": "cpu"}) is not None
    assert r.get_sample_value("radixfleet_worker_tier_blocks", {"worker": "w0", "tier": "gpu"}) is None


# -------------------------------------------------------------------- the price


def test_seeds_come_from_bandwidth():
    assert seed_load_s_per_token("cpu") == SEED_KV_BYTES_PER_TOKEN / PCIE_GEN5_X16_BYTES_PER_S
    assert seed_load_s_per_token("disk") > 5 * seed_load_s_per_token("cpu")
    p = TierPrice(seed_load_s_per_token("cpu"))
    assert 0.9 < p.fraction(10_000.0) < 1.0  # a CPU hit is nearly a GPU hit at 10k tok/s
    assert p.fraction(1e7) == 0.0  # ... and worth nothing under a prefill faster than the link


def test_price_converges_from_the_seed_to_what_answers_show():
    rng = random.Random(7)
    true = 4e-5  # 10x the CPU seed: a congested link
    p = TierPrice(seed_load_s_per_token("cpu"))
    t = 0.0
    for _ in range(200):
        t += 0.5
        n = rng.randint(MIN_LOADED_TOKENS, 4096)
        assert p.observe(n, n * true * rng.uniform(0.8, 1.2), t)
        p.check()
    assert p.observations == 200
    assert abs(p.load_s_per_token - true) / true < 0.05
    # too few tokens, garbage: refused, the estimate unmoved
    before = p.load_s_per_token
    assert not p.observe(MIN_LOADED_TOKENS - 1, 1.0, t + 1)
    assert not p.observe(float("nan"), 1.0, t + 1)
    assert not p.observe("x", 1.0, t + 1)
    assert p.load_s_per_token == before
    # a negative residual (the load overlapped) reads as free, not as negative time
    p2 = TierPrice(seed_load_s_per_token("disk"))
    for i in range(50):
        p2.observe(2048, -0.5, float(i))
    assert 0 <= p2.load_s_per_token < seed_load_s_per_token("disk") / 10
    p2.check()


def test_prices_attribute_only_single_tier_answers():
    tp = TierPrices()
    # 8 CPU blocks of 64 tokens past a 256-token GPU prefix; 640 cached: 384 loaded
    assert tp.observe({"cpu": 8}, 256, 640, 64, 0.01, 1.0) == "cpu"
    assert tp.by_tier["cpu"].observations == 1
    assert tp.observe({"cpu": 4, "disk": 4}, 256, 768, 64, 0.01, 2.0) is None
    tp.check()


def test_the_live_link_learns_its_load_price_from_answers():
    from prometheus_client import CollectorRegistry

    from radixfleet.config import WorkerSpec, parse_config
    from radixfleet.engines.keyspace import SpaceKey
    from radixfleet.engines.link import EngineLink, Placement
    from radixfleet.engines.manager import Engines
    from radixfleet.fleet.pool import Pool

    cfg = parse_config({})
    idx = PrefixIndex()
    eng = Engines(cfg, Pool(cfg, idx), idx, CollectorRegistry())
    spec = WorkerSpec(url="http://127.0.0.1:9", id="p", kind="vllm", prefill_tokens_per_s=10_000)
    link = EngineLink(SimpleNamespace(id="p"), spec, eng)
    bt, true = 16, 2e-4  # a slow link: 0.2 ms per token, prefill at 10,000 tokens/s
    hashes = list(range(100))
    rng = random.Random(3)
    for i in range(60):
        now = 1.0 + i
        # 20 GPU blocks, up to 40 CPU blocks (all loaded back), the rest prefilled
        cpu = rng.randint(16, 40)
        own = (80 - cpu) * bt
        ttft = own / 10_000 + cpu * bt * true
        sk = SpaceKey(hashes, 100 * bt, bt, True)
        link.observe(
            Placement(sk, 20, own, 0, None, None, {"cpu": cpu}), (100 * bt, (20 + cpu) * bt), ttft, now
        )
        # and an answer with no colder hit: the prefill rate's sample
        link.observe(Placement(sk, 20, 80 * bt, 0, None), (100 * bt, 20 * bt), 80 * bt / 10_000, now)
    price = link.tier_describe(61.0)["cpu"]
    assert price["observations"] == 60
    assert abs(price["load_s_per_token"] - true) / true < 0.1
    # the prefill rate learned from the same answers, less the load: not read slow
    assert abs(link.prefill_rate(61.0) - 10_000) / 10_000 < 0.1
    # at 0.2 ms per token to load against 0.1 ms to prefill, a CPU hit is worth nothing
    assert price["gpu_hit_fraction"] == 0.0 and link.colder_value({"cpu": 4}, bt, 61.0) == 0.0
    assert "kv_tiers" in link.describe()


# ------------------------------------------------------------------- policies


def _views(*ids):
    return [WorkerView(w, prefill_tokens_per_s=10_000.0) for w in ids]


def test_prefix_load_cpu_hit_beats_a_miss_and_loses_to_a_gpu_hit():
    req = RouteRequest(list(range(64)), 64 * 16, 16)
    # "cpu" holds 48 blocks in its CPU tier (no GPU prefix) at 0.8 of a GPU hit
    cpu_only = MatchResult({}, 48, 0.0, False, {"cpu": 48 * 0.8})
    pol = PrefixLoad(rng=random.Random(1))
    for _ in range(20):
        d = pol.choose(req, cpu_only, _views("miss", "cpu"), 0.0)
        assert d.worker == "cpu" and d.reason is Reason.AFFINITY
        assert d.matched_blocks == 0  # the GPU prefix: what the hint and load count use
    both = MatchResult({"gpu": 48}, 48, 0.0, False, {"cpu": 48 * 0.8})
    for _ in range(20):
        d = pol.choose(req, both, _views("miss", "cpu", "gpu"), 0.0)
        assert d.worker == "gpu" and d.matched_blocks == 48
    # without the price, the same CPU blocks are no hit at all: chance decides
    plain = MatchResult({}, 48, 0.0, False)
    seen = {pol.choose(req, plain, _views("miss", "cpu"), 0.0).worker for _ in range(40)}
    assert seen == {"miss", "cpu"}


def test_prefix_load_credits_a_colder_extension_only_where_in_flight_kv_leaves_room():
    """A load back becomes the request's own KV: on a worker whose in-flight requests
    (prompts held while they decode, the shared GPU prefix once) leave no room for
    the prompt, the request would wait for a running one to finish, so the colder
    extension earns nothing there; the GPU prefix still counts."""
    bt, cap = 32, 12_000
    prompt = 5_090  # a 2,304-token shared schema (72 blocks) and a session's history
    req = RouteRequest(list(range(prompt // bt)), prompt, bt)
    # both hold the schema on the GPU; "holder" holds the history in its CPU tier
    m = MatchResult({"holder": 72, "idle": 72}, 72, 0.0, False, {"holder": 87 * 0.9})

    def views(in_flight):
        return [
            WorkerView(
                "holder",
                in_flight=in_flight,
                in_flight_kv_tokens=in_flight * prompt,
                kv_capacity_tokens=cap,
                prefill_tokens_per_s=37_000.0,
            ),
            WorkerView("idle", kv_capacity_tokens=cap, prefill_tokens_per_s=37_000.0),
        ]

    def pick(vs, **params):  # a fresh policy each time: one decision, no history
        return [
            PrefixLoad(PrefixLoad.Params(**params), rng=random.Random(s)).choose(req, m, vs, 0.0)
            for s in range(10)
        ]

    # three decoding turns: 3 x (5,090 - 2,304) + 5,090 > 12,000
    assert all(d.worker == "idle" and d.matched_blocks == 72 for d in pick(views(3)))
    # one: 2,786 + 5,090 fits, and the read-back saves ~2,500 tokens of prefill
    assert all(d.worker == "holder" for d in pick(views(1)))
    # an unknown capacity is never judged
    blind = [dataclasses.replace(v, kv_capacity_tokens=0) for v in views(3)]
    assert all(d.worker == "holder" for d in pick(blind))
    # colder_room=false: the credit counts whatever the holder holds
    assert all(d.worker == "holder" for d in pick(views(3), colder_room=False))


def test_cache_aware_reads_the_priced_match():
    req = RouteRequest(list(range(64)), 64 * 16, 16, text_len=64 * 16 * 4)
    pol = CacheAware(rng=random.Random(1))
    m = MatchResult({"gpu": 40}, 48, 0.0, False, {"cpu": 48 * 0.9})
    assert pol.choose(req, m, _views("gpu", "cpu"), 0.0).worker == "cpu"  # 43.2 > 40
    m = MatchResult({"gpu": 48}, 48, 0.0, False, {"cpu": 48 * 0.9})
    d = pol.choose(req, m, _views("gpu", "cpu"), 0.0)
    assert d.worker == "gpu" and d.matched_blocks == 48


def test_the_router_prices_the_index_tiers_into_the_match():
    """Engines.key: the index's colder extension, priced by the link, reaches the
    policy as MatchResult.colder; the pick's placement carries the raw extension."""
    from prometheus_client import CollectorRegistry

    from radixfleet.config import WorkerSpec, parse_config
    from radixfleet.engines.link import EngineLink
    from radixfleet.engines.manager import Engines
    from radixfleet.fleet.pool import Pool
    from radixfleet.keys import Endpoint, PrefixKey

    cfg = parse_config({})
    idx = PrefixIndex()
    eng = Engines(cfg, Pool(cfg, idx), idx, CollectorRegistry())
    for wid in ("a", "b"):
        spec = WorkerSpec(url="http://127.0.0.1:9", id=wid, kind="vllm", prefill_tokens_per_s=10_000)
        eng.links[wid] = EngineLink(SimpleNamespace(id=wid), spec, eng)
    bb = eng.byte_space.block_bytes
    hashes = list(range(1000, 1032))
    pk = PrefixKey("m", "", None, b"x" * (32 * bb), hashes, bb)
    idx.insert("a", hashes[:8], 1.0)
    idx.tier_add("a", "cpu", hashes[:24])
    idx.tier_add("b", "disk", hashes[:32])
    kr = eng.key(Endpoint.COMPLETIONS, {}, pk, None, _views("a", "b"), 2.0)
    m = kr.match
    assert m.blocks == {"a": 8}
    frac_cpu = eng.links["a"].tier_prices.fraction("cpu", eng.links["a"].prefill_rate(2.0))
    frac_disk = eng.links["b"].tier_prices.fraction("disk", eng.links["b"].prefill_rate(2.0))
    assert 0 < frac_disk < frac_cpu < 1
    assert m.colder == pytest.approx({"a": 16 * frac_cpu, "b": 32 * frac_disk})
    assert kr.colder_for("a") == {"cpu": 16} and kr.colder_for("b") == {"disk": 32}
    # the pick's matched tokens per tier
    eng.links["a"].count_match(8, kr.colder_for("a"), 32)
    eng.links["a"].count_match(8, None, 32)
    got = {
        t: eng.prom.tier_matched.labels("a", t)._value.get()  # noqa: SLF001 - the counter's value
        for t in ("gpu", "cpu")
    }
    assert got == {"gpu": 512.0, "cpu": 512.0}
