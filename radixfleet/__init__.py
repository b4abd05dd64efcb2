"""The top of the dependency graph: the ``radixfleet`` command (``radixfleet.cli``),
``radixfleet gateway`` (``radixfleet.gateway``: Envoy with the router as its endpoint
picker) and the benchmarks behind ``radixfleet bench`` (``radixfleet.bench``), which put the
router, the policies, the agent and the load generator together. Nothing below
imports this package.
"""
