"""Router replicas decide as one router, request by request, when their bus is instant.

The simulator runs the demo's mixed workload (the size ``radixfleet bench
replicas`` runs: 4 workers x 12k KV tokens, 12 requests/s, 498 requests — enough to
put the caches under pressure) twice through the live ``router.pick`` path: once
with one prefix_load, once with four prefix_load instances taking the requests in
turn over one index and pool — an instant bus, so that whatever differs is state
each replica keeps for itself. After each decision the other instances get what
``router.bus`` gives a replica of its peers' picks: ``observe_route`` (the hint's
request and this replica's match for it) and the hot-root records
(``HotRoots.apply_remote``). The instances share one random generator, drawn in
the same order as one router's, so chance cannot hide a difference: every decision
must be one router's (worker and matched blocks).

A replica that recorded only its own picks in its session footprints judged
"crowded" on its share of every session's turns and routed the fleet to a lower hit
rate (0.80 -> 0.73 on this workload); this is the check that state of that kind
travels.
"""

from __future__ import annotations

import argparse

import pytest

import loadtest.simulator.simulation as fleet
from loadtest.simulator import cli as simulate_main
from policies.prefix_load import PrefixLoad


class _Replicas(PrefixLoad):
    """``n`` prefix_load replicas behind one name; each request to the next in turn."""

    def __init__(self, n: int, rng) -> None:
        super().__init__(None, rng)
        self.replicas = [PrefixLoad(None, rng) for _ in range(n)]
        self.turn = 0
        self.now = 0.0
        self.decisions: list[tuple[str, int]] = []
        for r in self.replicas:
            r.hot.listener = self._relay(r)

    def _relay(self, source: PrefixLoad):
        def listener(op: str, key: int, depth: int, worker: str) -> None:
            for r in self.replicas:
                if r is not source:
                    r.hot.apply_remote(op, key, depth, worker, self.now)

        return listener

    def choose(self, request, match, views, now):
        self.now = now
        picker = self.replicas[self.turn % len(self.replicas)]
        self.turn += 1
        d = picker.choose(request, match, views, now)
        for r in self.replicas:
            if r is not picker:
                r.observe_route(request, match, d.worker, now)
        self.decisions.append((d.worker, d.matched_blocks))
        return d


def _run(monkeypatch, n: int) -> tuple[dict, list]:
    made: list[_Replicas] = []

    def build(name, params, rng, path=None):
        made.append(_Replicas(n, rng))
        return made[-1]

    monkeypatch.setattr(fleet, "build_policy", build)
    p = argparse.ArgumentParser()
    simulate_main.configure(p)
    args = p.parse_args(
        [
            "--workload",
            "mixed",
            "--workers",
            "4",
            "--kv-tokens",
            "12000",
            "--rate",
            "12",
            "--requests",
            "600",
            "--duration",
            "60",
            "--policies",
            "prefix_load",
        ]
    )
    plans, workload, bounds, params = simulate_main.build(args)
    out = simulate_main.simulate(plans, workload, bounds, params, seed=args.seed)[0]
    return out.report, made[0].decisions


@pytest.mark.parametrize("n", [4, 8])
def test_replicas_with_an_instant_bus_make_one_routers_decisions(monkeypatch, n):
    one, one_decisions = _run(monkeypatch, 1)
    many, decisions = _run(monkeypatch, n)
    assert one["requests"] >= 450 and one["hit_rate"] > 0.7, one["hit_rate"]
    diverged = [i for i, (a, b) in enumerate(zip(decisions, one_decisions)) if a != b]
    assert len(decisions) == len(one_decisions) and not diverged, (
        f"{len(diverged)} decisions differ, first at request {diverged[:1]}: "
        f"hit {many['hit_rate']:.3f} vs one router's {one['hit_rate']:.3f}"
    )
    assert many["hit_rate"] == one["hit_rate"]
