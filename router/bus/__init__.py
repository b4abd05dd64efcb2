"""The router's side of the event bus shared by router replicas and agents (contract 11,
docs/DESIGN.md), on NATS JetStream: ``remote_load`` (other replicas' in-flight counts),
``replica`` (a router replica's consumer and publisher). What travels is
``protocol.bus_wire``; the connection kept up is ``service.bus_connection``; the
agent's publisher is ``worker_agent.bus``."""
