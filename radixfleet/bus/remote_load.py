"""Other router replicas' in-flight counts per worker, as heard on the bus.

Per remote replica: when it was last heard, the last message number applied, and
its absolute (requests, prompt tokens) per worker. ``totals`` sums them per worker;
the replica hands those sums to ``Pool.set_remote``.

    apply(msg, now)   a replica's message: its counts replace the old ones for the
                      workers it names (all of them on a heartbeat, ``full``); a
                      message older than one already applied is ignored; ``bye``
                      drops the replica
    expire(now, ttl)  replicas not heard for ``ttl`` seconds are dropped

Both return the worker ids whose totals changed.

Invariants (``check()``):

- ``totals[w]`` is the sum of every replica's counts for ``w``; no zero totals kept.
- Every count is >= 0.
"""

from __future__ import annotations

from radixfleet.wire.bus_wire import RouterMessage


class _Remote:
    __slots__ = ("seen", "seq", "counts")

    def __init__(self) -> None:
        self.seen = 0.0
        self.seq = -1
        self.counts: dict[str, tuple[int, int]] = {}


class RemoteInFlight:
    __slots__ = ("replicas", "totals")

    def __init__(self) -> None:
        self.replicas: dict[str, _Remote] = {}
        self.totals: dict[str, tuple[int, int]] = {}

    def apply(self, msg: RouterMessage, now: float) -> set[str]:
        r = self.replicas.get(msg.replica)
        if msg.bye:
            return self.drop(msg.replica)
        if r is None:
            r = self.replicas[msg.replica] = _Remote()
        elif msg.seq <= r.seq and not msg.full:
            return set()  # late or repeated (a restarted replica heals at its heartbeat)
        r.seen = now
        r.seq = msg.seq
        changed: set[str] = set()
        if msg.full:
            for wid in list(r.counts):
                if wid not in msg.inflight:
                    self._set(r, wid, (0, 0), changed)
        for wid, c in msg.inflight.items():
            self._set(r, wid, c, changed)
        return changed

    def expire(self, now: float, ttl_s: float) -> set[str]:
        changed: set[str] = set()
        for name in [n for n, r in self.replicas.items() if now - r.seen > ttl_s]:
            changed |= self.drop(name)
        return changed

    def drop(self, replica: str) -> set[str]:
        r = self.replicas.pop(replica, None)
        changed: set[str] = set()
        if r is not None:
            for wid in list(r.counts):
                self._set(r, wid, (0, 0), changed)
        return changed

    def total(self, wid: str) -> tuple[int, int]:
        return self.totals.get(wid, (0, 0))

    def _set(self, r: _Remote, wid: str, c: tuple[int, int], changed: set[str]) -> None:
        old = r.counts.get(wid, (0, 0))
        if old == c:
            return
        if c == (0, 0):
            r.counts.pop(wid, None)
        else:
            r.counts[wid] = c
        tr, tt = self.totals.get(wid, (0, 0))
        t = (tr + c[0] - old[0], tt + c[1] - old[1])
        if t == (0, 0):
            self.totals.pop(wid, None)
        else:
            self.totals[wid] = t
        changed.add(wid)

    def check(self) -> None:
        sums: dict[str, tuple[int, int]] = {}
        for r in self.replicas.values():
            for wid, (a, b) in r.counts.items():
                assert a >= 0 and b >= 0 and (a, b) != (0, 0), f"{wid=} {a=} {b=}"
                x, y = sums.get(wid, (0, 0))
                sums[wid] = (x + a, y + b)
        assert sums == self.totals, f"{sums=} {self.totals=}"
