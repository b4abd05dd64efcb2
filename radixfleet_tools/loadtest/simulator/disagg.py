"""A disaggregated (prefill/decode) fleet in the simulator: P prefill + D decode workers.

Each request runs in two legs, as vLLM's P/D proxy runs it (the prefill request with
``max_tokens: 1``, then the decode request on the KV it left)::

    dispatch: the live router's pick (radixfleet.route.core.RouteCore, the named policy) over
              the PREFILL workers only: the pool, the index and the agents' events
              are the prefill side's (the index lives where the prompts run)
    prefill:  the agent's own scheduler and radix cache (engine.SimWorker), the
              prompt with max_tokens=1: a cached prefix is reused there (the hit)
    pick:     a decode worker: the route core asked again for the request's
              second leg, as radixfleet/route/pd.py asks it (``Ask.admit``: no admission
              chain again, not placed), among the decode workers' views at that
              instant (free KV, running + queued), its chooser
              radixfleet.policies.disagg.choose_decode
    admit:    the decode worker reserves prompt + max_tokens KV tokens (FIFO; at
              most max_running sequences); none free: the request waits there
    transfer: the prompt's whole KV, ``CostModel.kv_transfer_bytes(prompt tokens)``,
              over the link (``radixfleet_tools.agent.cost_model.LINKS``) at its full rate;
              one transfer at a time per prefill worker's egress and per decode
              worker's ingress (a later one queues behind)
    decode:   the request joins the decode worker's continuous batch at its next
              step; every step prices the batch as the engine prices a decode step,
              ``cost.forward_s(cost.decode_flops(b, ctx), ctx)``; the decode worker
              emits the FIRST token (its first step) and every later one

So TTFT = prefill queue + prefill + decode admission wait + transfer + the rest of
the decode step in progress + the first decode step; ITL = the decode workers' step
durations (their per-step samples, as the colocated report's). Hit rate and
``cached_tokens`` are the prefill side's. The report's ``floor_ttft_ms`` is the
prefill side's floor (no transfer); ``kv_capacity_tokens`` the prefill pool's.

What is not modelled: the decode side keeps no prefix cache (every request moves its
whole prompt's KV, so the bytes transferred depend on the requests, not the prefill
policy); a prefill worker releases a request's KV (into its radix cache, evictable)
when its prefill ends, not when the transfer does (vLLM's NIXL connector holds the
blocks until the decode side has pulled them); the decode pick reads the decode
workers' state without report delay; ``both`` workers in a fleet with prefill/decode
workers (refused: an all-``both`` fleet is the colocated ``Simulation``); client
timeouts (refused); the answer's KV is not sent back to a prefill worker, so a
conversation's next turn hits only on what its prompts left there (as live P/D).
The decode worker is this module's own model of a continuous batch, not the agent's
scheduler (which a live decode agent runs: it pulls the remote KV the same way,
``SchedRequest.remote``, but also keeps it in its prefix cache, which this model
does not).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixfleet.engines.keyspace import KeyedRequest, SpaceKey
from radixfleet.index.prefix_index import PrefixIndex
from radixfleet.keys import WorkerId
from radixfleet.policies.base import EMPTY_MATCH, Decision, Reason, RouteRequest, WorkerView
from radixfleet.policies.disagg import DECODE, PREFILL, choose_decode, validate_roles
from radixfleet.route.core import Ask, Route, RouteCore, RouteParts
from radixfleet.wire.errors import ConfigError, NoWorkerAvailable
from radixfleet_tools.agent import tokenizer
from radixfleet_tools.agent.cost_model import DEFAULT_LINK, CostModel, LinkSpec, link_preset
from radixfleet_tools.loadtest.report import percentiles
from radixfleet_tools.loadtest.simulator.engine import _pack
from radixfleet_tools.loadtest.simulator.prompts import SimPrompt
from radixfleet_tools.loadtest.simulator.reference import TextReference
from radixfleet_tools.loadtest.simulator.simulation import (
    _CALL,
    UNREAD_ANSWER_BASE,
    Job,
    SimConfig,
    SimOutcome,
    Simulation,
    _reads_answer,
)


@dataclass(frozen=True, slots=True)
class DisaggSpec:
    """The disaggregated fleet: its roles (``prefill``/``decode``) and its link preset."""

    roles: tuple[str, ...]
    link: str = DEFAULT_LINK

    @classmethod
    def split(cls, text: str, link: str = DEFAULT_LINK) -> DisaggSpec:
        """``P:D`` (the ``--disagg`` flag): P prefill then D decode workers."""
        p, sep, d = str(text).partition(":")
        try:
            np_, nd = int(p), int(d)
        except ValueError:
            np_ = nd = -1
        if not sep or np_ < 0 or nd < 0:
            raise ConfigError("--disagg", f"{text!r} must be P:D, two non-negative integers (e.g. 4:4)")
        spec = cls((PREFILL,) * np_ + (DECODE,) * nd, link)
        spec.validate("--disagg", "--link")
        return spec

    def validate(self, roles_path: str = "disagg.roles", link_path: str = "disagg.link") -> None:
        """``ConfigError`` at the roles' (or one role's) path or at the link's."""
        roles = validate_roles(self.roles, roles_path)
        if PREFILL not in roles:  # all 'both': a colocated fleet, the plain Simulation
            raise ConfigError(roles_path, "an all-'both' fleet is colocated: run it as the plain simulation")
        for i, r in enumerate(roles):
            if r not in (PREFILL, DECODE):
                raise ConfigError(
                    f"{roles_path}[{i}]",
                    "a 'both' worker in a prefill/decode fleet is not modelled by the simulator",
                )
        link_preset(self.link, link_path)

    @property
    def prefill(self) -> int:
        return self.roles.count(PREFILL)

    @property
    def decode(self) -> int:
        return self.roles.count(DECODE)


