"""Tests of the router replica bus (router/bus/, protocol/bus_wire.py): a real nats-server,
auth, shared state, wire validation, replica decisions."""
