"""The prefix index and the feedback that keeps it true (contracts 2 and 9).

Modules:

- ``eviction``: The prefix index's eviction: the global memory budget, the fair share between
  workers and per-worker caps (``radixfleet.index.prefix_index.PrefixIndex``'s base; it works on the
  index's own state, whose invariants ``PrefixIndex.check`` asserts).
- ``feedback``: Applies agents' event batches (radixfleet.wire.events, contract 2 of docs/DESIGN.md)
  to the index and pool.
- ``prefix_index``: The router's approximate prefix index: which worker holds which prompt blocks.
- ``tiers``: The prefix index's colder KV tiers: blocks a worker's engine holds outside GPU memory,
  beside the tree (``radixfleet.index.prefix_index.PrefixIndex``'s base; it works on the index's own
  state, and ``PrefixIndex.check`` asserts its invariants too).
"""
