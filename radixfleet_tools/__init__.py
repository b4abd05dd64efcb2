"""What runs around the router but is no part of it: the simulated worker agent,
the load generator and the simulator, and the benchmarks behind ``radixfleet bench``.
Nothing in ``radixfleet`` imports this package (``radixfleet.cli`` dispatches to it by name).

Modules:

- ``agent``: The worker agent: what the router routes to.
- ``bench``: ``radixfleet bench NAME``: benchmarks that print their figures (and ``--json``).
- ``harness``: What the tests and the live benchmarks (bench/*.py) share to start and stop
  processes: children on loopback ports, a router process, real vLLM servers (run from a checkout).
- ``loadtest``: Load generation and reports: what the fleet does to traffic whose prefixes repeat.
"""
