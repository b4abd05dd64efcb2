"""What router replicas share beyond the index: a pick's session key and prompt size
with its hint (radixfleet.wire.bus_wire ``turns``), and the rate-limit consumption of each
replica (``limits`` messages, radixfleet.route.tenancy ``drain`` / ``debit``).

Unit tests, no server: the replicas against a real nats-server are in
tests/bus/test_bus.py (``test_a_tenants_limit_holds_for_the_fleet_on_a_bus``).
"""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from radixfleet.bus.replica import BusReplica
from radixfleet.common.tenancy import TenantSalts
from radixfleet.config import parse_config
from radixfleet.fleet.pool import Pool
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.policies.base import RouteRequest
from radixfleet.policies.prefix_load import PrefixLoad
from radixfleet.route.tenancy import Tenancy, TenancyConfig
from radixfleet.server.app import Router
from radixfleet.wire.bus_wire import (
    MAX_LIMIT_ENTRIES,
    BadMessage,
    BusKey,
    RouterMessage,
    Sequences,
    build_limits,
    parse_limits,
    parse_router,
    session_key,
)
from radixfleet.wire.errors import RateLimited
from tests.bus.client import metric

pytestmark = pytest.mark.usefixtures("bus_salt")

TOKEN = b"agent-secret"
DIGEST = session_key(b"secret", "alice@example.com")


def router_msg(**fields) -> bytes:
    return json.dumps(
        {"v": 1, "kind": "router", "replica": "r1", "seq": 1, "block_bytes": 128, **fields}
    ).encode()


def limits_msg(replica: str, epoch: int, seq: int, used: list) -> bytes:
    """A limits message as the wire spells it (radixfleet.wire.bus_wire docstring)."""
    return json.dumps(
        {"v": 1, "kind": "limits", "replica": replica, "epoch": epoch, "seq": seq, "used": used}
    ).encode()


def cause(fn, *args) -> str:
    with pytest.raises(BadMessage) as e:
        fn(*args)
    return e.value.cause


# ------------------------------------------------------------------ sessions


def test_a_session_key_is_a_salted_digest_alike_on_every_replica():
    a, b = TenantSalts(b"deployment"), TenantSalts(b"deployment")
    k = a.session_key("alice@example.com")
    assert k == b.session_key("alice@example.com") and len(k) == 32
    assert "alice" not in k and k != TenantSalts(b"another").session_key("alice@example.com")
    assert a.session_key("x" * 100_000) != k and len(a.session_key("x" * 100_000)) == 32


@pytest.mark.parametrize(
    "turns",
    [
        [["alice@example.com", 10]],  # the client's id itself: never on the wire
        [["A" * 32, 10]],
        [[DIGEST + "0", 10]],
        [[DIGEST, -1]],
        [[DIGEST, 10**400]],
        [[DIGEST, 1.5]],
        [[DIGEST]],
        [[DIGEST, 10], [None, 10]],  # more turns than hints
    ],
)
def test_turns_out_of_bounds_are_refused(turns):
    assert cause(parse_router, router_msg(hints=[["w1", 0.1, [1]]], turns=turns)) == "bad_router"


def test_turns_travel_with_their_hints_and_a_message_without_them_still_parses():
    m = parse_router(
        RouterMessage(
            "r1", 1, 128, False, {}, [("w1", 0.1, [1]), ("w2", 0.2, [2])], turns=[(DIGEST, 40), (None, 7)]
        ).to_bytes()
    )
    assert m.turn(0) == (DIGEST, 40) and m.turn(1) == (None, 7)
    old = parse_router(router_msg(hints=[["w1", 0.1, [1]]]))  # a peer that predates turns
    assert old.turn(0) == (None, None)


def _replica(now: float, pol: PrefixLoad) -> tuple[Pool, BusReplica]:
    cfg = parse_config({"bus": {"url": "nats://127.0.0.1:1", "replica_id": "me"}})
    index = PrefixIndex()
    pool = Pool(cfg, index, clock=lambda: now)
    for i in (1, 2):
        pool.register(f"w{i}", f"http://127.0.0.1:{i}", "e")
    rep = BusReplica(
        cfg.bus,
        pool=pool,
        index=index,
        feedback=None,
        block_bytes=128,
        registry=CollectorRegistry(),
        clock=lambda: now,
        policy=lambda: pol,
    )
    return pool, rep


