"""The load generator's datasets (``--dataset random|sharegpt``): each bad value is
refused naming the flag that set it, in one line, with exit code 2."""

from __future__ import annotations

import pytest

from radixfleet.cli import main
from radixfleet.wire.errors import WorkloadError
from radixfleet_tools.loadtest.datasets import FLAGS, RandomParams, ShareGPTParams, make_dataset


def test_every_flag_names_a_parameter():
    assert set(FLAGS) == set(RandomParams.__pydantic_fields__) | set(ShareGPTParams.__pydantic_fields__)


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("random", {"requests": 0}, "--requests: expected an integer >= 1, got 0"),
        ("random", {"input_len": 0}, "--input-len: expected an integer >= 1, got 0"),
        ("random", {"output_len": -3}, "--output-len: expected an integer >= 1, got -3"),
        ("random", {"range_ratio": 1.0}, "--range-ratio: expected a number in [0, 1), got 1.0"),
        ("random", {"range_ratio": -0.1}, "--range-ratio: expected a number in [0, 1), got -0.1"),
        ("random", {"prefix_len": -1}, "--prefix-len: expected an integer >= 0, got -1"),
        ("random", {"api": "grpc"}, "--dataset-api: 'grpc' is not one of chat, completions"),
        ("sharegpt", {"path": "x", "output_len": -1}, "--output-len: expected an integer >= 0, got -1"),
        ("sharegpt", {"path": "x", "requests": -1}, "--requests: expected an integer >= 0, got -1"),
        ("sharegpt", {}, "--dataset sharegpt needs --dataset-path FILE"),
        ("sharegpt", {"path": "x", "api": "grpc"}, "--dataset-api: 'grpc' is not one of chat, completions"),
        (
            "random",
            {"input_len": 0, "prefix_len": -1},
            "2 errors: --input-len: expected an integer >= 1, got 0; "
            "--prefix-len: expected an integer >= 0, got -1",
        ),
    ],
)
def test_a_bad_dataset_value_names_its_flag(name, params, message):
    with pytest.raises(WorkloadError) as exc:
        make_dataset(name, params)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["loadtest", "--target", "a=http://127.0.0.1:9", "--dataset", "random", "--range-ratio", "1"],
            "radixfleet loadtest: error: --range-ratio: expected a number in [0, 1), got 1.0",
        ),
        (
            ["loadtest", "--target", "a=http://127.0.0.1:9", "--dataset", "random", "--prefix-len", "-2"],
            "radixfleet loadtest: error: --prefix-len: expected an integer >= 0, got -2",
        ),
        (  # 0 is a value, not "the default" (128)
            ["loadtest", "--target", "a=http://127.0.0.1:9", "--dataset", "random", "--output-len", "0"],
            "radixfleet loadtest: error: --output-len: expected an integer >= 1, got 0",
        ),
    ],
)
def test_on_the_command_line_a_bad_value_is_one_line_and_exit_2(capsys, argv, line):
    assert main(argv) == 2
    assert capsys.readouterr().err == line + "\n"
