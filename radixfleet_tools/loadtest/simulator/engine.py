"""One simulated worker: the agent's own scheduler, radix cache, KV pool and cost model.

Nothing here models the GPU or the cache: ``radixfleet_tools.agent.scheduler.Scheduler`` over
``radixfleet_tools.agent.radix_cache.RadixCache`` + ``KVPool``, priced by
``radixfleet_tools.agent.cost_model.CostModel``, built by the agent's own
``build_scheduler`` with its CLI defaults, is driven on the simulation's virtual
clock. This adapter only translates::

    Job (simulation.py) --submit--> SchedRequest(rid=job, ns, prompt=units, max_new,
                                            output, hashes=router block hashes)
    Scheduler.step(now) -> StepResult --> StepOut(duration, first, finished, ITL tokens)
    RadixCache.drain_events()         --> the agent reporter's stored/removed events
    Scheduler.load()                  --> the agent's load report (a tuple)

Generated tokens: a conversation's turn (text level) decodes the agent's own
deterministic answer, ``tokenizer.generate(request_seed(prompt bytes, agent
seed), max_tokens)``, so the next prompt re-tokenizes to exactly what the cache
grew by, as live; its router hashes continue the prompt's chain (the prompt's whole
blocks are not hashed again). Any other request's output is one private token id,
unique to the request and above every id a prompt can hold, repeated ``max_tokens``
times (an ``array('Q')`` built in C): the cache grows by the same number of tokens
and nobody ever matches an answer nobody sends back, so only its size matters — and
generating 256 answer tokens costs more than the rest of a request's simulation.
(The one difference: two identical single-shot prompts get identical answers live,
distinct ones here.)

Keys: prompts and outputs reach the scheduler as ``array('Q')`` cache keys
(``radix_cache.as_key``; text: ``tokenizer.encode_key``, blocks: prompts.py), so
the agent's cache compares and copies them in C and no int object is made per token.

Block level: a prompt's tokens are its blocks' ids, each repeated for the block's
length (prompts.py), so the same cache and scheduler run with ``hash_stride`` equal
to the trace's block size and a partial block is a prefix of the full one, as in
text. Decode stays one token per step for every request at both levels.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

from radixfleet.keys import block_hashes
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import setting, settings
from radixfleet_tools.agent import tokenizer
from radixfleet_tools.agent.cost_model import GPUS, MODELS, CostModel
from radixfleet_tools.agent.dram_tier import DramConfig
from radixfleet_tools.agent.radix_cache import ADMISSION_MODES, KEY_TYPECODE, AdmissionConfig
from radixfleet_tools.agent.scheduler import (
    ORDERS,
    SchedRequest,
    SchedulerConfig,
    StepResult,
    build_scheduler,
)

#: token ids above every tokenizer and block-level id: outputs nobody can match
PRIVATE_BASE = 2**48


#: the flag that sets each EngineSpec field (``from_flags``), for every command that
#: builds a simulated fleet (its errors name these)
FLAGS = {
    "model": "--agent-model",
    "gpu": "--gpu",
    "tp": "--tp",
    "kv_tokens": "--kv-tokens",
    "chunk_tokens": "--chunk-tokens",
    "max_running": "--max-running",
    "order": "--order",
    "admission": "--admission",
    "dram_tokens": "--dram-tokens",
    "dram_ratio": "--dram-tokens",
    "dram_admit_hits": "--dram-admit-hits",
}


@settings
class EngineSpec:
    """How each simulated worker is built (the agent's flags of the same names).

    Types and bounds are declared per field (``radixfleet.wire.settings``: checked when an
    instance is built); ``validate()`` checks what depends on the presets (their
    names, that the weights fit) and on other modules' registries (``order``,
    ``admission``), naming the flag (``FLAGS``)."""

    model: str = setting("llama-3-8b", "model preset (radixfleet_tools.agent.cost_model.MODELS)")
    gpu: str = setting("h100", "GPU preset (radixfleet_tools.agent.cost_model.GPUS)")
    tp: int = setting(1, "tensor-parallel degree per worker", lo=1)
    kv_tokens: int | None = setting(
        None, "KV capacity per worker in tokens; None: the preset's (HBM - weights - reserve)", lo=1
    )
    chunk_tokens: int | None = setting(None, "chunked-prefill token budget per step; None: the agent's", lo=1)
    max_running: int | None = setting(None, "sequences in a running batch at most; None: the agent's", lo=1)
    #: a name of radixfleet_tools.agent.scheduler.ORDERS (checked by validate()); None: the agent's
    order: str | None = None
    #: a name of radixfleet_tools.agent.radix_cache.ADMISSION_MODES (checked by validate());
    #: None: the agent CLI's
    admission: str | None = None
    min_prefix_tokens: int = setting(64, "admission min_prefix: shortest sequence worth keeping", lo=0)
    protected_fraction: float = setting(
        0.5, "admission protected: share of the cache kept for reused entries", lo=0, lo_open=True, hi=1
    )
    agent_seed: int = setting(0, "the agent's generation seed (its --seed)")
    dram_tokens: int | None = setting(
        None, "DRAM KV tier per worker in tokens (the agent's --dram-tokens); None: no tier", lo=0
    )
    dram_ratio: float | None = setting(
        None, "DRAM KV tier per worker as a multiple of its KV pool (--dram-tokens 4x)", lo=0, lo_open=True
    )
    dram_admit_hits: int = setting(
        1, "requests that must reach a chunk before it is written down (--dram-admit-hits)", lo=1
    )

    def validate(self) -> None:
        cost = self.cost_model()
        if self.kv_tokens is None:
            cost.kv_capacity_tokens()  # raises ConfigError when the weights do not fit
        if self.order is not None and self.order not in ORDERS:
            raise ConfigError("--order", f"{self.order!r} is not one of {', '.join(ORDERS)}")
        if self.admission is not None and self.admission not in ADMISSION_MODES:
            raise ConfigError("--admission", f"{self.admission!r} is not one of {', '.join(ADMISSION_MODES)}")
        self.dram_config()

    def cost_model(self) -> CostModel:
        for flag, name, table in (("--agent-model", self.model, MODELS), ("--gpu", self.gpu, GPUS)):
            if name not in table:
                raise ConfigError(flag, f"unknown preset {name!r}; choose one of {', '.join(table)}")
        return CostModel(self.model, self.gpu, tp=self.tp)

    def dram_tokens_per_worker(self) -> int:
        """The DRAM tier's tokens per worker (0: none)."""
        if self.dram_ratio is not None:
            return int(self.dram_ratio * self.capacity_tokens())
        return self.dram_tokens or 0

    def dram_config(self) -> DramConfig | None:
        """The DRAM tier's settings, or None; ``ConfigError`` naming the flag when bad."""
        if self.dram_tokens is None and self.dram_ratio is None:
            return None
        try:
            return DramConfig(self.dram_tokens_per_worker(), admit_hits=self.dram_admit_hits)
        except ValueError as e:
            flag = "--dram-admit-hits" if "admit_hits" in str(e) else "--dram-tokens"
            raise ConfigError(flag, str(e)) from None

    def capacity_tokens(self) -> int:
        return self.kv_tokens if self.kv_tokens is not None else self.cost_model().kv_capacity_tokens()

    def scheduler_config(self) -> SchedulerConfig:
        kw: dict[str, Any] = {}
        if self.chunk_tokens is not None:
            kw["chunk_tokens"] = self.chunk_tokens
        if self.max_running is not None:
            kw["max_running"] = self.max_running
        if self.order is not None:
            kw["order"] = self.order
        return SchedulerConfig(**kw)


