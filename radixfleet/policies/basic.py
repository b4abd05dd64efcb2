"""The cache-blind baselines: round_robin, random, least_load, power_of_two.

They ignore the match result except to report ``matched_blocks`` (so the router's
hit-rate metrics stay comparable across policies). Load is measured in prefill
tokens ahead of a new request (``radixfleet.policies.load``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from radixfleet.policies.base import (
    Decision,
    MatchResult,
    Policy,
    PolicyParams,
    Reason,
    RouteRequest,
    WorkerView,
)
from radixfleet.policies.load import least_tokens
from radixfleet.policies.params import parameters


class RoundRobin(Policy):
    """Each routable worker in turn, in the order of ``views``.

    State: ``_cursor``, a count of decisions made; the pick is
    ``views[_cursor % len(views)]``, so a worker leaving the set shifts the
    rotation but never stalls it.
    """

    name = "round_robin"

    @parameters
    class Params(PolicyParams):
        """round_robin has no parameters."""

    def __init__(self, params: PolicyParams | None = None, rng: random.Random | None = None) -> None:
        super().__init__(params, rng)
        self._cursor = 0  # only choose() advances it

    def choose(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], now: float
    ) -> Decision:
        v = views[self._cursor % len(views)]
        self._cursor += 1
        return Decision(v.id, Reason.ROUND_ROBIN, match.blocks.get(v.id, 0))

    def describe(self) -> dict[str, Any]:
        return {"params": {}, "cursor": self._cursor}


class RandomPolicy(Policy):
    """A uniformly random routable worker."""

    name = "random"

    @parameters
    class Params(PolicyParams):
        """random has no parameters."""

    def choose(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], now: float
    ) -> Decision:
        v = views[int(self.rng.random() * len(views))]
        return Decision(v.id, Reason.RANDOM, match.blocks.get(v.id, 0))


class LeastLoad(Policy):
    """The worker with the least prefill work ahead (in-flight prompt tokens plus its
    reported queue); ties at random."""

    name = "least_load"

    @parameters
    class Params(PolicyParams):
        """least_load has no parameters."""

    def choose(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], now: float
    ) -> Decision:
        v = least_tokens(views, self.rng)
        return Decision(v.id, Reason.LEAST_LOAD, match.blocks.get(v.id, 0))


class PowerOfTwo(Policy):
    """Two distinct random candidates; the less loaded (prefill tokens) wins, ties at
    random. With one worker, that worker."""

    name = "power_of_two"

    @parameters
    class Params(PolicyParams):
        """power_of_two has no parameters."""

    def choose(
        self, request: RouteRequest, match: MatchResult, views: Sequence[WorkerView], now: float
    ) -> Decision:
        n = len(views)
        rnd = self.rng.random
        if n == 1:
            v = views[0]
        else:
            i = int(rnd() * n)
            j = int(rnd() * (n - 1))
            if j >= i:
                j += 1  # a second candidate distinct from the first
            a, b = views[i], views[j]
            la = a.in_flight_tokens + a.queued_tokens
            lb = b.in_flight_tokens + b.queued_tokens
            v = a if la < lb or (la == lb and rnd() < 0.5) else b
        return Decision(v.id, Reason.LEAST_LOAD, match.blocks.get(v.id, 0))
