"""Reading traces: Mooncake JSONL and radixfleet traffic logs, into one record shape.

Both are one JSON object per line. A line without a ``format`` field is Mooncake's::

    {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [id, ...]}

with ``len(hash_ids) == ceil(input_length / block_tokens)`` (512-token blocks). A line
whose ``format`` is ``radixfleet.server.traffic_log.FORMAT`` is a traffic log line; the module
docstring of ``radixfleet.server.traffic_log`` gives its fields and how they map onto a Mooncake
record (dense renumbering of the 64-bit chained hashes, the log's own block size,
``routed_tokens`` as the length, one private id for the unkeyed tail, sorted by
timestamp). Every record comes out as ``(timestamp_ms, input_length, output_length,
ids)`` with ids in ``[0, MAX_BLOCK_ID]`` and ``len(ids) == ceil(input_length /
block_tokens)`` — what ``radixfleet_tools.loadtest.workloads.Trace`` and the simulator replay.

Bad input raises ``WorkloadError`` naming the file and 1-based line: not JSON, not an
object, a missing or ill-typed field, a log line from another radixfleet version
(``format`` ``radixfleet.traffic/N`` other than ours), lines of two formats or two
block sizes in one replay. With ``skip_bad`` such lines are skipped and counted in
``skipped`` instead (a mix of formats or block sizes is never skipped: it is not one
bad line but a wrong input).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from radixfleet.server.traffic_log import FORMAT, FORMAT_FAMILY
from radixfleet.wire.errors import WorkloadError

Record = tuple[float, int, int, list[int]]  # (timestamp_ms, input_length, output_length, ids)

MOONCAKE = "mooncake"
TRAFFIC_LOG = "traffic_log"
#: the largest block id replay accepts (the reference caches pack ids into 31 bits)
MAX_BLOCK_ID = 2**31 - 1
_U64 = 2**64


@dataclass(slots=True)
class LineInfo:
    """What a traffic-log line says beyond the replayable record (analyses use it)."""

    #: prompt tokens as the worker counted them
    input_length: int
    cached_tokens: int | None
    matched_tokens: int
    ttft_ms: float | None
    tenant: str
    model: str
    status: int
    sample_rate: float
    #: the worker that answered ("": shed by the router)
    worker: str = ""
    #: the stream broke off after the client had its 200
    broken: bool = False
    #: tokens the best-matching eligible worker held at pick time (None: a log of an
    #: earlier version, which did not write it)
    available_tokens: int | None = None


@dataclass(slots=True)
class TraceData:
    records: list[Record]
    #: MOONCAKE or TRAFFIC_LOG (None: nothing read)
    kind: str | None
    block_tokens: int
    #: (path, line) of skipped lines
    skipped: list[tuple[str, int]] = field(default_factory=list)
    #: per record, traffic logs only (``keep_info``), in record order
    info: list[LineInfo] | None = None
    #: distinct router hashes (traffic logs), i.e. distinct prefix blocks
    distinct_hashes: int = 0


class TraceReader:
    """Reads one or more files into a ``TraceData`` (``read`` each, then ``finish``).

    ``block_tokens``: Mooncake's block size (a traffic log carries its own).
    ``max_requests``: stop after this many records (0: all). ``keep_info``: keep
    each traffic-log line's ``LineInfo``.
    """

    def __init__(
        self,
        block_tokens: int = 512,
        *,
        skip_bad: bool = False,
        max_requests: int = 0,
        keep_info: bool = False,
    ) -> None:
        self.block_tokens = block_tokens
        self.skip_bad = skip_bad
        self.max_requests = max_requests
        self.keep_info = keep_info
        self.kind: str | None = None
        self.records: list[Record] = []
        self.info: list[LineInfo] | None = [] if keep_info else None
        self.skipped: list[tuple[str, int]] = []
        self._where = ""  # file and line of the first traffic-log line (block size)
        self._log_bt: int | None = None
        self._ids: dict[int, int] = {}  # router hash -> dense id (traffic logs)
        self._next_private = 0

    @property
    def full(self) -> bool:
        return bool(self.max_requests) and len(self.records) >= self.max_requests

    def read(self, path: str) -> None:
        """Appends ``path``'s records. Raises ``WorkloadError`` for an unreadable file
        or a bad line (unless ``skip_bad``)."""
        try:
            f = open(path, encoding="utf-8", errors="surrogateescape")  # noqa: SIM115 (closed by the generator)
        except OSError as exc:
            raise WorkloadError(f"trace {path}: {exc.strerror or exc}") from None
        with f:
            for lineno, line in enumerate(f, 1):
                if self.full:
                    return
                if not line.strip():
                    continue
                try:
                    self._line(line, path, lineno)
                except _Fatal as exc:
                    raise WorkloadError(f"trace {path} line {lineno}: {exc}") from None
                except ValueError as exc:
                    if not self.skip_bad:
                        raise WorkloadError(
                            f"trace {path} line {lineno}: {exc} (--skip-bad-lines to go on)"
                        ) from None
                    self.skipped.append((path, lineno))

    def finish(self) -> TraceData:
        recs, info = self.records, self.info
        if self.kind == TRAFFIC_LOG:
            # lines are written as requests finish: replay in arrival order
            order = sorted(range(len(recs)), key=lambda i: recs[i][0])
            recs = [recs[i] for i in order]
            if info is not None:
                info = [info[i] for i in order]
        bt = self._log_bt if self.kind == TRAFFIC_LOG and self._log_bt is not None else self.block_tokens
        return TraceData(recs, self.kind, bt, self.skipped, info, len(self._ids))

    # ----------------------------------------------------------------- one line

    def _line(self, line: str, path: str, lineno: int) -> None:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc.msg}; a truncated line?)") from None
        if not isinstance(rec, dict):
            raise ValueError("not a JSON object")
        fmt = rec.get("format")
        kind = MOONCAKE if fmt is None else TRAFFIC_LOG
        if fmt is not None and fmt != FORMAT:
            if isinstance(fmt, str) and fmt.startswith(FORMAT_FAMILY):
                raise ValueError(
                    f"'format' is {fmt!r}, from another radixfleet version; this one reads {FORMAT!r}"
                )
            raise ValueError(f"unknown 'format' {fmt!r} (expected {FORMAT!r}, or none for a Mooncake trace)")
        if self.kind is None:
            self.kind = kind
        elif kind != self.kind:
            raise _Fatal(
                f"a {kind.replace('_', ' ')} line among {self.kind.replace('_', ' ')} "
                "lines: replay one format at a time"
            )
        ts = rec.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0 or not math.isfinite(ts):
            raise ValueError("'timestamp' must be a non-negative number (ms)")
        if kind == MOONCAKE:
            self.records.append(_mooncake(rec, float(ts), self.block_tokens))
        else:
            self._traffic(rec, float(ts), path, lineno)

    def _traffic(self, rec: dict, ts: float, path: str, lineno: int) -> None:
        bt = rec.get("block_tokens")
        if type(bt) is not int or bt <= 0:
            raise ValueError("'block_tokens' must be a positive integer")
        if self._log_bt is None:
            self._log_bt, self._where = bt, f"{path} line {lineno}"
        elif bt != self._log_bt:
            raise _Fatal(
                f"'block_tokens' {bt} differs from {self._log_bt} at {self._where} "
                "(keys.block_bytes changed): replay those files separately"
            )
        routed = rec.get("routed_tokens")
        if type(routed) is not int or routed <= 0:
            raise ValueError("'routed_tokens' must be a positive integer")
        hashes = rec.get("hash_ids")
        if not isinstance(hashes, list) or any(type(h) is not int or not 0 <= h < _U64 for h in hashes):
            raise ValueError("'hash_ids' must be a list of integers in [0, 2**64)")
        full = len(hashes) * bt
        if not full <= routed < full + bt:
            raise ValueError(
                f"'hash_ids' has {len(hashes)} blocks of {bt} tokens; "
                f"'routed_tokens' {routed} must be in [{full}, {full + bt})"
            )
        out = rec.get("output_length")
        if out is not None and (type(out) is not int or out < 0):
            raise ValueError("'output_length' must be a non-negative integer or null")
        n_in = rec.get("input_length")
        if type(n_in) is not int or n_in <= 0:
            raise ValueError("'input_length' must be a positive integer")
        if self.keep_info:
            info = _line_info(rec, n_in)
        m = self._ids
        ids = [m.setdefault(h, len(m)) for h in hashes]
        if routed > full:
            # the unkeyed tail: an id no other request has (from the top of the range)
            ids.append(MAX_BLOCK_ID - self._next_private)
            self._next_private += 1
        if len(m) + self._next_private > MAX_BLOCK_ID:
            raise _Fatal("more distinct blocks than a replay can number (2**31)")
        self.records.append((ts, routed, max(1, out or 0), ids))
        if self.info is not None:  # kept exactly when keep_info
            self.info.append(info)


class _Fatal(ValueError):
    """A bad input that skipping lines cannot fix."""


def _mooncake(rec: dict, ts: float, block_tokens: int) -> Record:
    n_in, n_out, ids = (rec.get(k) for k in ("input_length", "output_length", "hash_ids"))
    for k, v in (("input_length", n_in), ("output_length", n_out)):
        if type(v) is not int or v <= 0:
            raise ValueError(f"'{k}' must be a positive integer")
    if not isinstance(ids, list) or not ids or any(type(h) is not int for h in ids):
        raise ValueError("'hash_ids' must be a non-empty list of integers")
    assert isinstance(n_in, int) and isinstance(n_out, int), "checked by the loop above"
    if len(ids) != math.ceil(n_in / block_tokens):
        raise ValueError(
            f"'hash_ids' has {len(ids)} ids, input_length {n_in} needs "
            f"{math.ceil(n_in / block_tokens)} blocks of {block_tokens}"
        )
    return ts, n_in, n_out, ids


def _line_info(rec: dict, n_in: int) -> LineInfo:
    def opt_num(k: str, typ=(int, float)):
        v = rec.get(k)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, typ) or v < 0:
            raise ValueError(f"'{k}' must be a non-negative number or null")
        return v

    cached = opt_num("cached_tokens", int)
    matched = opt_num("matched_tokens", int) or 0
    available = opt_num("available_tokens", int)
    ttft = opt_num("ttft_ms")
    status = rec.get("status", 200)
    if type(status) is not int:
        raise ValueError("'status' must be an integer")
    rate = opt_num("sample_rate")
    tenant, model, worker = rec.get("tenant", ""), rec.get("model", ""), rec.get("worker", "")
    if not isinstance(tenant, str) or not isinstance(model, str) or not isinstance(worker, str):
        raise ValueError("'tenant', 'model' and 'worker' must be strings")
    broken = rec.get("broken", False)
    if type(broken) is not bool:
        raise ValueError("'broken' must be true or false")
    rate = 1.0 if rate is None else float(rate)
    return LineInfo(n_in, cached, matched, ttft, tenant, model, status, rate, worker, broken, available)


def read_trace(
    paths, block_tokens: int = 512, *, skip_bad: bool = False, max_requests: int = 0, keep_info: bool = False
) -> TraceData:
    """Reads ``paths`` (files, in order) into one ``TraceData``; raises
    ``WorkloadError`` as the module docstring says."""
    r = TraceReader(block_tokens, skip_bad=skip_bad, max_requests=max_requests, keep_info=keep_info)
    for p in paths:
        r.read(p)
        if r.full:
            break
    return r.finish()
