"""prefix_load — the recommended default: least expected time to first token, with
bounded affinity and hot-root replication. The figures behind each rule are in
bench/RESULTS.md ("Routing policies", "Real engines", "Live against SGLang's gateway",
"prefix_load tuning").

For each routable worker w (rate_w = its prefill tokens/s)::

    queue_s(w)  = max(in_flight_tokens, queued_tokens) / rate_w   queueing delay
    matched(w)  = priced[w] * block_tokens, or 0 when < min_match_tokens (a miss),
                  when w is over the affinity bound, crowded or a retired replica,
                  or when the match is shared and w is churning (below)
    saved_s(w)  = matched(w) / rate_w                             prefill the match saves
    ttft(w)     = queue_s(w) + (prompt_tokens - matched(w)) / rate_w
    score(w)    = queue_s(w) + pw * (prompt_tokens - matched(w)) / rate_w
                  - pw * saved_s(w)**2 / long_match_s
    pw          = private_weight if the match is private, else prefill_weight

``priced[w]`` is ``MatchResult.priced()``: the worker's GPU prefix in blocks plus,
where its engine offloads KV, how far its colder tiers (CPU memory, disk) extend it,
each such block counted as the share of a GPU hit its learned price leaves (the
prefill it saves minus the time to load it back: radixfleet.engines.tier_price). So a
CPU hit beats a miss and loses to a GPU hit of the same length; ``Decision.
matched_blocks`` stays the GPU prefix (what the hint and the load count assume).

A colder block needs room (``colder_room``): loaded back, it becomes the request's
own KV, as a prefilled one would; only a GPU hit shares KV already there. An engine
admits a request only once its KV fits beside what running requests hold (their
whole prompts, locked, and their output), so where that is full the load back waits
for a running request to finish and saves nothing. Per worker w with a colder
extension, g = its GPU prefix in tokens::

    held(w) = in_flight_kv_tokens(w) - in_flight(w) * g     (at least 0)
    no room = held(w) + prompt_tokens > kv_capacity_tokens(w)   (capacity known)

``in_flight_kv_tokens``: the prompts of the router's requests in flight until they
finish (``radixfleet.fleet.pool``); g is taken out of each, as in-flight requests that share
the prefix this request found there hold one copy of it (an agent's tool schema, a
system prompt). Where there is no room the colder extension counts for nothing (the
GPU prefix still counts). The price is time only (prefill saved less load); this is
the memory a colder hit takes that a GPU hit does not. Without it the holder of a
session's DRAM history, the worker that served the session's turns and still
decodes them, wins by the read-back's credit over an idle worker, and the request
waits there for KV (bench/RESULTS.md "KV tiers, simulated"). The estimate leaves out
output tokens and other router replicas' requests and takes g out of every
in-flight request, shared or not: it errs toward crediting the tier, as before.

The pick is the minimum score; ``Decision.expected_ttft_s`` is ttft(w). Why each term:

- ``max`` of the router's count (fresh, uncached parts) and the worker's report (up
  to a batch old, whole prompts): both estimate mostly the same work, so their sum
  would make every warm worker look busy; the larger still covers other routers' work.
- ``prefill_weight`` > 1: a worker's uncached prefill delays every request queued
  behind it too. The quadratic term grows the credit faster than the match: a long
  context is long to rebuild, a second copy takes that much KV from every other
  prefix, and long contexts are the ones that come back. The affinity bound caps it.
- A *private* match (``MatchResult.private``: no other request went through its
  deepest block lately, a conversation's own history) weighs ``private_weight``,
  more than a shared one: a second copy of a shared prefix is a replica later
  requests use, a second copy of a private history only duplicates it. Weighting
  every match that high lets a burst onto a shared prefix herd.
- Ties: scores within ``tie_s`` of the minimum (measured prefill rates differ by a
  few percent between identical GPUs). Ties prefer the longer match, then the fewest
  in-flight requests (what holds KV while decoding), then (``tie_written``) the
  worker that wrote the least KV lately, then random.

Bounded affinity: a matching worker keeps its match only while it is *not*
overloaded relative to the least-loaded worker L::

    overloaded(w) = queue_s(w) - queue_s(L) > affinity_abs_s + prefill_weight * saved_s(w)
                    and queue_s(w) > queue_s(L) * affinity_rel

A miss goes to the least-loaded worker (the same tie order) — never to "the
smallest tree" (a death spiral in SGLang's router). A miss that avoids a churning or
crowded worker (below) goes to the least-loaded other one only while the queue that
adds, against L's, is less than the request's own prefill there: it pays at most its
prefill twice to spare another cache. Unbounded, an all-miss load on two vLLM servers
whose write rates differed by the factor went entirely to one of them (93 requests in
flight there against 3 on the other) while the shedder, seeing the other's room,
admitted it all; bounded by the affinity rule (1 s) it still queued a second there.

KV turnover: per worker, the decayed uncached tokens routed there (time constant
``kv_window_s``) are the KV it writes. A worker whose cache turns over in less than
``kv_turnover_s`` (capacity / write rate; unknown capacity is never judged) *and*
that writes more than ``kv_rel`` times the fleet's mean is *churning*: its shared
matches earn nothing and misses avoid it; its private matches stay. Without it every
session behind one shared prefix (an agent's tool schema) goes to its holder and
thrashes its cache. A fleet that churns evenly is left alone. Each router replica
counts what it routed, plus its peers' picks reaching ``observe_route`` (the bus's hints).

Session footprints (``radixfleet.policies.footprint``): the turnover rate sees a crowd only once
it writes. Per worker, the private tokens of its live sessions (continued within
``session_live_gaps`` of their own gaps between turns). A worker is *crowded* when its
live sessions (less this request's) plus the prompt pass ``footprint_full`` of its KV
capacity *and* exceed ``footprint_rel`` times the fleet's mean; while another worker of
known capacity stays within ``footprint_room`` with the prompt, crowded workers'
matches earn nothing (the session moves once instead of evicting its neighbours'
every turn) and misses avoid them. Nothing moves while the whole fleet's live
sessions pass ``footprint_room`` of its capacity: then every cache thrashes. Router
replicas keep the fleet's footprints, not each its own share of every session's turns:
peers' picks are recorded through ``observe_route`` as their own decisions are.

Reasons: AFFINITY (the chosen worker has the best match), REPLICA (it is a hot
prefix's replica, or was just made one), SPILL_LOAD (a better match existed but
its holder lost on load), MISS.

Load accounting the caller owes (``radixfleet.policies.base``): after each decision, add the
request to the chosen view's ``in_flight`` and its *uncached* prompt tokens to
``in_flight_tokens`` before the next pick; remove them when the prefill is done.

Hot-root replication (``radixfleet.policies.replication``): when the request's deepest indexed
node is hot (``match.rate >= hot_min_rate``), a missing holder is added — the
least-loaded non-holder takes this request (REPLICA), or with ``warm_ahead`` it is
named in ``Decision.warm`` for a prefill-only warm-up — and surplus replicas are
retired as the rate decays.

Cost: O(workers) with no allocation beyond three lists (write rates, queue delays,
scores) and the Decision; a hot prefix adds one dict lookup and O(workers)
bookkeeping; session footprints add one scan of at most a turn's worth of the
request's block hashes and O(workers).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from radixfleet.keys import WorkerId
from radixfleet.policies.base import (
    Decision,
    Explanation,
    MatchResult,
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
    WorkerView,
)
from radixfleet.policies.footprint import Branch, Footprints
from radixfleet.policies.kv_records import KvRecords, by_written
from radixfleet.policies.params import param, parameters
from radixfleet.policies.replication import RETIRE_FRACTION, HotRecord, HotRoots, holders_needed

_INF = math.inf
#: seconds a new replica may take to appear in the index as a holder
REPLICA_GRACE_S = 5.0


class PrefixLoad(KvRecords, Policy):
    """The module docstring's policy, with these rules for a saturated fleet.

    The fleet is *saturated* when every worker is: its queue (as the module docstring
    estimates it) is ``saturated_s`` or more, or the router refused a request it could
    serve within the last few seconds (``WorkerView.saturated``; radixfleet.route.shedding). The
    second is how saturation shows where the router sheds (its default): shedding holds
    each queue near its bound, a fraction of a typical prefill, so no queue reaches
    ``saturated_s``, yet the fleet refuses work; measured in bench/RESULTS.md "The same
    ramp with the live router's shedding". Then:

    - A worker's reported queue counts at its *uncached share*: the report counts
      whole prompts, and past saturation a holder's queue is mostly prompts it holds
      (the share: uncached over whole prompt tokens routed there lately, decayed as
      ``_written``; 1 before any). Counted whole, the best holders look the busiest
      and the affinity bound sends their prefixes away.

    - A worker whose match counts (not masked, not over the affinity bound) keeps the
      request whatever the score says. Below saturation the score's trade of queue
      against prefill is right; past it every worker has a queue, a move to the
      least-loaded one moves the queue and re-prefills the prefix there, evicting
      another prefix — the next misses and the next queue. Locality yields only to
      relative load (the affinity bound: over ``affinity_rel`` times the least queue
      and over ``affinity_abs_s`` plus the saved prefill more).
    - A miss goes to its prefix's *home*, the worker its last request went to, while
      that worker is within the affinity bound (nothing saved). With exact events the
      index drops a prefix the moment its worker evicts it, though a request that will
      re-fill it may already be waiting there; without the home the next request is a
      miss and goes to the least-loaded worker, the prefix lives on two workers, each
      evicts another prefix for it, and a fleet of many prefixes loses its partition.
      Homes are kept for the hash at depths ``min_match_tokens`` (in blocks, at least
      one) doubled up to the prompt's length, at most ``home_records`` of them (LRU);
      a miss looks them up deepest first. Below saturation a miss goes to the
      least-loaded worker (a re-fill there is done before its siblings arrive).
    - A home is *fresh* while fewer uncached tokens than its KV capacity (unknown:
      never judged, fresh) were routed there since its prefix last was (``_routed``,
      stamped in the home record). Past saturation the queue ahead of a request is
      served first, and it alone writes more than a cache holds: what the index shows
      now (exact engine events included) is not what the worker holds when this
      request's turn comes; the prefix routed there last is, until that much was
      written after it. So a fresh home whose prefix is at least as deep as every
      match that counts takes the request, matched or not (an older copy elsewhere
      would split the prefix's traffic and keep both copies cold). A stale home is
      no home: its match counts for nothing (the copy is gone by then) and a miss
      goes to the least-loaded worker, since the prefix is re-filled wherever it
      goes, and sent home it evicts the prefixes that do come back there. Measured
      per decision on the saturation ramp (bench/saturation_ramp.py, 32k tokens of
      KV per worker): a request sent home hit 91% within 8k tokens routed there
      since, 49% within 16k, 16% within 24k, none past; of 94 sent to a stale home
      the index showed holding the prefix, none hit.

    Cost of the rules: one more list of O(workers), a second O(workers) pass when
    saturated; O(log blocks) dict operations for the homes. State: ``_homes`` (only
    ``choose`` writes it), ``_written``, ``_prompted``, ``_routed``, ``hot``,
    ``footprints``; ``check()`` asserts their bounds.
    """

    name = "prefix_load"

    @parameters
    class Params(PolicyParams):
        min_match_tokens: int = param(64, "a match shorter than this many tokens counts as a miss", lo=0)
        prefill_weight: float = param(
            2.0,
            "weight of uncached prefill against queueing delay in the score "
            "(1 = pure expected TTFT; >1 values reuse, which also spares later requests)",
            lo=0.0,
            hi=100.0,
        )
        affinity_abs_s: float = param(
            1.0,
            "a holder loses its match once its queue exceeds the least-loaded "
            "worker's by more than this many seconds of prefill ...",
            lo=0.0,
        )
        affinity_rel: float = param(2.0, "... and by more than this factor", lo=1.0)
        replicate: bool = param(True, "replicate hot prefixes over more holders")
        hot_min_rate: float = param(
            2.0, "a prefix below this many requests/s is never replicated", lo=0.0, lo_open=True
        )
        holder_max_rate: float = param(
            10.0, "requests/s of one hot prefix a single holder is expected to absorb", lo=0.0, lo_open=True
        )
        hot_utilization: float = param(
            0.5, "share of a holder's prefill rate a hot prefix may use", lo=0.0, hi=1.0, lo_open=True
        )
        max_replicas: int = param(4, "extra holders per hot prefix, at most", lo=0)
        warm_ahead: bool = param(
            False,
            "warm a new replica with a prefill-only request (Decision.warm) "
            "instead of sending it the request that triggered it",
        )
        hot_records: int = param(64, "hot prefixes remembered (LRU)", lo=1, hi=100_000)
        private_weight: float = param(
            4.0,
            "prefill_weight for a request whose match is private (MatchResult."
            "private: no other request went through its deepest node lately, e.g. a "
            "conversation's next turn): a second copy of it serves nobody else",
            lo=0.0,
            hi=100.0,
        )
        long_match_s: float = param(
            0.25,
            "the reuse credit of a match doubles when it saves this many seconds "
            "of prefill (grows with the saved prefill; 0 = linear)",
            lo=0.0,
        )
        tie_s: float = param(
            0.005,
            "scores within this many seconds of the best are ties (then: longer "
            "match, fewer in-flight requests, random)",
            lo=0.0,
        )
        kv_turnover_s: float = param(
            30.0,
            "a worker whose KV cache is rewritten faster than this (its capacity "
            "over the uncached tokens routed to it per second) ...",
            lo=0.0,
        )
        kv_rel: float = param(
            1.25,
            "... and more than this many times as fast as the fleet's mean loses "
            "the credit of its shared (not private) matches",
            lo=1.0,
        )
        kv_window_s: float = param(
            10.0, "time constant of the routed-uncached-tokens rate", lo=0.0, lo_open=True
        )
        tie_written: bool = param(
            True,
            "break ties (after the longer match and fewer in-flight requests) toward "
            "the worker written the least KV lately, before chance",
        )
        colder_room: bool = param(
            True,
            "a worker's colder-tier (CPU, disk) extension counts only while its in-flight "
            "requests' KV leaves room for the prompt (a load back needs fresh KV; a GPU hit does not)",
        )
        footprint_room: float = param(
            0.7,
            "a crowded worker's matches earn nothing and misses avoid it while another "
            "worker's live sessions, with this prompt, fit in this share of its KV "
            "capacity (session footprints; 0 = off)",
            lo=0.0,
            hi=1.0,
        )
        footprint_full: float = param(
            0.8,
            "a worker is crowded when its live sessions' private tokens, with this "
            "prompt, pass this share of its KV capacity ...",
            lo=0.0,
            lo_open=True,
        )
        footprint_rel: float = param(1.25, "... and are more than this many times the fleet's mean", lo=1.0)
        saturated_s: float = param(
            1.0,
            "when even the least-loaded worker's queue is this many seconds (or the router "
            "is refusing what every worker could serve), a holder within the affinity bound "
            "keeps its match whatever the score, a prefix's fresh home takes its requests "
            "and reported queues count only the prompts a worker must prefill (0 = off)",
            lo=0.0,
        )
        home_records: int = param(
            4096,
            "prefixes whose last worker is remembered: past saturation a prefix goes "
            "back to that worker until its KV capacity was routed there since (LRU; 0 = off)",
            lo=0,
            hi=1_000_000,
        )
        session_live_gaps: float = param(
            4.0,
            "a session counts in its worker's footprint until this many of its own "
            "gaps between turns pass without a turn",
            lo=0.0,
            lo_open=True,
        )

    params: Params

    def __init__(self, params: PolicyParams | None = None, rng: random.Random | None = None) -> None:
        super().__init__(params, rng)
        p = self.params
        self.hot = HotRoots(p.hot_records, p.max_replicas)
        self.footprints = Footprints(p.session_live_gaps) if p.footprint_room > 0 else None
        self._init_records()  # what each worker writes, each prefix's home (radixfleet.policies.kv_records)
        # what the last ``_choose`` computed, kept for ``explain`` (references to its
        # own lists, nothing copied): (views, queue delays, [(score, credited
        # blocks)] or None when it decided before scoring, saturated-fleet rule)
        self._explained: tuple[Any, ...] | None = None

    def choose(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], now: float
    ) -> Decision:
        p = self.params
        fp = self.footprints
        branch = None
        if fp is not None:
            fp.expire(now)
            branch = fp.find(request)
        d = self._choose(request, match, views, now, branch)
        if fp is not None:
            fp.record(request, match, branch, d.worker, now)
        self._prune(views)
        unc = request.prompt_tokens - d.matched_blocks * request.block_tokens
        self._observe(d.worker, unc, request.prompt_tokens, now)
        if p.home_records:
            self._remember_home(request, d.worker)
        return d

    def observe_route(self, request: RouteRequest, match: MatchResult, worker: WorkerId, now: float) -> None:
        """Another router replica routed ``request`` to ``worker`` at ``now``;
        ``match`` is this replica's index match for it before the hint of that pick
        went in. Recorded as ``choose`` records its own decisions: the session's
        footprint (its branch continued or started, homed on ``worker``) and the KV
        written there (``observe_pick``). Without it each replica sees a quarter of
        every session's turns at four replicas: most continuations find no branch,
        the footprints hold a fraction of the fleet's sessions, and "crowded" is
        judged on that fraction (measured: 189 of 498 decisions of the demo's mixed
        workload judged another crowded set than one router, hit 0.80 -> 0.73 in
        the simulator). The router's bus feeds it from its peers' hints (radixfleet.bus)."""
        fp = self.footprints
        if fp is not None:
            fp.expire(now)
            fp.record(request, match, fp.find(request), worker, now)
        self._observe(
            worker,
            request.prompt_tokens - match.blocks.get(worker, 0) * request.block_tokens,
            request.prompt_tokens,
            now,
        )

    def _crowded(
        self, request: RouteRequest, branch: Branch | None, views: Sequence[WorkerView]
    ) -> set[WorkerId] | None:
        """Workers whose live sessions leave no room for this request's session, if
        another worker has room for it; else None (module docstring, "Session
        footprints")."""
        fp = self.footprints
        if fp is None or not fp.counted():
            return None
        p = self.params
        fs = [fp.tokens(v.id) for v in views]  # each worker's live sessions, read once
        total = sum(fs)
        cap_total = 0.0
        for v in views:
            if v.kv_capacity_tokens > 0:
                cap_total += v.kv_capacity_tokens
        if total > p.footprint_room * cap_total:
            # the fleet cannot hold its live sessions: every cache thrashes, and moving
            # a session would only re-prefill it somewhere else
            return None
        over = p.footprint_rel * total / len(views)
        # the whole prompt: its private part and the shared prefix it needs there too
        size = request.prompt_tokens
        own = branch.home if branch is not None and branch.live else None
        out = None
        room = False
        for v, f in zip(views, fs):
            cap = v.kv_capacity_tokens
            if cap <= 0:
                continue  # unknown capacity: never judged, never a destination
            # own is set only when branch is: v.id == own implies branch is not None
            t = (f - branch.size if v.id == own else f) + size  # type: ignore[union-attr]
            if t > p.footprint_full * cap and f > over:
                if out is None:
                    out = set()
                out.add(v.id)
            elif t <= p.footprint_room * cap:
                room = True
        return out if room else None

    def _priced(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView]
    ) -> Mapping[WorkerId, float]:
        """``match.priced()`` without the colder extensions of workers whose in-flight
        KV leaves no room for this prompt (module docstring, ``colder_room``). O(workers)."""
        colder = match.colder
        if not colder or not self.params.colder_room:
            return match.priced()
        full = None
        gpu = match.blocks
        bt = request.block_tokens
        need = request.prompt_tokens
        for v in views:
            cap = v.kv_capacity_tokens
            if cap <= 0 or v.id not in colder:
                continue
            held = v.in_flight_kv_tokens - v.in_flight * gpu.get(v.id, 0) * bt
            if (held if held > 0 else 0) + need > cap:
                full = {v.id} if full is None else full | {v.id}
        if full is None:
            return match.priced()
        out: dict[WorkerId, float] = dict(match.blocks)
        for w, x in colder.items():
            if w not in full:
                out[w] = out.get(w, 0) + x
        return out

    def _choose(
        self,
        request: RouteRequest,
        match: MatchResult,
        views: Sequence[WorkerView],
        now: float,
        branch: Branch | None = None,
    ) -> Decision:
        p = self.params
        rnd = self.rng.random
        gpu = match.blocks
        # the match each worker is valued at: its GPU prefix plus, priced in GPU-hit
        # blocks, how far its colder tiers extend it (module docstring)
        blocks = self._priced(request, match, views) if match.colder else gpu
        bt = request.block_tokens
        prompt = request.prompt_tokens

        # Workers whose caches churn: their shared matches do not count and misses
        # avoid them (module docstring, "KV turnover").
        churn = self._kv_churning(views, now)
        unmatched = None if match.private else churn  # whose matches count for nothing
        avoid = churn  # where misses do not go
        # Workers without room for this session: no match of theirs counts, misses
        # avoid them ("Session footprints").
        crowded = self._crowded(request, branch, views)
        if crowded:
            unmatched = crowded if not unmatched else unmatched | crowded
            avoid = crowded if not avoid else avoid | crowded

        # A saturated fleet: every worker has a queue of saturated_s or the router refused
        # a request it could serve lately (class docstring).
        sat = p.saturated_s > 0 and self._saturated(views, p.saturated_s)

        # Pass 1: queue delays, the least-loaded worker, the best routable match.
        qs = []
        lo_i, lo_q, lo_f, lo_ties = 0, _INF, 0, 0
        best_b: float = 0  # priced blocks: colder tiers count fractionally
        written = self._write_rate if p.tie_written and self._written else None
        lo_r = None  # the least-loaded worker's write rate, computed on a tie only
        for i, v in enumerate(views):
            a, c = v.in_flight_tokens, v.queued_tokens
            # past saturation, the report's whole prompts -> the part w prefills
            cq = c * self._uncached_share(v.id, now) if sat and c > a else c
            q = (a if a > cq else cq) / v.prefill_tokens_per_s
            qs.append(q)
            f = v.in_flight
            if q < lo_q or (q == lo_q and f < lo_f):
                lo_i, lo_q, lo_f, lo_r, lo_ties = i, q, f, None, 1
            elif q == lo_q and f == lo_f:
                c, lo_r, r = by_written(written, now, views[lo_i].id, lo_r, v.id)
                if c < 0:
                    lo_i, lo_r, lo_ties = i, r, 1
                elif c == 0:
                    lo_ties += 1
                    if rnd() * lo_ties < 1.0:
                        lo_i = i
            if blocks:
                b = blocks.get(v.id, 0)
                if b > best_b and not (unmatched and v.id in unmatched):
                    best_b = b
        min_b = -(-p.min_match_tokens // bt) if bt > 0 else 0
        if sat and p.home_records:
            # a fresh home at least as deep as every match that counts takes the
            # request; a stale one is no home, and its match counts for nothing
            # (class docstring)
            h, hd = self._home(request, views, qs, lo_q, min_b)
            if h >= 0 and hd == 0:
                stale = views[h].id
                unmatched = {stale} if not unmatched else unmatched | {stale}
                if blocks and blocks.get(stale, 0) >= best_b:
                    best_b = 0
                    for v in views:
                        b = blocks.get(v.id, 0)
                        if b > best_b and v.id not in unmatched:
                            best_b = b
            elif h >= 0 and hd >= min_b and hd >= best_b and not (avoid and views[h].id in avoid):
                v = views[h]
                b = blocks.get(v.id, 0) if blocks else 0
                unc = prompt - b * bt
                self._explained = (views, qs, None, True)
                return Decision(
                    v.id,
                    Reason.AFFINITY if b and b >= min_b else Reason.MISS,
                    gpu.get(v.id, 0),
                    qs[h] + (unc if unc > 0 else 0) / v.prefill_tokens_per_s,
                )
        if best_b == 0 or best_b < min_b:
            i = lo_i
            if avoid and views[i].id in avoid:
                # the least-loaded worker that is not churning or crowded (all are: lo_i),
                # while the queue it adds is less than the request's own prefill there
                j = self._least_loaded_non_holder(views, qs, avoid, ())
                if j >= 0 and qs[j] - lo_q < prompt / views[j].prefill_tokens_per_s:
                    i = j
            v = views[i]
            self._explained = (views, qs, None, False)
            return Decision(
                v.id,
                Reason.MISS,
                gpu.get(v.id, 0) if gpu else 0,
                qs[i] + prompt / v.prefill_tokens_per_s,
            )

        masked: dict[str, float] | None = None
        replicas: dict[str, float] | None = None
        warm: tuple[WorkerId, ...] = ()
        depth = match.depth
        if (
            depth
            and p.replicate
            and depth <= len(request.hashes)
            and (match.rate >= p.hot_min_rate or request.hashes[depth - 1] in self.hot)
        ):
            out = self._replicate(request, match, views, qs, now)
            if isinstance(out, Decision):
                self._explained = (views, qs, None, False)
                return out
            masked, replicas, warm = out

        # Pass 2: scores, bounded affinity (the bound at prefill_weight for every match).
        wb = p.prefill_weight
        w = p.private_weight if match.private else wb
        bound_q = lo_q + p.affinity_abs_s
        bound_r = lo_q * p.affinity_rel
        grow = w / p.long_match_s if p.long_match_s > 0 else 0.0
        eb: list[float] = []  # each worker's match that counts (0: none, or over the affinity bound)
        kept = False
        for i, v in enumerate(views):
            q = qs[i]
            b = blocks.get(v.id, 0)
            if (
                b < min_b
                or (masked and v.id in masked)
                or (unmatched and v.id in unmatched)
                or q > bound_r
                and q > bound_q + wb * b * bt / v.prefill_tokens_per_s
            ):
                b = 0
            eb.append(b)
            kept = kept or b > 0
        # A saturated fleet (even its least-loaded worker has a queue): a holder within
        # the affinity bound keeps the request whatever the score says (class docstring).
        hold = kept and sat
        ss: list[tuple[float, float]] = []
        min_s = _INF
        for i, v in enumerate(views):
            q = qs[i]
            b = eb[i]
            tps = v.prefill_tokens_per_s
            if hold and b == 0:
                ss.append((_INF, 0))
                continue
            unc = prompt - b * bt
            if unc < 0:
                unc = 0
            s = q + w * unc / tps
            if b:
                sv = b * bt / tps
                s -= grow * sv * sv
            ss.append((s, b))
            if s < min_s:
                min_s = s
        # Pass 3: among the ties (within tie_s of the best), the longest match, then
        # the fewest in-flight requests, then the least KV written lately, then at random.
        cut = min_s + p.tie_s
        pick_b: float = -1
        pick_i, pick_f, pick_r, ties = 0, 0, None, 0
        for i, (s, b) in enumerate(ss):
            if s > cut:
                continue
            f = views[i].in_flight
            if b > pick_b or (b == pick_b and f < pick_f):
                pick_i, pick_b, pick_f, pick_r, ties = i, b, f, None, 1
            elif b == pick_b and f == pick_f:
                c, pick_r, r = by_written(written, now, views[pick_i].id, pick_r, views[i].id)
                if c < 0:
                    pick_i, pick_r, ties = i, r, 1
                elif c == 0:
                    ties += 1
                    if rnd() * ties < 1.0:
                        pick_i = i
        v = views[pick_i]
        if replicas and v.id in replicas and pick_b > 0:
            reason = Reason.REPLICA
        elif pick_b >= best_b:
            reason = Reason.AFFINITY
        else:
            reason = Reason.SPILL_LOAD
        unc = prompt - pick_b * bt
        ttft = qs[pick_i] + (unc if unc > 0 else 0) / v.prefill_tokens_per_s
        self._explained = (views, qs, ss, hold)
        return Decision(v.id, reason, gpu.get(v.id, 0), ttft, warm)

    def explain(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], decision: Decision
    ) -> Explanation:
        """The last ``choose``'s queue delays (as it priced them, saturation's uncached
        share included) and, where it scored the views, each one's score and the
        match it credited (an infinite score: past saturation a holder kept the
        request and the others were not considered). O(1): references to its lists."""
        ex = self._explained
        if ex is None or ex[0] is not views:  # another chooser (a P/D decode leg)
            return Explanation(request, match, views, decision)
        return Explanation(request, match, views, decision, ex[1], ex[2], ex[3])

    def _replicate(
        self,
        request: RouteRequest,
        match: MatchResult,
        views: Sequence[WorkerView],
        qs: list[float],
        now: float,
    ) -> Decision | tuple[dict[str, float] | None, dict[str, float] | None, tuple[WorkerId, ...]]:
        """Hot-root bookkeeping for a request through a hot (or recorded) node.

        Returns a REPLICA ``Decision`` when this request goes to a new replica, else
        ``(masked, replicas, warm)`` for the scoring pass.
        """
        p = self.params
        hot = self.hot
        depth, rate = match.depth, match.rate
        key = request.hashes[depth - 1]
        blocks = match.blocks
        holders = [v for v in views if blocks.get(v.id, 0) >= depth]
        held: set[str] = {v.id for v in holders}
        if rate < p.hot_min_rate:
            rec = hot.get(key)
            if rec is None:
                return None, None, ()
            rec.rate, rec.needed = rate, 1
            hot.retire_all(rec, now)
            self._forget_departed(rec, held, now)
            if not rec.replicas and not rec.retired:
                hot.drop(key)
                return None, None, ()
            return rec.retired, None, ()
        rec = hot.see(key, depth, rate, now)
        self._forget_departed(rec, held, now)
        bt = request.block_tokens
        uncached = max(request.prompt_tokens - depth * bt, bt, 1)
        src = holders or views
        mean_tps = sum(v.prefill_tokens_per_s for v in src) / len(src)
        cap = min(1 + p.max_replicas, len(views))
        needed, per_holder = holders_needed(
            rate, uncached, mean_tps, p.holder_max_rate, p.hot_utilization, cap
        )
        rec.needed = needed
        # holders not retired, plus replicas still on their way into the index
        active = held.difference(rec.retired)
        if len(rec.replicas):
            routable = {v.id for v in views}
            active.update(w for w in rec.replicas if w in routable)
        warm: tuple[WorkerId, ...] = ()
        if len(active) < needed:
            back = [w for w in rec.retired if w in held]
            if back:
                # still holds the prefix: cheaper than a cold replica
                hot.reinstate(rec, back[-1], now)
            elif len(rec.replicas) < p.max_replicas:
                i = self._least_loaded_non_holder(views, qs, held, rec.replicas)
                if i >= 0:
                    new = views[i]
                    hot.add_replica(rec, new.id, now)
                    if not p.warm_ahead:
                        return Decision(
                            new.id,
                            Reason.REPLICA,
                            blocks.get(new.id, 0),
                            qs[i] + request.prompt_tokens / new.prefill_tokens_per_s,
                        )
                    warm = (new.id,)
        elif len(active) > 1 and rate < RETIRE_FRACTION * per_holder * (len(active) - 1):
            hot.retire_newest(rec, active, now)
        return (rec.retired or None), rec.replicas, warm

    @staticmethod
    def _saturated(views: Sequence[WorkerView], saturated_s: float) -> bool:
        """Every worker is saturated: the router refuses what it could serve
        (``WorkerView.saturated``), or its queue (the module docstring's ``queue_s``)
        is ``saturated_s`` or more. O(workers)."""
        for v in views:
            if v.saturated:
                continue
            a, c = v.in_flight_tokens, v.queued_tokens
            if (a if a > c else c) < saturated_s * v.prefill_tokens_per_s:
                return False
        return True

    def _least_loaded_non_holder(
        self,
        views: Sequence[WorkerView],
        qs: list[float],
        held: Collection[str],
        pending: Collection[str],
    ) -> int:
        """Index of the least-loaded view that neither holds the prefix nor is a
        replica still warming up; ties at random; -1 if none."""
        rnd = self.rng.random
        best, best_q, ties = -1, _INF, 0
        for i, v in enumerate(views):
            if v.id in held or v.id in pending:
                continue
            q = qs[i]
            if q < best_q:
                best, best_q, ties = i, q, 1
            elif q == best_q:
                ties += 1
                if rnd() * ties < 1.0:
                    best = i
        return best

    @staticmethod
    def _forget_departed(rec: HotRecord, held: set[str], now: float) -> None:
        """Retired workers the index no longer credits with the prefix have aged out;
        so have replicas that lost it (or never got it) ``REPLICA_GRACE_S`` after they
        were added — the grace covers a warm-up's round trip before agent events."""
        for w in [w for w in rec.retired if w not in held]:
            del rec.retired[w]
        for w in [w for w, t in rec.replicas.items() if w not in held and now - t > REPLICA_GRACE_S]:
            del rec.replicas[w]

    def describe(self) -> dict[str, Any]:
        d = self.hot.describe()
        d["params"] = asdict(self.params)
        return d

    def check(self) -> None:
        self.hot.check()
        if self.footprints is not None:
            self.footprints.check()
        self._check_records()
