"""The top of the dependency graph: the ``radixfleet`` command (``radixfleet.cli``) and
the benchmarks behind ``radixfleet bench`` (``radixfleet.bench``), which put the
router, the policies, the agent and the load generator together. Nothing below
imports this package.
"""
