"""``tracing`` is read at start (radixfleet/server/app.py): a reload that changes it keeps the
running tracing, says so in the log, and applies the rest of the file."""

from __future__ import annotations

import logging

from radixfleet.config import load_config
from radixfleet.server.app import Router


async def test_a_reload_that_changes_tracing_keeps_it_and_applies_the_rest(tmp_path, caplog):
    path = tmp_path / "router.yaml"
    path.write_text("workers: [http://127.0.0.1:9001]\npolicy: {name: round_robin}\n")
    router = Router(load_config(str(path)))
    path.write_text(
        "workers: [http://127.0.0.1:9001]\npolicy: {name: least_load}\n"
        "tracing: {enabled: true, sample_ratio: 1.0}\n"
    )
    with caplog.at_level(logging.WARNING):
        ok, _, _, _ = await router.reload()
    assert ok
    assert router.cfg.policy.name == "least_load"  # the rest applied
    assert not router.cfg.tracing.enabled and router.cfg.tracing.sample_ratio == 0.01
    assert any("tracing changes need a restart" in r.getMessage() for r in caplog.records)
    assert router.dataplane.tracing is None
