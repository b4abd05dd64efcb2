"""What ``/admin/workers`` shows of a worker's engine side (radixfleet.engines.link.EngineLink).

``describe`` reads the link and changes nothing: its kind and truth, its keys
(radixfleet.engines.link_keys.describe), its key space and capacity, its learned
prefill rate and engine queue, its KV tiers, and its event streams per rank.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from radixfleet.engines.adapters import Truth


def describe(link: Any) -> dict:
    """The view of ``link`` (an ``EngineLink``: no import of it, it imports this)."""
    acc = link.stats.summary().to_json()
    return {
        "kind": link.kind.value if link.kind else None,
        "truth": link.truth.value,
        "key_space": repr(link.space),
        "keys": link.keys_describe(),
        "models": list(link.models),
        "block_size": link.block_size,
        "kv_capacity_tokens": link.capacity_tokens,
        "index_cap_blocks": None if link.learned is None else link.learned.blocks,
        "prefill_tokens_per_s": round(link.prefill_rate(time.monotonic()), 1),
        "prefill_tokens_per_s_own": round(link.rate.tokens_per_s, 1),
        "load_source": "engine" if link.engine_load_fresh(time.monotonic()) else "router",
        "engine_queue": {
            "tokens_per_request": round(link.queue.tokens_per_request, 1),
            "departures_per_s": None
            if link.queue.departures_per_s is None
            else round(link.queue.departures_per_s, 2),
        },
        "kv_tiers": link.tier_describe(time.monotonic()),
        "data_parallel_ranks": link.ranks,
        "events": None
        if not link.streams
        else {
            "source": link.events_source,
            "in_sync": link.in_sync,
            "endpoint": link.subscriber.address,
            "connected": all(sub.connected for sub, _ in link.streams.values()),
            **_summed(bm.stats() for _, bm in link.streams.values()),
            "ranks": {
                str(r): {
                    "endpoint": sub.address,
                    "connected": sub.connected,
                    "in_sync": link.rank_truth(r) is Truth.EXACT,
                    "entries": link.engines.index.entries(link.holder(r)),
                }
                for r, (sub, _) in link.streams.items()
                if r is not None
            },
        },
        "prediction": acc,
    }


def _summed(stats) -> dict:
    """Several ranks' block-map counters, added up."""
    out: dict = {}
    for st in stats:
        for k, v in dataclasses.asdict(st).items():
            out[k] = out.get(k, 0) + v
    return out
