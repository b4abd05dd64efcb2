"""Token buckets: the rate limits of a tenant or an API key (``radixfleet.route.tenancy``).

A bucket holds up to ``burst`` units and refills at ``rate`` units per second; a
request costing ``n`` units passes when the bucket holds ``n`` (it is taken at once)
and otherwise is told how long until it would. Two buckets make a limit: one counted
in requests (``requests_per_s``), one in tokens (``tokens_per_min``)::

    level  ──refill: + rate × elapsed, at most burst──>  level
    wait_s(n) = 0 if level >= min(n, burst) else (min(n, burst) - level) / rate

A cost above the whole burst passes only with a full bucket and leaves it in debt
(level < 0) for the excess (``radixfleet.route.tenancy`` refuses such a request before it
asks). ``give`` corrects a reservation once the real cost is known (a refund, or
with a negative amount a further charge: debt again), so a tenant's token rate holds
on what its requests really used. Debt is capped at one burst (level >= -burst):
one charge far above the burst (a request's usage, a peer replica's report) costs
the tenant at most two bursts' refill, never hours of refusals for every key it has.

Why not a library: ``aiolimiter`` makes a caller wait (we answer 429 at once),
``limits`` and ``pyrate-limiter`` count fixed or sliding windows behind storage
backends and offer neither the remaining level and reset time the
``x-ratelimit-*`` headers need nor a refund; the bucket is twenty lines on the hot
path, allocation-free.
"""

from __future__ import annotations


class TokenBucket:
    """One token bucket. One event loop owns it; every method is O(1).

    Invariants (``check()``): ``rate > 0``; ``burst > 0``; ``-burst <= level <= burst``
    (negative: debt, at most one burst); ``at`` is the latest time it was refilled at (time never runs
    backwards for it: an earlier ``now`` refills nothing)."""

    __slots__ = ("rate", "burst", "level", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a token bucket needs rate > 0 and burst > 0, got {rate=}, {burst=}")
        self.rate = rate  # units per second
        self.burst = burst  # the most it holds (and the most one request waits for)
        self.level = burst  # units available now; starts full
        self.at = now  # monotonic time of the last refill

    def _refill(self, now: float) -> None:
        if now > self.at:
            level = self.level + (now - self.at) * self.rate
            self.level = level if level < self.burst else self.burst
            self.at = now

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` units could be taken (0.0: now). Takes nothing."""
        self._refill(now)
        need = cost if cost < self.burst else self.burst
        short = need - self.level
        return short / self.rate if short > 0 else 0.0

    def take(self, cost: float) -> None:
        """Takes ``cost`` units; call after ``wait_s(cost, now)`` answered 0.0 (it may
        leave debt: a cost above the burst, at most one burst of it)."""
        level = self.level - cost
        self.level = level if level > -self.burst else -self.burst

    def give(self, amount: float, now: float) -> None:
        """Returns ``amount`` units (negative: charges them), the level kept within
        [-burst, burst]."""
        self._refill(now)
        level = self.level + amount
        self.level = self.burst if level > self.burst else -self.burst if level < -self.burst else level

    def remaining(self) -> int:
        """Whole units available at the last refill (never negative)."""
        return int(self.level) if self.level > 0 else 0

    def reset_s(self) -> float:
        """Seconds until the bucket is full again, from the last refill."""
        short = self.burst - self.level
        return short / self.rate if short > 0 else 0.0

    def reconfigure(self, rate: float, burst: float, now: float) -> None:
        """New limits (a reload): what was used so far still counts (a larger burst
        adds its difference to the level; a smaller one caps it)."""
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a token bucket needs rate > 0 and burst > 0, got {rate=}, {burst=}")
        self._refill(now)
        level = self.level + (burst - self.burst if burst > self.burst else 0)
        self.rate, self.burst = rate, burst
        self.level = burst if level > burst else -burst if level < -burst else level

    def check(self) -> None:
        assert self.rate > 0 and self.burst > 0, (self.rate, self.burst)
        assert -self.burst <= self.level <= self.burst, (self.level, self.burst)


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it in ``x-ratelimit-reset-*``: ``20ms``, ``1s``,
    ``6m0s``, ``1h2m3s``."""
    if seconds < 1.0:
        return f"{max(0, int(seconds * 1000 + 0.999))}ms"
    s = int(seconds + 0.999)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    return f"{m}m{s}s" if m else f"{s}s"
