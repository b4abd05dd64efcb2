"""``index:``: the router's prefix index (memory budget, hot-prefix counters,
learned capacities) and what a colder-tier prefix is worth to the policy.
"""

from __future__ import annotations

from typing import Literal, get_args

from radixfleet.wire.settings import setting as _opt
from radixfleet.wire.settings import settings

#: ``index.tiers``: what a colder-tier prefix is worth to the policy
TierMode = Literal["priced", "ignore", "as_gpu"]
TIER_MODES: tuple[TierMode, ...] = get_args(TierMode)


@settings
class IndexConfig:
    """``index:``: the prefix index and the worth of a colder tier."""

    max_bytes: int = _opt(256 * 2**20, "global memory budget of the prefix index", lo=1)
    half_life_s: float = _opt(30.0, "half-life of the hot-prefix request counters", lo=0, lo_open=True)
    hot_k: int = _opt(10, "hot prefixes shown in /admin/index and metrics", lo=0, hi=1000)
    learn_capacity: bool = _opt(
        True,
        "approximate mode: cap each plain engine's entries at a "
        "capacity learned from its cached_tokens (radixfleet.engines."
        "capacity), not only the configured one",
    )
    tiers: TierMode = _opt(
        "priced",
        "what a prefix held in a worker's colder KV tier (CPU memory, disk: engine "
        "offloading or an agent's DRAM tier) is worth to the policy: priced (a GPU hit "
        "times the share its learned load price leaves, radixfleet.engines.tier_price), "
        "ignore (a miss), as_gpu (a full GPU hit)",
    )
