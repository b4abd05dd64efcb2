"""Namespace fields (model, adapter, tenant) never run together into one key: distinct
namespaces give distinct seeds (radixfleet.keys)."""

from __future__ import annotations

from radixfleet.keys import namespace_seed


def test_namespace_fields_never_run_together():
    pairs = [
        (("ab", "c", None), ("a", "bc", None)),
        (("a\x00", "", None), ("a", "\x00", None)),
        (("m", "t\x00x", None), ("m", "t", "x")),
        (("m", "", "ab"), ("m", "a", "b")),
        (("m\x00\x00\x00", "", None), ("m", "", None)),
    ]
    for one, other in pairs:
        assert namespace_seed(*one) != namespace_seed(*other), (one, other)
    assert namespace_seed("m", "t", None) == namespace_seed("m", "t", "")
