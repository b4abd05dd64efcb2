"""The router's YAML loader is bounded: a document whose aliases expand past
``MAX_YAML_NODES`` (nine lines of nested aliases stand for 9**8 nodes) or that
names itself through an alias is refused while it is composed, with its line, by
check-config (exit 2 at once), at start and at reload (the running config stays,
and the event loop keeps serving while a reload is prepared: it runs off the loop).
Duplicate keys and every other error are still reported together."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from radixfleet.config import MAX_YAML_NODES, load_config
from radixfleet.server.app import Router
from radixfleet.wire.errors import ConfigError
from radixfleet_tools.harness.procs import radixfleet_argv
from tests.config.yaml_bombs import alias_bomb


@pytest.mark.integration
def test_check_config_refuses_an_alias_bomb_at_once_with_its_line(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(alias_bomb(9))
    assert len(p.read_bytes()) < 700
    t0 = time.monotonic()
    r = subprocess.run(radixfleet_argv("check-config", str(p)), capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    # a5 names 9**6 = 531,441 nodes: its aliases cross the bound
    assert r.stderr == (
        f"radixfleet check-config: error: {p}: YAML refused at line 6, "
        f"column 15: the document stands for more than {MAX_YAML_NODES:,} "
        "nodes once its aliases are expanded (nested aliases multiply: an "
        "alias bomb?)\n"
    )
    assert took < 15, took  # a Python start-up; the bomb itself took minutes before


@pytest.mark.parametrize(
    "text, line",
    [
        ("a: &x [1, *x]\n", 1),  # a list holding itself
        ("workers:\n  - &w {url: 'http://h:1', id: *w}\n", 2),
    ],
)
def test_a_recursive_document_is_refused_with_its_line(tmp_path, text, line):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(str(p))
    assert f"YAML refused at line {line}" in str(ei.value)
    assert "is used inside the node it names" in str(ei.value)


def test_aliases_a_real_config_uses_still_load(tmp_path):
    """Aliases that share settings stay legal, a fleet of 4,096 listed workers loads,
    and every error is still reported at once with its path."""
    p = tmp_path / "ok.yaml"
    p.write_text(
        "health: {interval_s: 0.5, timeout_s: 0.25}\n"
        "workers:\n"
        "  - {url: 'http://10.0.0.1:8000', metrics: &m {interval_s: 2.0}}\n"
        "  - {url: 'http://10.0.0.2:8000', metrics: *m}\n"
    )
    cfg = load_config(str(p))
    assert [w.metrics.interval_s for w in cfg.workers] == [2.0, 2.0]
    big = tmp_path / "big.yaml"
    big.write_text(
        "workers:\n"
        + "".join(
            f"  - {{url: 'http://10.0.{i >> 8}.{i & 255}:8000', kind: openai, weight: 1.5}}\n"
            for i in range(4096)
        )
    )
    assert len(load_config(str(big)).workers) == 4096
    dup = tmp_path / "dup.yaml"
    dup.write_text("limits: {max_queue: 1, max_queue: 2}\nhealth: {interval_s: -1}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(str(dup))
    assert [e.path for e in ei.value.errors] == ["limits.max_queue", "health.interval_s"]
    assert "duplicate key at line 1 (also at line 1)" in str(ei.value)


async def test_a_reload_with_an_alias_bomb_keeps_the_config_and_the_loop_responsive(tmp_path):
    p = tmp_path / "router.yaml"
    p.write_text("policy: {name: round_robin}\nreload: {watch: false}\n")
    router = Router(load_config(str(p)))
    before = router.cfg
    p.write_text(alias_bomb(8))
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    t0 = time.monotonic()
    ok, msg, added, removed = await asyncio.wait_for(router.reload(), 30)
    took = time.monotonic() - t0
    stop.set()
    await tick
    assert not ok and (added, removed) == ([], [])
    assert "YAML refused at line 6" in msg and "alias bomb" in msg, msg
    assert router.cfg is before
    assert took < 5, took  # before the bound: 10.65 s with the loop frozen throughout
    assert max(gaps, default=0) < 1.0, max(gaps)
