"""Tests of the router YAML (radixfleet/config/, radixfleet/config/reload): schema, bounds, error
messages, roles, models, reload."""
