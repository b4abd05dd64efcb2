"""Load measures and least-loaded selection shared by the policies.

Two measures of a ``WorkerView``'s load, each the one a policy family is defined on:

- ``tokens``: prefill work ahead of a new request, ``in_flight_tokens + queued_tokens``
  (``WorkerView.load_tokens``) — least_load, power_of_two, prefix_load's misses.
- ``requests``: the router's own in-flight request count (``in_flight``) —
  SGLang's cache_aware and consistent hashing with bounded loads.

Ties are broken uniformly at random with the policy's ``rng`` by reservoir
sampling: the k-th tied candidate replaces the current pick with probability 1/k,
so a tie costs one ``rng.random()`` and no list.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from radixfleet.policies.base import WorkerView


def least_tokens(views: Sequence[WorkerView], rng: random.Random) -> WorkerView:
    """The view with the least ``in_flight_tokens + queued_tokens``; ties at random. O(n)."""
    best = views[0]
    best_load = best.in_flight_tokens + best.queued_tokens
    ties = 1
    for i in range(1, len(views)):
        v = views[i]
        load = v.in_flight_tokens + v.queued_tokens
        if load < best_load:
            best, best_load, ties = v, load, 1
        elif load == best_load:
            ties += 1
            if rng.random() * ties < 1.0:
                best = v
    return best


def least_requests(views: Sequence[WorkerView], rng: random.Random) -> WorkerView:
    """The view with the fewest router in-flight requests; ties at random. O(n)."""
    best = views[0]
    best_load = best.in_flight
    ties = 1
    for i in range(1, len(views)):
        v = views[i]
        load = v.in_flight
        if load < best_load:
            best, best_load, ties = v, load, 1
        elif load == best_load:
            ties += 1
            if rng.random() * ties < 1.0:
                best = v
    return best


def queue_seconds(v: WorkerView) -> float:
    """Seconds of prefill work queued ahead of a new request on ``v``."""
    return (v.in_flight_tokens + v.queued_tokens) / v.prefill_tokens_per_s
