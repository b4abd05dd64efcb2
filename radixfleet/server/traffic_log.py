"""The traffic log: one privacy-safe JSON line per routed request (YAML ``traffic_log``).

What an operator needs to draw the cache-size knee from their own traffic and to
replay it through the simulator (``radixfleet analyze``, ``radixfleet simulate
--trace``) — never the text: prompts appear only as their chained block hashes
(contract 1, docs/DESIGN.md), tenants only as a keyed hash.

Request path and writer::

    request path                                writer thread (one per log)
    ------------                                ---------------------------
    record(key, ...)  sample? -> tuple          every flush_interval_s (and at close):
      -> deque.append                             pop every record, encode one JSON
      (no I/O, no lock, no encoding;               line each, append to the open file,
       queue full: drop and count)                 rotate past max_file_bytes, delete
                                                   the oldest beyond max_files

``record()`` costs a sampling test, a tuple and a deque append (about a
microsecond); everything else — the tenant's HMAC, JSON encoding, file I/O —
happens on the writer thread, one record at a time so that it never holds the
GIL for long (``bench traffic_log`` measures routing p99 with the log on and off).
The writer gives the GIL back after every record (a 50 us pause), so a request
waits for it at most one record's encoding (~15 us at 8 KiB prompts), never the
interpreter's 5 ms switch interval; that caps the writer near 10,000 lines/s. The
queue holds at most ``queue_size`` records; past it new records are dropped and
counted (``stats().dropped_full``), so a slow disk costs records, never latency.

A write error (disk full, I/O error, directory gone) stops the writing, never the
data already kept::

    writing  --a write or open fails-->  stopped: one ERROR line, write_errors and
                                         ``writing`` 0 (radixfleet_traffic_log_writing);
                                         the failed batch's bytes cut off its file (the
                                         file's whole lines stay) or a file that got
                                         none of them deleted; records dropped
                                         (dropped_error) without being encoded
    stopped  --RETRY_S later: the next batch written whole into a new file-->  writing
                                         (one INFO line); a retry that fails again
                                         stays stopped, its file deleted

Files are rotated out only by a successful write: the oldest beyond ``max_files``
are deleted once a new file holds a batch, never when it is opened, so a full disk
never replaces kept files with empty ones.

Line format (``FORMAT``), one JSON object per line; Mooncake's trace fields first::

    timestamp       float  arrival, ms since the UNIX epoch (Mooncake: ms from the
                           trace start; readers subtract the first line's)
    input_length    int    prompt tokens as the worker counted them (usage), else
                           the router's estimate
    output_length   int    generated tokens (0: unknown or failed)
    hash_ids        [int]  the router's chained block hashes, one per whole routing
                           block (``block_tokens`` router tokens each); the partial
                           tail is not keyed, as in routing
    format          str    "radixfleet.traffic/1"
    block_tokens    int    router tokens per hash (keys.block_bytes / 4)
    routed_tokens   int    the router's token count of the prompt (ceil(bytes / 4)):
                           hash_ids cover its first len(hash_ids) * block_tokens
    tenant          str    HMAC-SHA256(key, tenant), 16 hex digits ("" tenant: "")
    model, adapter  str, str|null
    worker          str    the worker that served it (the last attempt's); "" for a
                           request the router shed (429, every worker saturated)
    available_tokens int   tokens the best-matching eligible worker held (pick time:
                           the reuse available anywhere; radixfleet.route.decisions; >=
                           matched_tokens; 0 when shed or failed; absent in logs of
                           earlier versions, which readers take as unknown)
    matched_tokens  int    tokens the router believed that worker held (pick time;
                           0 when shed): predicted
    cached_tokens   int|null  cached prompt tokens the worker reported: delivered
    ttft_ms         float|null  the worker's part of the TTFT: the router's send of the
                           last attempt to the first content token back (streams;
                           null for non-streamed answers)
    status          int    the HTTP status the client got: the worker's own answer
                           (a 4xx passed through), the router's error when every
                           attempt failed (502, 503, 504, a worker's 429; matched_tokens
                           0, cached_tokens/ttft_ms null), 429 when the router shed it
                           (worker "", output_length 0, cached_tokens/ttft_ms null)
    broken          bool   the worker broke off a stream after the client had its 200
                           (the client's stream ended with an error event): status
                           is that 200, output_length 0, the answer incomplete
    sample_rate     float  the log's sample rate when this line was written

Mapping onto a Mooncake trace (``radixfleet_tools.loadtest.workloads.Trace`` reads both). Mooncake's
``hash_ids`` are small ids of 512-token blocks, prefix-chained by construction; ours
are 64-bit chained hashes of ``block_tokens``-token routing blocks (32 tokens at the
default 128-byte blocks), equally prefix-chained: a hash fingerprints the whole
prefix up to its block, and tenants, models and adapters never share one. A reader
replaying a traffic log therefore:

- renumbers the hashes densely in order of first appearance (a one-to-one map,
  so sharing is unchanged; the simulator packs ids into 31 bits);
- uses the line's ``block_tokens`` as the trace's block size (every line of one
  replay must agree; a reload that changes ``keys.block_bytes`` starts a new file);
- takes ``routed_tokens`` as the prompt length and gives the unkeyed tail
  (``routed_tokens - len(hash_ids) * block_tokens`` tokens, < one block) an id of its
  own that no other request has, so that ``len(ids) == ceil(tokens / block_tokens)``
  holds as in Mooncake and the tail can never match;
- sorts lines by ``timestamp`` (lines are written when requests finish, so they are
  not quite in arrival order) and takes ``output_length`` 0 as 1.

A request the router sheds (every worker saturated, ``radixfleet.route.shedding``) is logged
too, so that the log is the offered load, not only the admitted: replay takes it as
a request like any other (a replay decides for itself whether to shed it), and
``radixfleet analyze`` counts it in ``shed_requests`` and leaves it out of the
observed figures (hit rate, router matched share), which are the served requests'.
So is a request every attempt failed (its error status, the last worker tried,
nothing matched) and one whose stream broke (``broken``): the log records the
outcome the client saw, never a 200 for an error. ``analyze`` counts them
(``failed_requests``, ``broken_requests``) and keeps failed lines out of the observed
figures. A request refused by the concurrency limit (``limits.max_concurrency``) is
not logged: it is refused before its body is read, so it has no prefix to log; nor
is one whose client went away before its answer was whole (it got no outcome).

Token counts on replay are the router's (4 bytes per token, the simulated engine's
tokenizer); ``input_length`` keeps the engine's own count for analyses that want it.

Sampling (``sample_rate`` < 1) keeps whole sessions: a request naming a session is
logged iff a hash of the session id falls under the rate, so a kept conversation
keeps every turn; requests without one are sampled independently. Reuse *across*
sessions thins with the rate, so a sampled log understates cross-session hit rates.

Lifecycle: ``start()`` (creates the directory, starts the writer; raises
``ConfigError`` when it cannot write there) -> ``record()`` ... -> ``aclose()`` (or
``close()``; idempotent) drains the queue, closes the file, joins the thread.
``async with TrafficLog(...)`` does both.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import io
import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from radixfleet.keys import BYTES_PER_TOKEN, PrefixKey
from radixfleet.wire.errors import ConfigError

log = logging.getLogger("radixfleet.traffic_log")

FORMAT = "radixfleet.traffic/1"
#: the format family: a line whose ``format`` starts with this but differs from
#: ``FORMAT`` comes from another radixfleet version
FORMAT_FAMILY = "radixfleet.traffic/"
#: env var holding the tenant hash key when the config names none
DEFAULT_KEY_ENV = "RADIXFLEET_TRAFFIC_LOG_KEY"
_TENANT_CACHE = 4096
#: the writer's pause after each record: long enough for a thread waiting on the GIL
#: to wake and take it (a bare sleep(0) releases it, but the writer wins it back)
_YIELD_S = 5e-5
#: one line of ``FORMAT``, in the module docstring's field order
_LINE = (
    '{"timestamp":%s,"input_length":%d,"output_length":%d,"hash_ids":[%s],'
    '"format":"' + FORMAT + '","block_tokens":%d,"routed_tokens":%d,"tenant":"%s",'
    '"model":%s,"adapter":%s,"worker":%s,"available_tokens":%d,"matched_tokens":%d,"cached_tokens":%s,'
    '"ttft_ms":%s,"status":%d,"broken":%s,"sample_rate":%s}'
)
_FILE_RE_TEMPLATE = r"^{prefix}-\d{{8}}T\d{{6}}Z-\d+-\d{{4}}\.jsonl$"
#: seconds a stopped log waits before it tries to write again (module docstring)
RETRY_S = 10.0


class LogState(enum.Enum):
    NEW = "new"  # built; record() refused until start()
    RUNNING = "running"  # the writer thread runs; record() queues
    CLOSING = "closing"  # aclose() in progress: record() drops (counted), the writer drains
    CLOSED = "closed"  # the writer has exited; the file is closed


@dataclass(slots=True)
class TrafficLogStats:
    """Counters since start (a snapshot; ``stats()`` builds a new one)."""

    written: int = 0
    #: not logged because the queue was full (the writer fell behind)
    dropped_full: int = 0
    #: not logged because writing failed (disk full, directory gone, ...)
    dropped_error: int = 0
    #: left out by sampling
    sampled_out: int = 0
    write_errors: int = 0
    #: 1 while writing, 0 while stopped by a write error (until a retry succeeds)
    writing: int = 1
    files_opened: int = 0
    files_deleted: int = 0
    bytes_written: int = 0
    queued: int = 0


class TrafficLog:
    """The log of one router process. See the module docstring for the contract.

    ``cfg`` is a ``radixfleet.config.TrafficLogConfig``. ``key`` (bytes) is the tenant
    hash's secret; None reads ``cfg.tenant_key_env``, and when that is unset a random
    key is drawn (tenant ids are then stable only within this process — logged).
    ``clock`` gives UNIX seconds (file names); ``opener`` opens a file for appending
    (``open(path, "ab")``); tests inject both. ``retry_s``: how long a stopped log
    waits (monotonic seconds) before it tries again.
    """

    def __init__(
        self,
        cfg,
        *,
        key: bytes | None = None,
        clock=time.time,
        opener=None,
        retry_s: float = RETRY_S,
    ) -> None:
        self.cfg = cfg
        #: no key configured: a random one, so tenant ids hold within this process only
        self._random_key = False
        if key is None:
            env = os.environ.get(cfg.tenant_key_env, "") if cfg.tenant_key_env else ""
            if env:
                key = env.encode("utf-8")
            else:
                key = os.urandom(32)
                self._random_key = True
        self._key = key
        self._clock = clock
        self.state = LogState.NEW
        #: records waiting for the writer: appended by record(), popped by the writer
        self._q: collections.deque = collections.deque()
        self._cap = cfg.queue_size
        self._rate = cfg.sample_rate
        self._threshold = int(cfg.sample_rate * 2**64)  # session hash below this: kept
        self._rng = random.Random()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # counters: each written by one side only (record(): dropped_full, sampled_out;
        # the writer: the rest), so no lock is needed
        self._dropped_full = 0
        self._sampled_out = 0
        self._written = 0
        self._dropped_error = 0
        self._write_errors = 0
        self._files_opened = 0
        self._files_deleted = 0
        self._bytes = 0
        # writer-thread state
        self._file: io.BufferedWriter | None = None
        self._file_block_tokens: int | None = None
        self._file_bytes = 0
        self._seq = 0
        self._tenants: dict[str, str] = {}
        self._strings: dict = {}  # name -> its JSON text
        self._errors_logged: set = set()
        self._file_re = re.compile(_FILE_RE_TEMPLATE.format(prefix=re.escape(cfg.prefix)))
        self._opener = opener if opener is not None else _append
        self._retry_s = retry_s
        self._path: str | None = None  # the open file's path
        #: the open file holds no batch yet: rotation waits for its first write
        self._fresh = False
        #: monotonic time until which a stopped log drops records; None: writing
        self._stopped_until: float | None = None
        self._dropped_at_stop = 0  # dropped_error when it stopped (the resume line's count)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Creates the directory and starts the writer. Raises ``ConfigError``
        (``traffic_log.dir``) when the directory cannot be created or written."""
        if self.state is not LogState.NEW:
            raise RuntimeError(f"TrafficLog.start() called in state {self.state.value}")
        d = self.cfg.dir
        try:
            os.makedirs(d, exist_ok=True)
            probe = os.path.join(d, f".{self.cfg.prefix}-probe-{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError("traffic_log.dir", f"cannot write into {d}: {exc.strerror or exc}") from None
        if self._random_key:
            log.warning(
                "traffic log: %s is unset; tenant ids are hashed with a random key "
                "and will not match across restarts",
                self.cfg.tenant_key_env,
            )
        self.state = LogState.RUNNING
        self._thread = threading.Thread(target=self._run, name="radixfleet-traffic-log", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Drains the queue, closes the file and joins the writer. Idempotent; blocks
        for as long as the last write takes (use ``aclose()`` on an event loop)."""
        if self.state in (LogState.NEW, LogState.CLOSED):
            self.state = LogState.CLOSED
            return
        self.state = LogState.CLOSING
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self.state = LogState.CLOSED

    async def aclose(self) -> None:
        """``close()`` off the event loop. Idempotent."""
        if self.state in (LogState.NEW, LogState.CLOSED):
            self.state = LogState.CLOSED
            return
        import asyncio

        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> TrafficLog:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- request path

    def record(
        self,
        key: PrefixKey,
        *,
        arrival_s: float,
        worker: str,
        matched_tokens: int,
        available_tokens: int = 0,
        prompt_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_tokens: int | None = None,
        ttft_s: float | None = None,
        status: int = 200,
        broken: bool = False,
        session: str | None = None,
    ) -> bool:
        """Queues one request's line; returns whether it was queued. Never blocks,
        never raises for a full queue (dropped, counted) or in any state but NEW.

        ``key``: the request's ``PrefixKey`` (its hashes list is kept by reference,
        not copied: callers must not mutate it). ``arrival_s``: UNIX seconds when
        the router received the request. ``matched_tokens`` / ``available_tokens``:
        the chosen worker's match and the best eligible one's (``radixfleet.route.decisions``;
        the second never below the first). ``prompt_tokens`` / ``output_tokens`` /
        ``cached_tokens``: the worker's usage, None when it reported none (the
        prompt then falls back to the router's estimate). ``ttft_s``: the last attempt's
        send to its first content token (streams). ``status``: the HTTP status the client got; ``broken``: the
        stream broke off after it. ``session``: the request's session id (sampling only; never
        written). O(1)."""
        if self.state is not LogState.RUNNING:
            if self.state is LogState.NEW:
                raise RuntimeError("TrafficLog.record() before start()")
            self._dropped_full += 1
            return False
        if self._threshold < 2**64:
            if session is not None:
                keep = xxhash.xxh3_64_intdigest(session.encode("utf-8", "surrogatepass")) < self._threshold
            else:
                keep = self._rng.random() < self._rate
            if not keep:
                self._sampled_out += 1
                return False
        q = self._q
        if len(q) >= self._cap:
            self._dropped_full += 1
            return False
        q.append(
            (
                arrival_s,
                key,
                worker,
                matched_tokens,
                available_tokens if available_tokens > matched_tokens else matched_tokens,
                prompt_tokens,
                output_tokens,
                cached_tokens,
                ttft_s,
                status,
                broken,
            )
        )
        return True

    def stats(self) -> TrafficLogStats:
        return TrafficLogStats(
            self._written,
            self._dropped_full,
            self._dropped_error,
            self._sampled_out,
            self._write_errors,
            0 if self._stopped_until is not None else 1,
            self._files_opened,
            self._files_deleted,
            self._bytes,
            len(self._q),
        )

    # ---------------------------------------------------------------- writer thread

    def _run(self) -> None:
        interval = self.cfg.flush_interval_s
        stop = self._stop
        try:
            while not stop.is_set():
                stop.wait(interval)
                self._drain()
            self._drain()
        finally:
            self._close_file()

    def _drain(self) -> None:
        q = self._q
        if not q:
            return
        until = self._stopped_until
        if until is not None and time.monotonic() < until:
            n = len(q)  # stopped: dropped unencoded (only this thread pops)
            for _ in range(n):
                q.popleft()
            self._dropped_error += n
            return
        lines: list[str] = []
        n = 0
        pop = q.popleft
        sleep = time.sleep
        rate_s = repr(float(self._rate))
        while q:
            try:
                rec = pop()
            except IndexError:  # pragma: no cover - only this thread pops
                break
            arrival_s, key, worker, matched, available, prompt, output, cached, ttft_s, status, broken = rec
            bt = key.block_bytes // BYTES_PER_TOKEN
            if bt != self._file_block_tokens and self._file is not None:
                self._flush(lines, n)  # a new block size starts a new file
                lines, n = [], 0
                self._close_file()
            self._file_block_tokens = bt
            routed = max(1, -(-len(key.data) // BYTES_PER_TOKEN))
            # formatted by hand: twice as fast as json.dumps of a dict (the 64-bit
            # hashes dominate); strings go through json (escaping), cached
            js = self._json
            line = _LINE % (
                repr(round(arrival_s * 1000.0, 3)),
                prompt if prompt else routed,
                output or 0,
                ",".join(map(str, key.hashes)),
                bt,
                routed,
                self._tenant(key.tenant),
                js(key.model),
                js(key.adapter),
                js(worker),
                available,
                matched,
                "null" if cached is None else int(cached),
                "null" if ttft_s is None else repr(round(ttft_s * 1000.0, 3)),
                status,
                "true" if broken else "false",
                rate_s,
            )
            lines.append(line)
            n += 1
            # give the GIL back: a request waiting for it waits for one record's
            # encoding, never for the interpreter's 5 ms switch interval
            sleep(_YIELD_S)
            if n >= 256:
                self._flush(lines, n)
                lines, n = [], 0
        self._flush(lines, n)

    def _json(self, v) -> str:
        """A JSON string (or null) for a model, adapter or worker name, cached."""
        out = self._strings.get(v)
        if out is None:
            out = json.dumps(v)
            if len(self._strings) >= _TENANT_CACHE:
                self._strings.clear()
            self._strings[v] = out
        return out

    def _tenant(self, tenant: str) -> str:
        if not tenant:
            return ""
        h = self._tenants.get(tenant)
        if h is None:
            h = hmac.new(self._key, tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:16]
            if len(self._tenants) >= _TENANT_CACHE:
                self._tenants.clear()
            self._tenants[tenant] = h
        return h

    def _flush(self, lines: list[str], n: int) -> None:
        if not lines:
            return
        data = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
        until = self._stopped_until
        if until is not None and time.monotonic() < until:
            self._dropped_error += n
            return
        try:
            f = self._file
            if f is None:
                f = self._open_file()
            f.write(data)
            f.flush()
        except OSError as exc:
            self._write_errors += 1
            self._dropped_error += n
            self._stop_writing(exc)
            return
        self._written += n
        self._bytes += len(data)
        self._file_bytes += len(data)
        if self._fresh:  # a file holding a batch: now it counts among the kept ones
            self._fresh = False
            self._prune()
        if until is not None:
            self._stopped_until = None
            log.info(
                "traffic log in %s writes again (%d records dropped while it was stopped)",
                self.cfg.dir,
                self._dropped_error - self._dropped_at_stop,
            )
        if self._file_bytes >= self.cfg.max_file_bytes:
            self._close_file()

    def _stop_writing(self, exc: OSError) -> None:
        """A write failed: the file keeps only its whole lines (a file that got none
        of them is deleted) and the log stops until ``retry_s`` from now."""
        f, path, good, fresh = self._file, self._path, self._file_bytes, self._fresh
        self._file, self._path, self._fresh = None, None, False
        if f is not None:
            try:
                f.close()  # its flush fails as the write did; the descriptor is closed
            except OSError:
                pass
        if path is not None:
            try:
                if fresh or not good:
                    os.unlink(path)
                else:
                    os.truncate(path, good)
            except OSError as exc2:
                self._log_error(exc2)
        retrying = self._stopped_until is not None
        self._stopped_until = time.monotonic() + self._retry_s
        if not retrying:
            self._dropped_at_stop = self._dropped_error
            log.error(
                "traffic log in %s stopped writing: %s; records are dropped (counted) and no "
                "kept file is rotated out; retrying every %gs",
                self.cfg.dir,
                exc,
                self._retry_s,
            )

    def _open_file(self) -> io.BufferedWriter:
        now = self._clock()
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        name = f"{self.cfg.prefix}-{stamp}-{os.getpid()}-{self._seq % 10000:04d}.jsonl"
        os.makedirs(self.cfg.dir, exist_ok=True)
        path = os.path.join(self.cfg.dir, name)
        self._file = f = self._opener(path)
        self._path = path
        self._file_bytes = 0
        self._fresh = True
        self._files_opened += 1
        return f

    def _prune(self) -> None:
        """Deletes the oldest files of this prefix beyond ``max_files`` (names sort
        by time; the open file, which holds a batch, is the newest)."""
        try:
            names = sorted(n for n in os.listdir(self.cfg.dir) if self._file_re.match(n))
        except OSError as exc:
            self._log_error(exc)
            return
        for n in names[: max(0, len(names) - self.cfg.max_files)]:
            try:
                os.unlink(os.path.join(self.cfg.dir, n))
                self._files_deleted += 1
            except OSError as exc:
                self._log_error(exc)

    def _close_file(self) -> None:
        f, self._file = self._file, None
        self._path = None
        self._fresh = False
        if f is not None:
            try:
                f.close()
            except OSError as exc:
                self._write_errors += 1
                self._log_error(exc)

    def _log_error(self, exc: OSError) -> None:
        cause = (exc.__class__.__name__, exc.errno)
        if cause not in self._errors_logged:
            self._errors_logged.add(cause)
            log.error(
                "traffic log in %s: %s; records are dropped (counted) until writing works again",
                self.cfg.dir,
                exc,
            )

    def check(self) -> None:
        """Asserts the invariants: the queue is within its bound; counters are
        non-negative; a closed log has no writer thread running and no open file."""
        assert len(self._q) <= self._cap, f"{len(self._q)=} > {self._cap=}"
        st = self.stats()
        for name in st.__slots__:
            assert getattr(st, name) >= 0, f"{name}={getattr(st, name)}"
        if self.state is LogState.CLOSED:
            assert self._thread is None or not self._thread.is_alive(), "writer still running"
            assert self._file is None, "file left open"


def _append(path: str) -> io.BufferedWriter:
    """The default opener: ``path`` for appending, kept open across writes (closed on
    rotation)."""
    return open(path, "ab")  # noqa: SIM115 - the log keeps it open; _close_file closes it


def log_files(paths: Sequence[str]) -> list[str]:
    """Expands directories among ``paths`` into their ``*.jsonl`` files (sorted, so a
    rotated log's files come in time order); files are kept as given."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out.extend(sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".jsonl")))
        else:
            out.append(p)
    return out
