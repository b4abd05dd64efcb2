"""Which tenants are getting less than their fair share of the fleet right now.

A tenant is *under its share* while the tokens recently admitted for it are less than
``under`` times its weighted share of everything admitted recently::

    served_t     tokens admitted for tenant t (the rate limits' cost: prompt + the
                 output bound, radixfleet.route.tenancy.output_bound, reserved at admission,
                 corrected as they are: Tenancy.charge), decayed with half-life
                 ``half_life_s``
    total        the sum of served_t over all tenants, decayed alike
    active       the tenants whose served_t is at least ACTIVE_SHARE of total
                 (recomputed at most every REFRESH_S), plus t itself
    share_t      weight_t / sum of the active tenants' weights
    under(t)  <=>  served_t < under * share_t * total      (never with one active tenant)

``radixfleet.route.tenancy`` sheds a request of a tenant under its share as it sheds the next
class up: its shedding bound's factor is that class's ``queue_scale`` (critical has
none above it), so it is shed no sooner than a request of that class and never later —
a higher class is still admitted whenever it is — while its admission-queue band and
engine ``priority`` stay its own class's. Why: the shed verdict judges the workers, not who
fills them, so at 5x a tenant's share next to one at half of its share (both standard,
two simulated agents) the light tenant's requests were refused about as often as the
heavy one's (bench/RESULTS.md "Tenants and priority classes"); the admission
queue's fair queuing (``radixfleet.route.admission_queue``, off by default) orders only the
requests that wait. What remains for the light tenant is the prefill the engine is
already running when its request arrives, which no admission order shortens.

Why decayed admitted tokens rather than the queue's virtual token counters: those
exist only while requests wait and are forgotten when the queue empties (fairness
among the waiting), while "under its share" must hold for a tenant that never waits
at all. Why a margin (``under`` < 1): two tenants at equal rates each sit near their
share, and a strict comparison would promote whichever is momentarily below it —
half of everyone's requests, at random. One replica counts what it admitted (the bus
shares rate limits, not this): behind N replicas with an even spread of each tenant,
every replica sees the same proportions.

Cost: O(1) per request (two decays, a dict lookup); O(tenants seen within a few
half-lives) every REFRESH_S, when tenants whose decayed service fell below
FORGET_SHARE of the total are forgotten (the dict stays bounded by the tenants
active lately).

Invariants (``check()``): every served value and the total are finite and >= 0; the
total is at least each tenant's value (up to rounding); the active weight sum is >= 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: a tenant counts among those sharing the fleet from this share of the recent total
ACTIVE_SHARE = 0.01
#: a tenant below this share of the recent total is forgotten (at a refresh)
FORGET_SHARE = 0.001
#: seconds between recomputations of the active tenants' weight sum
REFRESH_S = 0.5
#: the most tokens one request counts for (a body's output bound is any integer a
#: client sends; the engine refuses what exceeds its context, after admission)
MAX_TOKENS = 1e12


class FairShare:
    """Decayed admitted tokens per tenant. One event loop owns it."""

    __slots__ = (
        "half_life_s",
        "under",
        "weights",
        "_served",
        "_total",
        "_total_at",
        "_active_w",
        "_refresh_at",
    )

    def __init__(self, half_life_s: float, under: float, weights: Mapping[str, float]) -> None:
        self.half_life_s = half_life_s
        self.under = under  # 0: never under (off)
        self.weights = weights  # tenant -> weight (others 1)
        self._served: dict[str, list[float]] = {}  # tenant -> [value, at]
        self._total = 0.0
        self._total_at = 0.0
        self._active_w = 0.0  # the active tenants' weights at the last refresh
        self._refresh_at = -math.inf

    def configure(self, half_life_s: float, under: float, weights: Mapping[str, float]) -> None:
        """A reload: what was served so far is kept."""
        self.half_life_s, self.under, self.weights = half_life_s, under, weights
        self._refresh_at = -math.inf

    def _decay(self, value: float, since: float, now: float) -> float:
        dt = now - since
        return value * 0.5 ** (dt / self.half_life_s) if dt > 0.0 else value

    def _total_now(self, now: float) -> float:
        """The total decayed to ``now`` (a ``now`` older than the last one, from a
        request admitted while another was, reads the total as it stands)."""
        if now > self._total_at:
            self._total = self._decay(self._total, self._total_at, now)
            self._total_at = now
        return self._total

    def served(self, tenant: str, tokens: float, now: float) -> None:
        """``tokens`` admitted for ``tenant`` (negative: a correction, once the answer
        showed it used fewer than were reserved); at most ``MAX_TOKENS`` either way."""
        tokens = MAX_TOKENS if tokens > MAX_TOKENS else -MAX_TOKENS if tokens < -MAX_TOKENS else float(tokens)
        total = self._total_now(now)
        e = self._served.get(tenant)
        v = self._decay(e[0], e[1], now) if e is not None else 0.0
        add = tokens if tokens > -v else -v  # a correction never takes it below 0
        if e is None:
            self._served[tenant] = [v + add, now]
        else:
            e[0], e[1] = v + add, now if now > e[1] else e[1]
        total += add
        self._total = total if total > 0.0 else 0.0

    def is_under(self, tenant: str, now: float) -> bool:
        """Whether ``tenant`` got less than ``under`` times its weighted share of what
        was admitted lately (module docstring). False when nothing was."""
        if self.under <= 0.0:
            return False
        total = self._total_now(now)
        if total <= 0.0:
            return False
        if now >= self._refresh_at:
            self._refresh(total, now)
        e = self._served.get(tenant)
        v = self._decay(e[0], e[1], now) if e is not None else 0.0
        w = self.weights.get(tenant, 1.0)
        active_w = self._active_w if v >= ACTIVE_SHARE * total else self._active_w + w
        if active_w <= w:  # alone: its share is everything
            return False
        return v < self.under * (w / active_w) * total

    def _refresh(self, total: float, now: float) -> None:
        """The active tenants' weight sum; forgets the ones served too little lately."""
        self._refresh_at = now + REFRESH_S
        active_w = 0.0
        gone = []
        for t, e in self._served.items():
            v = self._decay(e[0], e[1], now)
            if v < FORGET_SHARE * total:
                gone.append(t)
            elif v >= ACTIVE_SHARE * total:
                active_w += self.weights.get(t, 1.0)
        for t in gone:
            del self._served[t]
        self._active_w = active_w

    def check(self) -> None:
        assert math.isfinite(self._total) and self._total >= 0.0, self._total
        for t, (v, _) in self._served.items():
            assert math.isfinite(v) and v >= 0.0, (t, v)
        assert self._active_w >= 0.0, self._active_w
        for t, (v, at) in self._served.items():
            mine = self._decay(v, at, self._total_at) if at <= self._total_at else v
            assert mine <= self._total * (1.0 + 1e-9) + 1e-6, (t, mine, self._total)
