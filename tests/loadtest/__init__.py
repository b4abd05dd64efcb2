"""Tests of the load generator (radixfleet_tools/loadtest/): arrivals, client, datasets, workloads, metrics,
report, A/B runner, analyze."""
