"""Tests of service/: the shared lifecycle and backoff helpers."""
