"""Tests of the benchmark tooling (radixfleet/bench/): the proxy benchmark's wire ends and
the reproduction of bench/RESULTS.md."""
