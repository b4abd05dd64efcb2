"""A disaggregated fleet in the simulator: roles, the KV transfer's price, the decode
pick, and prefix-aware prefill selection against round robin (fast tier: in-process,
virtual time)."""

from __future__ import annotations

import random

import pytest

from radixfleet.keys import WorkerId
from radixfleet.policies.base import WorkerView
from radixfleet.policies.disagg import choose_decode, validate_roles
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.agent.cost_model import LINKS, CostModel, link_preset
from radixfleet_tools.loadtest.arrivals import Bounds, Poisson
from radixfleet_tools.loadtest.simulator.disagg import DecodeWorker, DisaggSimulation, DisaggSpec
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import SimConfig
from radixfleet_tools.loadtest.workloads import make_workload

GSP = {"groups": 8, "prompts_per_group": 12, "system_tokens": 512, "question_tokens": 32, "output_tokens": 32}


def _disagg(policy: str, split: str = "3:1", link: str = "rdma", kv_tokens: int = 3000, seed: int = 5):
    spec = DisaggSpec.split(split, link)
    cfg = SimConfig(workers=spec.prefill, policy=policy, engine=EngineSpec(kv_tokens=kv_tokens), check=True)
    wl = make_workload("gsp", GSP, seed=3)
    sim = DisaggSimulation(cfg, spec, wl, Poisson(40.0), Bounds(10_000, 1e6, 60.0), seed=seed)
    return sim, sim.run().report


# ------------------------------------------------------------------ roles


@pytest.mark.parametrize(
    "roles, path, words",
    [
        (["prefill", "decoder", "decode"], "roles[1]", "'decoder' is not a role"),
        (["prefill", 3], "roles[1]", "is not a role"),
        (["prefill", "prefill"], "roles", "at least one decode worker"),
        (["decode", "both"], "roles", "at least one prefill worker"),
        ([], "roles", "at least one worker"),
        ("prefill", "roles", "must be a list"),
    ],
)
def test_bad_roles_are_refused_with_their_path(roles, path, words):
    with pytest.raises(ConfigError) as exc:
        validate_roles(roles)
    assert exc.value.path == path
    assert words in str(exc.value)


def test_colocated_and_disaggregated_roles_are_valid():
    assert validate_roles(["both", "both"]) == ("both", "both")
    assert validate_roles(["prefill", "decode", "decode"]) == ("prefill", "decode", "decode")


@pytest.mark.parametrize(
    "make, path",
    [
        (lambda: DisaggSpec.split("4"), "--disagg"),
        (lambda: DisaggSpec.split("a:b"), "--disagg"),
        (lambda: DisaggSpec.split("0:4"), "--disagg"),
        (lambda: DisaggSpec.split("4:0"), "--disagg"),
        (lambda: DisaggSpec.split("2:2", "carrier-pigeon"), "--link"),
        (lambda: DisaggSpec(("prefill", "decode"), "pcie").validate(), "disagg.link"),
        (lambda: DisaggSpec(("prefill", "both", "decode")).validate(), "disagg.roles[1]"),
        (lambda: DisaggSpec(("prefill", "nope")).validate(), "disagg.roles[1]"),
        (lambda: DisaggSpec(("both", "both")).validate(), "disagg.roles"),
    ],
)
def test_bad_disaggregated_fleets_are_refused(make, path):
    with pytest.raises(ConfigError) as exc:
        make()
    assert exc.value.path == path


def test_the_simulation_refuses_a_fleet_that_does_not_match_its_roles():
    spec = DisaggSpec.split("2:2")
    wl = make_workload("gsp", GSP, seed=3)
    with pytest.raises(ConfigError) as exc:
        DisaggSimulation(SimConfig(workers=3), spec, wl, Poisson(1.0), Bounds(10, 1e6, 1.0))
    assert exc.value.path == "disagg.roles"
    with pytest.raises(ConfigError) as exc:
        DisaggSimulation(SimConfig(workers=2, timeout_s=5.0), spec, wl, Poisson(1.0), Bounds(10, 1e6, 1.0))
    assert exc.value.path == "--timeout"


# ------------------------------------------------------------------ transfer cost


