"""Tests of the load generator (loadtest/): arrivals, client, datasets, workloads, metrics,
report, A/B runner, analyze."""
