"""A clock-agnostic continuous-batching scheduler: a synchronous state machine (contract
4, docs/DESIGN.md).

The scheduler never reads a clock. Whoever drives it passes ``now`` and advances
its own clock by the returned duration, so the HTTP agent (real time) and the
offline simulator (virtual time) run the same code::

    sched.submit(req, now)                  # may raise PromptTooLarge
    while sched.has_work():
        res = sched.step(clock.now())       # what ran and how long it takes
        await clock.sleep(res.duration_s)   # or: t += res.duration_s
        deliver(res.decoded, res.finished)  # first/new tokens, completions

One step = a chunked-prefill slice (at most ``chunk_tokens`` new prompt tokens,
continuing the request whose prefill is in progress first, then admitting waiting
requests in the configured order, ``ORDERS``) + one decode step for every request
whose prefill finished in an earlier step. Its duration is
one forward pass on the roofline, ``cost.forward_s(FLOPs, KV tokens read)``
(compute-bound for long prefills, weight/KV-read-bound for decode and for short
cached prefills); everything the step produces happens at ``now + duration``.

Request lifecycle (only the scheduler changes ``state``)::

    WAITING --admit: match prefix, lock it, reserve KV--> [LOADING -->] PREFILL --last chunk-->
    RUNNING --max_new tokens--> FINISHED            (any state --cancel--> CANCELLED)

Waiting orders (``SchedulerConfig.order``): ``fcfs`` admits the head of the queue;
``lpm`` the longest cached prefix (ties by arrival; SGLang's schedule policy);
``priority`` the lowest ``SchedRequest.priority`` value, ties by arrival -- vLLM's
``--scheduling-policy priority`` (vLLM 0.32: ``config/scheduler.py`` ``policy``,
"lower value means earlier handling and time of arrival deciding any ties";
``v1/core/sched/request_queue.py`` ``PriorityRequestQueue``, a heap ordered by
``Request.__lt__``: priority, then arrival time, then request id). In priority order ``waiting`` is
kept sorted at ``submit`` (an insertion from the tail: O(1) when every request has
one class, at most O(queue)), so its head is always the next admission.

No preemption. vLLM's priority policy preempts the lowest-priority running request
(``max(running, key=(priority, arrival))``, ``v1/core/sched/scheduler.py``) only
when ``allocate_slots`` finds no free KV block for a scheduled request -- decode
growth outrunning the pool. Here admission reserves the whole prompt plus
``max_new`` tokens, so a running request never lacks KV and that trigger cannot
occur; and neither engine preempts to free a batch slot (``max_running`` /
``max_num_seqs``): a waiting high-priority request takes the next one. A prefill in
progress continues first, as vLLM schedules running requests before waiting ones.
Admission order is the whole of the policy, and every invariant of ``check()``
holds as in the other orders (plus: in priority order ``waiting`` is sorted by
(priority, arrival)).

Bulk decode: when nothing is prefilling and nothing can be admitted (the queue is
empty, or the batch is at ``max_running``), the next steps are decode steps of a
fixed batch until its first request finishes. ``decode_window()`` says how many
of them end with no request finishing and what context they start from;
``decode_many(k, duration_s)`` applies ``k`` of them at once -- exactly the state
``k`` calls of ``step()`` would leave -- in O(batch), not O(k x batch). The offline
simulator prices the run itself (``cost.forward_s`` per step, in closed form).

DRAM tier (``dram_tier.DramTier``, optional): at admission a request's whole
256-token chunks are counted by the tier's gate; when the tier holds a longer prefix
than the HBM tree, the difference is read back over PCIe into the request's own KV
(``LOADING``: admitted, KV reserved, waiting for its H2D copy, which is part of its
TTFT; other requests' steps go on meanwhile; a step with nothing else to do lasts
until the copy lands). Completed chunks the tree holds after a prompt insert or a
finish (and the HBM-matched ones at admission) are written down on the tier's own
D2H stream, outside every step's duration: decode is never delayed by it.

Remote KV (disaggregated decode, vLLM's ``kv_transfer_params``): a request whose
prompt's KV a prefill worker computed (``remote``: the prompt tokens it holds) does
not prefill them. At admission the part of them this worker does not hold locally
(tree + DRAM tier) is pulled over the link (``cost.kv_transfer_bytes`` /
``link.transfer_s``, the simulator's functions) into the request's own KV, on the
same ``LOADING`` path as a DRAM read-back: one transfer at a time over this worker's
ingress (a later one queues behind), the last prompt token is computed here (its
logits give the first token), then the prompt is inserted into the tree as any.

Memory: admission reserves the uncached prompt plus ``max_new`` tokens in the
``KVPool`` (evicting cold leaves first); if that cannot fit the request waits at the
head of the queue. When the prompt's prefill completes it is inserted into the radix
tree (admission control may refuse part of it) and the request's lock moves to the
new node; when the request finishes, prompt + generated tokens are inserted (growth
during decode: the next turn of a conversation finds its whole history).

Load report (``load()``): two counts of the queue, each plus the rest of every
admitted prompt still prefilling. ``queued_tokens`` counts every waiting prompt
whole: routing policies and load shedding weigh it (their rules were measured on it;
``radixfleet.route.shedding`` says why it stays whole). ``queued_prefill_tokens`` is what the
queue will prefill as far as the tree tells now: in queue order, a waiting request
with less than ``chunk_tokens`` of prefill ahead of it (the admitted prompts' rest
and the waiting requests before it) counts the tokens its admission would prefill
from the tree as it stands at the report (the prompt less its cached prefix, at
most ``len - 1`` of it, or less the remote KV it will pull; the DRAM tier's part
counts as uncached); every later one counts its whole prompt. Why: counted whole, a
worker with a cached prompt or two waiting reads as seconds of prefill it will not
do. Why whole past one step's budget: a waiting prefix is not locked (an engine pins
KV only at admission; pinning it would take memory from the requests that run), and
a request that waits several steps while others admit and evict often finds its
prefix gone. The count is taken at each report (O(depth) per request within the
budget), so eviction or insertion while a request waits is reflected at once.
``check()``: 0 <= prefill <= whole, and the prefill is that sum recomputed.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixfleet.wire.errors import Overloaded, PromptTooLarge
from radixfleet.wire.events import Load
from radixfleet_tools.agent.cost_model import DEFAULT_LINK, LINKS, CostModel, LinkSpec
from radixfleet_tools.agent.dram_tier import CHUNK_TOKENS, DramConfig, DramTier, chunk_digests
from radixfleet_tools.agent.kv_pool import KVPool
from radixfleet_tools.agent.radix_cache import Node, RadixCache, as_key

ORDERS = ("fcfs", "lpm", "priority")
#: prefill steps smaller than this do not update the measured prefill rate
RATE_MIN_TOKENS = 512


class State(enum.Enum):
    WAITING = "waiting"  # queued, holds nothing
    PREFILL = "prefill"  # admitted: prefix locked, KV reserved, prompt chunks running
    RUNNING = "running"  # prompt done, in the decode batch
    FINISHED = "finished"  # all tokens produced; KV returned to the pool / the tree
    CANCELLED = "cancelled"  # dropped by the caller; KV returned


class SchedRequest:
    """One request as the scheduler sees it.

    ``prompt``: token ids (``submit`` replaces them by the same ids as a cache key,
    ``radix_cache.as_key``: no copy when they already are one). ``output``: the
    tokens decoding produces, in order (at least ``max_new`` of them; empty:
    generated tokens are counted but not inserted).
    ``hashes``: router block hashes of ``prompt + output`` (may stop early).
    ``waiter`` is the driver's slot (e.g. an ``asyncio.Event``); never touched here.
    ``priority``: its scheduling priority, lower first (vLLM's request ``priority``);
    only the ``priority`` order reads it.
    """

    __slots__ = (
        "rid",
        "ns",
        "prompt",
        "max_new",
        "output",
        "hashes",
        "arrival",
        "priority",
        "state",
        "cached",
        "prefilled",
        "generated",
        "private",
        "reserved",
        "node",
        "prompt_held",
        "cached_dram",
        "ready_at",
        "digests",
        "remote",
        "transferred",
        "first_token_at",
        "finished_at",
        "waiter",
    )

    def __init__(
        self,
        rid: Any,
        ns: Hashable,
        prompt: Sequence[int],
        max_new: int,
        output: Sequence[int] = (),
        hashes: Sequence[int] | None = None,
        priority: int = 0,
    ) -> None:
        self.rid = rid
        self.ns = ns
        self.prompt = prompt
        self.max_new = max_new
        self.output = output
        self.hashes = hashes
        self.arrival = 0.0
        self.priority = priority
        self.state = State.WAITING
        #: prompt tokens reused from the tree at admission
        self.cached = 0
        #: prompt tokens with KV so far (cached + computed)
        self.prefilled = 0
        self.generated = 0
        #: this request's KV outside the tree, and its unused reservation
        self.private = 0
        self.reserved = 0
        #: the tree node this request holds a lock on
        self.node: Node | None = None
        #: prompt tokens the tree held after the prompt insert
        self.prompt_held = 0
        #: prompt tokens of ``cached`` read back from the DRAM tier, and when they land
        self.cached_dram = 0
        self.ready_at = 0.0
        #: the DRAM tier's chunk digests of the prompt (None: no tier)
        self.digests: list[int] | None = None
        #: prompt tokens whose KV a remote prefill worker holds for this request (set
        #: by the caller before ``submit``; 0: none), and those pulled at admission
        self.remote = 0
        self.transferred = 0
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.waiter: Any = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    def __repr__(self) -> str:
        return (
            f"SchedRequest({self.rid!r}, {self.state.value}, prompt={len(self.prompt)}, "
            f"cached={self.cached}, gen={self.generated}/{self.max_new})"
        )


@dataclass(slots=True)
class SchedulerConfig:
    #: prefill token budget of one step (SGLang's chunked_prefill_size)
    chunk_tokens: int = 8192
    #: most requests admitted at once (prefilling + decoding)
    max_running: int = 256
    #: waiting order: "fcfs", "lpm" (longest cached prefix first) or "priority"
    #: (lowest ``SchedRequest.priority`` first, ties by arrival)
    order: str = "fcfs"
    #: above this queue length lpm falls back to fcfs (SGLang does the same: cost)
    lpm_max_queue: int = 128
    #: most requests waiting; a submit past it is refused with ``Overloaded`` (429 +
    #: Retry-After from the agent). 0: unbounded (the offline simulator's default;
    #: ``radixfleet agent`` sets 4 x max_running)
    max_waiting: int = 0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} is not one of {', '.join(ORDERS)}")
        if self.chunk_tokens <= 0 or self.max_running <= 0:
            raise ValueError("chunk_tokens and max_running must be positive")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0 (0: unbounded)")


@dataclass(slots=True)
class StepResult:
    """What one step did. Times are the step's start; effects land at start + duration."""

    duration_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_batch: int = 0
    #: requests whose first token this step produced (also in ``decoded``)
    started: list = field(default_factory=list)
    #: requests that got at least one new token
    decoded: list = field(default_factory=list)
    finished: list = field(default_factory=list)


@dataclass(slots=True)
class SchedStats:
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    #: prompt tokens of admitted requests, and those served from the tree
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    prefill_busy_s: float = 0.0
    #: admissions that had to wait for KV
    kv_waits: int = 0
    #: prompt tokens of ``cached_tokens`` read back from the DRAM tier
    dram_cached_tokens: int = 0
    #: requests that pulled a remote prefill's KV, its tokens and bytes (not in
    #: ``cached_tokens``: those count what this worker held itself)
    kv_transfers_in: int = 0
    kv_transferred_in_tokens: int = 0
    kv_transferred_in_bytes: float = 0.0


class Scheduler:
    """Continuous batching over a ``RadixCache`` + ``KVPool`` priced by a ``CostModel``."""

    def __init__(
        self,
        cost: CostModel,
        cache: RadixCache,
        pool: KVPool,
        config: SchedulerConfig | None = None,
        dram: DramTier | None = None,
        link: LinkSpec | None = None,
    ) -> None:
        """``link``: what remote KV arrives over (default ``LINKS[DEFAULT_LINK]``)."""
        if pool.cache is not cache:
            raise ValueError("the pool must account for the same cache")
        self.cost = cost
        self.cache = cache
        self.pool = pool
        self.config = config or SchedulerConfig()
        self.stats = SchedStats()
        #: only the scheduler moves requests between these
        self.waiting: deque[SchedRequest] = deque()
        self.prefilling: deque[SchedRequest] = deque()
        #: admitted requests waiting for their DRAM read-back to land
        self.loading: list[SchedRequest] = []
        #: the DRAM tier below the tree (None: HBM only)
        self.dram = dram
        self.link = link or LINKS[DEFAULT_LINK]
        #: when this worker's link ingress is free (remote KV transfers queue on it)
        self._ingress_free = 0.0
        #: write-downs of the step in progress: (chunk digests, tokens held, hashes)
        self._writes: list[tuple[list[int], int, Any]] = []
        self.running: list[SchedRequest] = []
        #: prompt tokens of ``waiting``, whole
        self._queued_tokens = 0
        self._rate_tokens = 0.0
        self._rate_time = 0.0

    # ------------------------------------------------------------ intake

    def submit(self, req: SchedRequest, now: float) -> None:
        """Queues ``req``. Raises ``PromptTooLarge`` when it can never fit the pool,
        ``Overloaded`` when ``max_waiting`` requests already wait; before raising
        either, withdraws the router's hint: the router inserted the request's blocks
        for this worker at pick time, so ``Removed`` events go out for the prompt's
        whole blocks the cache does not hold (``RadixCache.report_unheld``). The HTTP
        agent and the simulator both get this by calling ``submit``."""
        need = len(req.prompt) + req.max_new
        if not req.prompt:
            raise ValueError("a request needs at least one prompt token")
        if need > self.pool.capacity:
            if req.hashes and self.cache.hash_stride:
                self.cache.report_unheld(
                    req.ns, req.prompt, req.hashes[: len(req.prompt) // self.cache.hash_stride]
                )
            raise PromptTooLarge(
                f"prompt of {len(req.prompt)} tokens plus max_tokens {req.max_new} needs "
                f"{need} KV tokens; this worker's KV pool holds {self.pool.capacity}",
                param="prompt",
            )
        if req.output and len(req.output) < req.max_new:
            raise ValueError("output must hold at least max_new tokens")
        cap = self.config.max_waiting
        if cap and len(self.waiting) >= cap:
            if req.hashes and self.cache.hash_stride:
                self.cache.report_unheld(
                    req.ns, req.prompt, req.hashes[: len(req.prompt) // self.cache.hash_stride]
                )
            rate = self.prefill_tokens_per_s() or 1.0
            raise Overloaded(
                f"{len(self.waiting)} requests already wait on this worker (max_waiting {cap}); retry later",
                retry_after_s=self.queued_prefill_tokens() / rate,
            )
        # one conversion per request: every cache call then compares in C
        req.prompt = as_key(req.prompt)
        req.arrival = now
        req.state = State.WAITING
        self._enqueue(req)
        self._queued_tokens += len(req.prompt)
        self.stats.submitted += 1

    def _enqueue(self, req: SchedRequest) -> None:
        """Appends ``req``; in priority order, behind the last request of its priority
        or a higher one (a lower value) -- the queue stays sorted by (priority, arrival)."""
        waiting = self.waiting
        if self.config.order != "priority" or not waiting or waiting[-1].priority <= req.priority:
            waiting.append(req)
            return
        i = len(waiting) - 1
        p = req.priority
        while i > 0 and waiting[i - 1].priority > p:
            i -= 1
        waiting.insert(i, req)

    def cancel(self, req: SchedRequest) -> None:
        """Drops ``req`` wherever it is and returns its KV; idempotent."""
        st = req.state
        if st is State.WAITING:
            try:
                self.waiting.remove(req)
                self._queued_tokens -= len(req.prompt)
            except ValueError:
                pass
        elif st is State.PREFILL:
            if req in self.loading:
                self.loading.remove(req)
            else:
                self.prefilling.remove(req)
            self._release(req)
        elif st is State.RUNNING:
            self.running.remove(req)
            self._release(req)
        else:
            return
        if st is not State.RUNNING and req.hashes:
            # the router may have inserted the prompt optimistically; it is not here
            self.cache.report_unheld(req.ns, req.prompt, req.hashes[: len(req.prompt) // self._stride()])
        req.state = State.CANCELLED
        self.stats.cancelled += 1

    def _stride(self) -> int:
        return self.cache.hash_stride or 1

    def _release(self, req: SchedRequest) -> None:
        self.cache.dec_lock_ref(req.node)
        req.node = None
        self.pool.release(req.private, req.reserved)
        req.private = req.reserved = 0

    # ------------------------------------------------------------ the step

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.loading)

    def _next_waiting(self) -> SchedRequest:
        """The next request to admit: the head (fcfs; priority, whose queue ``submit``
        keeps sorted) or the longest cached prefix (lpm; ties by arrival). O(1) for
        fcfs and priority, O(queue x prompt) for lpm."""
        cfg = self.config
        if cfg.order == "lpm" and 1 < len(self.waiting) <= cfg.lpm_max_queue:
            peek = self.cache.peek
            best, best_len = self.waiting[0], -1
            for r in self.waiting:
                n = peek(r.ns, r.prompt)
                if n > best_len:
                    best, best_len = r, n
            return best
        return self.waiting[0]

    def _admit(self, req: SchedRequest, now: float) -> bool:
        prompt = req.prompt
        # at least one prompt token is computed: its logits give the first token
        cached, node = self.cache.match_prefix(req.ns, prompt, len(prompt) - 1)
        dram = self.dram
        extra = 0
        if dram is not None:
            if req.digests is None:
                req.digests = chunk_digests(req.ns, as_key(prompt))
                dram.count(req.digests)
            extra = max(0, min(dram.match(req.digests), len(prompt) - 1) - cached)
        self.cache.inc_lock_ref(node)
        need = len(prompt) - cached + req.max_new
        if not self.pool.reserve(need):
            self.cache.dec_lock_ref(node)
            self.stats.kv_waits += 1
            return False
        req.node = node
        req.cached = req.prefilled = cached
        req.reserved = need
        req.state = State.PREFILL
        self._queued_tokens -= len(prompt)
        self.stats.prompt_tokens += len(prompt)
        if dram is not None and req.digests:
            assert req.digests is not None
            # the HBM-matched chunks this request made hot enough go down now
            dram.write_down(req.digests, cached, req.hashes, now)
        if extra:
            # the read-back tokens become this request's own KV, as if prefilled
            self.pool.commit(extra)
            req.reserved -= extra
            req.private += extra
            req.prefilled += extra
            req.cached += extra
            req.cached_dram = extra
            assert dram is not None
            req.ready_at = dram.read_back(extra, now)
            self.stats.dram_cached_tokens += extra
        if req.remote:
            self._pull(req, now)
        self.stats.cached_tokens += req.cached
        return True

    def _pull(self, req: SchedRequest, now: float) -> None:
        """Admission's remote-KV transfer (module docstring): the remote prompt
        tokens past what this worker holds become ``req``'s own KV, landing when the
        link has moved them. Needs their KV reserved (``_admit`` reserved the whole
        uncached prompt)."""
        n = max(0, min(req.remote, len(req.prompt) - 1) - req.prefilled)
        if not n:
            return
        self.pool.commit(n)
        req.reserved -= n
        req.private += n
        req.prefilled += n
        req.transferred = n
        nbytes = self.cost.kv_transfer_bytes(n)
        start = max(now, self._ingress_free)
        self._ingress_free = start + self.link.transfer_s(nbytes)
        req.ready_at = max(req.ready_at, self._ingress_free)
        st = self.stats
        st.kv_transfers_in += 1
        st.kv_transferred_in_tokens += n
        st.kv_transferred_in_bytes += nbytes

    def step(self, now: float) -> StepResult:
        """Runs one step starting at ``now``; see the module docstring."""
        res = StepResult()
        if self.dram is not None:
            self.dram.advance(now)
        if self.loading:  # read-backs that landed join the prefill queue, in admission order
            landed = [r for r in self.loading if r.ready_at <= now]
            if landed:
                self.loading = [r for r in self.loading if r.ready_at > now]
                self.prefilling.extend(landed)
        batch = self.running
        self.running = []
        cost, pool = self.cost, self.pool
        budget = self.config.chunk_tokens
        flops = 0.0
        kv_read = 0
        # 1. prefill slice: the request in progress first, then new admissions
        admitted_any = True
        while budget > 0:
            if self.prefilling:
                req = self.prefilling[0]
            elif (
                self.waiting
                and admitted_any
                and (
                    len(batch) + len(self.prefilling) + len(self.loading) + len(res.started)
                    < self.config.max_running
                )
            ):
                # one at a time: the remaining budget decides how many fit this step
                cand = self._next_waiting()
                admitted_any = self._admit(cand, now)
                if not admitted_any:
                    break  # no KV for it: it waits at the head (no overtaking)
                if cand is self.waiting[0]:
                    self.waiting.popleft()
                else:
                    self.waiting.remove(cand)
                if cand.ready_at > now:
                    self.loading.append(cand)
                else:
                    self.prefilling.append(cand)
                continue
            else:
                break
            chunk = min(len(req.prompt) - req.prefilled, budget)
            flops += cost.prefill_flops(chunk, req.prefilled)
            kv_read += req.prefilled + chunk
            pool.commit(chunk)
            req.reserved -= chunk
            req.private += chunk
            req.prefilled += chunk
            budget -= chunk
            res.prefill_tokens += chunk
            if req.prefilled == len(req.prompt):
                self.prefilling.popleft()
                self._prompt_done(req, res)
        # 2. one decode step for the batch that was running at the start
        ctx = 0
        if batch:
            for req in batch:
                ctx += len(req.prompt) + req.generated
                req.generated += 1
                req.reserved -= 1
                req.private += 1
            pool.commit(len(batch))
            res.decode_batch = len(batch)
            res.decoded.extend(batch)
            self.stats.decode_tokens += len(batch)
            flops += cost.decode_flops(len(batch), ctx)
            kv_read += ctx
        if res.prefill_tokens or batch:
            duration = cost.forward_s(flops, kv_read)
        elif self.loading:  # nothing to compute: wait for the first read-back to land
            duration = min(r.ready_at for r in self.loading) - now
        else:
            duration = 0.0
        res.duration_s = duration
        prefill_s = duration if res.prefill_tokens else 0.0
        res.prefill_s = prefill_s
        end = now + duration
        for req in batch:
            if req.generated >= req.max_new:
                self._finish(req, res)
            else:
                self.running.append(req)
        # requests that finished prefill this step join the next decode step
        for req in res.started:
            req.first_token_at = end
            if req.state is State.RUNNING:
                self.running.append(req)
        for req in res.finished:
            req.finished_at = end
        if self._writes:  # the chunks completed in this step: copied from its end on
            assert self.dram is not None
            for digests, held, hashes in self._writes:
                self.dram.write_down(digests, held, hashes, end)
            self._writes.clear()
        st = self.stats
        st.steps += 1
        st.busy_s += duration
        if res.prefill_tokens:
            st.prefill_tokens += res.prefill_tokens
            st.prefill_busy_s += prefill_s
            if res.prefill_tokens >= RATE_MIN_TOKENS and prefill_s > 0:
                # token-weighted decayed sums: big prefills say what a prompt costs
                self._rate_tokens = 0.9 * self._rate_tokens + res.prefill_tokens
                self._rate_time = 0.9 * self._rate_time + prefill_s
        return res

    def _prompt_done(self, req: SchedRequest, res: StepResult) -> None:
        # the walk resumes at the locked match: only the uncached part is compared
        held, node = self.cache.insert(
            req.ns, req.prompt, req.hashes, admit_from=0, below=req.node, lock=True
        )
        self._move_lock(req, node, held)
        req.prompt_held = held
        if self.dram is not None and req.digests:
            self._writes.append((req.digests, held, req.hashes))
        res.started.append(req)
        if req.max_new >= 1:
            req.generated = 1
            req.reserved -= 1
            req.private += 1
            self.pool.commit(1)
            res.decoded.append(req)
            self.stats.decode_tokens += 1
        if req.generated >= req.max_new:
            self._finish(req, res)
        else:
            req.state = State.RUNNING

    def _move_lock(self, req: SchedRequest, node: Node | None, held: int) -> None:
        """Moves the request's lock to ``node`` (already locked by ``insert(lock=True)``)."""
        self.cache.dec_lock_ref(req.node)
        req.node = node
        own = req.prefilled + req.generated - held
        self.pool.private -= req.private - own
        req.private = own

    def _finish(self, req: SchedRequest, res: StepResult) -> None:
        # growth during decode: keep the answer, except the last sampled token
        # (its KV is computed only by the next forward pass)
        n_out = req.generated - 1
        whole = len(req.prompt) - len(req.prompt) % self.cache.page_size
        if n_out > 0 and req.output and req.prompt_held >= whole:
            key = as_key(req.prompt) + as_key(req.output[:n_out])  # the prompt already is a key: no copy
            held, node = self.cache.insert(
                req.ns, key, req.hashes, admit_from=len(req.prompt), below=req.node, lock=True
            )
            self._move_lock(req, node, held)
            dram = self.dram
            if dram is not None and req.digests is not None and len(key) // CHUNK_TOKENS > len(req.digests):
                # growth: the answer's chunks, reached by this request
                more = chunk_digests(req.ns, key, req.digests[-1] if req.digests else None, len(req.digests))
                dram.count(more)
                self._writes.append((req.digests + more, held, req.hashes))
        self._release(req)
        req.state = State.FINISHED
        res.finished.append(req)
        self.stats.finished += 1

    # ------------------------------------------------------------ bulk decode

    def decode_window(self) -> tuple[int, int]:
        """``(k, context)``: the next ``k`` steps are certain to be pure decode steps
        of the running batch in which no request finishes, the first of them reading
        ``context`` KV tokens (each later one reads ``len(running)`` more). ``k`` is 0
        unless nothing is prefilling and nothing can be admitted -- the queue is
        empty, or the batch is at ``max_running`` -- and is then (steps to the first
        finish) - 1: the finishing step is always a real ``step()``. O(batch)."""
        batch = self.running
        if (
            not batch
            or self.prefilling
            or self.loading  # a read-back landing mid-run joins the next step
            or (self.waiting and len(batch) < self.config.max_running)
        ):
            return 0, 0
        left = batch[0].max_new
        ctx = 0
        for r in batch:  # one pass: the run's length and its first context
            g = r.generated
            ctx += len(r.prompt) + g
            if r.max_new - g < left:
                left = r.max_new - g
        left -= 1
        return (left, ctx) if left >= 1 else (0, 0)

    def decode_many(self, k: int, duration_s: float) -> None:
        """Applies ``k`` pure decode steps of the running batch at once, lasting
        ``duration_s`` in all: the state ``k`` calls of ``step()`` would leave, given
        that ``k <= decode_window()[0]`` when the first of them started (requests
        submitted since wait for the next ``step()``, as they would have). Every
        running request gains ``k`` tokens and the pool commits ``k`` slots each.
        O(batch). Raises ``ValueError`` when ``k`` steps would finish a request."""
        batch = self.running
        if k <= 0:
            return
        if not batch or self.prefilling or self.loading or min(r.max_new - r.generated for r in batch) <= k:
            raise ValueError(
                f"decode_many({k}): only decode_window()'s steps can be "
                "applied in bulk; the finishing step must be a step() call"
            )
        for r in batch:
            r.generated += k
            r.reserved -= k
            r.private += k
        n = k * len(batch)
        self.pool.commit(n)
        st = self.stats
        st.decode_tokens += n
        st.steps += k
        st.busy_s += duration_s

    # ------------------------------------------------------------ reporting

    def _uncached(self, req: SchedRequest) -> int:
        """The prompt tokens ``req``'s admission would prefill from the tree as it
        stands: all but its cached prefix (at most ``len - 1``: the last token is
        always computed) or the remote KV it would pull, whichever covers more.
        The DRAM tier's part counts as uncached (its read-back is not free, and
        matching it would count its chunks as sightings). No side effects."""
        n = len(req.prompt)
        covered = self.cache.peek(req.ns, req.prompt, n - 1)
        if req.remote:
            r = min(req.remote, n - 1)
            if r > covered:
                covered = r
        return n - covered

    def _admitted_prefill(self) -> int:
        """Prompt tokens admitted requests have still to prefill."""
        n = 0
        for r in self.prefilling:
            n += len(r.prompt) - r.prefilled
        for r in self.loading:
            n += len(r.prompt) - r.prefilled
        return n

    def queued_prefill_tokens(self, admitted: int | None = None) -> int:
        """The waiting queue's prefill (module docstring, "Load report"): in queue
        order, a request with less than ``chunk_tokens`` of prefill ahead of it
        (``admitted``, the admitted prompts' rest, default computed, plus the
        waiting requests before it) counts its uncached tokens, any later one its
        whole prompt. O(depth) per request within the budget, O(1) past it."""
        ahead = self._admitted_prefill() if admitted is None else admitted
        budget = self.config.chunk_tokens
        total = whole = 0  # counted so far, and those requests' whole prompts
        for r in self.waiting:
            if ahead >= budget:  # the rest wait steps, their prefixes evictable: whole
                return total + self._queued_tokens - whole
            u = self._uncached(r)
            total += u
            ahead += u
            whole += len(r.prompt)
        return total

    def prefill_tokens_per_s(self) -> float:
        """Measured prefill throughput: decayed, token-weighted tokens/s over steps that
        prefilled at least ``RATE_MIN_TOKENS`` (short prefills are bound by the weight
        read and would make every prompt look slow to a router that divides uncached
        tokens by this rate). Before any such step: the model's rate for one chunk."""
        if self._rate_time > 0:
            return self._rate_tokens / self._rate_time
        n = self.config.chunk_tokens
        return n / self.cost.forward_s(self.cost.prefill_flops(n), n)

    def load(self) -> Load:
        return Load(*self.load_values())

    def load_values(self) -> tuple[int, int, int, int, int, float, int]:
        """``load()`` as a plain tuple in ``Load``'s field order (queued requests,
        queued tokens, running, KV used, KV capacity, prefill tokens/s, queued
        prefill tokens): the simulator records one after every step and compares it
        with the last."""
        pool = self.pool
        admitted = self._admitted_prefill()
        return (
            len(self.waiting),
            self._queued_tokens + admitted,
            len(self.running) + len(self.prefilling) + len(self.loading),
            pool.used,
            pool.capacity,
            float(self.prefill_tokens_per_s()),
            self.queued_prefill_tokens(admitted) + admitted,
        )

    def check(self) -> None:
        """Asserts the scheduler's, the pool's and the cache's invariants."""
        self.cache.check()
        self.pool.check()
        private = reserved = 0
        for r in self.waiting:
            assert r.state is State.WAITING and r.node is None and not r.private, f"{r=}"
        for r in (*self.prefilling, *self.loading):
            assert r.state is State.PREFILL, f"{r=}"
        for r in self.running:
            assert r.state is State.RUNNING and r.generated < r.max_new, f"{r=}"
        if self.dram is not None:
            self.dram.check()
        for r in (*self.prefilling, *self.loading, *self.running):
            assert r.node is None or r.node.lock_ref > 0, f"{r=}"
            private += r.private
            reserved += r.reserved
        assert private == self.pool.private, (private, self.pool.private)
        assert reserved == self.pool.reserved, (reserved, self.pool.reserved)
        assert self._queued_tokens == sum(len(r.prompt) for r in self.waiting)
        prefill = self.queued_prefill_tokens()
        assert 0 <= prefill <= self._queued_tokens, (prefill, self._queued_tokens)
        ahead, budget, left = self._admitted_prefill(), self.config.chunk_tokens, prefill
        for r in self.waiting:  # within the budget uncached, past it whole
            u = self._uncached(r) if ahead < budget else len(r.prompt)
            ahead += u
            left -= u
        assert left == 0, (prefill, left)
        if self.config.order == "priority":
            order = [(r.priority, r.arrival) for r in self.waiting]
            assert order == sorted(order), f"waiting not in (priority, arrival) order: {order}"


def build_scheduler(
    model: str = "llama-3-8b",
    gpu: str = "h100",
    *,
    tp: int = 1,
    mfu: float = 0.6,
    kv_tokens: int | None = None,
    page_size: int = 1,
    hash_stride: int | None = None,
    admission=None,
    config: SchedulerConfig | None = None,
    fingerprint=None,
    record_events: bool = True,
    disable_radix_cache: bool = False,
    dram: DramConfig | None = None,
    link: LinkSpec | None = None,
) -> Scheduler:
    """One simulated worker: cost model, radix cache, KV pool and scheduler wired together.

    ``kv_tokens`` None sizes the pool from the presets (``CostModel.kv_capacity_tokens``,
    which raises ``ConfigError`` if the weights do not fit). ``hash_stride`` is tokens
    per router block (None: no router hashes, no events). The offline simulator calls
    this with ``record_events=False`` and its own page size. ``disable_radix_cache``:
    no prefix reuse at all (``RadixCache(disabled=True)``): every prompt is computed
    whole and its KV freed when the request ends. ``dram``: a DRAM tier below the tree
    (``dram_tier``; None: HBM only). ``link``: what remote KV arrives over (None:
    ``LINKS[DEFAULT_LINK]``).
    """
    cost = CostModel(model, gpu, tp=tp, mfu=mfu)
    capacity = kv_tokens if kv_tokens is not None else cost.kv_capacity_tokens()
    cache = RadixCache(
        page_size=page_size,
        hash_stride=hash_stride,
        capacity_tokens=capacity,
        admission=admission,
        fingerprint=fingerprint,
        record_events=record_events,
        disabled=disable_radix_cache,
    )
    tier = DramTier(dram, cost, hash_stride=hash_stride) if dram is not None else None
    return Scheduler(cost, cache, KVPool(capacity, cache), config, tier, link)
