"""Tests of the worker agent (worker_agent/): its cache, cost model, scheduler, server,
reporter, DRAM tier and remote KV; fakes.py holds a fake router for them."""
