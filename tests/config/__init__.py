"""Tests of the router YAML (router/config/, router/reload): schema, bounds, error
messages, roles, models, reload."""
