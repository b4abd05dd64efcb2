"""The fleet and load a first run gets: ``radixfleet demo`` (live agents) and
``radixfleet simulate`` (virtual time) share them, so that the two tell the same
story on the same workload unless a flag says otherwise.

The KV size is the point: with a preset's whole KV pool (400k+ tokens on an H100)
nothing is ever evicted and every policy looks alike. At 4 agents x 12k and 18
sessions in progress at once, the sessions' histories (~17k tokens live on average,
26k at the peak) and the 8 system prompts of ~1k fit the fleet's 48k with room to
spare, but one agent holds half of them: where a request lands decides whether its
history is still cached. A router that keeps each session on one agent
and each system prompt on few reaches nearly what one pooled cache would; one that
scatters turns (round_robin) must hold every history everywhere and evicts them.

Why 18 sessions, not the workload's default 24 (``WORKLOAD_OPTIONS``; simulated,
seeds 0-15, 600 requests): at 24 each agent's share (~2.2k of system prompts, ~5.6k
of live histories on average, 2-3k more at its peaks, ~1k held by requests in
flight) reaches its 12k, histories are evicted from the agent that serves their
session, and prefix_load's hit rate lands anywhere from 80% to 94% of the pooled cache's (mean
89%); at 18 it is 93-98% (mean 96%). And at 24 (or 20, 16: a multiple of the 4
agents) sessions come back in lockstep with round_robin's cycle, which then sends
42% of a session's turns back to its agent (15% at 18): round_robin looks
cache-aware.
"""

from __future__ import annotations

AGENTS = 4
#: per-agent KV tokens (a trace in ``simulate`` keeps the preset's: its prompts are
#: sized for real engines)
KV_TOKENS = 12_000
POLICIES = ("round_robin", "cache_aware", "prefix_load")
WORKLOAD = "mixed"
#: the default workload's options where ``-o`` sets none of the same name (module
#: docstring: why)
WORKLOAD_OPTIONS = {"max_parallel": 18}
#: open loop, requests/s: the same offered load for every policy
RATE = 12.0


def workload_options(options: list[str]) -> list[str]:
    """``options`` (``-o NAME=VALUE`` texts for ``WORKLOAD``) after ``WORKLOAD_OPTIONS``
    of every name they do not set, so a user's own value wins."""
    given = {o.split("=", 1)[0].strip() for o in options}
    return [f"{k}={v}" for k, v in WORKLOAD_OPTIONS.items() if k not in given] + list(options)
