"""The router's side of the event bus shared by router replicas and agents (contract 11,
docs/DESIGN.md), on NATS JetStream: ``remote_load`` (other replicas' in-flight counts),
``replica`` (a router replica's consumer and publisher). What travels is
``radixfleet.wire.bus_wire``; the connection kept up is ``radixfleet.common.bus_connection``; the
agent's publisher is ``radixfleet_tools.agent.bus``."""
