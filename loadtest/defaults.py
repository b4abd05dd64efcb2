"""The fleet and load a first run gets: ``radixfleet demo`` (live agents) and
``radixfleet simulate`` (virtual time) share them, so that the two tell the same
story on the same workload unless a flag says otherwise.

The KV size is the point: the default workload's working set is ~55k tokens (8
system prompts of ~1k, 24 active sessions of ~2k history each); 4 agents x 12k sit
just under it and one agent holds a fifth of it — so eviction matters, and where a
request lands decides whether its history is still cached. (Running requests lock
their KV too: ~3-4 per agent at the default rate.) With a preset's whole KV pool
(400k+ tokens on an H100) nothing is ever evicted and every policy looks alike.
"""

from __future__ import annotations

AGENTS = 4
#: per-agent KV tokens (a trace in ``simulate`` keeps the preset's: its prompts are
#: sized for real engines)
KV_TOKENS = 12_000
POLICIES = ("round_robin", "cache_aware", "prefix_load")
WORKLOAD = "mixed"
#: open loop, requests/s: the same offered load for every policy
RATE = 12.0
