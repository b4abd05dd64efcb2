"""The discrete-event fleet simulation: one router, N workers, feedback, virtual time.

Per run: one policy, one workload, one seed. Everything happens on one event heap
of ``(time, seq, kind, arg)``; ``seq`` breaks ties in push order, so a seed
reproduces a run exactly::

    driver (loadtest's session rules) --dispatch--> router side: the live code
        prompt   = SimPrompt (text or block level, prompts.py)
        views    = pool.views(now)                 radixfleet.fleet.pool.Pool (virtual clock):
                   in-flight counted at pick time + the last agent load report
                   the router has received (stale ones ignored, weights)
        radixfleet.route.core.RouteCore.decide: index.match, the shedder (--shed),
                   policy.choose (the real policy), index.insert (optimistic
                   hint), pool.pick (uncached tokens): the live router's decision
        hot-root warm-ups (Decision.warm): radixfleet.route.warmup.WarmupGate with the
                   router config's warmup.min_interval_s; max_tokens=1, not counted
    --path latency--> worker.submit(job)  ->  STEP events (engine.py)
    first token: pool.prefilled(worker, counted); finish: pool.finish(...)
    --path latency--> driver.complete(answer): the session's next turn
    agent batches (events + load) --every B, after D--> radixfleet.index.feedback.Feedback.apply

Latencies are measured as the client would: TTFT from dispatch to the first token
plus the way back (``path_latency_s``, 0 by default: GPU time only).

The TTFT floor (``floor_ttft_ms`` in the report, ``Simulation.floor_ttft_s``): each
request alone on an idle worker that holds every token of its prompt the oracle
(one unbounded cache, ``job.oracle``) holds, its uncached part priced by the
workers' cost model as one forward pass (``CostModel.floor_ttft_s``: exact when it
fits one prefill chunk, a lower bound otherwise), plus the path both ways. No
policy can beat it; every report says how far above it one runs.
At block level the oracle keys a partial last block apart from the full block of
the same id where a worker's cache can match one against the other, so a request
whose prompt shares only such a partial block may, rarely, run below its floor.

The router side is the live router's own objects: ``radixfleet.fleet.pool.Pool`` (workers
registered as agents, ``clock`` = the virtual clock; ``SimConfig.router_config``
supplies ``load.report_stale_s``, ``index.half_life_s``, ``warmup.*`` and the
breaker), ``radixfleet.index.feedback.Feedback`` and ``radixfleet.route.core.RouteCore``. Where the
simulator must differ because time is virtual, the difference is one named seam:
``agentlink.py`` (when an agent's batch is built and delivered).

Feedback (``feedback``):

- ``events``: the radix caches' stored/removed events reach the index in batches
  cut every ``feedback_batch_s`` per worker (each worker's ticks at its own phase)
  and applied ``feedback_delay_s`` after the cut — the agent reporter's cadence —
  through ``Feedback.apply`` with the live epoch/sequence checks. The live
  reporter's pushes between ticks (after removals, before an answer ends:
  ``radixfleet_tools.agent.reporter``) are not modelled (ARCHITECTURE.md says what they move).
- ``none``: cache events are dropped; the index holds the router's optimistic
  inserts only (and forgets by its own memory budget). The ablation's difference
  is the value of eviction feedback.
- ``plain``: what the live router sees of an engine that sends nothing (``kind:
  openai``, ``loadtest --ab --plain-workers``): no events and no load reports; the
  views carry the router's own in-flight counts, the worker's KV capacity (as
  configured) and its prefill rate (as the live router learns it from TTFTs); the
  index ages each worker at its KV capacity (``PrefixIndex.set_capacity``) and each
  answer's cached tokens correct it and the capacity it is aged at, by the live
  router's rule (``radixfleet.engines.capacity.correct``; ``index.learn_capacity`` of
  ``--router-config`` turns the learned capacity off).

KV tiers: with a DRAM tier (``EngineSpec.dram_tokens``) each agent's ``"cpu"``-tier
events travel in the same batches (``SimWorker.take_events``, as the live reporter
sends them) into the index's colder tiers, and the pick values a worker's DRAM
extension by the router config's ``index.tiers`` (``radixfleet.config.IndexConfig``):
``priced`` at the share of a GPU hit its load price leaves at the worker's reported
prefill rate (``radixfleet.engines.tier_price.TierPrice``, seeded with the simulated
engine's own PCIe read-back cost per token: what the live link's learning converges
to, since the simulated read-back is exactly that cost), ``ignore`` as a miss,
``as_gpu`` as a GPU hit.

Load reports travel with every batch in ``none`` and ``events`` (they are not cache
feedback): the view of worker w at ``now`` carries w's state at its last tick at or
before ``now - feedback_delay_s`` (``agentlink.py``: delivered lazily, when read).

Autoscaling (``scaler``, ``radixfleet_tools.loadtest.simulator.scaling_loop``): every ``interval_s`` the
scaler names the fleet size it wants (at most its ``max_workers``); the controller
adds workers at once, as Kubernetes' HPA does by default at most max(4, 100% of the
current size) per 15 s (each registers with the pool ``startup_s`` after it is
requested: ``STARTING`` -> ``ACTIVE``), and removes them only down to the largest
size wanted over the last ``stabilization_s`` — a pending join is cancelled first,
else the active worker with the fewest requests in flight is ``DRAINING`` (the
pool's drain: no longer routable) until its last request is done, then ``GONE``
(removed from the pool, which drops its index entries). The report gains
``autoscale``: worker-seconds (from each request to its leaving), peak size,
joins, leaves and the timeline.

Invariants (``check()``): per worker, the pool's ``in_flight`` equals its client
jobs dispatched and not finished, and ``in_flight_tokens`` the sum of their counted
tokens not yet prefilled; the driver's, the pool's, the index's and every engine's
own invariants; every job is in exactly one of: in flight, finished ok, failed
(rejected with the agent's 4xx, or cancelled when the drain grace ran out); a
``GONE`` worker has nothing in flight and nothing in the index.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from radixfleet.config import Config
from radixfleet.engines.accuracy import predicted_tokens
from radixfleet.engines.capacity import LearnedCapacity, correct
from radixfleet.engines.keyspace import KeyedRequest, SpaceKey
from radixfleet.engines.tier_price import TierPrice
from radixfleet.fleet.pool import Pool
from radixfleet.index.feedback import Feedback
from radixfleet.index.prefix_index import DEFAULT_MAX_BYTES, PrefixIndex
from radixfleet.keys import BYTES_PER_TOKEN, DEFAULT_BLOCK_BYTES, check_block_bytes, namespace_seed
from radixfleet.policies.base import MatchResult, RouteRequest, WorkerView
from radixfleet.policies.registry import build_policy
from radixfleet.route.core import Ask, Reject, Route, RouteCore, RouteParts
from radixfleet.route.shedding import Shedder
from radixfleet.route.warmup import WarmupGate, warmup_prefix
from radixfleet.wire.errors import ConfigError, RequestError
from radixfleet.wire.settings import section, setting, settings
from radixfleet_tools.agent.dram_tier import CHUNK_TOKENS
from radixfleet_tools.loadtest.arrivals import Bounds
from radixfleet_tools.loadtest.client import Result
from radixfleet_tools.loadtest.metrics import goodput
from radixfleet_tools.loadtest.report import mark_bounds, percentiles, summarize
from radixfleet_tools.loadtest.simulator import blocktrace
from radixfleet_tools.loadtest.simulator.agentlink import AgentLink, tick_after, tick_at_or_before
from radixfleet_tools.loadtest.simulator.driver import VirtualDriver
from radixfleet_tools.loadtest.simulator.engine import FLAGS as ENGINE_FLAGS
from radixfleet_tools.loadtest.simulator.engine import EngineSpec, SimWorker
from radixfleet_tools.loadtest.simulator.prompts import SimPrompt, block_prompt, text_prompt, truncate
from radixfleet_tools.loadtest.simulator.reference import BlockReference, TextReference
from radixfleet_tools.loadtest.workloads import SingleShot, Trace, Workload

log = logging.getLogger(__name__)

#: what the router learns from the workers (module docstring)
FeedbackMode = Literal["none", "events", "plain"]
FEEDBACK_MODES: tuple[str, ...] = get_args(FeedbackMode)
#: 'auto' = block level for traces, text level otherwise
Level = Literal["auto", "text", "block"]
LEVELS: tuple[str, ...] = get_args(Level)
#: token ids standing for single-shot answers in the references (one per job): above
#: the tokenizer's range (< 2**34) and the engine's private ids (2**48 + n)
UNREAD_ANSWER_BASE = 2**56

# event kinds, in the order same-time events of different kinds were pushed
_WAKE, _STEP, _FLUSH, _DELIVER, _END, _ARRIVE, _DONE, _TIMEOUT, _TICK, _SCALE, _JOIN, _CALL = range(12)

# a worker's life in an autoscaled run (only Simulation changes it)
STARTING = "starting"  # requested, not yet registered with the pool (start-up delay)
ACTIVE = "active"  # registered, routable
DRAINING = "draining"  # drained in the pool; finishing what it has
GONE = "gone"  # removed from the pool (its index entries dropped)


#: the flag of ``radixfleet simulate`` that sets each SimConfig field (``from_flags``),
#: the engine's included (``engine.FLAGS``); other commands that build a fleet use
#: the same names
FLAGS = {
    "workers": "--agents",
    "block_bytes": "--block-bytes",
    "feedback": "--feedback",
    "feedback_delay_s": "--feedback-delay-ms",
    "feedback_batch_s": "--feedback-batch-ms",
    "level": "--level",
    "path_latency_s": "--path-latency-ms",
    "timeout_s": "--timeout",
    "shed": "--shed",
    "router_config": "--router-config",
    "slo": "--slo",
    **{f"engine.{k}": flag for k, flag in ENGINE_FLAGS.items()},
}


@settings
class SimConfig:
    """One simulated fleet.

    Types and bounds are declared per field (``radixfleet.wire.settings``: checked when an
    instance is built; ``from_flags(SimConfig, values, FLAGS)`` names the flags).
    ``validate()`` checks the rules across fields and the engine's presets (raises
    ``ConfigError`` naming the flag). ``policy_params``, ``router_config`` and
    ``slo`` are built and checked by their own parsers (``radixfleet.policies.params``,
    ``radixfleet.config``, ``radixfleet_tools.loadtest.metrics.parse_slo``) and held as given."""

    workers: int = setting(8, "simulated workers", lo=1)
    #: a policy's registered name (radixfleet.policies.registry builds it, or refuses the name)
    policy: str = "prefix_load"
    #: the policy's parameters as YAML gives them (radixfleet.policies.params checks them)
    policy_params: Mapping[str, Any] | None = None
    engine: EngineSpec = section(EngineSpec, "how each worker is built")
    block_bytes: int = setting(
        DEFAULT_BLOCK_BYTES, "router block size, bytes (text level); block level uses the trace's", lo=1
    )
    feedback: FeedbackMode = setting("events", "what the router learns from the workers (module docstring)")
    feedback_delay_s: float = setting(0.005, "agent -> router batch delivery delay, seconds", lo=0)
    feedback_batch_s: float = setting(0.1, "agent reporter batch interval, seconds", lo=0)
    index_max_bytes: int = setting(DEFAULT_MAX_BYTES, "the router index's memory budget, bytes", lo=1)
    level: Level = setting("auto", "prompt level: text, block, or auto (block for traces, text otherwise)")
    send_session: bool = setting(False, "send the session id as the request's session key (--send-session)")
    path_latency_s: float = setting(
        0.0,
        "one-way latency of the request path (client -> router -> agent, and the answer's "
        "way back): a request reaches its worker this much after the pick, and the client "
        "sees every token this much after the worker made it; 0: none (a GPU-only view). "
        "bench fidelity measures it on the live fleet",
        lo=0,
    )
    timeout_s: float | None = setting(
        None,
        "the client's per-request timeout (loadtest --timeout): no complete answer this long "
        "after dispatch -> error 'timeout'; None: requests never time out",
        lo=0,
        lo_open=True,
    )
    shed: bool = setting(
        False,
        "the live router's load shedding (radixfleet.route.shedding, with router_config's limits): a "
        "request every worker's report shows saturated past the bound gets a 429 at once "
        "(error kind http_429), as live; off: every request is routed (the tables of routing "
        "policies measure routing on the whole offered load)",
    )
    fast_forward: bool = setting(
        True,
        "fast-forward runs of pure decode steps (engine.py); false: every step is a "
        "Scheduler.step() call (same results, slower; the equivalence tests use it)",
    )
    #: the live router's settings the simulated router runs with (radixfleet.config):
    #: load.report_stale_s, index.half_life_s, warmup.enabled / min_interval_s,
    #: breaker. Its workers, policy and index.max_bytes are not used (the fields
    #: above set the fleet, the policy and the index budget).
    router_config: Config = section(Config, "the live router's settings (radixfleet.config)")
    report_every_tick: bool = setting(
        False,
        "deliver every agent batch at its own tick (an event per worker per tick) instead "
        "of lazily when read (agentlink.py); same results, slower (tests)",
    )
    check: bool = setting(False, "call every check() after every event (tests; slow)")
    #: report key (ttft_ms, tpot_ms, e2e_ms) -> bound in ms: the report gains
    #: ``goodput`` as the load generator's (``radixfleet_tools.loadtest.metrics.goodput``, ``--slo``);
    #: None or empty: no goodput
    slo: Mapping[str, float] | None = None

    def validate(self) -> None:
        if self.report_every_tick and not self.feedback_batch_s > 0:
            raise ConfigError("report_every_tick", "needs feedback_batch_s > 0")
        try:
            check_block_bytes(self.block_bytes)
        except ValueError as exc:
            raise ConfigError("--block-bytes", str(exc)) from None
        self.engine.validate()


class Job:
    """One request (or hot-root warm-up) in the simulation. Only ``Simulation`` and
    the worker adapter write it."""

    __slots__ = (
        "idx",
        "session",
        "spec",
        "prompt",
        "worker",
        "arrival",
        "max_tokens",
        "counted",
        "prefilled",
        "first_t",
        "done_t",
        "cached",
        "cached_dram",
        "output",
        "ok",
        "error_kind",
        "warm",
        "oracle",
        "pooled",
        "answer_seed",
        "handle",
        "matched",
        "touches",
    )

    def __init__(
        self, idx: int, session, spec, prompt: SimPrompt, arrival: float, max_tokens: int, warm: bool = False
    ) -> None:
        self.idx = idx
        self.session = session
        self.spec = spec
        self.prompt = prompt
        self.worker = -1
        self.arrival = arrival
        self.max_tokens = max_tokens
        self.counted = 0  # in_flight_tokens counted on the worker at pick time
        self.prefilled = False  # counted tokens released (first token seen)
        self.first_t: float | None = None
        self.done_t: float | None = None
        self.cached = 0  # prompt tokens served from cache (set by the worker)
        self.cached_dram = 0  # of them, read back from the worker's DRAM tier
        self.output = 0  # tokens generated (set by the worker)
        self.ok: bool | None = None  # None: in flight
        self.error_kind: str | None = None
        self.warm = warm  # a prefill-only warm-up: not a client request, not reported
        self.oracle = 0
        self.pooled = 0
        self.answer_seed: int | None = None  # set by the worker when it finishes
        self.handle = None  # the worker adapter's own request object
        self.matched = 0  # blocks the index matched on the chosen worker
        #: plain feedback: those blocks' last-use times before the pick (corrections)
        self.touches: tuple | None = None


@dataclass(slots=True)
class SimOutcome:
    """One run: the report entry (loadtest schema + wall_s, sim_requests_per_s, sim)
    and the raw TTFT samples for plots."""

    report: dict
    ttft_ms: list[float]
    jobs: list[Job]


class _Ref(AgentLink):
    """Per-worker state: the agent's report stream (``AgentLink``: the live pool's
    ``Worker`` holds the router's side) and the stepping bookkeeping."""

    __slots__ = ("busy", "gen", "zero_steps", "state", "requested_at", "left_at")

    def __init__(
        self, wid: str, phase: float, pool_worker, state: str = ACTIVE, requested_at: float = 0.0
    ) -> None:
        super().__init__(wid, phase, pool_worker)
        self.busy = False  # a step is running or about to start
        self.gen = 0  # generation of the worker's live _STEP event (older ones are stale)
        self.zero_steps = 0  # consecutive zero-duration steps (a stall guard)
        self.state = state  # STARTING / ACTIVE / DRAINING / GONE (module docstring)
        self.requested_at = requested_at  # worker-seconds count from here
        self.left_at: float | None = None

    @property
    def linked(self) -> bool:
        """Registered with the pool: its agent batches reach the router."""
        return self.state is ACTIVE or self.state is DRAINING


