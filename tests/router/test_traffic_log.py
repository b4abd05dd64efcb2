"""The traffic log (radixfleet.server.traffic_log) and its reader (radixfleet_tools.loadtest.trace_format)."""

from __future__ import annotations

import errno
import json
import os
import time

import pytest

from radixfleet.cli import main
from radixfleet.config import TrafficLogConfig
from radixfleet.keys import Endpoint, request_key
from radixfleet.server.metrics import Metrics
from radixfleet.server.traffic_log import FORMAT, LogState, TrafficLog, log_files
from radixfleet.wire.errors import WorkloadError
from radixfleet_tools.loadtest.trace_format import MAX_BLOCK_ID, TRAFFIC_LOG, read_trace
from radixfleet_tools.loadtest.workloads import make_workload


def _cfg(tmp_path, **kw) -> TrafficLogConfig:
    kw.setdefault("flush_interval_s", 0.02)
    return TrafficLogConfig(enabled=True, dir=str(tmp_path / "log"), **kw)


def _keys(n_sessions=6, turns=3, tenant="acme"):
    """Real routing keys of a multi-turn chat workload (growing, shared prefixes)."""
    w = make_workload(
        "multiturn", {"clients": n_sessions, "rounds": turns, "question_tokens": 40, "output_tokens": 8}, 0
    )
    out = []
    for s in w.sessions():
        spec = s.first()
        while spec is not None:
            body = dict(spec.body, model="m")
            out.append((s.id, request_key(Endpoint.CHAT, body, tenant=tenant)))
            spec = s.follow("an answer " * 3)
    return out


def _lines(tmp_path) -> list[dict]:
    rows = []
    for p in log_files([str(tmp_path / "log")]):
        with open(p) as f:
            rows += [json.loads(line) for line in f]
    return rows