def test_transfer_cost_is_prompt_kv_over_the_link():
    cost = CostModel("llama-3-8b", "h100")
    per_token = 2 * 32 * 8 * 128 * 2  # K and V x layers x kv heads x head dim x bf16
    assert cost.kv_transfer_bytes(1000) == 1000 * per_token
    assert CostModel("llama-3-8b", "h100", tp=4).kv_transfer_bytes(1000) == 1000 * per_token
    assert LINKS["rdma"].transfer_s(50e9) == pytest.approx(1.0)
    assert LINKS["nvlink"].transfer_s(450e9) == pytest.approx(1.0)
    assert all(link.source for link in LINKS.values())
    assert link_preset("nvlink").bytes_per_s == 9 * link_preset("rdma").bytes_per_s


def test_the_simulation_moves_every_prompt_kv_once_at_the_link_rate():
    rdma_sim, rdma = _disagg("prefix_load", link="rdma")
    nv_sim, nv = _disagg("prefix_load", link="nvlink")
    per_token = rdma_sim.decoders[0].cost.model.kv_bytes_per_token
    prompts = sum(j.prompt.prompt_tokens for j in rdma_sim.jobs if not j.warm and j.ok)
    assert rdma["ok"] == rdma["requests"] > 0
    assert rdma["disagg"]["kv_bytes_transferred"] == prompts * per_token
    assert rdma["disagg"]["transfers"] == rdma["ok"]
    # the same transfers at 9x the rate: each takes 1/9 of the time
    assert rdma["disagg"]["transfer_ms"]["mean"] == pytest.approx(9 * nv["disagg"]["transfer_ms"]["mean"])
    # the first token comes after the transfer: a slower link costs TTFT
    assert rdma["ttft_ms"]["mean"] > nv["ttft_ms"]["mean"]
    assert rdma["itl_ms"]["p99"] is not None and rdma["output_tokens"] == nv["output_tokens"]


# ------------------------------------------------------------------ decode pick


def _view(wid: str, used: int, running: int, queued: int = 0, cap: int = 1000) -> WorkerView:
    return WorkerView(
        WorkerId(wid),
        running_requests=running,
        queued_requests=queued,
        kv_used_tokens=used,
        kv_capacity_tokens=cap,
    )


def test_decode_pick_takes_the_least_loaded_worker_with_room():
    rng = random.Random(0)
    views = [_view("full", 900, 1), _view("busy", 100, 9), _view("light", 500, 2)]
    assert choose_decode(views, 200, rng).id == "light"
    # no room anywhere: the one that frees first, the most free KV
    assert choose_decode(views, 950, rng).id == "busy"


def test_decode_pick_among_equally_loaded_prefers_the_worker_holding_the_prompt():
    """The pairing's transfer: at equal load, the decode worker that already holds
    most of the prompt (least to pull) wins over more free KV; load still comes
    first, and a worker without room is not chosen for what it holds."""
    rng = random.Random(0)
    views = [_view("roomy", 100, 2), _view("holder", 600, 2), _view("idle", 300, 1), _view("full", 950, 0)]
    held = {"roomy": 0, "holder": 320, "idle": 0, "full": 900}.get
    assert choose_decode(views, 200, rng, held).id == "idle"  # least load first
    views[2] = _view("idle", 300, 2)
    assert choose_decode(views, 200, rng, held).id == "holder"  # then least to transfer
    assert choose_decode(views, 200, rng).id == "roomy"  # nothing known: most free KV


def test_decode_worker_holds_kv_and_batch_within_bounds():
    dw = DecodeWorker("d0", CostModel("llama-3-8b", "h100"), capacity=1000, max_running=2)

    class _Job:
        pass

    from radixfleet_tools.loadtest.simulator.disagg import _Leg

    legs = []
    for _ in range(3):
        leg = _Leg(_Job(), 2)
        leg.need, leg.ctx = 300, 298
        dw.waiting.append(leg)
        legs.append(leg)
    admitted = dw.admit()
    assert admitted == legs[:2] and len(dw.waiting) == 1  # max_running, not KV, stops the third
    for leg in admitted:
        dw.land(leg)
    dw.check()
    end = dw.start_step(0.0)
    assert end is not None and end > 0
    first, done, itl = dw.end_step()
    assert first == legs[:2] and done == [] and itl is None
    dw.start_step(end)
    first, done, itl = dw.end_step()
    assert done == legs[:2] and itl is not None and itl[1] == 2
    assert dw.used == 0
    assert dw.admit() == [legs[2]]
    dw.check()


