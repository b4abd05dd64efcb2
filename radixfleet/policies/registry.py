"""The policy registry: YAML name -> strategy class, and validated construction.

::

    POLICIES["prefix_load"] is PrefixLoad
    build_policy("prefix_load", {"min_match_tokens": 64}, random.Random(7))

``build_policy`` raises ``radixfleet.wire.errors.ConfigError`` whose path names the bad field:

    policy.name: 'cache-aware' is not one of cache_aware, consistent_hash, least_load, ...
    policy.params.min_match_tokens: expected an integer >= 0, got -3
    policy.params.foo: unknown parameter of prefix_load; valid: affinity_abs_s, ...

Adding a policy: write its class (``name``, frozen ``Params`` declared with
``radixfleet.policies.params.param``) and list it in ``_CLASSES``.
"""

from __future__ import annotations

import random
from typing import Any

from radixfleet.policies.base import Policy, PolicyParams
from radixfleet.policies.basic import LeastLoad, PowerOfTwo, RandomPolicy, RoundRobin
from radixfleet.policies.cache_aware import CacheAware
from radixfleet.policies.consistent_hash import ConsistentHash
from radixfleet.policies.params import param_docs, parse_params
from radixfleet.policies.prefix_load import PrefixLoad
from radixfleet.wire.errors import ConfigError

#: the policy the router uses when its config names none
DEFAULT_POLICY = "prefix_load"

_CLASSES: tuple[type[Policy], ...] = (
    RoundRobin,
    RandomPolicy,
    LeastLoad,
    PowerOfTwo,
    ConsistentHash,
    CacheAware,
    PrefixLoad,
)

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in _CLASSES}


def policy_names() -> list[str]:
    """The registered YAML names, sorted."""
    return sorted(POLICIES)


def policy_class(name: Any, *, path: str = "policy") -> type[Policy]:
    """The class registered as ``name``; ``ConfigError(f"{path}.name", ...)`` if none."""
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"{path}.name", f"{name!r} is not one of {', '.join(policy_names())}")
    return cls


def parse_policy_params(name: Any, params: Any, *, path: str = "policy") -> PolicyParams:
    """Validates ``params`` for policy ``name`` without building it (config checks)."""
    cls = policy_class(name, path=path)
    parsed: PolicyParams = parse_params(cls.Params, cls.name, params, f"{path}.params")
    return parsed


def build_policy(
    name: Any, params: dict[str, Any] | None, rng: random.Random, *, path: str = "policy"
) -> Policy:
    """A new policy instance from its YAML name and parameter mapping.

    ``params`` None or ``{}`` means every default. ``rng`` is the policy's only
    source of randomness. Raises ``ConfigError`` naming ``{path}.name`` or
    ``{path}.params.<field>``.
    """
    cls = policy_class(name, path=path)
    parsed = parse_params(cls.Params, cls.name, params, f"{path}.params")
    return cls(parsed, rng)


def describe_policies() -> dict[str, list[dict[str, Any]]]:
    """``{name: [{name, type, default, expected, doc}, ...]}`` for docs and help."""
    return {name: param_docs(POLICIES[name].Params) for name in policy_names()}
