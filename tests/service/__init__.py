"""Tests of radixfleet/common/: the shared lifecycle and backoff helpers."""
