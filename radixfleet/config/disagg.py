"""``disagg:``: disaggregated prefill/decode (workers with ``role: prefill`` or
``decode``, ``radixfleet.route.pd``).
"""

from __future__ import annotations

from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings


@settings
class DisaggConfig:
    """Disaggregated prefill/decode (workers with ``role: prefill`` / ``decode``)."""

    colocate_below_tokens: int = _opt(
        -1,
        "a request whose uncached prompt part on its decode worker is shorter runs colocated "
        "there, skipping the prefill pool; -1: derived, the tokens that decode worker prefills "
        "(its learned rate) in decode_step_s",
        lo=-1,
    )
    decode_step_s: float = _opt(
        0.025, "one decode step's time, for the derived colocate threshold", lo=0, hi=10
    )
    prefill_attempts: int = _opt(
        2, "prefill workers a request's prefill leg may try (a failed leg has started no decode)", lo=1, hi=10
    )
