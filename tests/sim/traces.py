"""A small synthetic trace for the simulator tests."""

from __future__ import annotations

import json
import random

BLOCK = 16


def _trace(path, n: int = 60, seed: int = 0) -> str:
    """A Mooncake-format trace with shared prefixes of various depths and partial
    last blocks (some of which share their id with a full block elsewhere)."""
    rng = random.Random(seed)
    roots = [[rng.randrange(10_000) + 100_000 * r for _ in range(rng.randint(2, 6))] for r in range(5)]
    lines = []
    next_id = 1_000_000
    for i in range(n):
        ids = list(rng.choice(roots))
        for _ in range(rng.randint(1, 4)):
            ids.append(next_id)
            next_id += 1
        n_in = len(ids) * BLOCK - (rng.randrange(BLOCK) if rng.random() < 0.6 else 0)
        lines.append(
            json.dumps(
                {
                    "timestamp": i * 40,
                    "input_length": n_in,
                    "output_length": rng.randint(2, 12),
                    "hash_ids": ids,
                }
            )
        )
    p = path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)