class Simulation:
    """A fleet under one policy, fed by one workload. ``run()`` once."""

    def __init__(
        self,
        cfg: SimConfig,
        workload: Workload,
        arrivals,
        bounds: Bounds,
        *,
        seed: int = 0,
        name: str | None = None,
        sessions=None,
        scaler=None,
    ) -> None:
        """``scaler``: an autoscaler (``radixfleet_tools.loadtest.simulator.scaling_loop``) that resizes
        the fleet while the run goes; None: a fixed fleet of ``cfg.workers``."""
        cfg.validate()
        self.cfg = cfg
        self.workload = workload
        self.arrivals = arrivals
        self.bounds = bounds
        self.seed = seed
        self.name = name or cfg.policy
        self.block_level = cfg.level == "block" or (cfg.level == "auto" and isinstance(workload, Trace))
        if self.block_level and not isinstance(workload, Trace):
            raise ConfigError("--level", "block level needs a trace workload (hash ids)")
        self.model = cfg.engine.model
        self.ns_seed = namespace_seed(self.model)
        if self.block_level:
            self.block_tokens = workload.params.block_tokens
        else:
            self.block_tokens = cfg.block_bytes // BYTES_PER_TOKEN
        self._sessions = sessions
        rng = random.Random(seed)
        self.policy = build_policy(
            cfg.policy, dict(cfg.policy_params or {}), random.Random(rng.getrandbits(64)), path="policy"
        )
        # the live router's objects on the virtual clock (module docstring)
        rcfg = self.router_cfg = dataclasses.replace(cfg.router_config, workers=())
        self.index = PrefixIndex(cfg.index_max_bytes, rcfg.index.half_life_s)
        self.now = 0.0  # the virtual clock (the pool reads it at once)
        self.pool = Pool(rcfg, self.index, clock=self._clock)
        keyed = self._keyed = None if self.block_level else cfg.block_bytes
        self.feedback = Feedback(self.pool, self.index, None, keyed)
        ids = [f"w{i}" for i in range(cfg.workers)]
        batch = cfg.feedback_batch_s
        self.refs = []
        for i, wid in enumerate(ids):
            ref = _Ref(wid, batch * i / cfg.workers, None)
            ref.pool_worker = self.pool.register(wid, ref.url, ref.epoch, (self.model,), keyed)
            self.refs.append(ref)
        self.by_id = {w: i for i, w in enumerate(ids)}
        self.workers = [
            SimWorker(
                w,
                cfg.engine,
                block_level=self.block_level,
                hash_stride=self.block_tokens,
                fast_forward=cfg.fast_forward,
            )
            for w in ids
        ]
        self.kv_capacity_tokens = sum(w.capacity_tokens for w in self.workers)
        #: the pick's valuation of DRAM-tier extensions (module docstring, "KV tiers")
        self.tiers_mode = rcfg.index.tiers
        self._dram_price: TierPrice | None = None
        if cfg.engine.dram_config() is not None and self.tiers_mode != "ignore" and self.workers:
            cost = self.workers[0].cost
            self._dram_price = TierPrice(cost.pcie_s(CHUNK_TOKENS) / CHUNK_TOKENS)
        self.ref_cache: BlockReference | TextReference
        if self.block_level:
            self.ref_cache = BlockReference(self.kv_capacity_tokens, self.block_tokens)
        else:
            self.ref_cache = TextReference(self.kv_capacity_tokens)
        self.jobs: list[Job] = []
        self._heap: list = []
        self._seq = 0
        self.now = 0.0
        self._wake_at: float | None = None
        self._pumping = False  # inside driver.pump (a rejection completes synchronously)
        self._warmed = WarmupGate()  # hot-root warm-ups sent (radixfleet.route.warmup)
        #: (duration_s, tokens) per decode step: the ITL distribution, per step not per token
        self._itl: list[tuple[float, int]] = []
        self.events_applied = 0
        self.events_dropped = 0
        self.batches = 0  # agent batches the live feedback applied
        self.plain = cfg.feedback == "plain"
        self._learned: dict[str, LearnedCapacity] = {}  # plain: each worker's learned cap
        for w in range(len(self.refs)):  # each agent's first batch: a snapshot
            self._record_state(w, 0.0)
            self._hello(w, 0.0)
        self.reasons: collections.Counter = collections.Counter()  # Decision.reason counts
        self.rejected = 0
        self.shed = 0  # requests the live shedder refused (SimConfig.shed)
        lim = rcfg.limits
        self.shedder = (
            Shedder(lim.worker_queue_requests, lim.worker_queue_min_s, self.pool.refused)
            if cfg.shed
            else None
        )
        #: the live router's route core over the virtual fleet: its own views (load-only
        #: batches caught up lazily), one byte key space, no tenancy, plain mode's
        #: corrections keeping the matched blocks' last-use times
        self._space = ("bytes", self.block_tokens)
        plain = self.plain
        self.route = RouteCore(
            RouteParts(
                self.pool,
                self.index,
                self.policy,
                self.shedder,
                views=lambda now, model, adapter: self._views(now),
                corrects=lambda w: plain,
            )
        )
        self.cancelled = 0
        self.timed_out = 0
        self.steps = 0
        self._ran = False
        self.scaler = scaler
        #: (time, active, starting, draining, desired) at each autoscaler tick
        self.timeline: list[tuple[float, int, int, int, int]] = []
        self._desired_hist: collections.deque = collections.deque()  # (time, desired)
        self._added: collections.deque = collections.deque()  # (time, workers added)
        self.joins = 0
        self.leaves = 0

    # ------------------------------------------------------------------ heap

    def _push(self, t: float, kind: int, arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, arg))

    # ------------------------------------------------------------------ run

    def run(self) -> SimOutcome:
        """Runs the simulation to the end; returns its outcome. Call once."""
        if self._ran:
            raise RuntimeError("Simulation.run() was already called; build a new Simulation")
        self._ran = True
        sessions = self._sessions if self._sessions is not None else self._build_sessions()
        self._planned = sum(s.planned_requests for s in sessions)
        t_wall = time.perf_counter()
        self.driver = VirtualDriver(
            sessions,
            self.arrivals,
            self.bounds,
            self._dispatch,
            max_active_sessions=self.workload.max_active_sessions,
            seed=self.workload.seed,
        )
        if self.cfg.report_every_tick:
            for w, ref in enumerate(self.refs):
                self._push(ref.phase + self.cfg.feedback_delay_s, _TICK, (w, ref.phase))
        if self.scaler is not None:
            self._push(self.scaler.interval_s, _SCALE)
        self._pump()
        heap = self._heap
        pop = heapq.heappop
        check = self.cfg.check
        end_pushed = False
        while heap:
            t, _, kind, arg = pop(heap)
            self.now = t
            if kind == _STEP:
                w, gen = arg
                if gen == self.refs[w].gen:  # else superseded by a cut run
                    self._step(w, t)
            elif kind == _WAKE:
                if t == self._wake_at:
                    self._wake_at = None
                    self._pump()
            elif kind == _FLUSH:
                self._cut(arg, t)
            elif kind == _DELIVER:
                self._deliver(arg[0], arg[1], arg[2], t)
            elif kind == _ARRIVE:
                self._hand(arg[0], arg[1], t)
            elif kind == _DONE:
                self._client_done(arg, t)
            elif kind == _TIMEOUT:
                self._timeout(arg, t)
            elif kind == _TICK:
                self._tick(arg[0], arg[1], t)
            elif kind == _SCALE:
                self._autoscale(t)
                self._push(t + self.scaler.interval_s, _SCALE)
            elif kind == _JOIN:
                self._join(arg, t)
            elif kind == _CALL:  # a subclass's own event (disagg.py): arg(now)
                arg(t)
            else:  # _END: the drain grace ran out
                self._cancel_in_flight(t)
                break
            d = self.driver
            if d.stopped_at is not None:
                if d.in_flight == 0:
                    break
                if not end_pushed:
                    end_pushed = True
                    self._push(d.stopped_at + self.bounds.drain_s, _END)
            if check:
                self.check()
        wall = time.perf_counter() - t_wall
        return self._outcome(wall)

    def _build_sessions(self):
        if self.block_level:
            return blocktrace.sessions(self.workload)
        return self.workload.sessions()

    # ----------------------------------------------------------- driver side

    def _pump(self) -> None:
        self._pumping = True
        try:
            wake = self.driver.pump(self.now)
        finally:
            self._pumping = False
        if wake is not None and wake != self._wake_at:
            self._wake_at = wake
            self._push(wake, _WAKE)

    def _prompt(self, spec) -> SimPrompt:
        if self.block_level:
            b = spec.body
            return block_prompt(b["hash_ids"], b["input_length"], self.block_tokens, self.ns_seed)
        return text_prompt(spec, self.ns_seed, self.cfg.block_bytes, self.workers[0].tokenize)

    def _dispatch(self, session, spec) -> None:
        """The router's request path, at pick time (the driver calls it)."""
        now = self.now
        prompt = self._prompt(spec)
        job = Job(len(self.jobs), session, spec, prompt, now, spec.max_tokens)
        self.jobs.append(job)
        req = RouteRequest(
            prompt.hashes,
            prompt.prompt_tokens,
            self.block_tokens,
            spec.session if self.cfg.send_session else None,
            self.model,
            prompt.text_len,
        )
        index = self.index
        space = self._space

        def keyer(views, now: float) -> KeyedRequest:
            # the request in the one byte space, matched (hot roots counted) and priced
            match = index.match(req.hashes, now, True)
            if self._dram_price is not None:
                match = self._priced(req.hashes, match, views)
            key = SpaceKey(req.hashes, req.prompt_tokens, req.block_tokens, False)
            return KeyedRequest.single(space, key, req, match)

        # the live router's decision (radixfleet.route.core): views, key, match, shed, choose,
        # hint and count the uncached tokens
        verdict = self.route.decide(Ask(keyer, self.model), now)
        if isinstance(verdict, Reject):
            self._shed(job, now)
            return
        assert isinstance(verdict, Route)  # no tenancy, no admission queue, no P/D split
        d, placed = verdict.decision, verdict.placement
        assert placed is not None
        counted, depth, job.touches = placed.own, verdict.keyed.match.depth, placed.touches
        # what the oracle and the pooled cache see: the requests that run
        ref = self.ref_cache  # a BlockReference exactly when block_level
        if isinstance(ref, BlockReference):
            assert prompt.block_ids is not None, "block-level prompts carry their block ids"
            ids = prompt.block_ids
            _, job.oracle, job.pooled = ref.observe(ids, prompt.prompt_tokens, prompt.last_tokens)
        else:
            assert prompt.data is not None, "text-level prompts carry their text"
            _, job.oracle, job.pooled = ref.observe_prompt(prompt.data, prompt.units)
        job.matched = d.matched_blocks
        w = self.by_id[d.worker]
        if self.scaler is not None:
            self.scaler.on_dispatch(now, counted, prompt.prompt_tokens)
        self.reasons[d.reason.value] += 1
        if d.warm and self.router_cfg.warmup.enabled:
            self._warm(d.warm, prompt, depth, now)
        if self.cfg.timeout_s is not None:
            self._push(now + self.cfg.timeout_s, _TIMEOUT, job)
        self._submit(w, job, counted, now)

    def _shed(self, job: Job, now: float) -> None:
        """The live router's 429 for ``job``: nothing routed, counted or hinted; the
        client has its answer at once (the session ends, as a failed turn ends it)."""
        job.ok = False
        job.error_kind = "http_429"
        job.done_t = now
        job.prefilled = True
        self.shed += 1
        self._finish_client(job, None, now)
        _retire(job)

    def _priced(self, hashes, match: MatchResult, views) -> MatchResult:
        """``match`` with ``colder``: each worker's DRAM extension in GPU-hit blocks by
        ``index.tiers`` (module docstring, "KV tiers")."""
        ext = self.index.match_tiers(hashes, match)
        if not ext:
            return match
        price = self._dram_price
        assert price is not None, "called only with a DRAM tier priced"
        as_gpu = self.tiers_mode == "as_gpu"
        colder = {}
        for v in views:
            e = ext.get(v.id)
            if e:
                n = sum(e.values())
                colder[v.id] = n if as_gpu else n * price.fraction(v.prefill_tokens_per_s)
        if not colder:
            return match
        return MatchResult(match.blocks, match.depth, match.rate, match.private, colder)

    def _warm(self, workers, prompt: SimPrompt, depth: int, now: float) -> None:
        """Prefill-only warm-ups of a hot prefix, as the live router sends them: a
        max_tokens=1 completion of the prefix's first ``depth`` blocks, gated by the
        live ``WarmupGate`` with the router config's ``warmup.min_interval_s``, not
        counted as load, not hinted in the index (the agent's events report what it
        caches)."""
        prefix = warmup_prefix(prompt.hashes, depth)
        if prefix is None:
            return
        blocks, h = prefix
        interval = self.router_cfg.warmup.min_interval_s
        p = None
        for wid in workers:
            w = self.by_id.get(wid)
            if w is None or not self._warmed.admit(wid, h, now, interval):
                continue
            if p is None:
                p = truncate(prompt, blocks, self.block_tokens)
            job = Job(len(self.jobs), None, None, p, now, 1, warm=True)
            self.jobs.append(job)
            self._submit(w, job, 0, now, count=False)

    def _submit(self, w: int, job: Job, counted: int, now: float, count: bool = True) -> None:
        """Sends ``job`` to worker ``w`` (it arrives ``path_latency_s`` later);
        ``counted``: the tokens the route core counted on it (``count=False``: a
        warm-up, not counted)."""
        job.worker = w
        if count:
            job.counted = counted
        lat = self.cfg.path_latency_s
        if lat > 0:
            self._push(now + lat, _ARRIVE, (w, job))
        else:
            self._hand(w, job, now)

    def _hand(self, w: int, job: Job, now: float) -> None:
        """``job`` reaches worker ``w`` at ``now``."""
        if job.ok is not None:
            return  # timed out on its way: the client's disconnect got there first
        ref = self.refs[w]
        try:
            self.workers[w].submit(
                job,
                now,
                answer=_reads_answer(job),
                ns_seed=self.ns_seed,
                block_bytes=0 if self.block_level else self.cfg.block_bytes,
            )
        except RequestError as exc:  # e.g. PromptTooLarge: the agent's 400
            job.ok = False
            job.error_kind = f"http_{exc.status}"
            job.done_t = now
            self.rejected += 1
            log.debug("%s rejected by %s: %s", job.idx, ref.id, exc)
            if not job.warm:
                # the agent's 4xx reaches the router as an answer (not a worker failure)
                job.prefilled = True
                self.pool.finish(ref.pool_worker, job.counted, True, job.prompt.prompt_tokens)
                self._finish_client(job, None, now)
            self._collect_events(w, now)  # the agent withdrew the router's hint
            _retire(job)
            return
        self._record_state(w, now)
        self._collect_events(w, now)
        if not ref.busy:
            ref.busy = True
            ref.gen += 1
            self._push(now, _STEP, (w, ref.gen))
        else:
            end = self.workers[w].cut(now)
            if end is not None:  # a fast-forwarded decode run stops early for this job
                ref.gen += 1
                self._push(end, _STEP, (w, ref.gen))

    def _finish_client(self, job: Job, answer: str | None, now: float) -> None:
        """The job's end reaches the client ``path_latency_s`` after ``now``."""
        lat = self.cfg.path_latency_s
        if lat > 0:
            self._push(now + lat, _DONE, (job, answer))
        else:
            self.driver.complete(job.session, answer)
            if not self._pumping:
                self._pump()

    def _timeout(self, job: Job, now: float) -> None:
        """The client gives up on ``job`` (``timeout_s`` after dispatch, if it has no
        complete answer): it fails with "timeout", the router releases its load at
        once (as its client-disconnect path does) and the agent cancels it at the end
        of the step in progress (a fast-forwarded run is cut there), returning its
        KV. The session ends, as a failed turn ends it live. A job that finished at
        the worker before ``now`` is not timed out (its answer is on its way back;
        the path latency is not counted against the timeout)."""
        if job.ok is not None:
            return
        job.ok = False
        job.error_kind = "timeout"
        job.done_t = now
        self.timed_out += 1
        w = job.worker
        ref = self.refs[w]
        # the client went away: the router releases the load (no breaker verdict)
        self.pool.finish(ref.pool_worker, 0 if job.prefilled else job.counted, None, job.prompt.prompt_tokens)
        job.prefilled = True
        if job.handle is not None:
            worker = self.workers[w]
            worker.cancel(job)
            if worker.stepping:
                end = worker.cut(now, force=True)
                if end is not None:
                    ref.gen += 1
                    self._push(end, _STEP, (w, ref.gen))
            else:  # between steps: at once
                worker.apply_cancels()
                self._record_state(w, now)
                self._collect_events(w, now)
        _retire(job)
        self.driver.complete(job.session, None)
        if not self._pumping:
            self._pump()

    def _client_done(self, arg, now: float) -> None:
        job, answer = arg
        self.driver.complete(job.session, answer)
        self._pump()

    # ----------------------------------------------------------- worker side

    def _step(self, w: int, now: float) -> None:
        """The step that worker ``w`` started ends at ``now`` (or ``w`` was idle):
        deliver its effects, then start the next one."""
        ref = self.refs[w]
        worker = self.workers[w]
        if worker.stepping:
            self._apply_outcome(w, worker.end_step(now), now)
        worker.apply_cancels()  # timed-out requests leave between steps
        end = worker.start_step(now)
        self._record_state(w, now)
        self._collect_events(w, now)
        if end is None:
            ref.busy = False
            if ref.state is DRAINING and ref.pool_worker.in_flight == 0:
                self._leave(w, now)
            return
        self.steps += 1
        if end <= now:
            ref.zero_steps += 1
            assert ref.zero_steps < 10_000, f"worker {ref.id} stalls: zero-duration steps"
        else:
            ref.zero_steps = 0
        ref.gen += 1
        self._push(end, _STEP, (w, ref.gen))

    def _apply_outcome(self, w: int, out, now: float) -> None:
        ref = self.refs[w]
        if out.itl:
            self._itl.extend(out.itl)
        pool = self.pool
        for job in out.first:
            if job.ok is False:
                continue  # timed out while this step ran
            job.first_t = now
            if not job.prefilled and not job.warm:
                job.prefilled = True
                pool.prefilled(ref.pool_worker, job.counted)  # the first byte reached the router
        for job in out.finished:
            if job.ok is False:
                continue  # timed out while this step ran: the client has gone
            if job.first_t is None:
                job.first_t = now
            job.done_t = now
            job.ok = True
            if not job.warm:
                pool.finish(
                    ref.pool_worker, 0 if job.prefilled else job.counted, True, job.prompt.prompt_tokens
                )
                job.prefilled = True
                if job.touches:
                    self._correct(ref, job)
                self._finish_client(job, self._answer(job), now)
            _retire(job)

    def _correct(self, ref: _Ref, job: Job) -> None:
        """Plain feedback: the answer's cached tokens correct the index and the
        worker's learned cap, by the live router's rule (``radixfleet.engines.capacity.
        correct``; the agent caches by token, so no whole-block cap on the
        prediction)."""
        bt = self.block_tokens
        pred = predicted_tokens(job.matched, bt, job.prompt.prompt_tokens, False)
        correct(self.index, ref.id, self._learned.get(ref.id), job.matched, pred, job.cached, bt, job.touches)

    def _answer(self, job: Job) -> str:
        """The answer text a finished job's client receives; the load generator's
        references cache prompt + answer (text level)."""
        p = job.prompt
        if p.data is None:
            return ""  # block level: no text; single-turn sessions never read it
        ref = self.ref_cache
        assert isinstance(ref, TextReference), "text-level prompts (data set) go with the text reference"
        if not _reads_answer(job):
            # never read back: only its length matters to the references
            ref.observe_unread_answer(p.data, p.units, job.output, UNREAD_ANSWER_BASE + job.idx)
            return ""
        data, toks = SimWorker.answer(job)
        ref.observe_answer_bytes(p.data, p.units, data, toks)
        return data.decode("ascii", "replace")

    def _cancel_in_flight(self, now: float) -> None:
        for job in self.jobs:
            if job.ok is None:
                job.ok = False
                job.error_kind = "cancelled"
                if not job.warm:
                    self.cancelled += 1

    # ----------------------------------------------------------- agent batches

    def _clock(self) -> float:
        return self.now

    def _record_state(self, w: int, now: float) -> None:
        self.refs[w].record(now, self.workers[w].load_state())

    def _hello(self, w: int, now: float) -> None:
        """Worker ``w`` registers: the agent's first batch (a snapshot of its cache with
        ``events``, its load only with ``none``); a plain engine sends nothing, and the
        router ages its index entries at the engine's KV capacity instead."""
        ref = self.refs[w]
        if self.plain:
            blocks = max(1, self.workers[w].capacity_tokens // max(1, self.block_tokens))
            if self.router_cfg.index.learn_capacity:
                self._learned[ref.id] = LearnedCapacity(blocks)
            self.index.set_capacity(ref.id, blocks)
            return
        st = ref.hist[-1][1]
        self._send(
            ref, ref.hello(st) if self.cfg.feedback == "events" else ref.batch((), st), now, hello=True
        )

    def _send(self, ref: _Ref, batch, at: float, hello: bool = False) -> None:
        """``batch`` reaches the router at ``at``: the live ``Feedback.apply``.
        (``hello``: the registration snapshot, not counted as cache events.)"""
        status, word = self.feedback.apply(batch, at)
        if status != 200:
            raise AssertionError(
                f"the live feedback refused {ref.id}'s batch seq {batch.seq} "
                f"(epoch {batch.epoch}): {status} {word}"
            )
        self.batches += 1
        if not hello:
            self.events_applied += len(batch.events)

    def _views(self, now: float) -> list[WorkerView]:
        """The live pool's views at ``now``, after the load-only batches the router
        would have received by then (agentlink.py: built lazily, when read)."""
        if self.plain:
            return [self._plain_view(v) for v in self.pool.views(now)]
        if not self.cfg.report_every_tick:
            for ref in self.refs:
                if now >= ref.next_at and ref.linked:
                    self._catch_up(ref, now)
        return self.pool.views(now)

    def _plain_view(self, v: WorkerView) -> WorkerView:
        """A plain engine's view: the router's own counts, the configured KV capacity
        and the prefill rate the live router learns from its TTFTs (the engine's own,
        taken as learned)."""
        st = self.workers[self.by_id[v.id]].load_state()
        return dataclasses.replace(v, kv_capacity_tokens=st[4], prefill_tokens_per_s=st[5])

    def _catch_up(self, ref: _Ref, now: float) -> None:
        """Delivers ``ref``'s newest load report due by ``now``, if newer than the
        router's (one batch for the load-only ticks since the last one)."""
        cfg = self.cfg
        dl, b = cfg.feedback_delay_s, cfg.feedback_batch_s
        t = now - dl
        if b > 0:
            tick = tick_at_or_before(t, ref.phase, b)
            ref.next_at = tick + b + dl
            if tick <= ref.last_tick:
                return
            got = ref.state_at(tick)
        else:  # a batch at every state change
            got = ref.state_at(t)
            if got is None or got[0] <= ref.last_tick:
                return
            tick = got[0]
        if got is None:
            return
        ref.last_tick = tick
        self._send(ref, ref.batch((), got[1]), tick + dl)

    def _tick(self, w: int, tick: float, now: float) -> None:
        """``report_every_tick``: worker ``w``'s batch of ``tick`` arrives now."""
        ref = self.refs[w]
        if ref.state is GONE or self.plain:
            return  # its reporter stopped with it; a plain engine has none
        if tick > ref.last_tick and ref.linked:
            got = ref.state_at(tick)
            if got is not None:
                ref.last_tick = tick
                self._send(ref, ref.batch((), got[1]), now)
        nxt = tick + self.cfg.feedback_batch_s
        self._push(nxt + self.cfg.feedback_delay_s, _TICK, (w, nxt))

    def _collect_events(self, w: int, now: float) -> None:
        evs = self.workers[w].take_events()
        if not evs:
            return
        cfg = self.cfg
        if cfg.feedback != "events":
            self.events_dropped += len(evs)
            return
        ref = self.refs[w]
        if cfg.feedback_batch_s <= 0 and cfg.feedback_delay_s <= 0:
            ref.last_tick = now
            self._send(ref, ref.batch(evs, ref.hist[-1][1]), now)
            return
        ref.pending.extend(evs)
        if ref.flush_at is None:
            b = cfg.feedback_batch_s
            at = tick_after(now, ref.phase, b) if b > 0 else now
            ref.flush_at = at
            self._push(at, _FLUSH, w)

    def _cut(self, w: int, now: float) -> None:
        """The reporter's tick at ``now`` cuts the pending events into a batch."""
        ref = self.refs[w]
        ref.flush_at = None
        batch, ref.pending = ref.pending, []
        if batch:
            self._push(now + self.cfg.feedback_delay_s, _DELIVER, (w, batch, now))

    def _deliver(self, w: int, events: list, tick: float, now: float) -> None:
        """The batch cut at ``tick`` arrives: its events and the load as of the tick."""
        ref = self.refs[w]
        if not ref.linked:
            return  # the router has forgotten it; late events must not bring it back
        got = ref.state_at(tick)
        state = got[1] if got is not None else ref.hist[-1][1]
        ref.last_tick = max(ref.last_tick, tick)
        self._send(ref, ref.batch(events, state), now)

    # ----------------------------------------------------------- autoscaling

    def _autoscale(self, now: float) -> None:
        """One controller tick: the scaler's desired size, scaled up at once (at most
        max(4, 100%) per 15 s) and down only to the largest desired size of the last
        ``stabilization_s`` (HPA's scale-down stabilization window); joins take
        ``startup_s``, leaves drain first."""
        sc = self.scaler
        for w, ref in enumerate(self.refs):  # drained while idle between steps
            if ref.state is DRAINING and ref.pool_worker.in_flight == 0 and not ref.busy:
                self._leave(w, now)
        desired = max(1, int(sc.desired(self, now)))
        hist = self._desired_hist
        hist.append((now, desired))
        while hist and hist[0][0] < now - sc.stabilization_s:
            hist.popleft()
        target = min(max(d for _, d in hist), sc.max_workers)
        live = [w for w, r in enumerate(self.refs) if r.state is ACTIVE or r.state is STARTING]
        if target > len(live):
            added = self._added
            while added and added[0][0] <= now - 15.0:
                added.popleft()
            room = max(4, len(live)) - sum(n for _, n in added)
            n = min(target - len(live), max(0, room))
            if n:
                added.append((now, n))
            for _ in range(n):
                self._add_worker(now, sc.startup_s)
        elif target < len(live):
            for _ in range(len(live) - target):
                self._remove_worker(now)
        counts = collections.Counter(r.state for r in self.refs)
        self.timeline.append((now, counts[ACTIVE], counts[STARTING], counts[DRAINING], desired))

    def _add_worker(self, now: float, startup_s: float) -> None:
        i = len(self.refs)
        wid = f"w{i}"
        batch = self.cfg.feedback_batch_s
        phase = (batch * i / self.cfg.workers) % batch if batch else 0.0
        self.refs.append(_Ref(wid, phase, None, STARTING, now))
        self.by_id[wid] = i
        self.workers.append(
            SimWorker(
                wid,
                self.cfg.engine,
                block_level=self.block_level,
                hash_stride=self.block_tokens,
                fast_forward=self.cfg.fast_forward,
            )
        )
        self.joins += 1
        self._push(now + startup_s, _JOIN, i)

    def _join(self, w: int, now: float) -> None:
        """The worker's agent is up: it registers and sends its first snapshot."""
        ref = self.refs[w]
        if ref.state is not STARTING:
            return  # cancelled while starting
        ref.state = ACTIVE
        ref.pool_worker = self.pool.register(ref.id, ref.url, ref.epoch, (self.model,), self._keyed)
        self._record_state(w, now)
        self._hello(w, now)
        ref.last_tick = now
        if self.cfg.report_every_tick and self.cfg.feedback_batch_s > 0:
            tick = tick_after(now, ref.phase, self.cfg.feedback_batch_s)
            self._push(tick + self.cfg.feedback_delay_s, _TICK, (w, tick))

    def _remove_worker(self, now: float) -> None:
        """Cancels the newest pending join, else drains the active worker with the
        fewest requests in flight (ties: the newest)."""
        refs = self.refs
        starting = [w for w, r in enumerate(refs) if r.state is STARTING]
        if starting:
            w = starting[-1]
            refs[w].state = GONE
            refs[w].left_at = now
            self.leaves += 1
            return
        active = [w for w, r in enumerate(refs) if r.state is ACTIVE]
        if len(active) <= 1:
            return
        w = min(active, key=lambda i: (refs[i].pool_worker.in_flight, -i))
        ref = refs[w]
        ref.state = DRAINING
        self.pool.drain(ref.id, True)
        if ref.pool_worker.in_flight == 0 and not ref.busy:
            self._leave(w, now)

    def _leave(self, w: int, now: float) -> None:
        ref = self.refs[w]
        ref.state = GONE
        ref.left_at = now
        ref.pending = []
        self.pool.remove(ref.id)  # drops its index entries
        self.leaves += 1

    def worker_seconds(self, end: float) -> float:
        """Seconds each worker was requested and not gone, summed (billing starts at
        the request: a starting worker costs as much as a running one)."""
        return sum((r.left_at if r.left_at is not None else end) - r.requested_at for r in self.refs)

    # ----------------------------------------------------------- report

    def floor_ttft_s(self, job: Job) -> float:
        """The TTFT floor of ``job`` (the module docstring): its prompt on an idle
        worker holding the oracle's cached prefix, plus the path both ways."""
        gpu = self.workers[0].cost.floor_ttft_s(job.prompt.prompt_tokens, job.oracle)
        return gpu + 2.0 * self.cfg.path_latency_s

    def _outcome(self, wall_s: float) -> SimOutcome:
        results = []
        ttft = []
        floor = []
        for job in self.jobs:
            if job.warm:
                continue
            spec = job.spec
            r = Result(spec.id, spec.session, spec.turn, start=job.arrival)
            r.ok = bool(job.ok)
            r.error_kind = job.error_kind
            r.worker = self.refs[job.worker].id if job.worker >= 0 else None
            r.est_prompt_tokens = job.prompt.prompt_tokens
            r.oracle_cached = job.oracle
            r.pooled_cached = job.pooled
            if r.ok:
                assert job.first_t is not None and job.done_t is not None, "a succeeded job has its times"
                lat = self.cfg.path_latency_s  # the way back to the client
                r.ttft_s = job.first_t + lat - job.arrival
                r.e2e_s = job.done_t + lat - job.arrival
                r.prompt_tokens = job.prompt.prompt_tokens
                r.cached_tokens = job.cached
                r.output_tokens = job.output
                ttft.append(r.ttft_s * 1000.0)
                floor.append(self.floor_ttft_s(job))
            results.append(r)
        report = summarize(
            self.name,
            "simulated",
            self.workload.describe(),
            results,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )
        report["itl_ms"] = weighted_percentiles(self._itl)
        if self.cfg.slo:
            report["goodput"] = goodput(results, dict(self.cfg.slo), report["duration_s"])
        report["floor_ttft_ms"] = percentiles(floor)
        mark_bounds(report, self.bounds, self.driver.stopped_by, self.driver.dispatched, self._planned)
        n = len(results)
        report["wall_s"] = wall_s
        report["sim_requests_per_s"] = n / wall_s if wall_s > 0 else 0.0
        st = self.index.stats()
        report["sim"] = {
            "level": "block" if self.block_level else "text",
            "policy": self.cfg.policy,
            "workers_n": self.cfg.workers,
            "model": self.cfg.engine.model,
            "gpu": self.cfg.engine.gpu,
            "kv_tokens_per_worker": self.workers[0].capacity_tokens,
            "block_tokens": self.block_tokens,
            "feedback": self.cfg.feedback,
            "feedback_delay_ms": self.cfg.feedback_delay_s * 1000.0,
            "feedback_batch_ms": self.cfg.feedback_batch_s * 1000.0,
            "path_latency_ms": self.cfg.path_latency_s * 1000.0,
            "seed": self.seed,
            "rejected": self.rejected,
            "shed": self.shed,
            "cancelled": self.cancelled,
            "timed_out": self.timed_out,
            "warmups": sum(1 for j in self.jobs if j.warm),
            "reasons": dict(sorted(self.reasons.items())),
            "steps": self.steps,
            "engine_steps": sum(w.real_steps for w in self.workers),
            "fast_forwarded_steps": sum(w.ff_steps for w in self.workers),
            "events_applied": self.events_applied,
            "events_dropped": self.events_dropped,
            "agent_batches": self.batches,
            "index_nodes": st.nodes,
            "index_evicted_entries": st.evicted_entries,
            "stopped_by": self.driver.stopped_by,
            "sim_duration_s": self.now,
        }
        report["tiers"] = self._tiers()
        if self.scaler is not None:
            report["autoscale"] = {
                "rule": self.scaler.name,
                "worker_seconds": self.worker_seconds(self.now),
                "peak_workers": max((a + s + d for _, a, s, d, _ in self.timeline), default=0),
                "joins": self.joins,
                "leaves": self.leaves,
                "startup_s": self.scaler.startup_s,
                "interval_s": self.scaler.interval_s,
                "stabilization_s": self.scaler.stabilization_s,
                "timeline": [list(x) for x in self.timeline],
            }
        return SimOutcome(report, ttft, self.jobs)

    def _tiers(self) -> dict:
        """Prompt tokens served per KV tier over the reported (ok, non-warm-up) jobs:
        ``gpu`` from the HBM tree, ``dram`` read back from the DRAM tier; each also as a
        share of prompt tokens (they sum to ``hit_rate``). Plus the DRAM tier's copies."""
        prompt = gpu = dram = 0
        for job in self.jobs:
            if job.warm or not job.ok:
                continue
            prompt += job.prompt.prompt_tokens
            dram += job.cached_dram
            gpu += job.cached - job.cached_dram
        out: dict = {
            "gpu_hit_tokens": gpu,
            "dram_hit_tokens": dram,
            "gpu_hit_rate": gpu / prompt if prompt else 0.0,
            "dram_hit_rate": dram / prompt if prompt else 0.0,
            "dram_tokens_per_worker": self.cfg.engine.dram_tokens_per_worker(),
        }
        tiers = [w.sched.dram for w in self.workers if w.sched.dram is not None]
        if tiers:
            out["dram_admit_hits"] = self.cfg.engine.dram_admit_hits
            out["written_chunks"] = sum(t.stats.written_chunks for t in tiers)
            out["evicted_chunks"] = sum(t.stats.evicted_chunks for t in tiers)
            out["dropped_writes"] = sum(t.stats.dropped_writes for t in tiers)
            out["read_back_s"] = sum(t.stats.read_back_s for t in tiers)
            out["d2h_busy_s"] = sum(t.d2h.busy_s for t in tiers)
        return out

    # ----------------------------------------------------------- invariants

    def check(self) -> None:
        """Asserts the invariants in the module docstring (O(jobs + index))."""
        self.driver.check()
        per = [[0, 0] for _ in self.refs]
        states: collections.Counter[str] = collections.Counter()
        for job in self.jobs:
            if job.ok is None:
                if not job.warm:
                    per[job.worker][0] += 1
                    if not job.prefilled:
                        per[job.worker][1] += job.counted
                states["in_flight"] += 1
            elif job.ok:
                states["ok"] += 1
            else:
                states["failed"] += 1
        for ref, (n, tok) in zip(self.refs, per):
            pw = ref.pool_worker
            if pw is None:  # a join cancelled before its agent registered
                assert ref.state is GONE or ref.state is STARTING, f"{ref.id}: {ref.state}"
                assert n == 0, f"{ref.id}: {n} jobs in flight before it joined"
                continue
            assert pw.in_flight == n, f"{ref.id}: {pw.in_flight=} != {n} jobs in flight"
            assert pw.in_flight_tokens == tok, f"{ref.id}: {pw.in_flight_tokens=} != {tok}"
            if ref.state is GONE:
                assert n == 0 and ref.left_at is not None, f"{ref.id} left with {n} in flight"
                assert ref.id not in self.index.workers(), f"{ref.id} left, still indexed"
                assert self.pool.get(ref.id) is None, f"{ref.id} left, still in the pool"
        assert sum(states.values()) == len(self.jobs), f"{states=} {len(self.jobs)=}"
        self.pool.check()
        self.index.check()
        for w in self.workers:
            w.check()


def _retire(job: Job) -> None:
    """Drops what a done job no longer needs: its prompt's tokens (and, at text
    level, bytes) and the worker's request object. The report reads counts only,
    and a 100,000-request trace of 15k-token prompts would otherwise keep ~12 GB
    of keys alive to the end."""
    job.handle = None
    job.touches = None
    p = job.prompt
    if not job.warm:  # a warm-up's prompt may be shared by its sibling warm-ups
        p.units = None
        p.data = None


def _reads_answer(job: Job) -> bool:
    """A session with turns after this one sends the answer back in its next prompt."""
    return job.session is not None and not isinstance(job.session, SingleShot)


def weighted_percentiles(samples: Sequence[tuple[float, int]], scale: float = 1000.0) -> dict:
    """``radixfleet_tools.loadtest.report.percentiles`` over (value, count) pairs: the same nearest-rank
    p50/p90/p99 and mean as if each value were listed ``count`` times."""
    total = sum(c for _, c in samples)
    if not total:
        return percentiles([], scale)
    s = sorted(samples)
    out = {}
    for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        rank = min(total, max(1, math.ceil(q * total)))
        acc = 0
        for v, c in s:
            acc += c
            if acc >= rank:
                out[name] = v * scale
                break
    out["mean"] = sum(v * c for v, c in samples) / total * scale
    return out
