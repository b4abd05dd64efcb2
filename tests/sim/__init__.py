"""Tests of the virtual-time simulator (radixfleet_tools/loadtest/simulator/) and the autoscaling loop it
closes."""
