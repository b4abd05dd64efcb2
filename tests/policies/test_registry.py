"""The policy registry and parameter validation: names, defaults, exact messages."""

from __future__ import annotations

import dataclasses
import random

import pytest

from radixfleet.policies.base import Policy, PolicyParams
from radixfleet.policies.params import check_defaults
from radixfleet.policies.registry import (
    DEFAULT_POLICY,
    POLICIES,
    build_policy,
    describe_policies,
    parse_policy_params,
    policy_names,
)
from radixfleet.wire.errors import ConfigError

NAMES = [
    "cache_aware",
    "consistent_hash",
    "least_load",
    "power_of_two",
    "prefix_load",
    "random",
    "round_robin",
]


def test_names_sorted_and_complete():
    assert policy_names() == NAMES
    assert DEFAULT_POLICY in POLICIES
    for name, cls in POLICIES.items():
        assert cls.name == name
        assert issubclass(cls, Policy)
        assert issubclass(cls.Params, PolicyParams)
        assert dataclasses.is_dataclass(cls.Params)
        check_defaults(cls.Params)
        assert cls.Params.__dataclass_params__.frozen, f"{name}.Params must be frozen"


@pytest.mark.parametrize("name", NAMES)
def test_build_every_policy_with_defaults(name):
    pol = build_policy(name, None, random.Random(1))
    assert isinstance(pol, POLICIES[name])
    assert pol.params == POLICIES[name].Params()
    assert build_policy(name, {}, random.Random(1)).params == pol.params


def test_params_are_applied_and_ints_accepted_for_floats():
    pol = build_policy(
        "prefix_load", {"min_match_tokens": 128, "affinity_abs_s": 1, "replicate": False}, random.Random(0)
    )
    assert pol.params.min_match_tokens == 128
    assert pol.params.affinity_abs_s == 1.0 and type(pol.params.affinity_abs_s) is float
    assert pol.params.replicate is False
    pol = build_policy(
        "cache_aware",
        {"cache_threshold": 0.5, "balance_abs_threshold": 32, "balance_rel_threshold": 2},
        random.Random(0),
    )
    assert (
        pol.params.cache_threshold,
        pol.params.balance_abs_threshold,
        pol.params.balance_rel_threshold,
    ) == (0.5, 32, 2.0)


ALL = ", ".join(NAMES)
PL_PARAMS = (
    "affinity_abs_s, affinity_rel, colder_room, footprint_full, footprint_rel, footprint_room, "
    "holder_max_rate, home_records, hot_min_rate, hot_records, "
    "hot_utilization, kv_rel, kv_turnover_s, kv_window_s, long_match_s, "
    "max_replicas, min_match_tokens, prefill_weight, private_weight, replicate, "
    "saturated_s, session_live_gaps, tie_s, tie_written, warm_ahead"
)


@pytest.mark.parametrize(
    "name, params, path, message",
    [
        ("cache-aware", None, "policy.name", f"'cache-aware' is not one of {ALL}"),
        (3, None, "policy.name", f"3 is not one of {ALL}"),
        (None, None, "policy.name", f"None is not one of {ALL}"),
        (
            "prefix_load",
            {"min_match_tokens": -3},
            "policy.params.min_match_tokens",
            "expected an integer >= 0, got -3",
        ),
        (
            "prefix_load",
            {"min_match_tokens": 3.0},
            "policy.params.min_match_tokens",
            "expected an integer >= 0, got 3.0",
        ),
        (
            "prefix_load",
            {"min_match_tokens": True},
            "policy.params.min_match_tokens",
            "expected an integer >= 0, got True",
        ),
        (
            "prefix_load",
            {"affinity_abs_s": "x"},
            "policy.params.affinity_abs_s",
            "expected a number >= 0, got 'x'",
        ),
        (
            "prefix_load",
            {"affinity_abs_s": float("nan")},
            "policy.params.affinity_abs_s",
            "expected a number >= 0, got nan",
        ),
        (
            "prefix_load",
            {"affinity_rel": 0.5},
            "policy.params.affinity_rel",
            "expected a number >= 1, got 0.5",
        ),
        ("prefix_load", {"hot_min_rate": 0}, "policy.params.hot_min_rate", "expected a number > 0, got 0"),
        (
            "prefix_load",
            {"hot_utilization": 1.5},
            "policy.params.hot_utilization",
            "expected a number in (0, 1], got 1.5",
        ),
        ("prefix_load", {"replicate": "yes"}, "policy.params.replicate", "expected true or false, got 'yes'"),
        (
            "prefix_load",
            {"foo": 1},
            "policy.params.foo",
            f"unknown parameter of prefix_load; valid: {PL_PARAMS}",
        ),
        ("round_robin", {"foo": 1}, "policy.params.foo", "unknown parameter of round_robin; valid: (none)"),
        ("prefix_load", [1, 2], "policy.params", "expected a mapping of parameters, got list"),
        (
            "cache_aware",
            {"cache_threshold": 1.2},
            "policy.params.cache_threshold",
            "expected a number in [0, 1], got 1.2",
        ),
        (
            "consistent_hash",
            {"load_factor": 0.9},
            "policy.params.load_factor",
            "expected a number in [1, 100], got 0.9",
        ),
        (
            "consistent_hash",
            {"vnodes": 0},
            "policy.params.vnodes",
            "expected an integer in [1, 10000], got 0",
        ),
    ],
)
def test_exact_messages(name, params, path, message):
    with pytest.raises(ConfigError) as ei:
        build_policy(name, params, random.Random(0))
    assert ei.value.path == path
    assert ei.value.message == message
    assert str(ei.value) == f"{path}: {message}"
    with pytest.raises(ConfigError) as ei2:
        parse_policy_params(name, params)
    assert str(ei2.value) == str(ei.value)


def test_path_prefix_is_the_callers():
    with pytest.raises(ConfigError) as ei:
        build_policy("prefix_load", {"max_replicas": -1}, random.Random(0), path="tenants[2].policy")
    assert str(ei.value) == "tenants[2].policy.params.max_replicas: expected an integer >= 0, got -1"


def test_describe_policies_documents_every_param():
    docs = describe_policies()
    assert sorted(docs) == NAMES
    names = [d["name"] for d in docs["prefix_load"]]
    assert ", ".join(sorted(names)) == PL_PARAMS
    ca = {d["name"]: d for d in docs["cache_aware"]}
    assert ca["cache_threshold"]["default"] == 0.3
    assert ca["balance_abs_threshold"]["default"] == 64
    assert ca["balance_rel_threshold"]["default"] == 1.5
    assert {d["name"]: d["default"] for d in docs["consistent_hash"]}["load_factor"] == 1.25
    for entries in docs.values():
        for d in entries:
            assert d["doc"] and d["expected"]
