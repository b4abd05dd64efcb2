"""An agent's DRAM tier on contract 2: the ``tier`` field's wire form and bounds, the
router's feedback applying colder-tier events, the reporter sending them only to
routers that read them, and the simulated router pricing a DRAM-only prefix."""

from __future__ import annotations

from array import array

import pytest

from radixfleet.config import Config, IndexConfig
from radixfleet.fleet.pool import HealthState, Pool
from radixfleet.index.feedback import Feedback
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.wire.bus_wire import build_agent, parse_agent, worker_token
from radixfleet.wire.errors import MalformedRequest
from radixfleet.wire.events import (
    MAX_TIER_NAME,
    Cleared,
    EventBatch,
    Removed,
    Snapshot,
    Stored,
    is_tiered,
    parse_batch,
)
from radixfleet_tools.agent.cost_model import CostModel
from radixfleet_tools.agent.dram_tier import DramConfig, DramTier, chunk_digests
from radixfleet_tools.agent.reporter import Reporter
from radixfleet_tools.agent.router_link import LinkState
from radixfleet_tools.loadtest.arrivals import Bounds, Closed
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import SimConfig, Simulation
from radixfleet_tools.loadtest.workloads import API_COMPLETIONS, RequestSpec, SingleShot, make_workload

URL = "http://127.0.0.1:9"


def _batch(seq: int, events: list, epoch: str = "e") -> EventBatch:
    return EventBatch("a", URL, epoch, seq, events)


# ------------------------------------------------------------------ wire form


def test_tier_field_round_trips_and_defaults_to_gpu():
    evs = [
        Snapshot([(1, None), (2, 1)], tiers={"cpu": [7, 8]}),
        Stored(2, [3, 4], tier="cpu"),
        Removed([7], tier="cpu"),
        Stored(None, [5]),
        Removed([5]),
        Cleared(),
    ]
    body = _batch(0, evs).to_json()
    # a GPU event is written as before tiers existed: an older router reads it unchanged
    assert "tier" not in body["events"][3] and "tier" not in body["events"][4]
    assert body["events"][1]["tier"] == "cpu" and body["events"][0]["tiers"] == {"cpu": [7, 8]}
    back = parse_batch(body)
    assert back.events == evs
    # an older agent's events (no field) are GPU events
    old = parse_batch({"worker_id": "a", "url": URL, "epoch": "e", "seq": 0, "events": [
        {"type": "stored", "parent": None, "hashes": [1]}, {"type": "removed", "hashes": [1]},
        {"type": "snapshot", "blocks": []}]})  # fmt: skip
    assert [getattr(e, "tier", None) for e in old.events[:2]] == ["gpu", "gpu"]
    assert old.events[2].tiers == {}
    assert [is_tiered(e) for e in evs] == [False, True, True, False, False, False]


@pytest.mark.parametrize(
    "event",
    [
        {"type": "stored", "parent": None, "hashes": [1], "tier": ""},
        {"type": "stored", "parent": None, "hashes": [1], "tier": "x" * (MAX_TIER_NAME + 1)},
        {"type": "removed", "hashes": [1], "tier": 3},
        {"type": "snapshot", "blocks": [], "tiers": [1]},
        {"type": "snapshot", "blocks": [], "tiers": {"cpu": [-1]}},
        {"type": "snapshot", "blocks": [], "tiers": {"": [1]}},
    ],
)
def test_bad_tiers_are_refused(event):
    with pytest.raises(MalformedRequest):
        parse_batch({"worker_id": "a", "url": URL, "epoch": "e", "seq": 0, "events": [event]})


def test_a_tiered_snapshot_survives_the_bus():
    b = EventBatch("a", URL, "e", 0, [Snapshot([(1, None)], tiers={"cpu": [9]})])
    msg = parse_agent(build_agent(b, ["m"], 128), worker_token("a"))
    assert msg.batch.events == b.events


# ------------------------------------------------------------------ feedback


def _fleet():
    idx = PrefixIndex()
    pool = Pool(Config(), idx, clock=lambda: 0.0)
    w = pool.register("a", URL, "e", ("m",), None)
    pool._set_health(w, HealthState.HEALTHY)
    return pool, idx, Feedback(pool, idx)


