"""The seam between a simulated agent and the router's live feedback path.

Live, each agent's ``radixfleet_tools.agent.reporter.Reporter`` posts an ``EventBatch``
every ``interval_s`` — the cache events drained since the last one and the
agent's load, stamped with its epoch and the next sequence number — and the
router applies it with ``radixfleet.index.feedback.Feedback.apply``: epoch and sequence
checks, events into the index, the load into ``radixfleet.fleet.pool`` (where
``Worker.build_view`` ignores it once ``load.report_stale_s`` old). The simulator
calls that same ``Feedback.apply`` with the same batches, on a live ``Pool``
(driven by its virtual clock). What differs is only *when* a batch is built,
because time is virtual — this module is that one difference:

- **Ticks**: worker i's reporter ticks at ``phase_i + k * batch_s`` (phases spread
  over one interval) and a batch built at a tick reaches the router ``delay_s``
  later, carrying the worker's load as of the tick. ``batch_s == 0``: a batch at
  every change of the worker's state.
- **Batches with cache events** are scheduled as live: a FLUSH at the next tick
  cuts them, a DELIVER ``delay_s`` later applies them (the simulation's heap).
- **Load-only batches are built lazily** (the seam): when the router next reads
  its views, one batch stands for the newest tick it would have received by then
  — each load report replaces the last, so the skipped ones were never read — and
  is applied with the time it would have arrived (``tick + delay_s``), so a report
  goes stale exactly when it would live. Sequence numbers count the batches
  delivered, so the live epoch/seq check sees a gap-free stream (a refused batch
  is a simulator bug and raises). ``SimConfig.report_every_tick`` delivers every
  tick's batch as its own event instead; ``tests/sim/test_core.py`` pins that both
  give the same run.

The first batch, at registration (time 0), is a snapshot of the (empty) cache,
as the live reporter's first batch after registering is.
"""

from __future__ import annotations

import collections
import math

from radixfleet.wire.events import EventBatch, Load, Snapshot


class AgentLink:
    """One simulated agent's report stream. Only ``Simulation`` mutates it."""

    __slots__ = (
        "id",
        "url",
        "epoch",
        "seq",
        "phase",
        "hist",
        "pending",
        "flush_at",
        "last_tick",
        "next_at",
        "pool_worker",
    )

    def __init__(self, wid: str, phase: float, pool_worker) -> None:
        self.id = wid
        self.url = f"sim://{wid}"
        self.epoch = f"sim-{wid}"
        self.seq = 0  # the next batch's sequence number
        self.phase = phase  # offset of this worker's ticks in [0, batch_s)
        #: (time, load tuple) state changes not yet superseded for the router
        self.hist: collections.deque = collections.deque()
        self.pending: list = []  # cache events since the last cut
        self.flush_at: float | None = None  # the next cut, if scheduled
        #: the newest tick whose batch the router has (state time when batch_s == 0)
        self.last_tick = -math.inf
        #: the router's reads before this time cannot find a newer tick to deliver
        self.next_at = -math.inf
        self.pool_worker = pool_worker  # radixfleet.fleet.pool.Worker: the live pool's record of it

    def record(self, now: float, state: tuple) -> None:
        """The worker's load state is ``state`` from ``now`` on."""
        h = self.hist
        if h and h[-1][1] == state:
            return
        if h and h[-1][0] == now:
            h[-1] = (now, state)
        else:
            h.append((now, state))

    def state_at(self, t: float) -> tuple[float, tuple] | None:
        """``(since, state)``: the state at time ``t`` (older entries are dropped: the
        router never asks for an earlier time than it already has)."""
        h = self.hist
        while len(h) > 1 and h[1][0] <= t:
            h.popleft()
        if h and h[0][0] <= t:
            return h[0]
        return None

    def batch(self, events, state: tuple) -> EventBatch:
        """The next batch of the stream (takes a sequence number)."""
        b = EventBatch(self.id, self.url, self.epoch, self.seq, list(events), Load(*state))
        self.seq += 1
        return b

    def hello(self, state: tuple) -> EventBatch:
        """The first batch after registering: a snapshot of the empty cache."""
        return self.batch([Snapshot([])], state)


def tick_at_or_before(t: float, phase: float, batch_s: float) -> float:
    """The last reporter tick at or before ``t`` (``phase + k * batch_s``)."""
    return phase + math.floor((t - phase) / batch_s) * batch_s


def tick_after(t: float, phase: float, batch_s: float) -> float:
    """The first reporter tick strictly after ``t``."""
    return phase + (math.floor((t - phase) / batch_s) + 1) * batch_s
