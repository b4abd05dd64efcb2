"""Tests of the worker agent (radixfleet_tools/agent/): its cache, cost model, scheduler, server,
reporter, DRAM tier and remote KV; fakes.py holds a fake router for them."""
