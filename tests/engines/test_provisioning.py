"""The engine tests' provisioning fails loudly and cheaply when it cannot install."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from radixfleet_tools.harness import vllm_env

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXFLEET_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(vllm_env, "_install_error", None)
    return tmp_path


def test_a_full_disk_is_said_before_any_download_and_not_retried(empty_cache, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * 2**30, 10 * 2**30 - 2**28, 2**28))
    ran = []
    monkeypatch.setattr(vllm_env, "_run", lambda argv, t, what: ran.append(what))
    with pytest.raises(vllm_env.EngineUnavailable, match=r"needs 5 GiB free at .*0\.2 GiB"):
        vllm_env.vllm_python()
    with pytest.raises(vllm_env.EngineUnavailable, match="needs 5 GiB free"):
        vllm_env.vllm_python()
    assert ran == []  # nothing was started, twice
    assert not (empty_cache / f"vllm-{vllm_env.VLLM_VERSION}").exists()


@pytest.mark.integration
def test_a_failed_install_removes_its_venv_and_shows_pips_error(empty_cache, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(2**40, 0, 2**40))
    venv = empty_cache / f"vllm-{vllm_env.VLLM_VERSION}"
    calls = []
    real_run = vllm_env._run

    def fake_run(argv, timeout_s, what):
        calls.append(what)
        if what.startswith("creating"):
            (venv / "bin").mkdir(parents=True)
            (venv / "lib" / "big").mkdir(parents=True)
            return
        # the real _run's formatting, on pip's real output shape
        real_run(
            [
                "sh",
                "-c",
                "echo \"WARNING: Location 'file:///x/' is ignored\"; "
                "echo 'ERROR: Could not install packages due to an OSError: "
                "[Errno 28] No space left on device'; exit 1",
            ],
            10,
            what,
        )

    monkeypatch.setattr(vllm_env, "_run", fake_run)
    with pytest.raises(vllm_env.EngineUnavailable) as err:
        vllm_env.vllm_python()
    msg = str(err.value)
    assert "No space left on device" in msg and "WARNING: Location" not in msg
    assert msg.startswith(f"pip install {vllm_env.PACKAGE} failed (exit 1)")
    assert not venv.exists()  # the disk came back
    with pytest.raises(vllm_env.EngineUnavailable):
        vllm_env.vllm_python()
    assert calls == ["creating the vLLM venv", f"pip install {vllm_env.PACKAGE}"]