class _Leg:
    """One request's decode leg (only ``DisaggSimulation`` and ``DecodeWorker`` write it)."""

    __slots__ = (
        "job",
        "max_tokens",
        "need",
        "ctx",
        "generated",
        "first_t",
        "src",
        "dst",
        "queued_at",
        "data",
        "units",
    )

    def __init__(self, job: Job, max_tokens: int) -> None:
        self.job = job
        self.max_tokens = max_tokens
        self.need = 0  # KV tokens reserved on the decode worker: prompt + max_tokens
        self.ctx = 0  # tokens in its KV now
        self.generated = 0
        self.first_t: float | None = None
        self.src = -1  # prefill worker
        self.dst = -1  # decode worker
        self.queued_at = 0.0  # when it reached its decode worker's queue
        #: text level: the prompt's bytes and keys (the references observe the answer)
        self.data: bytes | None = None
        self.units: Sequence[int] | None = None


class DecodeWorker:
    """A decode-only worker: a continuous batch over KV that arrives by transfer.

    States of a leg: ``waiting`` (no KV room yet) -> ``landing`` (KV reserved, transfer
    under way) -> ``ready`` (landed; joins at the next step) -> ``running`` -> done.
    ``used`` = the reserved KV of landing + ready + running legs; never above
    ``capacity``; at most ``max_running`` legs hold KV. Steps: ``start_step(now)``
    (None: nothing to run), then ``end_step(now)`` at the time it returned."""

    __slots__ = (
        "id",
        "cost",
        "capacity",
        "max_running",
        "waiting",
        "landing",
        "ready",
        "running",
        "used",
        "ctx",
        "_batch",
        "_dur",
        "stepping",
        "ingress_free",
        "steps",
    )

    def __init__(self, wid: str, cost: CostModel, capacity: int, max_running: int) -> None:
        self.id = wid
        self.cost = cost
        self.capacity = capacity
        self.max_running = max_running
        self.waiting: collections.deque[_Leg] = collections.deque()
        self.landing: set[_Leg] = set()
        self.ready: list[_Leg] = []
        self.running: list[_Leg] = []
        self.used = 0
        self.ctx = 0  # tokens of KV the running batch reads per step
        self._batch: list[_Leg] = []
        self._dur = 0.0
        self.stepping = False
        self.ingress_free = 0.0  # when its link ingress is free
        self.steps = 0

    def view(self) -> WorkerView:
        return WorkerView(
            WorkerId(self.id),
            running_requests=len(self.running) + len(self.ready) + len(self.landing),
            queued_requests=len(self.waiting),
            kv_used_tokens=self.used,
            kv_capacity_tokens=self.capacity,
        )

    def admit(self) -> list[_Leg]:
        """Reserves KV for waiting legs, FIFO, while they fit; returns them (their
        transfers start now)."""
        out = []
        held = len(self.landing) + len(self.ready) + len(self.running)
        while self.waiting and held < self.max_running and self.used + self.waiting[0].need <= self.capacity:
            leg = self.waiting.popleft()
            self.used += leg.need
            self.landing.add(leg)
            held += 1
            out.append(leg)
        return out

    def land(self, leg: _Leg) -> None:
        self.landing.remove(leg)
        self.ready.append(leg)

    def start_step(self, now: float) -> float | None:
        if self.ready:
            for leg in self.ready:
                self.ctx += leg.ctx
            self.running.extend(self.ready)
            self.ready = []
        if not self.running:
            return None
        b = len(self.running)
        self._batch = list(self.running)
        self._dur = self.cost.forward_s(self.cost.decode_flops(b, self.ctx), self.ctx)
        self.stepping = True
        self.steps += 1
        return now + self._dur

    def end_step(self) -> tuple[list[_Leg], list[_Leg], tuple[float, int] | None]:
        """The step's effects: (legs given their first token, legs finished, ITL sample)."""
        self.stepping = False
        first, done = [], []
        later = 0
        for leg in self._batch:
            leg.generated += 1
            leg.ctx += 1
            self.ctx += 1
            if leg.generated == 1:
                first.append(leg)
            else:
                later += 1
            if leg.generated >= leg.max_tokens:
                done.append(leg)
        if done:
            gone = set(done)
            self.running = [leg for leg in self.running if leg not in gone]
            for leg in done:
                self.used -= leg.need
                self.ctx -= leg.ctx
        self._batch = []
        return first, done, ((self._dur, later) if later else None)

    def check(self) -> None:
        held = list(self.landing) + self.ready + self.running
        assert self.used == sum(leg.need for leg in held), f"{self.id}: used {self.used} != reserved"
        assert self.used <= self.capacity, f"{self.id}: {self.used} KV tokens > capacity {self.capacity}"
        assert len(held) <= self.max_running, f"{self.id}: {len(held)} sequences > {self.max_running}"
        assert self.ctx == sum(leg.ctx for leg in self.running), f"{self.id}: ctx out of step"