# ------------------------------------------------------------------ prefill selection


def test_prefix_aware_prefill_beats_round_robin_on_hit_and_moves_no_more_bytes():
    _, rr = _disagg("round_robin")
    _, pl = _disagg("prefix_load")
    assert rr["ok"] == pl["ok"] == rr["requests"]
    assert pl["hit_rate"] >= 1.5 * rr["hit_rate"], (pl["hit_rate"], rr["hit_rate"])
    assert pl["disagg"]["kv_bytes_transferred"] <= rr["disagg"]["kv_bytes_transferred"]
    assert pl["disagg"]["prefill_policy"] == "prefix_load"


def test_a_disaggregated_run_is_reproducible():
    _, a = _disagg("prefix_load", seed=7)
    _, b = _disagg("prefix_load", seed=7)
    for k in ("wall_s", "sim_requests_per_s"):
        a.pop(k)
        b.pop(k)
    assert a == b


# ------------------------------------------------------------------ the benchmark's flags


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--gpus", "8", "--disagg", "3:3"], "--disagg: 3:3 is 6 GPUs, --gpus is 8"),
        (["--gpus", "1"], "--gpus"),
        (["--link", "pcie"], "--link: unknown link preset 'pcie'"),
        (["--workloads", "mooncake,nope"], "--workloads: 'nope'"),
        (["--disagg", "8:0"], "--disagg"),
    ],
)
def test_bench_disagg_refuses_bad_flags_with_one_line(argv, words, capsys):
    import argparse

    from radixfleet_tools.bench import disagg as bench

    parser = argparse.ArgumentParser()
    bench.configure(parser)
    assert bench.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


@pytest.mark.parametrize("feedback", ["none", "plain"])
def test_a_disaggregated_run_keeps_its_invariants_with_any_feedback_and_a_path_latency(feedback):
    spec = DisaggSpec.split("2:2", "nvlink")
    cfg = SimConfig(
        workers=2,
        policy="prefix_load",
        engine=EngineSpec(kv_tokens=3000),
        feedback=feedback,
        path_latency_s=0.002,
        check=True,
    )
    sim = DisaggSimulation(cfg, spec, make_workload("gsp", GSP, seed=1), Poisson(30.0), Bounds(40, 1e6, 60.0))
    r = sim.run().report
    assert r["ok"] == r["requests"] == 40
    assert r["disagg"]["transfers"] == 40 and r["disagg"]["decode_workers"] == 2
    # every client-seen TTFT includes the way there and back
    assert r["ttft_ms"]["p50"] >= 4.0


def test_a_conversation_reads_back_the_decode_sides_whole_answer():
    """Multi-turn chat at text level: the answer the client sends back is the decode
    leg's (max_tokens long), so the prefill side's cache covers the previous prompt
    but not the answer, which lives on the decode side."""
    opts = {"clients": 4, "rounds": 3, "question_tokens": 64, "output_tokens": 16}
    spec = DisaggSpec.split("2:1")
    cfg = SimConfig(workers=2, policy="prefix_load", engine=EngineSpec(kv_tokens=20_000), check=True)
    sim = DisaggSimulation(
        cfg, spec, make_workload("multiturn", opts, seed=2), Poisson(20.0), Bounds(100, 1e6, 60.0)
    )
    r = sim.run().report
    assert r["ok"] == r["requests"] == 12
    assert r["output_tokens"] == 12 * 16
    jobs = sorted((j for j in sim.jobs if not j.warm), key=lambda j: (j.spec.session, j.spec.turn))
    by_session: dict = {}
    for j in jobs:
        by_session.setdefault(j.spec.session, []).append(j)
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:]):
            # the next prompt = previous prompt + its 16-token answer + a question (+ chat framing)
            assert nxt.prompt.prompt_tokens >= prev.prompt.prompt_tokens + 16 + 64
            assert prev.prompt.prompt_tokens - 16 <= nxt.cached < prev.prompt.prompt_tokens + 16
