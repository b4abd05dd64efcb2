"""Mooncake-format traces at block level: sessions whose specs carry hash ids, not text.

The load generator's ``Trace`` workload parses and validates the file (same errors,
same line numbers, same ``max_requests`` / ``time_scale`` / ``max_output_tokens``);
this module turns its records into single-turn sessions whose ``RequestSpec.body``
is ``{"hash_ids": [...], "input_length": n}`` — no text is synthesized. The
simulator builds each prompt with ``prompts.block_prompt``.

``repeat(records, copies)`` makes a longer trace out of a short one: copy k is
shifted by k periods in time and its ids by k * (max id + 1), so every copy has the
original's sharing structure without sharing blocks with the other copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixfleet_tools.loadtest.workloads import API_COMPLETIONS, RequestSpec, Session, SingleShot, Trace

Record = tuple[float, int, int, list[int]]  # (timestamp_ms, input_length, output_length, ids)


def repeat(records: Sequence[Record], copies: int) -> list[Record]:
    """``copies`` time-shifted, id-shifted copies of a trace, in time order."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if not records or copies == 1:
        return list(records)
    t0 = records[0][0]
    span = records[-1][0] - t0
    gap = span / max(1, len(records) - 1)  # keep the mean rate across the seam
    period = span + gap
    stride = max(i for r in records for i in r[3]) + 1
    out: list[Record] = []
    for k in range(copies):
        dt, di = k * period, k * stride
        for ts, n_in, n_out, ids in records:
            out.append((ts + dt, n_in, n_out, [i + di for i in ids] if di else ids))
    return out


def sessions(trace: Trace, records: Sequence[Record] | None = None) -> list[Session]:
    """Single-shot sessions of a (validated) trace's records, at block level."""
    p = trace.params
    recs = trace.records if records is None else records
    out: list[Session] = []
    t0 = recs[0][0] if recs else 0.0
    for i, (ts, n_in, n_out, ids) in enumerate(recs):
        if p.max_output_tokens:
            n_out = min(n_out, p.max_output_tokens)
        sid = f"t{i}"
        body = {"hash_ids": ids, "input_length": n_in}
        out.append(
            SingleShot(
                RequestSpec(
                    f"{sid}.0", API_COMPLETIONS, body, n_out, sid, 0, (ts - t0) / 1000.0 * p.time_scale, n_in
                )
            )
        )
    return out
