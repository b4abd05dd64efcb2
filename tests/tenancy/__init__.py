"""Tests of tenancy: salted keys, signed tenant headers, per-tenant limits and queues."""