async def test_lines_carry_hashes_never_text_and_replay_as_a_trace(tmp_path):
    keys = _keys()
    t0 = 1_700_000_000.0
    async with TrafficLog(_cfg(tmp_path), key=b"k") as tl:
        # written out of arrival order: the reader sorts by timestamp
        for i, (sid, key) in reversed(list(enumerate(keys))):
            assert tl.record(
                key,
                arrival_s=t0 + i,
                worker=f"w{i % 3}",
                matched_tokens=32 * (i % 2),
                prompt_tokens=key.prompt_tokens + 5,
                output_tokens=8,
                cached_tokens=16,
                ttft_s=0.012,
                session=sid,
            )
        tl.check()
    tl.check()
    assert tl.state is LogState.CLOSED and tl.stats().written == len(keys)
    rows = _lines(tmp_path)
    assert len(rows) == len(keys)
    text = (tmp_path / "log").joinpath(os.listdir(tmp_path / "log")[0]).read_text()
    assert "acme" not in text and "question" not in text  # no tenant, no prompt text
    by_ts = {r["timestamp"]: r for r in rows}
    for i, (_, key) in enumerate(keys):
        r = by_ts[round((t0 + i) * 1000, 3)]
        assert r["format"] == FORMAT and r["hash_ids"] == key.hashes
        assert r["block_tokens"] == 32 and r["routed_tokens"] == key.prompt_tokens
        assert r["input_length"] == key.prompt_tokens + 5 and r["output_length"] == 8
        assert r["tenant"] and r["tenant"] != "acme" and len(r["tenant"]) == 16
        assert r["ttft_ms"] == 12.0 and r["cached_tokens"] == 16 and r["model"] == "m"
    # the reader: dense ids, one private tail id, lengths in router tokens, sorted
    data = read_trace(log_files([str(tmp_path / "log")]), keep_info=True)
    assert data.kind == TRAFFIC_LOG and data.block_tokens == 32
    assert [r[0] for r in data.records] == sorted(r[0] for r in data.records)
    dense: dict[int, int] = {}  # hash -> id: one to one
    for (_ts, n_in, n_out, ids), (_, key) in zip(data.records, keys):
        assert n_in == key.prompt_tokens and n_out == 8
        assert len(ids) == -(-n_in // 32)
        for h, i in zip(key.hashes, ids):
            assert dense.setdefault(h, i) == i
        if n_in > 32 * len(key.hashes):
            assert ids[-1] > MAX_BLOCK_ID - len(keys)  # private tail
    assert data.distinct_hashes == len(dense) == len(set(dense.values()))
    assert data.info[0].cached_tokens == 16 and data.info[0].input_length == keys[0][1].prompt_tokens + 5


async def test_tenant_hash_is_keyed_and_stable(tmp_path, monkeypatch):
    monkeypatch.setenv("RFTEST_KEY", "secret")
    ((_, key),) = _keys(1, 1)
    tenants = []
    for run in range(2):
        async with TrafficLog(_cfg(tmp_path / str(run), tenant_key_env="RFTEST_KEY")) as tl:
            tl.record(key, arrival_s=1.0, worker="w", matched_tokens=0)
        tenants.append(_lines(tmp_path / str(run))[0]["tenant"])
    assert tenants[0] == tenants[1]
    async with TrafficLog(_cfg(tmp_path / "other"), key=b"another key") as tl:
        tl.record(key, arrival_s=1.0, worker="w", matched_tokens=0)
    assert _lines(tmp_path / "other")[0]["tenant"] != tenants[0]


async def test_rotation_bounds_size_and_files(tmp_path):
    keys = _keys(8, 4)
    async with TrafficLog(_cfg(tmp_path, max_file_bytes=4096, max_files=3)) as tl:
        for round_ in range(5):
            for i, (_, key) in enumerate(keys):
                tl.record(key, arrival_s=round_ * 100 + i, worker="w", matched_tokens=0)
            # each round its own batch (so its own file): wait until the writer wrote it,
            # not a fixed time (a loaded machine's writer takes two rounds in one batch)
            deadline = time.monotonic() + 10
            while tl.stats().written < (round_ + 1) * len(keys) and time.monotonic() < deadline:
                time.sleep(0.005)
    st = tl.stats()
    files = log_files([str(tmp_path / "log")])
    assert len(files) <= 3 and st.files_opened > 3 and st.files_deleted == st.files_opened - len(files)
    for p in files[:-1]:
        # a file is closed at the first write past the bound: at most one batch over
        assert os.path.getsize(p) < 4096 + 256 * 2000
    assert st.written == 5 * len(keys)


async def test_sampling_keeps_whole_sessions(tmp_path):
    keys = _keys(40, 3)
    async with TrafficLog(_cfg(tmp_path, sample_rate=0.5)) as tl:
        for i, (sid, key) in enumerate(keys):
            tl.record(key, arrival_s=float(i), worker="w", matched_tokens=0, session=sid)
    rows = _lines(tmp_path)
    st = tl.stats()
    assert st.written + st.sampled_out == len(keys)
    assert 0.25 * len(keys) < st.written < 0.75 * len(keys)
    assert st.written % 3 == 0  # every kept session keeps its 3 turns
    assert all(r["sample_rate"] == 0.5 for r in rows)


async def test_full_queue_drops_and_counts_without_waiting(tmp_path):
    ((_, key),) = _keys(1, 1)
    tl = TrafficLog(_cfg(tmp_path, queue_size=5, flush_interval_s=60.0))
    with pytest.raises(RuntimeError, match="before start"):
        tl.record(key, arrival_s=0.0, worker="w", matched_tokens=0)
    tl.start()
    try:
        t = time.perf_counter()
        ok = [tl.record(key, arrival_s=float(i), worker="w", matched_tokens=0) for i in range(50)]
        assert time.perf_counter() - t < 0.05
        assert ok.count(True) == 5 and tl.stats().dropped_full == 45
        tl.check()
    finally:
        await tl.aclose()
        await tl.aclose()  # idempotent
    assert tl.stats().written == 5
    assert not tl.record(key, arrival_s=0.0, worker="w", matched_tokens=0)  # closed: dropped


async def test_write_errors_are_counted_not_raised(tmp_path, caplog):
    ((_, key),) = _keys(1, 1)
    tl = TrafficLog(_cfg(tmp_path))
    tl.start()
    try:
        tl.record(key, arrival_s=0.0, worker="w", matched_tokens=0)
        deadline = time.monotonic() + 5
        while tl.stats().written < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the directory becomes a file: every later open fails
        tl._close_file()
        d = tmp_path / "log"
        for n in os.listdir(d):
            os.unlink(d / n)
        os.rmdir(d)
        d.write_text("not a directory")
        for i in range(3):
            tl.record(key, arrival_s=float(i), worker="w", matched_tokens=0)
            time.sleep(0.05)
    finally:
        await tl.aclose()
    st = tl.stats()
    assert st.written == 1 and st.dropped_error == 3 and st.write_errors >= 1
    assert sum("traffic log in" in r.message for r in caplog.records) == 1  # once per cause


class _Disk:
    """An opener whose files fail every write with ENOSPC while ``full`` (after
    writing the first bytes of it, as a filling disk does)."""

    def __init__(self) -> None:
        self.full = False
        self.opened: list[str] = []

    def __call__(self, path: str):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        self.opened.append(path)
        return _DiskFile(self, open(path, "ab"))  # noqa: SIM115 - closed by the log


class _DiskFile:
    def __init__(self, disk: _Disk, f) -> None:
        self.disk, self.f = disk, f

    def write(self, data: bytes) -> int:
        if self.disk.full:
            self.f.write(data[:10])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _round(tl: TrafficLog, keys, t: float) -> None:
    """Records ``keys`` and waits (bounded) until the writer has taken them."""
    before = tl.stats()
    for i, (_, key) in enumerate(keys):
        tl.record(key, arrival_s=t + i, worker="w", matched_tokens=0)
    want = before.written + before.dropped_error + len(keys)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = tl.stats()
        if st.written + st.dropped_error >= want:
            return
        time.sleep(0.005)
    raise AssertionError(f"the writer did not take {len(keys)} records: {tl.stats()}")


def _snapshot(d) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


async def test_a_full_disk_stops_the_log_and_never_rotates_out_kept_files(tmp_path, caplog):
    keys = _keys(8, 4)
    disk = _Disk()
    tl = TrafficLog(_cfg(tmp_path, max_file_bytes=4096, max_files=2), opener=disk, retry_s=3600.0)
    tl.start()
    d = tmp_path / "log"
    try:
        for r in range(3):  # each round past max_file_bytes: a file each, two kept
            _round(tl, keys, 100.0 * r)
        kept = _snapshot(d)
        assert len(kept) == 2 and tl.stats().writing == 1
        disk.full = True
        _round(tl, keys, 1000.0)  # the open file fails its write, or the next open does
        for r in range(5):
            _round(tl, keys, 2000.0 + 100 * r)
        st = tl.stats()
        assert st.writing == 0 and st.dropped_error == 6 * len(keys)
        m = Metrics()
        m.watch_traffic_log(tl)
        assert "radixfleet_traffic_log_writing 0.0" in m.render().decode()
        assert _snapshot(d) == kept  # no file deleted, none added, none cut
        assert len(disk.opened) == 3  # stopped: nothing opened while it waits
        tl.check()
    finally:
        await tl.aclose()
    stops = [r for r in caplog.records if "stopped writing" in r.message]
    assert len(stops) == 1 and stops[0].levelname == "ERROR"


async def test_a_write_error_cuts_the_failed_batch_off_its_file_and_a_retry_resumes(tmp_path, caplog):
    keys = _keys(4, 2)
    disk = _Disk()
    tl = TrafficLog(_cfg(tmp_path, max_files=4), opener=disk, retry_s=0.2)
    tl.start()
    d = tmp_path / "log"
    caplog.set_level("INFO", "radixfleet.traffic_log")
    try:
        _round(tl, keys, 0.0)
        (name,) = os.listdir(d)
        good = (d / name).read_bytes()
        disk.full = True
        _round(tl, keys, 100.0)  # 10 bytes of it reach the file, then ENOSPC
        assert (d / name).read_bytes() == good  # whole lines only
        assert tl.stats().writing == 0
        disk.full = False
        deadline = time.monotonic() + 10
        while tl.stats().writing == 0 and time.monotonic() < deadline:
            _round(tl, keys, 200.0)
        st = tl.stats()
        assert st.writing == 1 and st.written >= 2 * len(keys)
        assert st.dropped_error >= len(keys)
    finally:
        await tl.aclose()
    rows = _lines(tmp_path)  # every line whole
    assert len(rows) == tl.stats().written
    assert any("writes again" in r.message for r in caplog.records)


def test_start_refuses_an_unwritable_dir(tmp_path):
    (tmp_path / "file").write_text("x")
    from radixfleet.wire.errors import ConfigError

    with pytest.raises(ConfigError, match="traffic_log.dir: cannot write into"):
        TrafficLog(TrafficLogConfig(enabled=True, dir=str(tmp_path / "file" / "sub"))).start()


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _row(**kw):
    r = {
        "timestamp": 1.0,
        "input_length": 40,
        "output_length": 2,
        "hash_ids": [7],
        "format": FORMAT,
        "block_tokens": 32,
        "routed_tokens": 40,
        "tenant": "",
        "model": "m",
        "adapter": None,
        "worker": "w",
        "matched_tokens": 0,
        "cached_tokens": None,
        "ttft_ms": None,
        "status": 200,
        "sample_rate": 1.0,
    }
    r.update(kw)
    return r


@pytest.mark.parametrize(
    "rows, message",
    [
        ([_row(), '{"timestamp": 2.0, "input_len'], "line 2: not JSON"),
        (
            [_row(), _row(format="radixfleet.traffic/2")],
            "line 2: 'format' is 'radixfleet.traffic/2', from another radixfleet version",
        ),
        ([_row(routed_tokens=80)], "line 1: 'hash_ids' has 1 blocks of 32 tokens; 'routed_tokens' 80"),
        ([_row(), _row(block_tokens=16, routed_tokens=20)], "line 2: 'block_tokens' 16 differs from 32"),
        (
            [_row(), {"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}],
            "line 2: a mooncake line among traffic log lines",
        ),
        ([_row(hash_ids=[-1])], "line 1: 'hash_ids' must be a list of integers in [0, 2**64)"),
    ],
)
def test_bad_logs_name_the_line(tmp_path, rows, message):
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(
        WorkloadError,
        match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)").replace("*", r"\*"),
    ):
        read_trace([path])


def test_skip_bad_lines_counts_them(tmp_path):
    path = _write(
        tmp_path / "t.jsonl", [_row(), '{"trunc', _row(timestamp=5.0), _row(format="radixfleet.traffic/9")]
    )
    data = read_trace([path], skip_bad=True)
    assert len(data.records) == 2 and [line for _, line in data.skipped] == [2, 4]


def test_simulate_reads_a_traffic_log_directly(tmp_path):
    import asyncio

    async def write():
        async with TrafficLog(_cfg(tmp_path)) as tl:
            for i, (_sid, key) in enumerate(_keys(6, 4)):
                tl.record(key, arrival_s=1e9 + i * 0.05, worker="w", matched_tokens=0, output_tokens=8)

    asyncio.run(write())
    (path,) = log_files([str(tmp_path / "log")])
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "simulate",
                "--trace",
                path,
                "--workers",
                "2",
                "--kv-tokens",
                "5000",
                "--policies",
                "round_robin,prefix_load",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    runs = json.loads(out.read_text())["runs"]
    for r in runs:
        assert r["requests"] == 24 and r["ok"] == 24 and r["sim"]["level"] == "block"
        assert r["sim"]["block_tokens"] == 32
        assert r["oracle_hit_rate"] > 0.3  # turns repeat their history
    assert runs[1]["hit_rate"] > runs[0]["hit_rate"]


async def test_counters_are_exported_at_scrape(tmp_path):
    ((_, key),) = _keys(1, 1)
    m = Metrics()
    async with TrafficLog(_cfg(tmp_path, queue_size=2, flush_interval_s=60.0)) as tl:
        m.watch_traffic_log(tl)
        for i in range(5):
            tl.record(key, arrival_s=float(i), worker="w", matched_tokens=0)
        text = m.render().decode()
        assert 'radixfleet_traffic_log_records_total{outcome="dropped_full"} 3.0' in text
        assert "radixfleet_traffic_log_queued 2.0" in text
        assert "radixfleet_traffic_log_writing 1.0" in text
    text = m.render().decode()
    assert 'radixfleet_traffic_log_records_total{outcome="written"} 2.0' in text
