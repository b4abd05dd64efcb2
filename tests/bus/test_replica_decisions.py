"""Router replicas decide as one router, request by request, when their bus is instant.

The simulator runs the demo's mixed workload (the size ``radixfleet bench
replicas`` runs: 4 workers x 12k KV tokens, 12 requests/s, 498 requests — enough to
put the caches under pressure) twice through the live ``radixfleet.route.core`` path: once
with one prefix_load, once with four prefix_load instances taking the requests in
turn over one index and pool — an instant bus, so that whatever differs is state
each replica keeps for itself. After each decision the other instances get what
``radixfleet.bus`` gives a replica of its peers' picks: ``observe_route`` (the hint's
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
import dataclasses
import random

import pytest

import radixfleet_tools.loadtest.simulator.simulation as fleet
from radixfleet.bus.replica import remote_request
from radixfleet.policies.prefix_load import PrefixLoad
from radixfleet.wire.bus_wire import RouterMessage, parse_router, session_key
from radixfleet_tools.loadtest.simulator import cli as simulate_main
from radixfleet_tools.loadtest.simulator.harness import PickLoop

SECRET = b"the deployment's salt secret"


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


class _WireReplicas(_Replicas):
    """Replicas whose peers learn each pick only from what the bus carries: the
    picker keys the session as a router on a bus does (its digest), and the others
    record the pick from the hint as ``BusReplica._on_router`` does — the message
    serialized and parsed, the request rebuilt from the hint's keys and turn."""

    #: what the hint carries of the request beyond its keys (off: a hint as it was
    #: before turns, the control that shows the check is not vacuous)
    turns = True

    def choose(self, request, match, views, now):
        self.now = now
        if request.session is not None:
            request = dataclasses.replace(request, session=session_key(SECRET, request.session))
        picker = self.replicas[self.turn % len(self.replicas)]
        self.turn += 1
        d = picker.choose(request, match, views, now)
        hint = (d.worker, 0.0, list(request.hashes))
        turns = [(request.session, request.prompt_tokens)] if self.turns else []
        msg = RouterMessage("r", self.turn, 128, False, {}, [hint], turns=turns)
        m = parse_router(msg.to_bytes())
        wid, _, hashes = m.hints[0]
        heard = remote_request(hashes, *m.turn(0), request.block_tokens)
        for r in self.replicas:
            if r is not picker:
                r.observe_route(heard, match, wid, now)
        self.decisions.append((d.worker, d.matched_blocks))
        return d


def _run(monkeypatch, n: int, wire: bool = False, sessions: bool = False) -> tuple[dict, list]:
    made: list[_Replicas] = []

    def build(name, params, rng, path=None):
        made.append((_WireReplicas if wire else _Replicas)(n, rng))
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
            *(["--send-session"] if sessions else []),
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


class _Capacity(PickLoop):
    """The router's pick loop over workers of a known KV size (footprints judge it)."""

    def views(self):
        return [dataclasses.replace(v, kv_capacity_tokens=6000) for v in super().views()]


def _sessions(policy) -> list[tuple[str, int]]:
    """Twelve sessions of eight turns over three workers of 6,000 KV tokens: each turn
    a shared 1,600-token prefix and the session's own 640 fresh tokens (a client
    with a rolling window: no turn extends the last one's prompt, so only the
    client's session id ties them together). The prompts are whole blocks, so a
    hint's keys alone give their size: only the session key can make a difference."""
    loop = _Capacity(policy, ["w0", "w1", "w2"], block_tokens=16, decode_s=0.05)
    shared = list(range(1000, 1100))
    t = 0.0
    for k in range(8):
        for s in range(12):
            own = [s * 1_000_000 + k * 1000 + i for i in range(40)]
            loop.route(shared + own, (100 + 40) * 16, t, session=f"user-{s}@example.com")
            t += 0.3
    return [(d.worker, d.matched_blocks) for d in loop.decisions]


def test_sessions_whose_turns_alternate_over_two_replicas_combine_as_one_routers():
    """A client's session (``x-session-id`` / ``user``) whose turns alternate between
    two replicas is one session in both replicas' footprints: the hint carries the
    session's key (a salted digest, never the client's id) and the prompt's tokens,
    so every decision is one router's — on the simulator's mixed workload with
    sessions sent, and on sessions whose turns share nothing but their id. A hint
    without its turn (the control) splits each session into per-replica records,
    and the replicas judge "crowded" otherwise than one router."""
    one = _sessions(_Replicas(1, random.Random(0)))
    two = _sessions(_WireReplicas(2, random.Random(0)))
    assert len(set(one)) > 3  # the sessions spread: footprints decided something
    diverged = [i for i, (a, b) in enumerate(zip(two, one)) if a != b]
    assert not diverged, f"{len(diverged)} of {len(one)} decisions differ, first at {diverged[:1]}"
    control = _WireReplicas(2, random.Random(0))
    control.turns = False
    wrong = sum(a != b for a, b in zip(_sessions(control), one))
    assert wrong > 20, wrong  # without the session key: 75 of 96 differ


def test_the_mixed_workloads_sessions_over_two_replicas_make_one_routers_decisions(monkeypatch):
    one, one_decisions = _run(monkeypatch, 1, sessions=True)
    many, decisions = _run(monkeypatch, 2, wire=True, sessions=True)
    assert one["requests"] >= 450 and one["hit_rate"] > 0.7, one["hit_rate"]
    diverged = [i for i, (a, b) in enumerate(zip(decisions, one_decisions)) if a != b]
    assert len(decisions) == len(one_decisions) and not diverged, (
        f"{len(diverged)} decisions differ, first at request {diverged[:1]}: "
        f"hit {many['hit_rate']:.3f} vs one router's {one['hit_rate']:.3f}"
    )
