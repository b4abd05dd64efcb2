"""Tests of the router YAML (router/config.py, router/reload): schema, bounds, error
messages, roles, models, reload."""
