"""What a routing policy sees and returns (contract 3, docs/DESIGN.md): narrow, typed, read-only.

A policy never touches the prefix index or the worker pool. The router (live) and
the simulator (virtual time) each build, per request::

    RouteRequest  -- the request's prefix key, reduced to what a policy needs
    MatchResult   -- per worker, how many leading blocks it holds (from the index)
    WorkerView[]  -- per routable worker, its load as of pick time

and call ``policy.choose(request, match, views, now) -> Decision``. ``views`` holds
only routable workers (healthy, breaker closed, not draining) and is never empty:
the caller answers "no worker" itself. Policies draw randomness only from the
``random.Random`` they were constructed with, so a seed reproduces every decision.

After the choice the caller inserts the request's hashes for the chosen worker into
its index (an optimistic hint) and counts the request's load on that worker *at
pick time*, before the next request is routed.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from radixfleet.keys import WorkerId


class Reason(str, enum.Enum):
    """Why a worker was chosen; a label of the router's request metrics."""

    AFFINITY = "affinity"  # the best-matching worker, load allowing
    SPILL_LOAD = "spill_load"  # a match existed but its holder was too loaded
    REPLICA = "replica"  # a hot prefix's extra holder
    MISS = "miss"  # no useful match: least-loaded worker
    BALANCE = "balance"  # fleet imbalanced: least-loaded worker (cache_aware)
    HASH = "hash"  # consistent hashing
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOAD = "least_load"
    FALLBACK = "fallback"  # a retry after the first choice failed


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request as a policy sees it."""

    #: chained block hashes of the routing text (radixfleet.keys)
    hashes: Sequence[int]
    #: estimated prompt tokens
    prompt_tokens: int
    #: tokens per routing block
    block_tokens: int
    #: a session affinity key (header or ``user`` field), if the client gave one
    session: str | None = None
    model: str = ""
    #: characters of routing text, for SGLang's char-based cache_aware match rate
    text_len: int = 0


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The index's answer for one request.

    ``blocks[w]`` is the number of leading blocks of the request that worker ``w``
    holds (absent means 0). ``depth`` is the deepest block of the request present
    in the index for any worker; ``rate`` is the decayed request rate (requests/s)
    through that node — the hot-root signal (workers with ``blocks[w] >= depth``
    are that prefix's holders). ``private``: no earlier request went through that
    node lately (its decayed count, this request aside, is under one half) — the
    match is one session's own context, e.g. a conversation's previous turn, not a
    prefix that other requests share.
    """

    blocks: Mapping[WorkerId, int]
    depth: int = 0
    rate: float = 0.0
    private: bool = False
    #: colder KV tiers (the worker's engine offloaded blocks to CPU memory or disk):
    #: per worker, the GPU-hit-equivalent blocks they add beyond ``blocks[w]`` — the
    #: blocks a colder tier extends its GPU prefix by, times the share of a GPU hit
    #: their learned price leaves (saved prefill minus the load back:
    #: radixfleet.engines.tier_price). None: nothing colder matched (or no tiers known).
    colder: Mapping[WorkerId, float] | None = None

    @property
    def best(self) -> int:
        return max(self.blocks.values(), default=0)

    def priced(self) -> Mapping[WorkerId, float]:
        """``blocks`` with each worker's ``colder`` added: what a policy values a
        worker's match at, in GPU-hit blocks (``blocks`` itself without colder)."""
        c = self.colder
        if not c:
            return self.blocks
        out: dict[WorkerId, float] = dict(self.blocks)
        for w, x in c.items():
            out[w] = out.get(w, 0) + x
        return out


EMPTY_MATCH = MatchResult({})


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One routable worker's load as of pick time. Read-only to policies."""

    id: WorkerId
    #: requests the router has sent and not yet seen finish (counted at pick time)
    in_flight: int = 0
    #: prompt tokens of those requests not yet known to be prefilled — their
    #: uncached part, ``prompt_tokens - Decision.matched_blocks * block_tokens``, is
    #: the prefill work prefix_load's queue model assumes (radixfleet/policies/prefix_load.py)
    in_flight_tokens: int = 0
    #: the agent's last report, zeroed once stale
    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    #: measured (or configured) prefill throughput, tokens/s
    prefill_tokens_per_s: float = 10_000.0
    #: relative capacity weight (consistent hashing, weighted policies)
    weight: float = 1.0
    #: the prompt tokens of the router's requests in flight, until they finish: the
    #: KV they hold while decoding, a shared prefix counted in each (``radixfleet.fleet.pool``)
    in_flight_kv_tokens: int = 0
    #: the router refused a request this worker could have served within the last
    #: few seconds (``radixfleet.route.shedding.CALM_S``): every worker serving its model was
    #: past the shedding bound then, so its queue is held at that bound, not below it
    saturated: bool = False

    @property
    def load_tokens(self) -> int:
        """Prefill work ahead of a new request: in-flight plus reported queue."""
        return self.in_flight_tokens + self.queued_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's choice and why."""

    worker: WorkerId
    reason: Reason
    #: leading blocks the chosen worker was believed to hold
    matched_blocks: int = 0
    #: the policy's estimate of time to first token, seconds (prefix_load), else None
    expected_ttft_s: float | None = None
    #: workers that a prefill-only warm-up should be sent to (hot-root replication)
    warm: tuple[WorkerId, ...] = ()


