"""Hostile YAML for the config loader's bounds (an alias bomb)."""

from __future__ import annotations


def alias_bomb(levels: int) -> str:
    """``levels`` + 1 lines of anchors, each naming the previous one nine times
    (9 ** levels nodes), used under ``policy.params``."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    lines.append(f"policy: {{name: prefix_load, params: {{x: *a{levels}}}}}")
    return "\n".join(lines) + "\n"
