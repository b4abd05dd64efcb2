"""Tests of the routing policies (radixfleet/policies/)."""
