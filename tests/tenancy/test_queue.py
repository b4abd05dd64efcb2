"""The fair-share admission queue (radixfleet.route.admission_queue): off by default (the
shedder's 429 at once); turned on, a refused request waits and is let in by class
first, then by weighted virtual token counters across tenants (a tenant over its
share waits before one under it; idle time banks no credit); past max_wait it gets
the 429 its last check gave; a full queue refuses at once; a client gone while it
waits leaves the queue, counted, with nothing left behind (``check()``); bad
settings are refused with their paths."""

from __future__ import annotations

import asyncio
import time

import pytest

from radixfleet.config import parse_config
from radixfleet.route.admission_queue import AdmissionQueue, AdmissionQueueConfig
from radixfleet.server.metrics import Metrics
from radixfleet.wire.errors import ConfigError, Overloaded

CRITICAL, STANDARD, SHEDDABLE = 0, 1, 2


class Room:
    """The shedder's verdicts: ``free`` requests may still go to a worker."""

    def __init__(self) -> None:
        self.free = 0
        self.order: list[str] = []
        self.checks = 0

    def probe(self, name: str):
        def check(now: float) -> Overloaded | None:
            self.checks += 1
            if self.free > 0:
                self.free -= 1
                self.order.append(name)
                return None
            return Overloaded("every worker is saturated", retry_after_s=2.5)

        return check


def queue(max_wait_s: float = 30.0, max_length: int = 1000, weights=None) -> AdmissionQueue:
    cfg = AdmissionQueueConfig(max_wait_s=max_wait_s, max_length=max_length, weights=weights or {})
    return AdmissionQueue(cfg, Metrics())


def waits(q: AdmissionQueue, priority: str, outcome: str) -> float:
    return q.metrics.registry.get_sample_value(
        "radixfleet_admission_queue_wait_seconds_count", {"priority": priority, "outcome": outcome}
    )


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def start(q: AdmissionQueue, room: Room, name: str, tenant: str, rank: int, cost: int = 100):
    return asyncio.ensure_future(q.admit(tenant, rank, cost, room.probe(name), time.monotonic()))


async def release_one_by_one(q: AdmissionQueue, room: Room, n: int) -> None:
    for _ in range(n):
        room.free = 1
        q.kick(time.monotonic())
        q.check()
        await settle()


def test_off_by_default_the_shedders_429_comes_at_once():
    assert parse_config({}).tenancy.queue.max_wait_s == 0.0
    q = AdmissionQueue(parse_config({}).tenancy.queue, Metrics())
    room = Room()
    refusal, waited = asyncio.run(q.admit("a", STANDARD, 100, room.probe("r"), 0.0))
    assert isinstance(refusal, Overloaded) and refusal.retry_after_s == 2.5 and not waited
    assert q.waiting == 0
    q.check()


def test_with_room_a_request_goes_at_once_without_waiting():
    async def main():
        q, room = queue(), Room()
        room.free = 1
        assert await q.admit("a", SHEDDABLE, 100, room.probe("r"), 0.0) == (None, False)
        assert q.waiting == 0
        q.check()

    asyncio.run(main())


def test_waiters_are_let_in_by_class_first():
    async def main():
        q, room = queue(), Room()
        tasks = [
            start(q, room, "shed-1", "a", SHEDDABLE),
            start(q, room, "std-1", "a", STANDARD),
            start(q, room, "shed-2", "b", SHEDDABLE),
            start(q, room, "crit-1", "c", CRITICAL),
            start(q, room, "std-2", "b", STANDARD),
        ]
        await settle()
        assert q.waiting == 5
        q.check()
        await release_one_by_one(q, room, 5)
        assert room.order == ["crit-1", "std-1", "std-2", "shed-1", "shed-2"]
        assert [t.result() for t in tasks] == [(None, True)] * 5
        assert q.waiting == 0
        assert waits(q, "standard", "admitted") == 2
        q.check()

    asyncio.run(main())


def test_a_tenant_over_its_share_waits_before_one_under_it():
    async def main():
        q, room = queue(), Room()
        heavy = [start(q, room, f"a{i}", "a", STANDARD) for i in range(10)]
        await settle()
        light = [start(q, room, f"b{i}", "b", STANDARD) for i in range(2)]
        await settle()
        await release_one_by_one(q, room, 4)
        # equal weights, equal costs: they alternate although a's ten came first
        assert room.order == ["a0", "b0", "a1", "b1"]
        await release_one_by_one(q, room, 8)
        assert all(t.done() for t in heavy + light)
        q.check()

    asyncio.run(main())


def test_tokens_not_requests_are_shared():
    async def main():
        q, room = queue(), Room()
        for i in range(6):
            start(q, room, f"big{i}", "a", STANDARD, cost=3000)
            start(q, room, f"small{i}", "b", STANDARD, cost=1000)
        await settle()
        await release_one_by_one(q, room, 8)
        # a's one 3,000-token request is worth three of b's 1,000-token ones
        assert room.order.count("big0") + room.order.count("big1") == 2
        assert sum(n.startswith("small") for n in room.order) == 6
        await release_one_by_one(q, room, 4)
        q.check()

    asyncio.run(main())


def test_weights_divide_the_share():
    async def main():
        q, room = queue(weights={"gold": 3.0}), Room()
        for i in range(12):
            start(q, room, f"gold{i}", "gold", STANDARD)
            start(q, room, f"free{i}", "free", STANDARD)
        await settle()
        await release_one_by_one(q, room, 12)
        gold = sum(n.startswith("gold") for n in room.order)
        assert gold == 9, room.order  # 3 : 1
        await release_one_by_one(q, room, 12)
        q.check()

    asyncio.run(main())