async def test_a_peers_session_turn_continues_the_session_here():
    """A peer routed turn 1 of a session; this replica's policy finds that session
    by its key for turn 2 — whose prompt shares nothing with turn 1's — as one
    router that routed both would, and counts it live on its home."""
    now = 100.0
    pol = PrefixLoad(None, random.Random(0))
    pool, rep = _replica(now, pol)
    first = list(range(1, 11))
    msg = RouterMessage("peer", 1, 128, False, {}, [("w1", 2.0, first)], turns=[(DIGEST, 10 * 32 + 5)])
    await rep._on_router(SimpleNamespace(data=msg.to_bytes(), subject="radixfleet.router.peer", headers=None))
    second = RouteRequest(list(range(500, 520)), 20 * 32, 32, DIGEST)
    branch = pol.footprints.find(second)
    assert branch is not None and branch.home == "w1" and branch.size == 10 * 32 + 5
    pol.footprints.record(second, pol_match(rep, second, now), branch, "w2", now)
    assert pol.footprints.tokens("w2") == 20 * 32  # live from its second turn, at its new home
    pol.check()
    rep.check()


def pol_match(rep: BusReplica, req: RouteRequest, now: float):
    return rep.index.match(req.hashes, now, count=False)


def test_a_hint_queues_its_session_key_and_prompt_tokens():
    pol = PrefixLoad(None, random.Random(0))
    _, rep = _replica(1.0, pol)
    rep.conn.state = type(rep.conn.state).UP
    rep.hint("w1", [1, 2], 1.0, DIGEST, 70)
    rep.hint("w2", [3], 1.0)
    assert [(w, s, p) for w, _, _, s, p in rep._hints] == [("w1", DIGEST, 70), ("w2", None, 32)]


# --------------------------------------------------------------- rate limits


def tenancy(rps: float = 10.0, burst: int = 10, tpm: float = 0.0) -> Tenancy:
    cfg = TenancyConfig(
        tenants={"acme": {"requests_per_s": rps, "request_burst": burst, "tokens_per_min": tpm}},
    )
    return Tenancy(cfg, [], Router(parse_config({})).metrics, 0.0)


def admitted(t: Tenancy, n: int, now: float, tokens: int = 0) -> int:
    ok = 0
    for _ in range(n):
        try:
            t.admit("acme", "", "m", {}, tokens, {}, now)
            ok += 1
        except RateLimited:
            pass
    return ok


def test_drain_reports_net_consumption_once_and_debit_charges_the_peers_copy():
    a, b = tenancy(tpm=6000.0), tenancy(tpm=6000.0)
    ticket = a.admit("acme", "", "m", {}, 100, {"max_tokens": 50}, 0.0)
    a.admit("acme", "", "m", {}, 10, {}, 0.0)
    a.settle(ticket, 120, 0.0)  # 150 reserved, 120 used
    assert a.drain() == [("tenant", "acme", 2, 130.0)]
    assert a.drain() == []  # reported once
    shed = a.admit("acme", "", "m", {}, 5, {}, 0.0)
    a.shed(shed, 0.0)
    assert a.drain() == []  # given back whole: nothing to tell
    for kind, name, r, tok in [("tenant", "acme", 2, 130.0)]:
        assert b.debit(kind, name, r, tok, 0.0)
    lim = b._tenants["acme"][1]
    assert lim.requests.level == 8 and lim.tokens.level == 6000 - 130
    assert b.drain() == []  # a peer's consumption is not reported again (no echo)
    assert not b.debit("tenant", "nobody", 1, 1, 0.0) and not b.debit("key", "acme", 1, 1, 0.0)
    # a refund reported by a peer gives back, never past the burst
    b.debit("tenant", "acme", -5, -1000.0, 0.0)
    assert lim.requests.level == 10 and lim.tokens.level == 6000
    lim.requests.check()


def test_two_replicas_that_debit_each_other_admit_one_limit():
    """10 req/s, burst 10; each of two replicas is offered 20 req/s for 10 s (the fleet
    2x its limit) and they exchange consumption every 0.2 s: the fleet admits the
    limit's 100 plus the burst plus at most one interval's worth per replica, not the
    ~220 two separate limits admit."""
    for share, lo, hi in ((True, 100, 114), (False, 200, 230)):
        a, b = tenancy(), tenancy()
        total, t, step = 0, 0.0, 0.05
        next_flush = 0.2
        while t < 10.0:
            total += admitted(a, 1, t) + admitted(b, 1, t)
            t = round(t + step, 6)
            if t >= next_flush:
                next_flush += 0.2
                ua, ub = a.drain(), b.drain()
                if share:
                    for kind, name, r, tok in ua:
                        b.debit(kind, name, r, tok, t)
                    for kind, name, r, tok in ub:
                        a.debit(kind, name, r, tok, t)
        assert lo <= total <= hi, (share, total)