def test_feedback_puts_cpu_events_in_the_tier_not_the_tree():
    pool, idx, fb = _fleet()
    assert fb.apply(_batch(0, [Snapshot([(1, None)], tiers={"cpu": [1, 2, 3]})]), 0.0) == (200, "ok")
    assert idx.entries("a") == 1 and idx.tier_entries("a")["cpu"] == 3
    m = idx.match([1, 2, 3], 0.0, count=False)
    assert m.blocks == {"a": 1} and idx.match_tiers([1, 2, 3], m) == {"a": {"cpu": 2}}
    assert fb.apply(_batch(1, [Stored(3, [4, 5], tier="cpu"), Removed([1], tier="cpu")]), 0.0)[0] == 200
    assert idx.entries("a") == 1 and idx.tier_entries("a")["cpu"] == 4  # 2, 3, 4, 5
    # a tier the router does not know: counted, ignored, the stream goes on
    assert fb.apply(_batch(2, [Stored(None, [6], tier="hbm2"), Stored(1, [2])]), 0.0) == (200, "ok")
    assert fb.unknown_tiers == 1 and idx.entries("a") == 2 and idx.tier_entries("a")["cpu"] == 4
    # a snapshot replaces every tier
    assert fb.apply(_batch(0, [Snapshot([(1, None)], tiers={"cpu": [9]})]), 0.0)[0] == 200
    assert idx.tier_entries("a")["cpu"] == 1 and idx.tier_holds("a", "cpu", 9)
    assert fb.apply(_batch(0, [Snapshot([(1, None)])]), 0.0)[0] == 200
    assert idx.tier_entries("a")["cpu"] == 0
    # cleared empties the tiers too
    assert fb.apply(_batch(1, [Stored(None, [7, 8], tier="cpu")]), 0.0)[0] == 200
    assert fb.apply(_batch(2, [Cleared()]), 0.0)[0] == 200
    assert idx.tier_entries("a")["cpu"] == 0 and idx.entries("a") == 0
    idx.check()


# ------------------------------------------------------------------ the agent


def _dram_with_one_chunk() -> tuple[DramTier, list[int]]:
    tier = DramTier(DramConfig(4096), CostModel("llama-3-8b", "h100"), hash_stride=64)
    key = array("i", range(256))
    digests = chunk_digests("ns", key)
    hashes = list(range(100, 104))  # 4 router blocks of 64 tokens
    tier.count(digests)  # the admission gate: one request reached it
    tier.write_down(digests, 256, hashes, 0.0)
    tier.advance(1e9)
    return tier, hashes


def test_dram_tier_speaks_contract_2_and_the_reporter_filters_by_router():
    tier, hashes = _dram_with_one_chunk()
    assert tier.held_hashes() == hashes

    class _Cache:
        pending_events = 0

        def drain_events(self):
            return [Stored(None, [1])]

        def snapshot_blocks(self):
            return [(1, None)]

    rep = Reporter(
        [URL, URL + "0"], worker_id="a", url=URL, models=["m"], cache=_Cache(), load=lambda: None, dram=tier
    )
    new, old = rep.links
    for link in rep.links:
        link.state = LinkState.STREAMING
    new.tiers = True
    rep._distribute()
    assert new.pending == [Stored(None, [1]), Stored(None, hashes, tier="cpu")]
    assert old.pending == [Stored(None, [1])]  # an older router would read it as HBM
    assert rep._snapshot().tiers == {"cpu": hashes}


# ------------------------------------------------------------------ the simulator