def test_idle_time_banks_no_credit():
    async def main():
        q, room = queue(), Room()
        for i in range(8):
            start(q, room, f"a{i}", "a", STANDARD)
        await settle()
        await release_one_by_one(q, room, 4)  # a alone: its counter runs ahead
        for i in range(4):
            start(q, room, f"b{i}", "b", STANDARD)
        await settle()
        await release_one_by_one(q, room, 4)
        # b starts at a's counter, not at 0: they alternate, b does not take all four
        assert room.order[4:] == ["b0", "a4", "b1", "a5"] or room.order[4:] == ["a4", "b0", "a5", "b1"]
        await release_one_by_one(q, room, 4)
        q.check()

    asyncio.run(main())


def test_past_max_wait_a_request_gets_its_429():
    async def main():
        q, room = queue(max_wait_s=0.1), Room()
        t0 = asyncio.get_running_loop().time()
        refusal, waited = await q.admit("a", SHEDDABLE, 100, room.probe("r"), time.monotonic())
        assert waited and isinstance(refusal, Overloaded) and refusal.retry_after_s == 2.5
        assert 0.1 <= asyncio.get_running_loop().time() - t0 < 5.0  # the backstop timer expired it
        assert room.checks >= 2  # checked again while it waited
        assert q.waiting == 0 and waits(q, "sheddable", "expired") == 1
        q.check()

    asyncio.run(main())


def test_a_full_queue_refuses_at_once():
    async def main():
        q, room = queue(max_length=2), Room()
        waiting = [start(q, room, f"r{i}", "a", STANDARD) for i in range(2)]
        await settle()
        refusal, waited = await q.admit("b", CRITICAL, 100, room.probe("late"), 0.0)
        assert isinstance(refusal, Overloaded) and not waited
        assert q.waiting == 2
        for t in waiting:
            t.cancel()
        await settle()
        q.check()

    asyncio.run(main())


def test_a_client_gone_while_waiting_leaves_the_queue():
    async def main():
        q, room = queue(), Room()
        tasks = [start(q, room, f"r{i}", f"t{i % 3}", i % 3) for i in range(30)]
        await settle()
        assert q.waiting == 30
        for t in tasks[::2]:
            t.cancel()
        await settle()
        q.check()
        assert q.waiting == 15
        assert sum(waits(q, c, "left") for c in ("critical", "standard", "sheddable")) == 15
        for t in tasks[1::2]:
            t.cancel()
        await settle()
        assert q.waiting == 0
        q.check()
        # nothing is left behind: no counters, no arrivals, no timer, gauges at 0
        assert not q._vtc and not q._arrivals and q._timer is None
        assert all(
            q.metrics.registry.get_sample_value("radixfleet_admission_queued", {"priority": c}) == 0
            for c in ("critical", "standard", "sheddable")
        )

    asyncio.run(main())


@pytest.mark.parametrize(
    "raw, path, says",
    [
        ({"weights": {"a": 0}}, "tenancy.queue.weights.a", "greater than 0"),
        ({"weights": {"a": -1.5}}, "tenancy.queue.weights.a", "greater than 0"),
        ({"weights": {"a": "x"}}, "tenancy.queue.weights.a", ""),
        ({"max_wait_s": -1}, "tenancy.queue.max_wait_s", "in [0, 600]"),
        ({"max_length": 0}, "tenancy.queue.max_length", "in [1, 1000000]"),
        ({"max_lenght": 10}, "tenancy.queue.max_lenght", "unknown key"),
    ],
)
def test_bad_queue_settings_are_refused_with_their_path(raw, path, says):
    with pytest.raises(ConfigError) as ei:
        parse_config({"tenancy": {"queue": raw}})
    assert [e.path for e in ei.value.errors] == [path], str(ei.value)
    assert says in str(ei.value)


def test_the_next_is_let_in_only_once_the_last_is_counted_on_its_worker():
    """A request let in takes its room when its task runs (the pick); the queue must
    not probe the next head before that, or it lets in everyone at once."""

    async def main():
        q = queue()
        in_flight, capacity = [0], [0]

        def probe(now: float) -> Overloaded | None:
            return None if in_flight[0] < capacity[0] else Overloaded("saturated", retry_after_s=1.0)

        async def request():
            refusal, _ = await q.admit("a", STANDARD, 100, probe, time.monotonic())
            if refusal is None:
                in_flight[0] += 1  # the pick: no await between admission and it
            return refusal

        tasks = [asyncio.ensure_future(request()) for _ in range(6)]
        await settle()
        assert q.waiting == 6
        capacity[0] = 2
        q.kick(time.monotonic())
        await settle()
        assert in_flight[0] == 2 and q.waiting == 4
        q.check()
        for t in tasks:
            t.cancel()
        await settle()
        q.check()

    asyncio.run(main())


def test_waiters_behind_a_refused_head_expire_with_the_fleets_429():
    async def main():
        q, room = queue(max_wait_s=0.1), Room()
        tasks = [start(q, room, f"r{i}", f"t{i}", STANDARD) for i in range(3)]
        results = await asyncio.gather(*tasks)
        assert [(type(r), r.retry_after_s, waited) for r, waited in results] == [(Overloaded, 2.5, True)] * 3
        assert room.order == [] and q.waiting == 0
        assert waits(q, "standard", "expired") == 3
        q.check()

    asyncio.run(main())