@pytest.mark.parametrize(
    "used, why",
    [
        ([["tenant", "acme", 10**400, 0]], "bad_limits"),
        ([["tenant", "acme", 2.0**60, 0]], "bad_limits"),
        ([["tenant", "acme", 1, True]], "bad_limits"),
        ([["user", "acme", 1, 0]], "bad_limits"),
        ([["tenant", None, 1, 0]], "bad_limits"),
        ([["tenant", "x" * 257, 1, 0]], "bad_limits"),
        ([["tenant", "acme", 1]], "bad_limits"),
        ([["tenant", "acme", 1, 0]] * (MAX_LIMIT_ENTRIES + 1), "bad_limits"),
        ({"acme": 1}, "bad_limits"),
    ],
)
def test_limits_messages_out_of_bounds_are_refused(used, why):
    data = limits_msg("r1", 1, 1, used)
    assert cause(parse_limits, data, "r1") == why


@pytest.mark.parametrize(
    "numbers, why",
    [
        ({}, "unsequenced"),  # a sender that predates sequenced limits
        ({"epoch": 1}, "unsequenced"),
        ({"seq": 1}, "unsequenced"),
        ({"epoch": 1, "seq": 0}, "bad_limits"),
        ({"epoch": -1, "seq": 1}, "bad_limits"),
        ({"epoch": 1, "seq": 2**63}, "bad_limits"),
        ({"epoch": 1.0, "seq": 1}, "bad_limits"),
        ({"epoch": 1, "seq": True}, "bad_limits"),
        ({"epoch": "1", "seq": 1}, "bad_limits"),
    ],
)
def test_limits_messages_carry_an_epoch_and_a_sequence(numbers, why):
    data = json.dumps({"v": 1, "kind": "limits", "replica": "r1", "used": [], **numbers}).encode()
    assert cause(parse_limits, data, "r1") == why


def test_limits_messages_are_split_and_name_their_own_subject():
    used = [("tenant", f"t{i}", 1, 2.5) for i in range(MAX_LIMIT_ENTRIES + 3)]
    msgs = build_limits("r1", 1700, 5, used)
    assert len(msgs) == 2
    parsed = [parse_limits(m, "r1") for m in msgs]
    assert [(m.replica, m.epoch, m.seq) for m in parsed] == [("r1", 1700, 5), ("r1", 1700, 6)]
    back = [e for m in parsed for e in m.used]
    assert back == [(k, n, 1.0, 2.5) for k, n, _, _ in used]
    assert cause(parse_limits, msgs[0], "r2") == "wrong_subject"
    # the default tenant ("": no identity) has a name on the wire too
    assert parse_limits(build_limits("r1", 1, 1, [("tenant", "", 1, 0.0)])[0], "r1").used == [
        ("tenant", "", 1.0, 0.0)
    ]
    assert cause(parse_limits, b'{"v": 1, "kind": "router"}', "r1") == "wrong_kind"


def test_a_replica_charges_signed_peers_consumption_and_drops_the_rest():
    r = Router(
        parse_config(
            {
                "bus": {"url": "nats://127.0.0.1:4222", "replica_id": "me"},
                "tenancy": {"tenants": {"acme": {"requests_per_s": 10, "request_burst": 10}}},
            }
        )
    )
    b = BusReplica(
        r.cfg.bus,
        pool=r.pool,
        index=r.index,
        feedback=r.feedback,
        block_bytes=r.cfg.keys.block_bytes,
        registry=r.metrics.registry,
        agent_token=TOKEN,
        tenancy=lambda: r.dataplane.tenancy,
    )
    lim = r.dataplane.tenancy._tenants["acme"][1]

    def bad(cause: str) -> float:
        v = r.metrics.registry.get_sample_value("radixfleet_bus_bad_messages_total", {"cause": cause})
        return v or 0.0

    def deliver(subject: str, data: bytes, headers) -> None:
        asyncio.run(b._on_limits(SimpleNamespace(subject=subject, data=data, headers=headers)))

    subject = b.subjects.limits("peer")
    [data] = build_limits("peer", 1, 1, [("tenant", "acme", 4, 0.0)])
    deliver(subject, data, None)
    deliver(subject, data, BusKey(b"guess").sign(subject, data))
    oversized = limits_msg("peer", 1, 2, [["tenant", "acme", 1, 0]] * 2000)
    deliver(subject, oversized, b.key.sign(subject, oversized))
    deliver(b.subjects.limits("other"), data, b.key.sign(b.subjects.limits("other"), data))
    assert (bad("unsigned"), bad("bad_signature"), bad("bad_limits"), bad("wrong_subject")) == (1, 1, 1, 1)
    assert lim.requests.level == 10  # nothing charged
    deliver(subject, data, b.key.sign(subject, data))
    assert lim.requests.level <= 6 + 1e-6  # charged (plus what refilled since)
    mine = b.subjects.limits("me")
    [own] = build_limits("me", 1, 1, [("tenant", "acme", 4, 0.0)])
    level = lim.requests.level
    deliver(mine, own, b.key.sign(mine, own))  # our own message, back from the server
    assert lim.requests.level >= level