@dataclass(frozen=True, slots=True)
class Candidate:
    """One eligible worker as a decision weighed it (``Explanation.candidates``). Tokens are
    the policy's view: the primary key space's blocks times its ``block_tokens``."""

    worker: WorkerId
    #: the leading prompt tokens its GPU cache held, as the index said at pick time
    matched_tokens: int
    #: seconds of prefill queued ahead of the request there (load at pick time)
    queue_s: float
    in_flight: int
    #: refused a request it could serve lately (``WorkerView.saturated``)
    saturated: bool = False
    #: the match the policy credited (0: none counted: short, over the affinity
    #: bound, churning, crowded, masked); None: the policy does not say
    counted_tokens: int | None = None
    #: the policy's score, lower wins (prefix_load: seconds); None: it scores none
    score: float | None = None
    #: the policy's time-to-first-token estimate there; None: it makes none
    expected_ttft_s: float | None = None


class Explanation:
    """Why a decision went where it went, kept cheaply and computed when read.

    ``Policy.explain`` builds one right after its ``choose`` from references to what
    that computed (nothing is copied or derived on the request path: O(1));
    ``candidates`` derives each eligible worker's figures when someone reads them
    (``GET /admin/decisions``). ``queues`` (per view, the queue delay the policy
    priced) and ``scores`` (per view, (score, credited blocks)) are the policy's own
    lists, None where it has none; nobody mutates them afterwards. ``saturated``:
    the policy's saturated-fleet rules decided (prefix_load: a holder kept its
    request whatever the score, or a prefix's home took it)."""

    __slots__ = ("request", "match", "views", "decision", "queues", "scores", "saturated")

    def __init__(
        self,
        request: RouteRequest,
        match: MatchResult,
        views: Sequence[WorkerView],
        decision: Decision,
        queues: Sequence[float] | None = None,
        scores: Sequence[tuple[float, float]] | None = None,
        saturated: bool = False,
    ) -> None:
        self.request = request
        self.match = match
        self.views = views
        self.decision = decision
        self.queues = queues
        self.scores = scores
        self.saturated = saturated

    @property
    def eligible(self) -> int:
        return len(self.views)

    def candidates(self, limit: int) -> list[Candidate]:
        """At most ``limit`` candidates: the chosen worker first, then by score (lowest
        first), then the longest match, then the least queue. ``expected_ttft_s`` is
        the queue plus the prefill of what the credited match (else the held match)
        leaves, where the policy priced queues. O(n log n)."""
        blocks, bt, prompt = self.match.blocks, self.request.block_tokens, self.request.prompt_tokens
        qs, ss = self.queues, self.scores
        out = []
        for i, v in enumerate(self.views):
            held = blocks.get(v.id, 0) * bt
            q = qs[i] if qs is not None else _queue_s(v)
            score = counted = ttft = None
            if ss is not None:
                score, b = ss[i]
                counted = int(b * bt)
            if qs is not None:
                unc = prompt - (held if counted is None else counted)
                ttft = q + (unc if unc > 0 else 0) / v.prefill_tokens_per_s
            out.append(Candidate(v.id, held, q, v.in_flight, v.saturated, counted, score, ttft))
        chosen = self.decision.worker
        inf = float("inf")
        out.sort(
            key=lambda c: (
                c.worker != chosen,
                inf if c.score is None else c.score,
                -c.matched_tokens,
                c.queue_s,
            )
        )
        return out[:limit]


def _queue_s(v: WorkerView) -> float:
    """Seconds of prefill ahead on ``v``: the larger of the router's count and the
    worker's report (prefix_load's queue_s before saturation's rules)."""
    return max(v.in_flight_tokens, v.queued_tokens) / v.prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Base of each policy's parameter dataclass (validated from YAML)."""


class Policy:
    """Base of routing strategies. Subclasses set ``name`` and ``Params``.

    ``choose`` must be pure but for ``self.rng`` and the policy's own small state
    (a round-robin cursor, a ring): no I/O, no clocks (``now`` is passed in).
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[PolicyParams]] = PolicyParams

    def __init__(self, params: PolicyParams | None = None, rng: random.Random | None = None):
        self.params = params if params is not None else self.Params()
        self.rng = rng if rng is not None else random.Random(0)

    def choose(
        self,
        request: RouteRequest,
        match: MatchResult,
        views: Sequence[WorkerView],
        now: float,
    ) -> Decision:
        raise NotImplementedError

    def explain(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], decision: Decision
    ) -> Explanation:
        """Why ``decision`` (this policy's last ``choose`` over ``views``) went where it
        went. Called right after that ``choose``, and only where someone reads
        decisions (the router's ``/admin/decisions`` ring); O(1): a policy hands over
        references to what ``choose`` computed, never computes more here. Changes no
        state. The default: each view's match and load, no score."""
        return Explanation(request, match, views, decision)

    def describe(self) -> dict[str, Any]:
        """Policy-specific state for ``/admin/index`` (hot prefixes, replica sets)."""
        return {}