def _shot(i: int, prompt: str) -> SingleShot:
    return SingleShot(
        RequestSpec(f"s{i}.0", API_COMPLETIONS, {"prompt": prompt}, 2, f"s{i}", 0, None, len(prompt) // 4)
    )


def _dram_run(tiers: str) -> Simulation:
    """Prompt P on one worker, then fillers that evict it from both HBMs; P again."""
    p = "".join(chr(97 + (i * 7) % 26) for i in range(6000))
    fillers = ["".join(chr(97 + (i * j) % 23) for i in range(6000)) + str(j) for j in range(2, 10)]
    shots = [_shot(0, p), *(_shot(j + 1, f) for j, f in enumerate(fillers)), _shot(99, p)]
    cfg = SimConfig(
        workers=2,
        policy="prefix_load",
        engine=EngineSpec(kv_tokens=2500, dram_ratio=8.0),
        router_config=Config(index=IndexConfig(tiers=tiers)),
        check=True,
    )
    wl = make_workload("gsp", {"groups": 1, "prompts_per_group": 1})
    sim = Simulation(cfg, wl, Closed(1), Bounds(100, 1e6, 600.0), seed=0, sessions=shots)
    sim.outcome = sim.run()
    return sim


def test_a_dram_only_prefix_attracts_the_request_only_when_priced():
    runs = {t: _dram_run(t) for t in ("priced", "ignore", "as_gpu")}
    for t, sim in runs.items():
        first, last = sim.jobs[0], sim.jobs[-1]
        assert first.ok and last.ok, t
        if t == "ignore":
            assert last.worker != first.worker and last.cached_dram == 0, t
        else:  # P's HBM copy is gone everywhere; its DRAM copy on P's first worker wins
            assert last.worker == first.worker and last.cached_dram > 0, t
            assert sim.index.tier_entries(sim.refs[first.worker].id)["cpu"] > 0


# ------------------------------------------------------------------ the live router


def _engines(tiers: str):
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from radixfleet.config import WorkerSpec, parse_config
    from radixfleet.engines.link import EngineLink
    from radixfleet.engines.manager import Engines

    cfg = parse_config({"index": {"tiers": tiers}})
    idx = PrefixIndex()
    eng = Engines(cfg, Pool(cfg, idx), idx, CollectorRegistry())
    for wid in ("a", "b"):
        spec = WorkerSpec(url="http://127.0.0.1:9", id=wid, kind="agent", prefill_tokens_per_s=10_000)
        eng.links[wid] = EngineLink(SimpleNamespace(id=wid), spec, eng)
    return eng, idx


@pytest.mark.parametrize("tiers", ["priced", "ignore", "as_gpu"])
def test_index_tiers_decides_what_an_agents_dram_prefix_is_worth(tiers):
    from radixfleet.keys import Endpoint, PrefixKey
    from radixfleet.policies.base import WorkerView

    eng, idx = _engines(tiers)
    fb = Feedback(eng.pool, idx)
    w = eng.pool.register("a", URL, "e", ("m",), None)
    eng.pool._set_health(w, HealthState.HEALTHY)
    bb = eng.byte_space.block_bytes
    hashes = list(range(1000, 1032))
    # agent a reports 24 blocks in its DRAM tier and none on the GPU
    assert fb.apply(_batch(0, [Snapshot([], tiers={"cpu": hashes[:24]})]), 1.0)[0] == 200
    pk = PrefixKey("m", "", None, b"x" * (32 * bb), hashes, bb)
    views = [WorkerView(x, prefill_tokens_per_s=10_000.0) for x in ("a", "b")]
    m = eng.key(Endpoint.COMPLETIONS, {}, pk, None, views, 2.0).match
    link = eng.links["a"]
    if tiers == "ignore":
        assert not m.colder
    elif tiers == "as_gpu":
        assert m.colder == {"a": 24}
    else:
        frac = link.tier_prices.fraction("cpu", link.prefill_rate(2.0))
        assert 0 < frac < 1 and m.colder == pytest.approx({"a": 24 * frac})
    # /admin/workers: the agent's DRAM blocks and their price
    assert link.describe()["kv_tiers"]["cpu"]["blocks"] == 24


def test_an_agent_link_learns_its_dram_price_from_answers():
    from radixfleet.engines.keyspace import SpaceKey
    from radixfleet.engines.link import Placement

    eng, _ = _engines("priced")
    link = eng.links["a"]
    bt, true = 16, 5e-5  # 50 us per token read back, prefill at 10,000 tokens/s
    sk = SpaceKey(list(range(100)), 1600, bt, True)
    for i in range(60):
        now = 1.0 + i
        # the agent's cached tokens include what it read back from DRAM
        link.observe(
            Placement(sk, 20, 40 * bt, 0, None, None, {"cpu": 40}),
            (1600, 60 * bt),
            40 * bt / 10_000 + 40 * bt * true,
            now,
        )
        link.observe(Placement(sk, 20, 80 * bt, 0, None), (1600, 20 * bt), 80 * bt / 10_000, now)
    cpu = link.describe()["kv_tiers"]["cpu"]
    assert cpu["observations"] == 60 and abs(cpu["load_s_per_token"] - true) / true < 0.1
