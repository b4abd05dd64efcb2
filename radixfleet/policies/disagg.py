"""Worker roles of a disaggregated (prefill/decode) fleet, and the decode-side pick.

A worker is ``prefill`` (runs prompts, holds the radix cache the router's index
mirrors, hands the prompt's KV on), ``decode`` (receives the KV, generates the
tokens) or ``both`` (a colocated worker). A request of a disaggregated fleet runs
on one prefill worker, chosen by any prefill policy of the registry over the
prefill workers' views (the index lives on the prefill side: prefix_load's match
against queue is the prefix-aware choice, round_robin the blind one), then on one
decode worker, chosen here.

Decode pick (``choose_decode``): what decides first is whether the request's KV
(prompt + the tokens it will generate) fits now, then how many sequences already
share the worker's decode steps, then the pairing's transfer: the prompt's KV moves
from the prefill worker except what the decode worker already holds (a decode
worker keeps the KV of what it decoded, so a conversation's next turn is mostly
there; ``held``: the router index's tokens of this prompt per worker). Among the
workers with room, the one with the fewest running + queued requests; ties: the one
holding most of the prompt (least to transfer), then the most free KV, then at
random. Load comes before transfer because a queued sequence costs a decode step
(tens of ms) for every token it generates, while a prompt's KV crosses an RDMA link
in milliseconds. With room nowhere, the one with the most free KV (it admits first).
Pure, O(n).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from radixfleet.policies.base import WorkerView
from radixfleet.wire.errors import ConfigError

PREFILL = "prefill"
DECODE = "decode"
BOTH = "both"
ROLES = (PREFILL, DECODE, BOTH)


def validate_roles(roles: Sequence[object], path: str = "roles") -> tuple[str, ...]:
    """Checks a fleet's roles, one per worker; returns them as a tuple.

    ``ConfigError`` at ``path[i]`` for a role that is not one of ``ROLES``, and at
    ``path`` for an empty fleet or a disaggregated one (any ``prefill`` or
    ``decode`` worker) with no prefill or no decode worker: its requests could
    never finish. An all-``both`` fleet is colocated and valid."""
    if isinstance(roles, (str, bytes)) or not isinstance(roles, Sequence):
        raise ConfigError(path, f"must be a list of roles ({', '.join(ROLES)}), got {roles!r}")
    if not roles:
        raise ConfigError(path, "a fleet needs at least one worker")
    for i, role in enumerate(roles):
        if role not in ROLES:
            raise ConfigError(f"{path}[{i}]", f"{role!r} is not a role; use one of {', '.join(ROLES)}")
    out = tuple(str(r) for r in roles)
    if PREFILL in out or DECODE in out:
        for need in (PREFILL, DECODE):
            if need not in out:
                raise ConfigError(
                    path,
                    f"a disaggregated fleet needs at least one {need} worker; roles are {', '.join(out)}",
                )
    return out


def free_kv_tokens(view: WorkerView) -> int:
    """KV tokens the worker has not committed, as of its last report."""
    return max(0, view.kv_capacity_tokens - view.kv_used_tokens)


def choose_decode(
    views: Sequence[WorkerView],
    need_tokens: int,
    rng: random.Random,
    held: Callable[[str], int] | None = None,
) -> WorkerView:
    """The decode worker for a request whose KV needs ``need_tokens`` (module
    docstring); ``held(worker id)``: the prompt's tokens that worker holds (None:
    nothing known, as in a fleet whose decode side keeps no prefix cache)."""
    if not views:
        raise ValueError("choose_decode needs at least one decode worker")
    fits = [v for v in views if free_kv_tokens(v) >= need_tokens]
    if not fits:
        best_free = max(free_kv_tokens(v) for v in views)
        tied = [v for v in views if free_kv_tokens(v) == best_free]
        return tied[0] if len(tied) == 1 else rng.choice(tied)

    def key(v: WorkerView) -> tuple[int, int, int]:
        kept = held(v.id) if held is not None else 0
        return (v.running_requests + v.queued_requests, -kept, -free_kv_tokens(v))

    best = min(key(v) for v in fits)
    tied = [v for v in fits if key(v) == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
