"""``retries:`` and ``timeouts:``: how long each phase of a proxied request may
take, toward the worker and toward the client, and how often a failed connection
is tried elsewhere.
"""

from __future__ import annotations

from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import setting as _opt


@settings
class RetriesConfig:
    """``retries:``: tries per request and their backoff. Invariant: ``backoff_s <=
    backoff_max_s``."""

    max_attempts: int = _opt(3, "tries per request, first included", lo=1, hi=16)
    backoff_s: float = _opt(0.005, "first retry delay, doubled per retry", lo=0)
    backoff_max_s: float = _opt(0.1, "largest retry delay", lo=0)

    @document_check
    def _check(self) -> None:
        if self.backoff_max_s < self.backoff_s:
            raise ConfigError("backoff_max_s", f"expected a number >= retries.backoff_s ({self.backoff_s})")


@settings
class TimeoutsConfig:
    """Per phase: a non-streamed answer arrives only when its generation is done, so
    only ``total_s`` bounds it (a hung worker is found by its health checks instead);
    a stream is also bounded by ``first_byte_s``. A timed-out request is cancelled on
    its worker, never sent to another one. The client side: ``client_idle_s`` bounds
    each wait for the client to take what was written, ``total_s`` all of them."""

    connect_s: float = _opt(2.0, "connecting to a worker (then the next worker is tried)", lo=0, lo_open=True)
    first_byte_s: float = _opt(
        120.0,
        "streamed answers: until the worker's first byte, and the longest silence between chunks",
        lo=0,
        lo_open=True,
    )
    total_s: float = _opt(
        3600.0,
        "the whole request, all attempts, and the wait for its client to take the answer; "
        "the only bound on a non-streamed answer. A cut at this deadline is not the "
        "worker's failure (its breaker does not count it)",
        lo=0,
        lo_open=True,
    )
    client_idle_s: float = _opt(
        15.0,
        "a client that takes none of its answer for this long (the router's 64 KiB "
        "write buffer toward it stays full) is dropped: its connection closed, its "
        "slot freed, its request cancelled on the worker; logged and counted in "
        "radixfleet_slow_clients_dropped_total. Keep it below limits.queue_timeout_s, so "
        "that a request queued behind stalled streams gets their slots before it gives up",
        lo=0,
        lo_open=True,
    )
    keepalive_s: float = _opt(
        4.0,
        "an idle connection to a worker is reused only this long after its last answer; keep it "
        "below the workers' own keep-alive timeout (uvicorn's 5 s: vLLM, SGLang): a request sent "
        "as a worker closes its connection is lost, and never sent again; 0: a connection per request",
        lo=0,
    )
