"""Tests of the virtual-time simulator (loadtest/simulator/) and the autoscaling loop it closes."""
