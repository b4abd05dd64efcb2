"""``traffic_log:``: one JSON line per routed request (``radixfleet.server.traffic_log``)."""

from __future__ import annotations

import os

from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import document_check, settings
from radixfleet.wire.settings import setting as _opt


@settings
class TrafficLogConfig:
    """``traffic_log:``: the per-request JSON lines log (``radixfleet.server.traffic_log``); ``dir``
    is a path, ``prefix`` a file name prefix without ``/``."""

    enabled: bool = _opt(False, "write one JSON line per routed request (radixfleet.server.traffic_log)")
    dir: str = _opt("traffic", "directory of the log files (created if missing)")
    prefix: str = _opt("traffic", "file names: PREFIX-<UTC time>-<pid>-<seq>.jsonl")
    sample_rate: float = _opt(
        1.0, "share of sessions (requests without one: of requests) logged", lo=0, hi=1, lo_open=True
    )
    max_file_bytes: int = _opt(64 * 2**20, "a file is closed and the next begun past this size", lo=4096)
    max_files: int = _opt(16, "files kept; the oldest are deleted beyond this", lo=1)
    queue_size: int = _opt(
        65536,
        "records waiting for the writer; beyond it records are dropped and counted, never waited for",
        lo=1,
    )
    flush_interval_s: float = _opt(1.0, "the writer writes what is queued this often", lo=0, lo_open=True)
    tenant_key_env: str = _opt(
        "RADIXFLEET_TRAFFIC_LOG_KEY",
        "env var with the secret key of the tenant hash (unset: a random key per process)",
    )

    @document_check
    def _check(self) -> None:
        if not self.dir:
            raise ConfigError("dir", "expected a directory path, got ''")
        if not self.prefix or "/" in self.prefix or os.sep in self.prefix:
            raise ConfigError("prefix", f"expected a file name prefix without '/', got {self.prefix!r}")
