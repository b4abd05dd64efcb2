"""The tier check itself: an unmarked test that listens on a port fails, naming it;
the same test marked ``integration`` passes (tests/tiers.py). It runs pytest in a
child process, so it is an integration test itself."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[2]

BODY = """
import socket
{mark}
def test_serves():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
"""


@pytest.mark.parametrize("mark, passes", [("", False), ("import pytest\n@pytest.mark.integration", True)])
def test_an_unmarked_server_fails_and_a_marked_one_passes(tmp_path, mark, passes):
    (tmp_path / "test_probe.py").write_text(BODY.format(mark=mark))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.tiers",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert (p.returncode == 0) is passes, p.stdout + p.stderr
    if not passes:
        assert "listens on ('127.0.0.1'," in p.stdout and "is not marked" in p.stdout, p.stdout
