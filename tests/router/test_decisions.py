"""Routing quality and the recent decisions (radixfleet.route.decisions): the three numbers per
answer, their counters, the bounded ring with salted keys, the policy's explanation,
and ``GET /admin/decisions`` against a live router in front of agents."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from radixfleet.config import parse_config
from radixfleet.engines.keyspace import KeyedRequest, SpaceKey
from radixfleet.keys import Endpoint, request_key
from radixfleet.policies.base import MatchResult, RouteRequest, WorkerView
from radixfleet.policies.registry import build_policy
from radixfleet.route.core import Placement, Route
from radixfleet.route.decisions import MAX_CANDIDATES, MAX_SIZE, DecisionRing, Quality, quality, rule_of
from radixfleet.server.metrics import Metrics
from radixfleet.wire.openapi import CANDIDATES_MAX, DECISIONS_MAX
from tests.router.fleet import PROMPT, fleet, until  # noqa: F401 (the fixture)

BT = 32  # router tokens per block at the default 128-byte blocks


def _key(text: str = PROMPT, tenant: str = "salt"):
    return request_key(Endpoint.COMPLETIONS, {"model": "m", "prompt": text}, tenant=tenant)


def _route(blocks: dict[str, int], chosen: str, explained=None) -> Route:
    """A route to ``chosen`` over workers holding ``blocks`` (one byte space)."""
    pk = _key()
    sk = SpaceKey(pk.hashes, pk.prompt_tokens, BT, False)
    req = RouteRequest(pk.hashes, pk.prompt_tokens, BT, model="m")
    kr = KeyedRequest.single("bytes", sk, req, MatchResult(blocks))
    pick = Placement(sk, blocks.get(chosen, 0), 0, 0, None)
    policy = build_policy("round_robin", None, random.Random(0))
    decision = policy.choose(req, kr.match, [WorkerView(chosen)], 0.0)

    class _W:
        id = chosen

    return Route(decision, _W(), kr, pick, None, explained)  # type: ignore[arg-type]


def test_quality_is_available_predicted_delivered_capped_at_the_prompt():
    # the prefix was elsewhere (a holds 6 blocks, the request went to b holding 2)
    r = _route({"a": 6, "b": 2}, "b")
    assert quality(r, r.placement, None) == Quality(6 * BT, 2 * BT, None)
    assert quality(r, r.placement, (1000, 50)) == Quality(6 * BT, 2 * BT, 50)
    # a reported prompt shorter than the router's estimate caps both
    assert quality(r, r.placement, (100, 50)) == Quality(100, 64, 50)
    # never less available than predicted (another key space's rounding)
    r = _route({"b": 3}, "b")
    assert quality(r, r.placement, None) == Quality(3 * BT, 3 * BT, None)
    assert quality(None, r.placement, None) == Quality(3 * BT, 3 * BT, None)


def test_counters_hold_the_three_numbers_over_the_same_answers():
    m = Metrics()
    m.answered("w", "m", True, (1000, 300), Quality(600, 400, 300))
    m.answered("w", "m", True, (500, 0), Quality(200, 0, 0))
    m.answered("w", "m", True, None, Quality(900, 900, None))  # no usage: not counted
    m.answered("w", "m", False, None)
    page = m.render().decode()

    def value(name: str) -> float:
        line = next(ln for ln in page.splitlines() if ln.startswith(name + '{model="m",worker="w"}'))
        return float(line.split()[-1])

    assert value("radixfleet_prompt_tokens_total") == 1500
    assert value("radixfleet_available_cached_tokens_total") == 800
    assert value("radixfleet_predicted_cached_tokens_total") == 400
    assert value("radixfleet_cached_tokens_total") == 300


def test_rules():
    assert rule_of("affinity") == "affinity"
    assert [rule_of(r) for r in ("spill_load", "miss", "balance", "least_load")] == ["load"] * 4
    assert rule_of("replica") == "replication"
    assert rule_of("affinity", saturated=True) == "saturation"
    assert rule_of("fallback", saturated=True) == "fallback"
    assert rule_of("round_robin") == rule_of("hash") == "placement"


def _record(ring: DecisionRing, i: int, **kw) -> None:
    r = _route({"a": 6, "b": 2}, "b")
    args = dict(
        arrival_s=1000.0 + i,
        request_id=f"r{i}",
        tenant="acme",
        session="alice@example.com",
        policy="round_robin",
        route=r,
        reason="round_robin",
        worker="b",
        quality=Quality(6 * BT, 2 * BT, 2 * BT),
        status=200,
    )
    args.update(kw)
    ring.record(_key(), **args)


def test_ring_is_bounded_newest_first_and_resizes():
    ring = DecisionRing(3)
    for i in range(5):
        _record(ring, i)
        ring.check()
    assert len(ring) == 3
    assert [d["request_id"] for d in ring.recent(10)] == ["r4", "r3", "r2"]
    assert [d["request_id"] for d in ring.recent(2)] == ["r4", "r3"]
    ring.resize(2)
    ring.check()
    assert [d["request_id"] for d in ring.recent(10)] == ["r4", "r3"]
    ring.resize(0)
    assert not ring.on and ring.recent(5) == []
    with pytest.raises(ValueError):
        DecisionRing(MAX_SIZE + 1)
    assert (DECISIONS_MAX, CANDIDATES_MAX) == (MAX_SIZE, MAX_CANDIDATES)  # the OpenAPI bounds
    assert parse_config({}).decisions.size == 256


def test_entries_carry_salted_keys_only():
    ring = DecisionRing(4)
    _record(ring, 0)
    _record(ring, 1, route=None, worker="", reason="overloaded", quality=None, status=429, shed=True)
    _record(ring, 2, route=None, worker="", reason="model_not_found", quality=None, status=404)
    ring.check()
    refused, shed, routed = ring.recent(3)
    text = json.dumps([refused, shed, routed])
    key = _key()
    assert "alice" not in text and "shared system prompt" not in text
    for h in key.hashes:  # no index hash, in any spelling
        assert str(h) not in text and f"{h:016x}" not in text
    assert routed["session"] == shed["session"] and len(routed["session"]) == 16
    assert routed["prefix"] == ring.digest(key.hashes[0].to_bytes(8, "little"))
    assert DecisionRing(4).digest(b"x") != ring.digest(b"x")  # a secret per ring
    assert routed["rule"] == "placement" and routed["worker"] == "b"
    assert (routed["available_tokens"], routed["predicted_tokens"], routed["cached_tokens"]) == (192, 64, 64)
    assert shed["rule"] == "shed" and shed["worker"] is None and shed["outcome"]["status"] == 429
    assert refused["rule"] == "refused" and refused["reason"] == "model_not_found"


def _views() -> list[WorkerView]:
    return [
        WorkerView("hold", in_flight=1, in_flight_tokens=100, prefill_tokens_per_s=10_000),
        WorkerView("idle", prefill_tokens_per_s=10_000),
        WorkerView("busy", in_flight=9, in_flight_tokens=90_000, prefill_tokens_per_s=10_000),
    ]


def test_prefix_load_explains_its_scores_from_what_it_computed():
    """The holder wins on its match: it comes first with the lowest score and the
    match it was credited; the others follow by score; the figures are the policy's
    own (its expected TTFT of the chosen worker is the Decision's)."""
    pk = _key(PROMPT * 8)
    req = RouteRequest(pk.hashes, pk.prompt_tokens, BT, model="m")
    match = MatchResult({"hold": len(pk.hashes)}, depth=len(pk.hashes))
    policy = build_policy("prefix_load", None, random.Random(0))
    views = _views()
    d = policy.choose(req, match, views, 1.0)
    assert d.worker == "hold" and d.reason.value == "affinity"
    ex = policy.explain(req, match, views, d)
    assert ex.eligible == 3 and not ex.saturated
    cands = ex.candidates(8)
    assert [c.worker for c in cands] == ["hold", "idle", "busy"]
    hold, idle, busy = cands
    assert hold.matched_tokens == hold.counted_tokens == len(pk.hashes) * BT
    assert hold.expected_ttft_s == pytest.approx(d.expected_ttft_s)
    assert hold.score < idle.score < busy.score
    assert idle.matched_tokens == 0 and idle.queue_s == 0.0
    assert busy.queue_s == pytest.approx(9.0)
    assert [c.worker for c in ex.candidates(1)] == ["hold"]
    # views it did not choose over (another chooser): their match and load, no score
    other = _views()
    ex = policy.explain(req, match, other, d)
    assert all(c.score is None and c.counted_tokens is None for c in ex.candidates(8))
    assert [c.worker for c in ex.candidates(8)] == ["hold", "idle", "busy"]


def test_the_route_core_explains_only_when_asked():
    from radixfleet.server.app import Router

    for size in (0, 16):
        router = Router(parse_config({"decisions": {"size": size}, "workers": ["http://127.0.0.1:9"]}))
        dp = router.dataplane
        for w in router.pool:
            w.health = type(w.health).HEALTHY
        router.pool._routable = None
        pk = _key()
        body = {"model": "m", "prompt": PROMPT}
        v = dp.route.decide(dp.ask_of(Endpoint.COMPLETIONS, body, pk, None, "", "", {}), time.monotonic())
        assert isinstance(v, Route), v
        assert (v.explained is None) == (size == 0)
        if size:
            assert [c.worker for c in v.explained.candidates(4)] == [v.worker.id]
        router.dataplane.configure(
            parse_config({"decisions": {"size": 16 - size}}), router.policy, router.tenants
        )
        assert dp.route.parts.explain == (size == 0)


ADMIN = {"Authorization": "Bearer adm"}


@pytest.mark.integration
async def test_admin_decisions_explain_a_live_fleet(fleet, monkeypatch, tmp_path):  # noqa: F811
    """Two agents behind prefix_load: a first request misses (load), the next with
    the same prefix goes to its holder (affinity); an unknown model is refused before it. The
    endpoint shows each, newest first, with the candidates' scores and the three
    numbers, behind the admin token, with salted keys only; the answers' match
    headers and the traffic log carry the same numbers."""
    monkeypatch.setenv("RADIXFLEET_ADMIN_TOKEN", "adm")
    await fleet.start(
        {
            "policy": {"name": "prefix_load"},
            "decisions": {"size": 8},
            "response_headers": {"match_tokens": True},
            "traffic_log": {"enabled": True, "dir": str(tmp_path), "flush_interval_s": 0.05},
        }
    )
    for wid in ("a0", "a1"):
        await fleet.agent("m", worker_id=wid)
    await fleet.routable(2)
    fleet.past_grace()
    base = fleet.base
    async with httpx.AsyncClient(timeout=10) as c:
        heads = []
        for i in range(2):
            body = {"model": "m", "prompt": PROMPT + f" question {i}", "max_tokens": 2, "user": "alice"}
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            heads.append(r)
        r = await c.post(base + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404

        assert (await c.get(fleet.admin + "/admin/decisions")).status_code == 401
        for bad in ("n=0", "n=x", "n=1&n=2", f"n={MAX_SIZE + 1}", "candidates=0", "m=1"):
            r = await c.get(fleet.admin + "/admin/decisions?" + bad, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad
        r = await c.get(fleet.admin + "/admin/decisions?n=3", headers=ADMIN)
        assert r.status_code == 200, r.text
        out = r.json()
        page = (await c.get(fleet.admin + "/metrics")).text
    assert "question" not in r.text and "alice" not in r.text and "shared system prompt" not in r.text
    # an unserved model is refused from its bytes, before the route core (radixfleet.server.screen):
    # no decision is kept for it
    assert out["size"] == 8 and out["kept"] == 2
    second, first = out["decisions"]
    assert first["rule"] == "load" and first["reason"] == "miss" and first["available_tokens"] == 0
    holder = first["worker"]
    assert second["rule"] == "affinity" and second["worker"] == holder
    assert second["session"] == first["session"] and second["prefix"] == first["prefix"]
    assert second["eligible"] == 2 and [x["worker"] for x in second["candidates"]][0] == holder
    best, other = second["candidates"]
    assert best["matched_tokens"] == best["counted_tokens"] > 0 and other["matched_tokens"] == 0
    assert best["score"] < other["score"] and best["expected_ttft_s"] is not None
    assert second["available_tokens"] == second["predicted_tokens"] == best["matched_tokens"]
    assert second["cached_tokens"] >= second["predicted_tokens"]  # the agent matches tokens, not blocks
    assert second["outcome"] == {"status": 200, "ttft_ms": None, "broken": False}
    h = heads[1].headers
    assert int(h["x-radixfleet-available-tokens"]) == int(h["x-radixfleet-predicted-tokens"]) > 0
    assert heads[0].headers["x-radixfleet-available-tokens"] == "0"
    assert "radixfleet_available_cached_tokens_total" in page

    def log_lines():
        return [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]

    await until(lambda: len(log_lines()) >= 2, what="the traffic log's lines")
    served = sorted((x for x in log_lines() if x["status"] == 200), key=lambda x: x["timestamp"])
    assert [x["available_tokens"] for x in served] == [0, second["available_tokens"]]
    assert served[1]["matched_tokens"] == second["predicted_tokens"]
