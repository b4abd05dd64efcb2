"""The event bus shared by router replicas and agents (DESIGN.md contract 11), on NATS
JetStream: ``wire`` (subjects, message bodies), ``connection`` (one connection kept
up, metrics), ``remote_load`` (other replicas' in-flight counts), ``replica`` (the
router side), ``publisher`` (the agent side)."""
