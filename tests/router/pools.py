"""A router Pool of plain workers on a fake clock, for unit tests of what reads the pool."""

from __future__ import annotations

from radixfleet.config import parse_config
from radixfleet.fleet.pool import HealthState, Pool
from radixfleet.index.prefix_index import PrefixIndex


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_pool(**raw):
    clock = Clock()
    idx = PrefixIndex()
    cfg = parse_config(
        {
            "workers": [{"url": "http://127.0.0.1:1", "id": "a"}, {"url": "http://127.0.0.1:2", "id": "b"}],
            **raw,
        }
    )
    pool = Pool(cfg, idx, clock=clock)
    for w in pool:
        pool._set_health(w, HealthState.HEALTHY)
    return pool, idx, clock