def engine_help() -> str:
    """The presets, for ``--help``."""
    return (
        "model presets: " + ", ".join(MODELS) + "\n"
        "gpu presets: " + ", ".join(GPUS) + "\n"
        "admission modes: " + ", ".join(ADMISSION_MODES)
    )


def _pack(tokens) -> bytes:
    """``tokenizer.decode`` of generated tokens (whole 4-byte words), in C."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:  # not whole words: the tokenizer's own general path
        return tokenizer.decode(tokens)


def _continue_hashes(data: bytes, hashes: list[int], more: bytes, seed: int, block_bytes: int) -> list[int]:
    """``block_hashes(data + more, seed, block_bytes)`` given ``hashes`` =
    ``block_hashes(data, seed, block_bytes)``: only the blocks from the last whole
    block of ``data`` on are hashed (the chain resumes from its last hash)."""
    whole = len(hashes) * block_bytes
    tail = data[whole:] + more
    if len(tail) < block_bytes:
        return hashes
    return hashes + block_hashes(tail, hashes[-1] if hashes else seed, block_bytes)


class StepOut:
    """What one step (or one fast-forwarded run of decode steps) did."""

    __slots__ = ("duration_s", "first", "finished", "itl")

    def __init__(self, duration_s: float, first: list, finished: list, itl: list) -> None:
        self.duration_s = duration_s
        self.first = first  # jobs whose first token this step produced
        self.finished = finished  # jobs this step completed (cached/output set)
        #: (step duration, tokens after a first token) per step: ITL samples
        self.itl = itl


class _Run:
    """A planned run of ``k`` pure decode steps (see ``SimWorker.start_step``).

    Step i (0-based) lasts ``f(i) = cost.forward_s(cost.decode_flops(b, c_i), c_i)``
    with ``c_i = c_0 + i*b``. The run keeps ``f`` as linear pieces
    ``(i0, n, f(i0), slope)`` so that the time to the end of any step is O(pieces),
    not O(steps): a run's cost does not grow with the tokens it decodes.
    """

    __slots__ = ("start", "b", "k", "pieces", "full")

    def __init__(self, start: float, b: int, k: int, pieces: list, full: bool) -> None:
        self.start = start
        self.b = b  # the running batch's size (fixed for the run)
        self.k = k  # steps planned (cut() may shorten it)
        self.pieces = pieces
        #: the batch is at max_running: an arrival cannot join before the run ends
        self.full = full

    def elapsed(self, j: int) -> float:
        """Duration of the first ``j`` steps."""
        total = 0.0
        for i0, n, f0, slope in self.pieces:
            if j <= i0:
                break
            m = min(n, j - i0)
            total += m * f0 + slope * (m * (m - 1) / 2.0)
        return total

    def samples(self, j: int) -> list[tuple[float, int]]:
        """ITL samples of the first ``j`` steps: per piece, its mean step duration
        weighted by its tokens (steps within a piece differ by ``slope`` each —
        microseconds on a multi-millisecond step)."""
        b = self.b
        out = []
        for i0, n, f0, slope in self.pieces:
            if j <= i0:
                break
            m = min(n, j - i0)
            out.append((f0 + slope * (m - 1) / 2.0, m * b))
        return out


def _linear_pieces(f, lo: int, hi: int, out: list, depth: int = 0) -> None:
    """Splits ``f`` on [lo, hi] into linear pieces. ``f`` (a decode step's roofline
    time against its context) is convex — a max of linear terms — so a piece whose
    midpoint lies on the chord is linear throughout; others are halved."""
    flo = f(lo)
    if hi == lo:
        out.append((lo, 1, flo, 0.0))
        return
    fhi = f(hi)
    slope = (fhi - flo) / (hi - lo)
    if hi - lo >= 2 and depth < 40:
        mid = (lo + hi) // 2
        fm = f(mid)
        if abs(fm - (flo + slope * (mid - lo))) > 1e-12 * max(abs(fm), 1e-30):
            _linear_pieces(f, lo, mid, out, depth + 1)
            _linear_pieces(f, mid + 1, hi, out, depth + 1)
            return
    out.append((lo, hi - lo + 1, flo, slope))


class SimWorker:
    """The agent's engine for one simulated worker. Synchronous; virtual time only.

    The driver calls ``start_step(now)`` when the worker is idle or a step ended,
    and ``end_step(end)`` at the time ``start_step`` returned; ``cut(now)`` when a
    request arrives while a step runs. Steps are the scheduler's own
    (``Scheduler.step``), with one exception that changes no decision:

    **Fast-forward of pure decode.** When nothing is prefilling and nothing can be
    admitted (nothing waits, or the batch is at ``max_running``), the scheduler's
    next steps are decode steps of a fixed batch until its first request finishes,
    and their effects are known in closed form: each request gains one token per
    step, the pool commits one slot per request per step, and step i lasts
    ``cost.forward_s(cost.decode_flops(b, ctx_i), ctx_i)`` with ``ctx_i = ctx_0 +
    i*b``. So the scheduler's ``decode_window()`` steps (up to the first finish - 1)
    are planned as one run and applied with ``Scheduler.decode_many`` at its end —
    or at the end of the step in progress when a new request arrives (``cut``),
    exactly where the scheduler would have admitted it (a full batch admits nothing
    before its first finish, so then an arrival does not cut the run). The step
    that finishes a request is always a real ``step()``.
    ``tests/sim/test_core.py::test_fast_forward_is_exact`` pins that both ways make
    the same decisions and timings (equal up to float rounding: a run sums its
    steps in closed form).
    """

    __slots__ = (
        "id",
        "spec",
        "cost",
        "cache",
        "pool",
        "sched",
        "ns",
        "capacity_tokens",
        "_next_private",
        "block_level",
        "fast_forward",
        "_res",
        "_run",
        "ff_steps",
        "real_steps",
        "_cancels",
    )

    def __init__(
        self, wid: str, spec: EngineSpec, *, block_level: bool, hash_stride: int, fast_forward: bool = True
    ) -> None:
        self.id = wid
        self.spec = spec
        self.block_level = block_level
        self.fast_forward = fast_forward
        self.capacity_tokens = spec.capacity_tokens()
        # the agent's own wiring (radixfleet_tools.agent.server), with its CLI's admission defaults
        self.sched = build_scheduler(
            spec.model,
            spec.gpu,
            tp=spec.tp,
            kv_tokens=self.capacity_tokens,
            page_size=1,
            hash_stride=hash_stride,
            config=spec.scheduler_config(),
            admission=AdmissionConfig(
                spec.admission or "always",
                min_prefix_tokens=spec.min_prefix_tokens,
                protected_fraction=spec.protected_fraction,
                ghost_block_tokens=hash_stride,
            ),
            dram=spec.dram_config(),
        )
        self.cost = self.sched.cost
        self.cache = self.sched.cache
        self.pool = self.sched.pool
        # the agent's namespace for an untenanted request without adapter
        self.ns = (spec.model, "", None)
        self._next_private = PRIVATE_BASE
        self._res: StepResult | None = None  # the scheduler's StepResult of the step in progress
        self._run: _Run | None = None  # or the fast-forwarded run in progress
        self._cancels: list = []  # SchedRequests to cancel before the next step
        self.ff_steps = 0  # decode steps applied by fast-forward
        self.real_steps = 0  # Scheduler.step() calls

    @staticmethod
    def tokenize(data: bytes) -> array:
        """The agent tokenizer's tokens of ``data``, as a cache key."""
        return tokenizer.encode_key(data)

    def submit(self, job, now: float, *, answer: bool, ns_seed: int = 0, block_bytes: int = 0) -> None:
        """Queues ``job``; raises ``PromptTooLarge`` (a ``RequestError``) as the agent
        does. ``answer`` (text level, a conversation goes on): the output is the
        agent's own answer and the request's router hashes run on through it
        (``radixfleet_tools.agent.server`` does the same, so the next turn's blocks are
        reported as it will key them). Otherwise the output is private token ids:
        the same KV, and nobody reads it back."""
        p = job.prompt
        n = job.max_tokens
        hashes = p.hashes
        if answer and p.data is not None:
            output = tokenizer.generate(tokenizer.request_seed(p.data, self.spec.agent_seed), n)
            if block_bytes and tokenizer.is_aligned(p.units):
                hashes = _continue_hashes(p.data, p.hashes, _pack(output), ns_seed, block_bytes)
        else:
            private = self._next_private
            self._next_private = private + 1
            output = array(KEY_TYPECODE, (private,)) * n
        req = SchedRequest(job, self.ns, p.units, n, output, hashes)
        self.sched.submit(req, now)
        job.handle = req

    def has_work(self) -> bool:
        return self.sched.has_work()

    @property
    def stepping(self) -> bool:
        """A step or a fast-forwarded run is in progress."""
        return self._res is not None or self._run is not None

    def start_step(self, now: float) -> float | None:
        """Starts the next step at ``now``; returns when it ends (None: no work)."""
        assert not self.stepping, f"{self.id}: start_step() while a step is in progress"
        sched = self.sched
        if not sched.has_work():
            return None
        if self.fast_forward:
            run = self._plan(now)
            if run is not None:
                self._run = run
                return now + run.elapsed(run.k)
        self._res = res = sched.step(now)
        self.real_steps += 1
        return now + res.duration_s

    def _plan(self, now: float) -> _Run | None:
        sched = self.sched
        k, c0 = sched.decode_window()
        if k < 1:
            return None
        b = len(sched.running)
        fwd, flops = self.cost.forward_s, self.cost.decode_flops

        def f(i: int) -> float:
            c = c0 + i * b
            return fwd(flops(b, c), c)

        pieces: list = []
        _linear_pieces(f, 0, k - 1, pieces)
        return _Run(now, b, k, pieces, b >= sched.config.max_running)

    def cancel(self, job) -> None:
        """The client of ``job`` went away: the agent drops the request before its
        next step (``apply_cancels``), as a live agent does between forward passes.
        The caller cuts a fast-forwarded run (``cut(now, force=True)``) so that the
        next step comes at the end of the step in progress."""
        if job.handle is not None:
            self._cancels.append(job.handle)

    def apply_cancels(self) -> None:
        """Cancels what ``cancel`` queued (``Scheduler.cancel``: its KV returns to the
        pool; a request that finished meanwhile is left as it is). Between steps only."""
        if self._cancels:
            assert not self.stepping, f"{self.id}: apply_cancels() during a step"
            for req in self._cancels:
                self.sched.cancel(req)
            self._cancels.clear()

    def cut(self, now: float, force: bool = False) -> float | None:
        """A request arrived at ``now`` during a fast-forwarded run: the run stops at
        the end of the step in progress (a step ending exactly at ``now`` counts as
        in progress: the request joins the next step, as if it had been submitted
        just before that step ended). Returns the new end time, or None if the end
        did not change (a real step, or the run's last step). A full batch's run is
        not cut for an arrival (nothing could join it), but is with ``force`` (a
        request left it). O(pieces x log k)."""
        run = self._run
        if run is None or (run.full and not force):
            return None
        # the smallest j with start + elapsed(j) >= now: the step in progress is step j
        lo, hi = 1, run.k
        while lo < hi:
            mid = (lo + hi) // 2
            if run.start + run.elapsed(mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        if lo >= run.k:
            return None
        run.k = lo
        return run.start + run.elapsed(lo)

    def end_step(self, now: float) -> StepOut:
        """Applies the step that ends at ``now``; returns what it did."""
        run = self._run
        if run is not None:
            self._run = None
            return self._apply_run(run)
        res = self._res
        assert res is not None, f"{self.id}: end_step() without a step"
        self._res = None
        first = [r.rid for r in res.started]
        finished = []
        for r in res.finished:
            job = r.rid
            job.cached = r.cached
            job.cached_dram = r.cached_dram
            job.output = r.generated
            finished.append(job)
        n = len(res.decoded) - len(res.started)
        return StepOut(res.duration_s, first, finished, [(res.duration_s, n)] if n else [])

    def _apply_run(self, run: _Run) -> StepOut:
        """k decode steps' effects, as ``Scheduler.step`` would have made them."""
        k = run.k
        d = run.elapsed(k)
        self.sched.decode_many(k, d)
        self.ff_steps += k
        return StepOut(d, [], [], run.samples(k))

    @staticmethod
    def answer(job) -> tuple[bytes, list[int]]:
        """The bytes and tokens the agent streamed for a finished job whose answer was
        generated (``submit(answer=True)``)."""
        r = job.handle
        toks = list(r.output[: r.generated])
        return _pack(toks), toks

    def take_events(self) -> list | tuple:
        """The cache's events since the last call, then the DRAM tier's (``"cpu"``-tier
        events, as the live agent's reporter sends them); an empty tuple when none."""
        evs = self.cache.drain_events() if self.cache.pending_events else ()
        dram = self.sched.dram
        if dram is not None and dram.pending_events:
            evs = [*evs, *dram.drain_protocol_events()]
        return evs

    def load_state(self) -> tuple:
        """The agent's load report as a tuple (queued requests, queued tokens,
        running, KV used, KV capacity, prefill tokens/s)."""
        return self.sched.load_values()

    def check(self) -> None:
        if self._run is None:  # mid-run the scheduler's counters lag by design
            self.sched.check()
