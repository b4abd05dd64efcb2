"""One router's event stream as an agent sees it (``radixfleet_tools.agent.reporter`` keeps one
per ``--router`` URL, ``radixfleet_tools.agent.bus.AgentBus`` one for the bus): its state, its
sequence numbers and the deltas not yet sent. Only the reporter task mutates one."""

from __future__ import annotations

import enum


class LinkState(enum.Enum):
    UNREGISTERED = "unregistered"  # must POST /internal/v1/register first
    SNAPSHOT = "snapshot"  # registered; next batch starts with a snapshot
    STREAMING = "streaming"  # router in sync; send deltas


class RouterLink:
    """One router's stream. Only the reporter task mutates it."""

    __slots__ = (
        "base",
        "state",
        "seq",
        "pending",
        "sent_batches",
        "failures",
        "snapshots",
        "refused",
        "tiers",
    )

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self.state = LinkState.UNREGISTERED
        #: next batch number in this epoch
        self.seq = 0
        #: deltas not yet acknowledged (bounded: see module docstring)
        self.pending: list = []
        self.sent_batches = 0
        self.failures = 0
        self.snapshots = 0
        #: why the router last refused registration (its status word), None once accepted
        self.refused: str | None = None
        #: the router reads colder-tier events (its registration answer lists "cpu";
        #: the bus: always). False: only GPU events are sent (radixfleet.wire.events, "KV tiers")
        self.tiers = False

    def resnapshot(self) -> None:
        """The next batch starts with a snapshot: the pending deltas are dropped."""
        self.state = LinkState.SNAPSHOT
        self.pending.clear()
