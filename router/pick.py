"""The router's pick step: match, choose, hint, count — one function, two callers.

The offline simulator (``loadtest.simulator.simulation``, on its virtual clock) routes
through ``pick_worker``; the live data plane (``router.dataplane``) matches and
chooses across the key spaces its workers use (``router.engines``), which for one
byte key space is the same match and choice, and then calls the same
``hint_and_count`` — so the simulator runs exactly the bookkeeping the router does::

    match = index.match(request.hashes, now, count)     hot-root counters (count)
    admit(match)                                         the shedding verdict (the
                                                         simulator's; live: router.shedding)
    d     = policy.choose(request, match, views, now)
    index.insert(d.worker, request.hashes, now)          optimistic hint
    pool.pick(worker, uncached_tokens(...))              load counted at pick time

Nothing here awaits: the load is counted before the caller awaits anything, so a
burst cannot herd onto one worker (docs/DESIGN.md's lessons). ``views`` come from the
caller (``pool.views(now)``, minus workers already tried on a retry) and must not
be empty: the caller answers "no worker" itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from policies.base import Decision, MatchResult, Policy, RouteRequest, WorkerView
from protocol.errors import Overloaded
from router.pool import Pool, Worker


class Picked(NamedTuple):
    """What ``pick_worker`` did: the policy's decision, the pool's worker it named,
    the tokens counted on it (release them with ``pool.prefilled`` / ``finish``), the
    depth the index matched (hot-root warm-ups cover that prefix) and, when asked,
    the matched blocks' last-use times on that worker before the hint re-touched them
    (what an approximate-mode correction needs: ``router.engines.link``)."""

    decision: Decision
    worker: Worker
    tokens: int
    depth: int
    touches: tuple | None = None


def uncached_tokens(prompt_tokens: int, matched_blocks: int, block_tokens: int) -> int:
    """The prefill work a request adds to its worker: the prompt tokens its matched
    blocks do not cover (policies.base: load is counted in uncached tokens)."""
    return max(0, prompt_tokens - matched_blocks * block_tokens)


def pick_worker(
    policy: Policy,
    index,
    pool: Pool,
    request: RouteRequest,
    views: Sequence[WorkerView],
    now: float,
    *,
    count: bool = True,
    touches: bool = False,
    price: Callable[[Sequence[int], MatchResult], MatchResult] | None = None,
    admit: Callable[[MatchResult], Overloaded | None] | None = None,
) -> Picked:
    """Routes ``request`` among ``views`` and does the router's pick-time bookkeeping
    (module docstring). ``count``: record the request in the index's hot-root
    counters (False for a retry: the request was counted once). Raises
    ``AssertionError`` if the policy names a worker the pool does not know (a
    policy bug: never route into the void). ``touches``: return the matched blocks'
    last-use times (the live data plane's ``_pick`` takes the same). ``price``: the
    match with its colder tiers valued (``MatchResult.colder``; the live router's is
    ``router.engines.manager.Engines.key``). ``admit``: the shedding verdict on the
    match, before anything is chosen or counted: its ``Overloaded`` is raised (the
    live data plane sheds between its own match and choice, router.dataplane)."""
    match = index.match(request.hashes, now, count)
    if price is not None:
        match = price(request.hashes, match)
    if admit is not None:
        refusal = admit(match)
        if refusal is not None:
            raise refusal
    d = policy.choose(request, match, views, now)
    w = pool.get(d.worker)
    if w is None:
        raise AssertionError(f"policy {policy.name} chose unknown worker {d.worker!r}")
    tt = None
    if touches and d.matched_blocks:
        tt = tuple(index.touch_time(w.id, h) for h in request.hashes[: d.matched_blocks])
    tokens = hint_and_count(
        index, pool, w, request.hashes, request.prompt_tokens, d.matched_blocks, request.block_tokens, now
    )
    return Picked(d, w, tokens, match.depth, tt)


def hint_and_count(
    index,
    pool: Pool,
    w: Worker,
    hashes: Sequence[int],
    prompt_tokens: int,
    matched_blocks: int,
    block_tokens: int,
    now: float,
    holder: str | None = None,
) -> int:
    """The bookkeeping after a choice, before anything is awaited: ``w`` is hinted as
    holding ``hashes`` (in its own key space) and the request's uncached tokens are
    counted on it. Returns the tokens counted. The live data plane calls this once it
    has keyed the request in the chosen worker's space (router.engines.keyspace);
    ``pick_worker`` (the simulator, one byte key space) does match and choose itself.
    ``holder``: the index holder hinted, when not the worker itself (one data-parallel
    rank of its engine: ``EngineLink.holder``)."""
    if hashes:
        index.insert(holder or w.id, hashes, now)
    tokens = uncached_tokens(prompt_tokens, matched_blocks, block_tokens)
    pool.pick(w, tokens, prompt_tokens)
    return tokens