class _DecodeFleet:
    """The decode workers where the route core expects the router's pool (``get``,
    ``unavailable``); its legs are never placed (``Ask(place=False)``): each decode
    worker keeps its own KV reservations."""

    __slots__ = ("by_id",)

    def __init__(self, decoders: Sequence[DecodeWorker]) -> None:
        self.by_id = {dw.id: dw for dw in decoders}

    def get(self, worker: str) -> DecodeWorker | None:
        return self.by_id.get(worker)

    def unavailable(self, model: str, adapter: str | None, now: float) -> NoWorkerAvailable:
        return NoWorkerAvailable(f"no decode worker for model {model!r} is available", retry_after_s=1)


class DisaggSimulation(Simulation):
    """``Simulation`` with its workers as the prefill pool and ``spec.decode`` decode
    workers behind them (module docstring). ``cfg.workers`` must equal
    ``spec.prefill``; ``cfg.policy`` is the prefill selection policy."""

    def __init__(self, cfg: SimConfig, spec: DisaggSpec, workload, arrivals, bounds, **kw) -> None:
        spec.validate()
        if cfg.workers != spec.prefill:
            raise ConfigError(
                "disagg.roles", f"{spec.prefill} prefill workers, but the fleet has {cfg.workers}"
            )
        if cfg.timeout_s is not None:
            raise ConfigError("--timeout", "client timeouts are not modelled in a disaggregated fleet")
        super().__init__(cfg, workload, arrivals, bounds, **kw)
        self.spec = spec
        self.link: LinkSpec = link_preset(spec.link, "disagg.link")
        eng = cfg.engine
        cost = eng.cost_model()
        self.decoders = [
            DecodeWorker(f"d{i}", cost, eng.capacity_tokens(), eng.scheduler_config().max_running)
            for i in range(spec.decode)
        ]
        self._decoder_at = {dw.id: i for i, dw in enumerate(self.decoders)}
        #: the route core over the decode side: its views are the decode workers'
        #: (without report delay); the decode side keeps no prefix cache, so nothing
        #: is matched or placed in its index
        fleet: Any = _DecodeFleet(self.decoders)
        parts = RouteParts(fleet, PrefixIndex(), self.policy, views=self._decode_views)
        self._decode_route = RouteCore(parts)
        self._egress_free = [0.0] * len(self.workers)
        self._legs: dict[Job, _Leg] = {}
        self._decode_rng = random.Random(self.seed ^ 0x5EED_D1CE)
        self.kv_bytes_transferred = 0.0
        self._transfer_s: list[float] = []
        self._decode_wait_s: list[float] = []
        self.decode_rejected = 0

    # ------------------------------------------------------------- prefill leg

    def _submit(self, w: int, job: Job, counted: int, now: float, count: bool = True) -> None:
        if count and not job.warm:  # a client request: its prefill leg generates one token
            self._legs[job] = _Leg(job, job.max_tokens)
            job.max_tokens = 1
        super()._submit(w, job, counted, now, count)

    def _answer(self, job: Job) -> str:
        if job in self._legs:
            return ""  # the decode leg answers (its end observes the references)
        return super()._answer(job)

    def _finish_client(self, job: Job, answer: str | None, now: float) -> None:
        leg = self._legs.get(job)
        if leg is None or not job.ok:
            if leg is not None and not job.ok:
                del self._legs[job]  # refused by its prefill worker: no decode leg
            super()._finish_client(job, answer, now)
            return
        # the prefill leg is done: its worker's cache holds the prompt; the KV moves on
        leg.src = job.worker
        p = job.prompt
        leg.data, leg.units = p.data, p.units  # _retire drops them from the job next
        leg.need = p.prompt_tokens + leg.max_tokens
        leg.ctx = p.prompt_tokens
        job.first_t = None
        d = self._decode_pick(p, leg.need, now)
        dw = self.decoders[d]
        leg.dst = d
        if leg.need > dw.capacity:  # would never fit: the decode agent's 400
            self.decode_rejected += 1
            self.rejected += 1
            job.ok = False
            job.error_kind = "http_400"
            job.done_t = now
            del self._legs[job]
            super()._finish_client(job, None, now)
            return
        leg.queued_at = now
        dw.waiting.append(leg)
        self._admit(d, now)

    def _decode_views(self, now: float, model: str, adapter: str | None) -> list[WorkerView]:
        """The decode workers' state at ``now`` (no report delay: module docstring)."""
        return [dw.view() for dw in self.decoders]

    def _decode_pick(self, p: SimPrompt, need: int, now: float) -> int:
        """The decode leg's worker (its index): the route core asked for the
        request's second leg (radixfleet/route/pd.py's ``Ask.admit``), ``choose_decode`` its
        chooser; nothing held on the decode side (an empty match), nothing placed."""
        bt = self.block_tokens
        req = RouteRequest(p.hashes, p.prompt_tokens, bt, None, self.model, p.text_len)
        key = SpaceKey(p.hashes, p.prompt_tokens, bt, False)
        space, rng = self._space, self._decode_rng

        def keyer(views: Sequence[WorkerView], now: float) -> KeyedRequest:
            return KeyedRequest.single(space, key, req, EMPTY_MATCH)

        def choose(kr: KeyedRequest, views: Sequence[WorkerView], now: float) -> Decision:
            return Decision(choose_decode(views, need, rng).id, Reason.LEAST_LOAD)

        ask = Ask(keyer, self.model).admit(None, choose=choose, split=False, place=False)
        routed = self._decode_route.decide(ask, now)
        assert isinstance(routed, Route), "a disaggregated fleet has a decode worker"
        return self._decoder_at[routed.worker.id]

    # ------------------------------------------------------------- transfer

    def _admit(self, d: int, now: float) -> None:
        dw = self.decoders[d]
        for leg in dw.admit():
            self._decode_wait_s.append(now - leg.queued_at)
            nbytes = dw.cost.kv_transfer_bytes(leg.ctx)
            start = max(now, self._egress_free[leg.src], dw.ingress_free)
            end = start + self.link.transfer_s(nbytes)
            self._egress_free[leg.src] = dw.ingress_free = end
            self.kv_bytes_transferred += nbytes
            self._transfer_s.append(end - start)
            self._push(end, _CALL, lambda t, d=d, leg=leg: self._landed(d, leg, t))

    def _landed(self, d: int, leg: _Leg, now: float) -> None:
        dw = self.decoders[d]
        dw.land(leg)
        if not dw.stepping:
            self._decode_step(d, now)

    # ------------------------------------------------------------- decode leg

    def _decode_step(self, d: int, now: float) -> None:
        dw = self.decoders[d]
        if dw.stepping:
            first, done, itl = dw.end_step()
            if itl is not None:
                self._itl.append(itl)
            for leg in first:
                leg.first_t = now
            for leg in done:
                self._done(leg, now)
            self._admit(d, now)  # finished legs freed KV
        end = dw.start_step(now)
        if end is not None:
            self._push(end, _CALL, lambda t, d=d: self._decode_step(d, t))

    def _done(self, leg: _Leg, now: float) -> None:
        job = leg.job
        del self._legs[job]
        job.first_t = leg.first_t
        job.done_t = now
        job.output = leg.generated
        answer = ""
        ref = self.ref_cache
        if leg.data is not None and isinstance(ref, TextReference):  # text level: the agent's answer
            if _reads_answer(job):
                toks = tokenizer.generate(
                    tokenizer.request_seed(leg.data, self.cfg.engine.agent_seed), job.output
                )
                data = _pack(toks)
                ref.observe_answer_bytes(leg.data, leg.units, data, list(toks))
                answer = data.decode("ascii", "replace")
            else:
                ref.observe_unread_answer(leg.data, leg.units, job.output, UNREAD_ANSWER_BASE + job.idx)
        leg.data = leg.units = None
        super()._finish_client(job, answer, now)

    def _cancel_in_flight(self, now: float) -> None:
        super()._cancel_in_flight(now)
        for job in self._legs:  # still in their decode leg when the drain grace ran out
            if job.ok:
                job.ok = False
                job.error_kind = "cancelled"
                self.cancelled += 1
        self._legs.clear()

    # ------------------------------------------------------------- report

    def _outcome(self, wall_s: float) -> SimOutcome:
        out = super()._outcome(wall_s)
        out.report["disagg"] = {
            "prefill_workers": self.spec.prefill,
            "decode_workers": self.spec.decode,
            "prefill_policy": self.cfg.policy,
            "decode_pick": "free KV, then running + queued (radixfleet.policies.disagg.choose_decode)",
            "link": self.link.name,
            "link_bytes_per_s": self.link.bytes_per_s,
            "kv_bytes_per_token": self.decoders[0].cost.model.kv_bytes_per_token,
            "kv_bytes_transferred": self.kv_bytes_transferred,
            "transfers": len(self._transfer_s),
            "transfer_ms": percentiles(self._transfer_s),
            "decode_admission_wait_ms": percentiles(self._decode_wait_s),
            "decode_steps": sum(dw.steps for dw in self.decoders),
            "decode_rejected": self.decode_rejected,
            "first_token": "decode side (its first step after the KV landed)",
        }
        return out

    def check(self) -> None:
        super().check()
        for dw in self.decoders:
            dw.check()
        legs = list(self._legs.values())
        assert all(leg.job.ok is not False for leg in legs), "a failed job still has a decode leg"
