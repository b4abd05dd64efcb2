"""Starting and stopping real processes on loopback for integration tests.

``Proc`` runs ``python -m radixfleet.cli ...`` (or any argv) in its own process group,
waits until an HTTP endpoint answers, and kills the group on exit, whatever
happened. Every wait is bounded. Its output goes to a temporary file, read back by
``output()`` and ``stop()``: a pipe nobody reads fills at 64 KiB and blocks the
child's next log line, stalling a router in the middle of a test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from radixfleet_tools.loadtest.local_fleet import free_port as free_port  # the one helper, tests and benches


def radixfleet_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "radixfleet.cli", *args]


class Proc:
    """A child process; ``with Proc(argv, ready_url=...) as p:`` waits for readiness."""

    def __init__(
        self,
        argv: list[str],
        *,
        ready_url: str | None = None,
        env: dict | None = None,
        timeout_s: float = 20.0,
    ) -> None:
        self.argv = argv
        self.ready_url = ready_url
        self.env = {**os.environ, **(env or {})}
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        # append mode: the child's writes land at the end whatever output() seeks
        self._out = tempfile.TemporaryFile(mode="a+b")

    def __enter__(self) -> Proc:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if self.ready_url:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        assert self.proc is not None and self.ready_url is not None, "wait_ready before start"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.output()
                raise RuntimeError(f"{self.argv} exited with {self.proc.returncode}:\n{out}")
            try:
                if httpx.get(self.ready_url, timeout=0.5).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.ready_url} not ready after {self.timeout_s}s")

    def output(self) -> str:
        """What the process wrote (stdout and stderr) so far."""
        try:
            self._out.seek(0)
            return self._out.read().decode(errors="replace")
        except ValueError:  # closed
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, for failure tests)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self, timeout_s: float = 10.0) -> str:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the captured output."""
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.kill()
        return self.output()

    def __exit__(self, *exc) -> None:
        self.stop()


def two_free_ports() -> int:
    """A port P with P + 1 free too (rank r of a data-parallel engine publishes on P + r)."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")
