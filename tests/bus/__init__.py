"""Tests of the router replica bus (radixfleet/bus/, radixfleet/wire/bus_wire.py): a real nats-server,
auth, shared state, wire validation, replica decisions."""
