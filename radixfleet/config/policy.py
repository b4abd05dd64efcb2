"""``policy:``: the routing policy by name, its seed and its parameters (validated
by ``radixfleet.policies.registry``; their tables are generated from each policy's
``Params``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import setting as _opt


@settings
class PolicyConfig:
    """``policy:``: a registered policy and its parameters (checked by building it)."""

    name: str = _opt("prefix_load", "policy name")
    seed: int = _opt(0, "seed of the policy's random source", lo=0)
    #: raw parameters, validated by radixfleet.policies.registry.build_policy
    params: Mapping[str, Any] = Field(
        default_factory=dict, description="the policy's parameters (the tables below)"
    )

    @field_validator("params", mode="before")
    @classmethod
    def _no_params(cls, v: Any) -> Any:
        return {} if v is None else v

    @document_check
    def _check(self) -> None:
        build_policy_from(self, "")  # validates the name and the params


def build_policy_from(pc: PolicyConfig, path: str = "policy"):
    """The policy object a ``PolicyConfig`` names. Raises ``ConfigError``."""
    from radixfleet.policies.registry import build_policy

    return build_policy(pc.name, dict(pc.params), random.Random(pc.seed), path=path)
