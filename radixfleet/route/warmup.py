"""Hot-root warm-ups: which (worker, prefix) pairs get a prefill-only request now.

When prefix_load makes a worker a new replica of a hot prefix with ``warm_ahead``,
its ``Decision.warm`` names that worker; the router then sends it a ``max_tokens=1``
completion of the prefix (the first ``depth`` blocks the index matched), not
counted as load and not hinted in the index (the agent's events report what it
caches). ``WarmupGate`` keeps it to at most one warm-up per (worker, prefix) per
``warmup.min_interval_s`` (radixfleet.config). The live router (``radixfleet.server.app``) and
the simulator (``radixfleet_tools.loadtest.simulator.simulation``) both ask the same gate with the same
configured interval.

Memory: one entry per (worker, prefix) warmed; past ``max_entries`` the entries
older than the interval are dropped (they could not refuse anything any more).
"""

from __future__ import annotations

from collections.abc import Sequence


def warmup_prefix(hashes: Sequence[int], depth: int) -> tuple[int, int] | None:
    """``(blocks, prefix hash)`` a warm-up of a request matched to ``depth`` covers,
    or None when there is nothing to warm (no matched block)."""
    blocks = min(depth, len(hashes))
    if blocks <= 0:
        return None
    return blocks, hashes[blocks - 1]


class WarmupGate:
    """Last warm-up time per (worker, prefix hash). Only its owner calls ``admit``."""

    __slots__ = ("_last", "max_entries")

    def __init__(self, max_entries: int = 4096) -> None:
        self._last: dict[tuple[str, int], float] = {}
        self.max_entries = max_entries

    def __len__(self) -> int:
        return len(self._last)

    def admit(self, worker: str, prefix: int, now: float, min_interval_s: float) -> bool:
        """True (and recorded) when ``worker`` may be sent a warm-up of ``prefix`` at
        ``now``: none was sent in the last ``min_interval_s`` seconds."""
        key = (worker, prefix)
        last = self._last.get(key)
        if last is not None and now - last < min_interval_s:
            return False
        self._last[key] = now
        if len(self._last) > self.max_entries:
            cutoff = now - min_interval_s
            self._last = {k: t for k, t in self._last.items() if t >= cutoff}
        return True
