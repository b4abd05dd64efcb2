"""Tests of the prefix keys (protocol/prefix_keys.py) and the prefix index
(router/prefix_index.py), KV tiers included."""
