"""Tests of the prefix keys (radixfleet/keys.py) and the prefix index
(radixfleet/index/prefix_index.py), KV tiers included."""
