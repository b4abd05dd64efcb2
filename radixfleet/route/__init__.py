"""One request's decision: the sans-I/O route core (``core``) and what it consults
(shedding, tenancy, rate limits, fair share, the admission queue, P/D, warm-ups).

Modules:

- ``admission_queue``: The fair-share admission queue: at saturation, a request the shedder would
  refuse waits at the router, briefly and boundedly, and the waiting requests are let in by priority
  class, then by weighted fair queuing across tenants on tokens.
- ``core``: The route core: one request's decision, from its views to its placement, sans I/O.
- ``decisions``: Why each request went where it went: routing quality and the recent decisions.
- ``fair_share``: Which tenants are getting less than their fair share of the fleet right now.
- ``pd``: Disaggregated prefill/decode on the live data plane: a request's two legs.
- ``rate_limit``: Token buckets: the rate limits of a tenant or an API key
  (``radixfleet.route.tenancy``).
- ``served``: Which workers serve which models: the filter applied before every pick.
- ``shedding``: Load shedding by default: a request is refused (429 + Retry-After) at once when
  every worker that could serve it is saturated — by what the worker itself reports — rather than
  queued behind seconds of work.
- ``tenancy``: Many tenants on one fleet: priority classes and rate limits per tenant and per API
  key (YAML ``tenancy``), with per-tenant counts of what each got.
- ``warmup``: Hot-root warm-ups: which (worker, prefix) pairs get a prefill-only request now.
"""
