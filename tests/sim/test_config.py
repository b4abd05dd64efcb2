"""The simulator's settings (``SimConfig``, ``EngineSpec``): each bad value is refused
naming the flag that set it, in one line (``radixfleet.wire.settings.from_flags``), and the
rules across fields and presets that ``validate()`` keeps."""

from __future__ import annotations

import pytest

from radixfleet.cli import main
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import from_flags
from radixfleet_tools.loadtest.simulator.engine import FLAGS as ENGINE_FLAGS
from radixfleet_tools.loadtest.simulator.engine import EngineSpec
from radixfleet_tools.loadtest.simulator.simulation import FLAGS, SimConfig


def _sim_error(values: dict, shown: dict | None = None) -> str:
    with pytest.raises(ConfigError) as exc:
        from_flags(SimConfig, values, FLAGS, shown)
    return str(exc.value)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"workers": 0}, "--agents: expected an integer >= 1, got 0"),
        ({"workers": 2.0}, "--agents: expected an integer >= 1, got 2.0"),
        ({"workers": True}, "--agents: expected an integer >= 1, got True"),
        ({"block_bytes": 0}, "--block-bytes: expected an integer >= 1, got 0"),
        ({"feedback": "sometimes"}, "--feedback: 'sometimes' is not one of none, events, plain"),
        ({"level": "page"}, "--level: 'page' is not one of auto, text, block"),
        ({"timeout_s": 0.0}, "--timeout: expected a number > 0, got 0.0"),
        ({"timeout_s": -1}, "--timeout: expected a number > 0, got -1"),
        ({"index_max_bytes": 0}, "index_max_bytes: expected an integer >= 1, got 0"),
        ({"engine": {"kv_tokens": 0}}, "--kv-tokens: expected an integer >= 1, got 0"),
        ({"engine": {"kv_tokens": "x"}}, "--kv-tokens: expected an integer >= 1, got 'x'"),
        ({"engine": {"tp": 0}}, "--tp: expected an integer >= 1, got 0"),
        ({"engine": {"chunk_tokens": -1}}, "--chunk-tokens: expected an integer >= 1, got -1"),
        ({"engine": {"max_running": 0}}, "--max-running: expected an integer >= 1, got 0"),
        ({"engine": {"dram_admit_hits": 0}}, "--dram-admit-hits: expected an integer >= 1, got 0"),
        ({"engine": {"dram_tokens": -1}}, "--dram-tokens: expected an integer >= 0, got -1"),
        ({"engine": {"dram_ratio": 0.0}}, "--dram-tokens: expected a number > 0, got 0.0"),
        (
            {"engine": {"protected_fraction": 1.5}},
            "engine.protected_fraction: expected a number in (0, 1], got 1.5",
        ),
        ({"engine": {"min_prefix_tokens": -1}}, "engine.min_prefix_tokens: expected an integer >= 0, got -1"),
    ],
)
def test_a_bad_simulator_value_names_its_flag(values, message):
    assert _sim_error(values) == message


def test_millisecond_flags_quote_the_value_as_given_and_errors_come_together():
    values = {"feedback_delay_s": -0.005, "path_latency_s": -0.001, "feedback_batch_s": -0.1}
    shown = {"feedback_delay_s": -5.0, "path_latency_s": -1.0, "feedback_batch_s": -100.0}
    assert _sim_error(values, shown) == (
        "3 errors: --feedback-delay-ms: expected a number >= 0, got -5.0; "
        "--path-latency-ms: expected a number >= 0, got -1.0; "
        "--feedback-batch-ms: expected a number >= 0, got -100.0"
    )


def test_unset_optional_values_and_the_defaults_are_valid():
    cfg = from_flags(SimConfig, {"timeout_s": None, "engine": {"kv_tokens": None}}, FLAGS)
    assert cfg == SimConfig() and cfg.engine.kv_tokens is None
    cfg.validate()
    assert (
        from_flags(SimConfig, {"timeout_s": 5, "engine": EngineSpec(kv_tokens=100)}, FLAGS).timeout_s == 5.0
    )


@pytest.mark.parametrize(
    "cfg, message",
    [
        (SimConfig(block_bytes=6), "--block-bytes: block_bytes must be a positive multiple of 4, got 6"),
        (
            SimConfig(report_every_tick=True, feedback_batch_s=0.0),
            "report_every_tick: needs feedback_batch_s > 0",
        ),
        (SimConfig(engine=EngineSpec(gpu="tpu9")), "--gpu: unknown preset 'tpu9'"),
        (SimConfig(engine=EngineSpec(model="gpt-9")), "--agent-model: unknown preset 'gpt-9'"),
        (SimConfig(engine=EngineSpec(order="lifo")), "--order: 'lifo' is not one of fcfs, lpm"),
        (SimConfig(engine=EngineSpec(admission="never")), "--admission: 'never' is not one of always"),
        (
            SimConfig(engine=EngineSpec(kv_tokens=1000, dram_tokens=10)),
            "--dram-tokens: DRAM capacity must be an integer >= 256 tokens, got 10",
        ),
    ],
)
def test_validate_keeps_the_rules_across_fields_and_presets(cfg, message):
    with pytest.raises(ConfigError) as exc:
        cfg.validate()
    assert str(exc.value).startswith(message), str(exc.value)


def test_every_flag_names_a_field():
    engine = set(EngineSpec.__pydantic_fields__)
    assert set(ENGINE_FLAGS) <= engine
    assert {k.removeprefix("engine.") for k in FLAGS if k.startswith("engine.")} == set(ENGINE_FLAGS)
    assert {k for k in FLAGS if not k.startswith("engine.")} <= set(SimConfig.__pydantic_fields__)


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["simulate", "--workload", "gsp", "--kv-tokens", "0"],
            "radixfleet simulate: error: --kv-tokens: expected an integer >= 1, got 0",
        ),
        (
            ["simulate", "--workload", "gsp", "--feedback-delay-ms", "-5"],
            "radixfleet simulate: error: --feedback-delay-ms: expected a number >= 0, got -5.0",
        ),
    ],
)
def test_on_the_command_line_a_bad_value_is_one_line_and_exit_2(capsys, argv, line):
    assert main(argv) == 2
    assert capsys.readouterr().err == line + "\n"
