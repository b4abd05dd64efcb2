"""Tests of the routing policies (policies/)."""
