"""The client retry policy of ``radixfleet loadtest``: what a real client does on a refusal.

A router that sheds load answers 429 (or 503) with ``Retry-After``; the OpenAI SDK
that most clients use does not give up on that, it retries. So the load generator
does the same by default, and counts what it did, so that a refusal is never hidden
in the latency figures without being said::

    sdk    the OpenAI Python SDK's rule: up to 2 retries (``--max-retries``) of a
           408, 409, 429 or 5xx answer; the wait is the answer's ``retry-after-ms``
           or ``Retry-After`` (seconds or an HTTP date) when it lies in (0, 60] s,
           else min(0.5 s * 2**n, 8 s) times a jitter in [0.75, 1] (n: retries so far)
    none   no retries: the first refusal is the request's outcome

Connection failures are not retried (the SDK does retry them): a load generator
reports a target that drops connections instead of papering over it. A request's
TTFT and E2E count from its first attempt — what the user behind the client
waits — and its ``retries`` and ``retry_wait_s`` say how much of that was spent on
refusals (``radixfleet_tools.loadtest.client.Result``).
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

from radixfleet.wire.errors import ConfigError

RETRY_MODES = ("sdk", "none")

#: the OpenAI SDK's constants (openai/_constants.py)
SDK_MAX_RETRIES = 2
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
#: a Retry-After beyond this is ignored (the computed backoff is used), as the SDK does
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Which answers are retried, how often, and how long to wait before each retry."""

    mode: str = "sdk"
    max_retries: int = SDK_MAX_RETRIES

    def __post_init__(self) -> None:
        if self.mode not in RETRY_MODES:
            raise ConfigError("--retry", f"{self.mode!r} is not one of {', '.join(RETRY_MODES)}")
        if self.max_retries < 0:
            raise ConfigError("--max-retries", f"must be >= 0, got {self.max_retries}")

    def should_retry(self, status: int, headers: Mapping[str, str], retries_done: int) -> bool:
        """True when an answer of ``status`` is retried after ``retries_done`` retries."""
        if self.mode == "none" or retries_done >= self.max_retries:
            return False
        hint = headers.get("x-should-retry", "").lower()
        if hint in ("true", "false"):  # the server's explicit word wins, as in the SDK
            return hint == "true"
        return status in (408, 409, 429) or status >= 500

    def delay_s(
        self, headers: Mapping[str, str], retries_done: int, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before retry number ``retries_done + 1``."""
        hinted = retry_after_s(headers)
        if hinted is not None and 0 < hinted <= MAX_RETRY_AFTER_S:
            return hinted
        base = min(INITIAL_RETRY_DELAY_S * 2.0**retries_done, MAX_RETRY_DELAY_S)
        return base * (1 - 0.25 * (rng or random).random())


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The wait an answer asks for: ``retry-after-ms``, else ``Retry-After`` as seconds
    or an HTTP date; None when absent or unreadable."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()
