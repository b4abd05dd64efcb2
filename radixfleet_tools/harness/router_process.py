"""A router in its own process for the chaos probes, and its resources read from /proc.

``RouterProcess(config_yaml | argv)`` starts ``python -m radixfleet.cli router`` on a free
loopback port in its own process group, waits (bounded) for ``/health``, and kills the
group on exit. ``resources()`` reads the process's resident memory and open descriptors,
so a probe can assert "bounded while it ran, back near baseline after":

    with RouterProcess(argv=["--worker", url]) as r:
        base = r.resources()
        ... probe ...
        r.assert_settles(base, rss_slack=64 << 20, fd_slack=16)
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from radixfleet_tools.harness.procs import free_port, radixfleet_argv


@dataclass(frozen=True)
class Resources:
    rss_bytes: int
    open_fds: int


def resources_of(pid: int) -> Resources:
    """Resident set size and open file descriptors of a live process (Linux /proc)."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Resources(rss, fds)


class RouterProcess:
    """``radixfleet router`` in a child process on 127.0.0.1:``port``.

    Give either ``config`` (YAML text; write ``{port}`` where the listen port goes) or
    ``argv`` (router flags; ``--port`` is added). Its admin listener (``--admin-port``
    added: a free port) is at ``admin``. Its output goes to a file (a pipe
    nobody reads would fill and stall a router that logs a probe): ``output()``.
    ``launcher``: a command the router's command line is appended to, which must
    exec it (``unshare ... sh -c '...; exec "$@"'``), so ``pid`` is the router's."""

    def __init__(
        self,
        config: str | None = None,
        argv: list[str] | None = None,
        *,
        env: dict | None = None,
        timeout_s: float = 30.0,
        launcher: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin_port = free_port()
        self.admin = f"http://127.0.0.1:{self.admin_port}"  # /admin/*, /metrics
        self._dir = tempfile.TemporaryDirectory(prefix="radixfleet-chaos-")
        self.log_path = Path(self._dir.name) / "router.log"
        args = ["router", "--log-level", "INFO"]
        if config is not None:
            path = Path(self._dir.name) / "router.yaml"
            path.write_text(config.replace("{port}", str(self.port)))
            args += ["--config", str(path)]
        args += list(argv or []) + ["--port", str(self.port), "--admin-port", str(self.admin_port)]
        self.argv = [*(launcher or []), *radixfleet_argv(*args)]
        self.env = {**os.environ, **(env or {})}
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self._final: str | None = None  # the whole output, once stopped and cleaned up

    def __enter__(self) -> RouterProcess:
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=0.5).status_code < 500:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"router not healthy after {self.timeout_s}s:\n{self.output()}")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self._final = self.stop()  # kept: probes read the log after the with-block too
        self._dir.cleanup()

    def stop(self, timeout_s: float = 10.0) -> str:
        """SIGTERM the group, SIGKILL after ``timeout_s``; returns the output."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)
        return self.output()

    def output(self) -> str:
        if self._final is not None:
            return self._final
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None, "use `with RouterProcess(...)` before reading pid"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def resources(self) -> Resources:
        return resources_of(self.pid)

    def assert_settles(
        self, baseline: Resources, *, rss_slack: int = 64 << 20, fd_slack: int = 16, within_s: float = 10.0
    ) -> Resources:
        """Wait (bounded) until RSS and open FDs are back within the slack of
        ``baseline``; assert if they are not by ``within_s``."""
        deadline = time.monotonic() + within_s
        while True:
            now = self.resources()
            ok = (
                now.rss_bytes <= baseline.rss_bytes + rss_slack
                and now.open_fds <= baseline.open_fds + fd_slack
            )
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert self.alive(), "the router process died during the probe"
        assert now.rss_bytes <= baseline.rss_bytes + rss_slack, (
            f"RSS {now.rss_bytes >> 20} MiB, baseline {baseline.rss_bytes >> 20} MiB "
            f"+ slack {rss_slack >> 20} MiB"
        )
        assert now.open_fds <= baseline.open_fds + fd_slack, (
            f"{now.open_fds} open fds, baseline {baseline.open_fds} + slack {fd_slack}"
        )
        return now

    def assert_no_tracebacks(self) -> None:
        out = self.output()
        assert "Traceback" not in out, f"traceback in the router's log:\n{out[-4000:]}"
