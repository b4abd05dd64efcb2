"""cache_aware: SGLang's policy, with its semantics and defaults (sglang-router v0.3.1
``src/policies/cache_aware.rs``), so operators can switch with the same numbers and
comparisons against it are honest.

Per request::

    load(w)    = the router's own in-flight request count (WorkerView.in_flight)
    imbalanced = max(load) - min(load) > balance_abs_threshold
                 and max(load) > min(load) * balance_rel_threshold
    imbalanced                      -> least-loaded worker          (reason BALANCE)
    match_rate > cache_threshold    -> the best-matching worker     (reason AFFINITY)
    otherwise                       -> least-loaded worker          (reason MISS)

Where we differ, and why:

- SGLang matches characters in a per-model radix tree; our index is block-level, so
  ``match_rate = matched_blocks * block_bytes / text bytes`` with ``block_bytes =
  block_tokens * BYTES_PER_TOKEN`` and the text length ``RouteRequest.text_len``
  (bytes of routing text; ``prompt_tokens * BYTES_PER_TOKEN`` when 0). The partial
  tail block is never keyed, so a full match of an unaligned text rates just under 1.
- SGLang returns the most recently attached tenant of the deepest node; the index
  does not expose touch times to policies, so ties between equally matching
  workers (and between equally loaded ones) break at random.
- Only routable workers (``views``) are candidates; a match on an unroutable worker
  does not count.
- SGLang's router knows only GPU hits. Where an engine offloads KV, a worker's match
  counts its colder tiers at their price (``MatchResult.priced()``: each offloaded
  block as the share of a GPU hit that saved prefill minus the load back leaves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from radixfleet.keys import BYTES_PER_TOKEN
from radixfleet.policies.base import (
    Decision,
    MatchResult,
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
    WorkerView,
)
from radixfleet.policies.load import least_requests
from radixfleet.policies.params import param, parameters


class CacheAware(Policy):
    name = "cache_aware"

    @parameters
    class Params(PolicyParams):
        cache_threshold: float = param(
            0.3, "route to the best match only when match_rate exceeds this", lo=0.0, hi=1.0
        )
        balance_abs_threshold: int = param(
            64, "imbalanced when max-min in-flight exceeds this (and the ratio too)", lo=0
        )
        balance_rel_threshold: float = param(
            1.5, "imbalanced when max in-flight > min x this (and the difference too)", lo=1.0
        )

    params: Params

    def choose(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], now: float
    ) -> Decision:
        p = self.params
        blocks = match.blocks
        lo = hi = views[0].in_flight
        for v in views:
            f = v.in_flight
            if f < lo:
                lo = f
            elif f > hi:
                hi = f
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            v = least_requests(views, self.rng)
            return Decision(v.id, Reason.BALANCE, blocks.get(v.id, 0))
        if blocks or match.colder:
            # the best-matching routable worker (colder tiers at their price), ties at random
            priced = match.priced()
            best_id, best, ties = None, 0.0, 0
            rnd = self.rng.random
            for v in views:
                b = priced.get(v.id, 0)
                if b > best:
                    best_id, best, ties = v.id, b, 1
                elif b == best and b:
                    ties += 1
                    if rnd() * ties < 1.0:
                        best_id = v.id
            if best:
                text = request.text_len or request.prompt_tokens * BYTES_PER_TOKEN
                rate = best * request.block_tokens * BYTES_PER_TOKEN / text if text else 0.0
                if rate > p.cache_threshold:
                    assert best_id is not None, f"{best=}"  # set with best
                    return Decision(best_id, Reason.AFFINITY, blocks.get(best_id, 0))
        v = least_requests(views, self.rng)
        return Decision(v.id, Reason.MISS, blocks.get(v.id, 0))

    def describe(self) -> dict[str, Any]:
        return {"params": asdict(self.params)}