def test_a_replayed_limits_message_is_charged_once():
    """A peer's signed limits message published again 300 times (within max_skew_s:
    each one verifies) is charged once; the peer's next message counts, and so does
    its first after a restart (a later epoch), while its old epoch's replays do not.
    Without sequences every copy was charged: 4 x 300 requests of debt, a tenant
    limited to 10/s locked out here for two minutes."""
    now = [0.0]  # before the buckets were made: nothing refills (exact levels)
    r = Router(
        parse_config(
            {
                "bus": {"url": "nats://127.0.0.1:4222", "replica_id": "me"},
                "tenancy": {"tenants": {"acme": {"requests_per_s": 10, "request_burst": 100}}},
            }
        )
    )
    b = BusReplica(
        r.cfg.bus,
        pool=r.pool,
        index=r.index,
        feedback=r.feedback,
        block_bytes=r.cfg.keys.block_bytes,
        registry=r.metrics.registry,
        agent_token=TOKEN,
        tenancy=lambda: r.dataplane.tenancy,
        clock=lambda: now[0],
    )
    lim = r.dataplane.tenancy._tenants["acme"][1].requests
    subject = b.subjects.limits("peer")

    def deliver(epoch: int, seq: int, requests: int, times: int = 1) -> None:
        data = limits_msg("peer", epoch, seq, [["tenant", "acme", requests, 0]])
        headers = b.key.sign(subject, data)
        for _ in range(times):
            asyncio.run(b._on_limits(SimpleNamespace(subject=subject, data=data, headers=headers)))

    def replayed() -> float:
        return metric(r, "radixfleet_bus_bad_messages_total", cause="replayed")

    deliver(1000, 1, 4, times=301)
    assert lim.level == 96 and replayed() == 300
    deliver(1000, 2, 3)
    deliver(1000, 1, 4)  # late: older than the last applied
    assert lim.level == 93 and replayed() == 301
    deliver(2000, 1, 5)  # the peer restarted: a new epoch, its sequence from 1
    deliver(1000, 3, 7, times=3)  # what the old process sent, replayed after the restart
    deliver(2000, 1, 5, times=3)
    assert lim.level == 88 and replayed() == 307
    assert metric(r, "radixfleet_bus_messages_received_total", kind="limits") == 3


def test_sequences_forget_whom_a_replay_could_no_longer_fool_and_stay_bounded():
    seq = Sequences(forget_s=70.0, max_senders=3)
    assert seq.accept("a", 5, 1, 0.0) and not seq.accept("a", 5, 1, 0.0)
    assert seq.accept("a", 5, 2, 1.0) and not seq.accept("a", 4, 99, 1.0)  # an older epoch
    assert seq.accept("b", 1, 1, 2.0) and seq.accept("c", 1, 1, 3.0)
    seq.check()
    # a fourth sender: the one heard longest ago ("a") is forgotten
    assert seq.accept("d", 1, 1, 4.0) and len(seq) == 3
    seq.check()
    assert seq.accept("a", 5, 1, 5.0)  # unknown again ("b" made room)
    # silent past forget_s: forgotten, so a peer restarted with its clock set back
    # (a lower epoch) counts again; whoever spoke within forget_s is kept
    assert seq.accept("b", 1, 2, 60.0)
    assert seq.accept("a", 4, 1, 76.0) and not seq.accept("b", 1, 2, 76.0)
    assert len(seq) == 2  # "c" and "d" forgotten
    seq.check()
    # seeded stress: the invariants after every call, and never a replay accepted
    rnd = random.Random(7)
    seq = Sequences(forget_s=5.0, max_senders=8)
    applied: dict[str, tuple[int, int, float]] = {}
    t = 0.0
    for _ in range(5000):
        t += rnd.random() * 0.1
        sender = f"r{rnd.randrange(12)}"
        epoch, n = rnd.randrange(3), rnd.randrange(1, 20)
        ok = seq.accept(sender, epoch, n, t)
        last = applied.get(sender)
        if ok:
            applied[sender] = (epoch, n, t)
        else:
            assert last is not None and (epoch, n) <= last[:2] and t - last[2] <= 5.0
        seq.check()
