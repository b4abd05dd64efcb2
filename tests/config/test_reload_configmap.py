"""Hot reload through a Kubernetes ConfigMap volume.

The kubelet (AtomicWriter) never rewrites a mounted file in place. The volume
holds a timestamped directory with the data, a ``..data`` symlink to it, and one
symlink per key into ``..data``::

    /etc/radixfleet/
        ..2026_12_03_10_00_00.000000001/router.yaml
        ..data -> ..2026_12_03_10_00_00.000000001
        router.yaml -> ..data/router.yaml

An update writes a new timestamped directory, points a temporary symlink at it,
renames that over ``..data`` (atomic) and deletes the old directory. The path the
router watches never changes; only what it resolves to does.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from radixfleet.config import load_config
from radixfleet.server.app import Router


class ConfigMapVolume:
    """The kubelet's AtomicWriter layout, in a temp dir."""

    def __init__(self, root, key: str = "router.yaml") -> None:
        self.root = root
        self.key = key
        self.n = 0
        self.current: str | None = None

    def write(self, text: str, *, mtime_ns: int | None = None) -> None:
        self.n += 1
        ts = f"..2026_12_03_10_00_{self.n:02d}.{123456789 + self.n}"
        d = self.root / ts
        d.mkdir()
        (d / self.key).write_text(text)
        if mtime_ns is not None:
            os.utime(d / self.key, ns=(mtime_ns, mtime_ns))
        tmp = self.root / "..data_tmp"
        os.symlink(ts, tmp)
        os.rename(tmp, self.root / "..data")  # the atomic swap
        if not (self.root / self.key).is_symlink():
            os.symlink(f"..data/{self.key}", self.root / self.key)
        if self.current is not None:
            for f in (self.root / self.current).iterdir():
                f.unlink()
            (self.root / self.current).rmdir()
        self.current = ts

    @property
    def path(self) -> str:
        return str(self.root / self.key)

    def data_file(self):
        return self.root / self.current / self.key


YAML = "listen: {{port: 0}}\npolicy: {{name: {policy}}}\nreload: {{poll_interval_s: 0.05}}\n"


async def wait_policy(router: Router, name: str, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while router.policy.name != name:
        if time.monotonic() > deadline:
            raise AssertionError(f"policy still {router.policy.name}, expected {name}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def volume_and_router(tmp_path):
    vol = ConfigMapVolume(tmp_path)
    vol.write(YAML.format(policy="round_robin"))
    router = Router(load_config(vol.path))
    # run the app's lifecycle (reload watcher included) without listening
    from aiohttp import web

    runner = web.AppRunner(router.app)
    await runner.setup()
    yield vol, router
    await runner.cleanup()


async def test_reload_follows_the_data_symlink_swap(volume_and_router):
    vol, router = volume_and_router
    assert router.policy.name == "round_robin"
    vol.write(YAML.format(policy="least_load"))
    await wait_policy(router, "least_load")
    vol.write(YAML.format(policy="prefix_load"))  # and again: the old dir is gone
    await wait_policy(router, "prefix_load")
    assert router.metrics.reloads._value.get() == 2


async def test_reload_follows_a_swap_to_a_file_with_the_same_mtime(volume_and_router):
    """A new file carrying the old file's mtime (a filesystem with coarse
    timestamps, two updates in one tick; a copy that preserves mtimes) is still a
    new file: the watcher compares file identity, not only the mtime."""
    vol, router = volume_and_router
    old = os.stat(vol.path).st_mtime_ns
    vol.write(YAML.format(policy="least_load"), mtime_ns=old)
    assert os.stat(vol.path).st_mtime_ns == old
    await wait_policy(router, "least_load")


async def test_an_invalid_update_keeps_the_running_config(volume_and_router):
    vol, router = volume_and_router
    vol.write("policy: {name: cache-aware}\n")
    deadline = time.monotonic() + 3
    while router.metrics.reload_failures.labels(reason="invalid")._value.get() < 1:
        assert time.monotonic() < deadline, "the invalid update was not noticed"
        await asyncio.sleep(0.02)
    assert router.policy.name == "round_robin"
    vol.write(YAML.format(policy="least_load"))  # the next good one applies
    await wait_policy(router, "least_load")
