"""What prefix_load remembers between its decisions: the KV each worker writes and
each prefix's home (``radixfleet.policies.prefix_load.PrefixLoad``'s base, over its own state).

- Writes: per worker, the uncached prompt tokens routed to it, decayed over
  ``kv_window_s`` (``_written``: its write rate, how fast its cache turns over:
  ``_kv_churning``; the tie-break by KV written, ``by_written``), the whole prompts
  routed to it decayed alike (``_prompted``: with ``_written``, the share of its
  prompts it prefills, ``_uncached_share``) and the uncached tokens routed to it in
  all (``_routed``, never decayed: a home's staleness). Its own picks and a peer
  replica's (``observe_pick``) are recorded alike. Records of workers that left the
  fleet go once they pass twice the fleet (``_prune``).
- Homes: a prompt's prefixes at sampled depths (``_home_depths``) -> the worker its
  last request went to and that worker's ``_routed`` then; LRU, at most
  ``home_records`` (``_remember_home``, ``_home``).

Invariants (``_check_records``, part of ``PrefixLoad.check``): every record is finite
and non-negative; at most ``home_records`` homes; a home's stamp is at most its
worker's ``_routed``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radixfleet.keys import WorkerId
from radixfleet.policies.base import RouteRequest, WorkerView


def by_written(
    written: Callable[[WorkerId, float], float] | None,
    now: float,
    cur: WorkerId,
    cur_r: float | None,
    new: WorkerId,
) -> tuple[int, float | None, float]:
    """The tie-break by KV written lately between the current pick ``cur`` (its rate
    ``cur_r``, None until needed) and a tied candidate ``new``: (-1 new wrote less,
    0 equal, 1 more; cur's rate; new's rate). ``written`` None (``tie_written`` off, or
    nothing routed yet): always 0 — chance decides."""
    if written is None:
        return 0, 0.0, 0.0
    if cur_r is None:
        cur_r = written(cur, now)
    r = written(new, now)
    return (r > cur_r) - (r < cur_r), cur_r, r


class KvRecords:
    """The records of the module docstring; only ``PrefixLoad`` calls these methods,
    on itself."""

    #: the policy's parameters (``PrefixLoad.Params``)
    params: Any

    def _init_records(self) -> None:
        # worker -> [decayed uncached tokens routed to it, time of that value]
        self._written: dict[str, list[float]] = {}
        # prefix hash (at sampled depths, ``_home_depths``) -> (the worker its last
        # request went to, that worker's ``_routed`` then, this request's tokens
        # included); LRU, at most ``home_records`` entries; only ``choose`` writes
        self._homes: OrderedDict[int, tuple[WorkerId, float]] = OrderedDict()
        # worker -> uncached tokens routed to it in all (never decays): KV it writes
        self._routed: dict[str, float] = {}
        # worker -> [decayed whole prompt tokens routed to it, time]: with _written,
        # the share of its prompts it prefills (queued_tokens counts whole prompts)
        self._prompted: dict[str, list[float]] = {}

    def _prune(self, views: Sequence[WorkerView]) -> None:
        """Forgets workers that left the fleet (discovery churn) once a per-worker
        record passes twice the fleet: they stay bounded. O(1) unless pruning."""
        n = 2 * len(views) + 16
        if len(self._written) <= n and len(self._prompted) <= n and len(self._routed) <= n:
            return
        here = {v.id for v in views}
        for rec in (self._written, self._prompted, self._routed):
            for k in [k for k in rec if k not in here]:
                del rec[k]

    def observe_pick(self, worker: str, uncached_tokens: int, now: float) -> None:
        """``uncached_tokens`` were routed to ``worker`` at ``now``: the KV it writes
        (``_written``). ``choose`` calls it for its own decisions; another router
        replica's picks come in through it too (radixfleet.bus, from their hints), so N
        replicas judge KV turnover and break ties on the fleet's write rates, not on
        the 1/N each routes. O(1)."""
        if uncached_tokens <= 0:
            return
        self._routed[worker] = self._routed.get(worker, 0.0) + uncached_tokens
        self._add_decayed(self._written, worker, uncached_tokens, now)

    def _observe(self, worker: str, uncached_tokens: int, prompt_tokens: int, now: float) -> None:
        """A pick of a ``prompt_tokens`` prompt, ``uncached_tokens`` of it unheld (this
        router's or a peer's): the KV written (``observe_pick``) and the whole prompt
        (``_prompted``, for the uncached share). O(1)."""
        self.observe_pick(worker, uncached_tokens, now)
        if prompt_tokens > 0:
            self._add_decayed(self._prompted, worker, prompt_tokens, now)

    def _add_decayed(self, recs: dict[str, list[float]], worker: str, tokens: int, now: float) -> None:
        w = recs.get(worker)
        if w is None:
            recs[worker] = [float(tokens), now]
            return
        if now > w[1]:
            w[0], w[1] = self._decayed(w, now), now
        w[0] += tokens

    def _uncached_share(self, wid: str, now: float) -> float:
        """The share of the prompt tokens routed to ``wid`` lately that it prefills
        (uncached over whole, both decayed alike; 1 when nothing was routed). O(1)."""
        w = self._prompted.get(wid)
        if w is None:
            return 1.0
        whole = self._decayed(w, now)
        u = self._written.get(wid)
        if u is None or whole <= 0:
            return 0.0 if u is None and whole > 0 else 1.0
        x = self._decayed(u, now) / whole
        return x if x < 1.0 else 1.0

    def _decayed(self, w: list[float], now: float) -> float:
        """A ``_written`` record's tokens as of ``now`` (never grown by going back)."""
        return w[0] * math.exp(min(0.0, (w[1] - now) / self.params.kv_window_s))

    def _write_rate(self, wid: str, now: float) -> float:
        """Uncached prompt tokens routed to ``wid`` per second, decayed: the KV the
        worker writes, which evicts as much once its cache is full."""
        w = self._written.get(wid)
        return 0.0 if w is None else self._decayed(w, now) / self.params.kv_window_s

    def _kv_churning(self, views: Sequence[WorkerView], now: float) -> set[WorkerId] | None:
        """Workers whose caches turn over too fast to keep new sessions (params
        kv_turnover_s, kv_rel), or None."""
        p = self.params
        if p.kv_turnover_s <= 0 or not self._written or not any(v.kv_capacity_tokens > 0 for v in views):
            return None
        rates = [self._write_rate(v.id, now) for v in views]
        mean = sum(rates) / len(rates)
        out = None
        for v, r in zip(views, rates):
            cap = v.kv_capacity_tokens
            if cap > 0 and r > p.kv_rel * mean and cap < p.kv_turnover_s * r:
                if out is None:
                    out = set()
                out.add(v.id)
        return out

    @staticmethod
    def _home_depths(n: int, min_b: int) -> Iterator[int]:
        """The depths (in blocks) at which a prompt of ``n`` blocks records its home:
        ``min_b`` (at least 1) doubled up to ``n``, and ``n`` itself. O(log n)."""
        d = min_b if min_b > 0 else 1
        while d < n:
            yield d
            d *= 2
        if n > 0:
            yield n

    def _remember_home(self, request: RouteRequest, worker: WorkerId) -> None:
        """Records ``worker`` as the home of the request's prefixes (O(log blocks))."""
        p = self.params
        bt = request.block_tokens
        min_b = -(-p.min_match_tokens // bt) if bt > 0 else 0
        homes = self._homes
        hs = request.hashes
        rec = (worker, self._routed.get(worker, 0.0))
        for d in self._home_depths(len(hs), min_b):
            k = hs[d - 1]
            homes[k] = rec
            homes.move_to_end(k)
        while len(homes) > p.home_records:
            homes.popitem(last=False)

    def _home(
        self, request: RouteRequest, views: Sequence[WorkerView], qs: list[float], lo_q: float, min_b: int
    ) -> tuple[int, int]:
        """The request's home (class docstring): (the index of the routable worker
        the deepest recorded prefix of this request last went to, that prefix's depth
        in blocks), the depth 0 when the home is stale (as much as its KV capacity was
        routed there since; unknown capacity is never judged: fresh); (-1, 0) when there is none or
        it is overloaded relative to the least-loaded worker (the affinity bound
        with nothing saved). O(log blocks + workers)."""
        homes = self._homes
        if not homes:
            return -1, 0
        hs = request.hashes
        depths = list(self._home_depths(len(hs), min_b))
        for d in reversed(depths):
            rec = homes.get(hs[d - 1])
            if rec is None:
                continue
            w, stamp = rec
            for i, v in enumerate(views):
                if v.id == w:
                    q = qs[i]
                    p = self.params
                    if q > lo_q * p.affinity_rel and q > lo_q + p.affinity_abs_s:
                        return -1, 0
                    cap = v.kv_capacity_tokens
                    return i, (d if cap <= 0 or self._routed.get(w, 0.0) - stamp < cap else 0)
            return -1, 0
        return -1, 0

    def _check_records(self) -> None:
        """Asserts the records' invariants (module docstring)."""
        assert len(self._homes) <= self.params.home_records, len(self._homes)
        for recs in (self._written, self._prompted):
            for wid, (tokens, t) in recs.items():
                assert math.isfinite(tokens) and tokens >= 0 and math.isfinite(t), (wid, tokens, t)
        for wid, tokens in self._routed.items():
            assert math.isfinite(tokens) and tokens >= 0, (wid, tokens)
        for k, (wid, stamp) in self._homes.items():
            assert 0 <= stamp <= self._routed.get(wid, stamp), (k, wid, stamp)
