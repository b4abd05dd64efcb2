"""Tests of the benchmark tooling (radixfleet_tools/bench/): the proxy benchmark's wire ends and
the reproduction of bench/RESULTS.md."""
