"""The route core: one request's decision, from its views to its placement, sans I/O.

Every caller routes through ``RouteCore.decide``: the data plane (``radixfleet.server.dataplane``,
its retries and its prefetches), disaggregated P/D (``radixfleet.route.pd``, through the data
plane) and the offline simulator (``radixfleet_tools.loadtest.simulator.simulation``, on its virtual
clock). It awaits nothing, opens nothing and replies nothing; it returns a verdict
and the caller does the I/O::

    views  = views(now, model, adapter) - ask.exclude, if ask.eligible
                                               none: Reject(404 | 503)
    kr     = ask.keyer(views, now)             keyed per key space in use, matched in
                                               the index (radixfleet.engines.keyspace)
                                               a space refused the body: Reject(400)
    -- the admission chain, in this order (skipped once ask.admitted: a retry, a P/D
       leg, a request the admission queue let in) --
    ticket = tenancy.admit(...)                priority class; tenant and key rate
                                               limits (radixfleet.route.tenancy): Reject(429)
    pending prefetch                           a prefetch made for this request is
                                               waiting on a worker: admitted as it was
    shed   = shedder.check(...)                every eligible worker saturated
                                               (radixfleet.route.shedding): Reject(429, shed),
                                               or Hold when the admission queue is on
                                               (the caller awaits it, then resumes)
    -- a disaggregated fleet's request stops here: Admitted (radixfleet.route.pd picks its legs) --
    d      = (ask.choose or policy.choose)(kr, views, now)
    placed = place(worker, kr, now)            the hint (index, bus), the uncached
                                               tokens counted on the worker, the engine
                                               link's match count: Route
    explained = policy.explain(...)            only while someone reads decisions
                                               (``RouteParts.explain``: /admin/decisions)

A caller that traces passes ``marks`` (``Marks``): told the end of each stage
(match, admit, choose, place) as it happens; the core reads no clock of its own.

Invariants: a ``Route``'s load is counted on its worker before ``decide`` returns (so a
burst cannot herd: docs/DESIGN.md's lessons), and the caller releases it with
``pool.prefilled`` / ``pool.finish`` on every path; a ``Reject`` or ``Hold`` counted
nothing on any worker (a ``Reject`` after the tenancy stage carries its ticket so the
caller can give the reservation back); the policy only ever names a worker of the
views it was given (``AssertionError`` otherwise: never route into the void).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from radixfleet.engines.keyspace import KeyedRequest, SpaceKey
from radixfleet.keys import Endpoint
from radixfleet.policies.base import Decision, Explanation, Policy, WorkerView
from radixfleet.wire.errors import Overloaded, RequestError

if TYPE_CHECKING:
    from radixfleet.fleet.pool import Pool, Worker
    from radixfleet.index.prefix_index import PrefixIndex
    from radixfleet.route.shedding import Shedder
    from radixfleet.route.tenancy import Tenancy, Ticket
    from radixfleet.server.prefetch import PrefetchLedger

#: how a caller keys its request among the views: KeyedRequest (or RequestError)
Keyer = Callable[[Sequence[WorkerView], float], KeyedRequest]
#: a policy's choice over the views (``Policy.choose`` on the keyed request by default)
Chooser = Callable[[KeyedRequest, Sequence[WorkerView], float], Decision]
#: the shedding verdict at a time (what the admission queue re-probes)
Probe = Callable[[float], Overloaded | None]


class Placement(NamedTuple):
    """What the route core counted when it placed a request on a worker, in that
    worker's key space; the engine link learns from it with the answer
    (``EngineLink.observe``), and the caller releases ``own`` with ``pool.finish``."""

    key: SpaceKey  # the request in the worker's space
    blocks: int  # leading blocks the worker (its rank) held at pick time
    own: int  # the request's uncached prompt tokens, counted as queued prefill
    ahead: int  # uncached prompt tokens already queued on the worker at pick time
    touches: tuple | None  # approximate mode: the matched blocks' last-use times
    rank: int | None = None  # the data-parallel rank it went to (``pick_rank``)
    #: {colder tier: blocks} extending ``blocks`` there at pick time (``match_tiers``)
    colder: dict | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Ask:
    """One question to the route core: route this request now.

    A retry or a request the admission queue let in asks again with ``ticket`` set
    (its admission chain ran once) and, for a retry, the workers it must avoid."""

    #: keys the request among the views (and matches it in the index)
    keyer: Keyer
    model: str
    adapter: str | None = None
    #: who sent it, for the tenancy stage (radixfleet.server.auth): tenant and API key names
    tenant: str = ""
    api_key: str = ""
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: the parsed body (tenancy reads its output bound); None: no tenancy stage input
    body: Mapping[str, Any] | None = None
    #: the endpoint the body is read for (its output bound's field: radixfleet.route.tenancy)
    endpoint: Endpoint = Endpoint.CHAT
    #: its admission chain ran (``admit``): a retry, a request the queue let in, a
    #: P/D leg; the chain is not run again
    admitted: bool = False
    #: the tenancy ticket it was admitted with (None: no tenancy stage)
    ticket: Ticket | None = None
    #: workers a retry must not go to
    exclude: frozenset[str] = frozenset()
    #: a narrower set of candidates (a P/D decode leg's); None: every view
    eligible: Callable[[WorkerView], bool] | None = None
    #: who chooses (a P/D decode leg's rule); None: the configured policy
    choose: Chooser | None = None
    #: whether a disaggregated fleet stops at ``Admitted`` (the first decision of a
    #: client request); a P/D leg's own decision routes among its views directly
    split: bool = True
    #: a prefetch (radixfleet.server.prefetch): never held; dropped (a shed ``Reject``) when a
    #: real request arriving now would wait for an admission slot or be shed
    prefetch: bool = False
    #: place the pick (hint, count) before returning; False: the caller places it
    #: later (``place``): a prefetch once its deduplication and budget allow, a P/D
    #: prefill leg when it is sent
    place: bool = True

    def again(self, **changes: Any) -> Ask:
        return dataclasses.replace(self, **changes)

    def admit(self, ticket: Ticket | None, **changes: Any) -> Ask:
        """The same request once admitted with ``ticket`` (and ``changes``)."""
        return dataclasses.replace(self, admitted=True, ticket=ticket, **changes)


class Reject(NamedTuple):
    """Answer ``error`` (a 4xx or 503); nothing was counted on any worker."""

    error: RequestError
    #: the tenancy ticket taken before the refusal, or None: give it back
    ticket: Ticket | None = None
    #: refused by the shedder (the shed counters, the traffic log's offered load)
    shed: bool = False


class Hold(NamedTuple):
    """The shedder refused and the admission queue is on: the caller awaits the
    queue with ``probe`` and resumes (``RouteCore.resume``)."""

    ask: Ask
    views: list[WorkerView]
    keyed: KeyedRequest
    ticket: Ticket
    probe: Probe


class Admitted(NamedTuple):
    """Admitted on a disaggregated fleet: the caller picks its legs (radixfleet.route.pd)."""

    views: list[WorkerView]
    keyed: KeyedRequest
    ticket: Ticket | None


class Route(NamedTuple):
    """Send the request to ``worker``; its load is counted (``placement``)."""

    decision: Decision
    worker: Worker
    keyed: KeyedRequest
    #: None only when the ask said ``place=False`` (then ``RouteCore.place``)
    placement: Placement | None
    ticket: Ticket | None
    #: why it went there (``Policy.explain``); None unless ``RouteParts.explain``
    explained: Explanation | None = None

    @property
    def available_tokens(self) -> int:
        """The reuse available anywhere among this decision's eligible workers: the
        best match's leading tokens, in the policy's (primary) key space."""
        kr = self.keyed
        return kr.match.best * kr.route_request.block_tokens


Verdict = Reject | Hold | Admitted | Route


class Marks(Protocol):
    """Told the end of each stage of a decision as it happens (radixfleet.server.tracing)."""

    def mark(self, stage: str) -> None:
        """``stage`` (match | admit | choose | place) ended now."""


class Hinter(Protocol):
    """Told of each placed hint (radixfleet.bus.replica.BusReplica.hint)."""

    def hint(self, worker: str, hashes: Sequence[int], now: float, session: str | None, tokens: int) -> None:
        """Publishes the hint to the other replicas."""


@dataclasses.dataclass(slots=True)
class RouteParts:
    """What the route core decides with. The owner builds it once; only
    ``RouteCore.configure`` changes the policy afterwards."""

    pool: Pool
    index: PrefixIndex
    policy: Policy
    shedder: Shedder | None = None
    tenancy: Tenancy | None = None
    #: the admission queue (radixfleet.route.admission_queue); consulted only while it is on
    queue: Any = None
    #: prefetches awaiting their request (radixfleet.server.prefetch)
    prefetched: PrefetchLedger | None = None
    #: told of each hint (router replicas on a bus); None: one router
    hints: Hinter | None = None
    #: whether a request arriving now would wait for an admission slot (the data
    #: plane's concurrency limit); None: never
    busy: Callable[[], bool] | None = None
    #: the routable views of a model; None: ``pool.views``
    views: Callable[[float, str, str | None], list[WorkerView]] | None = None
    #: whether a fleet is disaggregated (radixfleet.route.pd); None: never
    disaggregated: Callable[[Sequence[WorkerView]], bool] | None = None
    #: whether a worker's answers correct the index (approximate mode): its matched
    #: blocks' last-use times are kept at the pick; None: a worker's engine link says
    corrects: Callable[[Worker], bool] | None = None
    #: whether each ``Route`` carries the policy's explanation (``Policy.explain``:
    #: references to what its choice computed; the decisions ring reads them)
    explain: bool = False


class RouteCore:
    """``decide`` (module docstring). One event loop (or one virtual clock) owns it."""

    __slots__ = ("parts",)

    def __init__(self, parts: RouteParts) -> None:
        self.parts = parts

    def configure(self, policy: Policy) -> None:
        """Takes a reloaded policy: decisions from now on use it."""
        self.parts.policy = policy

    def use_shedder(self, shedder: Shedder | None) -> None:
        """Sheds with ``shedder`` from now on (None: never; tests put a stand-in)."""
        self.parts.shedder = shedder

    def attach_hints(self, hints: Hinter | None) -> None:
        """Tells ``hints`` of every placed hint from now on (None: no one)."""
        self.parts.hints = hints

    def explain_routes(self, on: bool) -> None:
        """Whether each ``Route`` from now on carries its explanation."""
        self.parts.explain = on

    @property
    def policy(self) -> Policy:
        return self.parts.policy

    # ------------------------------------------------------------------ decide

    def decide(self, ask: Ask, now: float, marks: Marks | None = None) -> Verdict:
        """The verdict on ``ask`` at ``now`` (module docstring); ``marks`` told of
        each stage's end."""
        p = self.parts
        views = self.views(ask, now)
        if not views:
            return Reject(p.pool.unavailable(ask.model, ask.adapter, now), ask.ticket)
        try:
            kr = ask.keyer(views, now)
        except RequestError as exc:  # a token space refused the body
            return Reject(exc, ask.ticket)
        if marks is not None:
            marks.mark("match")
        ticket = ask.ticket
        if not ask.admitted:
            if p.tenancy is not None:
                try:
                    ticket = p.tenancy.admit(
                        ask.tenant,
                        ask.api_key,
                        ask.model,
                        ask.headers,
                        kr.route_request.prompt_tokens,
                        ask.body or {},
                        now,
                        ask.endpoint,
                    )
                except RequestError as exc:  # over a rate limit; a priority header naming no class
                    return Reject(exc)
            if ask.prefetch:
                shed = self._prefetch_room(ask, kr, now)
                if shed is not None:
                    return Reject(shed, ticket, shed=True)
            elif p.shedder is not None and not self._prefetch_pending(kr, views):
                probe = self.probe(ask, kr, ticket)
                queue = p.queue
                if ticket is not None and queue is not None and queue.cfg.max_wait_s > 0:
                    return Hold(ask, views, kr, ticket, probe)
                shed = probe(now)
                if shed is not None:
                    return Reject(shed, ticket, shed=True)
            if marks is not None:
                marks.mark("admit")
        return self.route(ask, views, kr, ticket, now, marks)

    def resume(
        self, hold: Hold, waited: bool, now: float, marks: Marks | None = None
    ) -> Reject | Admitted | Route:
        """After the admission queue let ``hold`` in: routed as it was keyed when it
        did not wait, else keyed and matched again with what the pool and index
        know now (its admission chain not run again)."""
        if not waited:
            return self.route(hold.ask, hold.views, hold.keyed, hold.ticket, now, marks)
        v = self.decide(hold.ask.admit(hold.ticket), now, marks)
        assert not isinstance(v, Hold), "an admitted request is never held again"
        return v

    def route(
        self,
        ask: Ask,
        views: list[WorkerView],
        kr: KeyedRequest,
        ticket: Ticket | None,
        now: float,
        marks: Marks | None = None,
    ) -> Admitted | Route:
        """The admitted request's choice and placement."""
        p = self.parts
        if ask.split and p.disaggregated is not None and p.disaggregated(views):
            return Admitted(views, kr, ticket)
        if ask.choose is not None:
            d = ask.choose(kr, views, now)
        else:
            d = p.policy.choose(kr.route_request, kr.match, views, now)
        w = p.pool.get(d.worker)
        if w is None:  # a policy bug: never route into the void
            raise AssertionError(f"policy {p.policy.name} chose unknown worker {d.worker!r}")
        if marks is not None:
            marks.mark("choose")
        placement = self.place(w, kr, now) if ask.place else None
        if marks is not None and placement is not None:
            marks.mark("place")
        if not p.explain:
            return Route(d, w, kr, placement, ticket)
        # (a chooser other than the policy's: the policy explains views it did not
        # choose over with their match and load alone)
        ex = p.policy.explain(kr.route_request, kr.match, views, d)
        return Route(d, w, kr, placement, ticket, ex)

    def views(self, ask: Ask, now: float) -> list[WorkerView]:
        """The routable views serving the ask's model, less its exclusions."""
        p = self.parts
        views = (p.views or p.pool.views)(now, ask.model, ask.adapter)
        if ask.exclude or ask.eligible is not None:
            ex, ok = ask.exclude, ask.eligible
            views = [v for v in views if v.id not in ex and (ok is None or ok(v))]
        return views

    def probe(self, ask: Ask, kr: KeyedRequest, ticket: Ticket | None) -> Probe:
        """The shedder's verdict on this request at a given time (its uncached tokens
        against every eligible worker; the ticket's class scales the bound)."""
        p = self.parts
        shedder = p.shedder
        assert shedder is not None, "probe() needs a shedder"
        pool, model, adapter = p.pool, ask.model, ask.adapter
        req = kr.route_request
        uncached = uncached_tokens(req.prompt_tokens, kr.match.best, req.block_tokens)
        scale = ticket.scale if ticket is not None else 1.0

        def probe(t: float) -> Overloaded | None:
            return shedder.check(pool.routable_workers(t), model, adapter, uncached, t, scale)

        return probe

    # ------------------------------------------------------------------- place

    def place(self, w: Worker, kr: KeyedRequest, now: float) -> Placement:
        """The optimistic hint and the load count for ``w``, in its own key space,
        before anything is awaited (``radixfleet.policies.base``)."""
        p = self.parts
        sk = kr.key_for(w.id)
        link = w.engine
        # a data-parallel engine: the rank holding most of the prompt (EngineLink)
        rank = link.pick_rank(kr.rank_blocks(w.id)) if link is not None and link.ranks else None
        holder = w.id if rank is None else link.holder(rank)
        blocks = kr.blocks_for(w.id, rank)
        touches = None
        if blocks and (p.corrects(w) if p.corrects is not None else link is not None and link.corrects):
            # when each matched block was last used, before this hint re-touches them:
            # what a correction needs if the worker reports fewer cached tokens
            tt = p.index.touch_time
            touches = tuple(tt(holder, h) for h in sk.hashes[:blocks])
        ahead = w.in_flight_tokens
        if sk.hashes:
            p.index.insert(holder, sk.hashes, now)
        own = uncached_tokens(sk.prompt_tokens, blocks, sk.block_tokens)
        p.pool.pick(w, own, sk.prompt_tokens)
        if p.hints is not None and sk.hashes and rank is None:
            # (a rank's hint stays local: the bus names workers, and every replica
            # follows the ranks' own events) queued; published by its own task
            p.hints.hint(w.id, sk.hashes, now, kr.route_request.session, sk.prompt_tokens)
        colder = kr.colder_for(holder)
        if link is not None and (blocks or colder):
            link.count_match(blocks, colder, sk.block_tokens)
        return Placement(sk, blocks, own, ahead, touches, rank, colder)

    def _prefetch_room(self, ask: Ask, kr: KeyedRequest, now: float) -> Overloaded | None:
        """A prefetch's refusal when a real request arriving now would wait for an
        admission slot or be shed: prefetches go first (radixfleet.server.prefetch)."""
        p = self.parts
        if p.busy is not None and p.busy():
            return Overloaded("the router is at capacity: prefetches are dropped first", retry_after_s=1)
        if p.shedder is None:
            return None
        req = kr.route_request
        uncached = uncached_tokens(req.prompt_tokens, kr.match.best, req.block_tokens)
        return p.shedder.check(
            p.pool.routable_workers(now), ask.model, ask.adapter, uncached, now, prefetch=True
        )

    def _prefetch_pending(self, kr: KeyedRequest, views: Sequence[WorkerView]) -> bool:
        """Whether a prefetch made for this request has not been used yet: a worker
        it may go to holds a prefetched prefix of it (then it is admitted as that
        prefetch was: radixfleet.server.prefetch)."""
        led = self.parts.prefetched
        if not led:
            return False
        for v in views:
            blocks = kr.blocks_for(v.id)
            if blocks and led.pending(v.id, kr.key_for(v.id).hashes[:blocks]):
                return True
        return False


def uncached_tokens(prompt_tokens: int, matched_blocks: int, block_tokens: int) -> int:
    """The prefill work a request adds to its worker: the prompt tokens its matched
    blocks do not cover (radixfleet.policies.base: load is counted in uncached tokens)."""
    return max(0, prompt_tokens - matched_blocks * block_tokens)
