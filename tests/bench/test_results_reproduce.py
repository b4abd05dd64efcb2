"""The seeded figures of bench/RESULTS.md reproduce (radixfleet_tools.bench.reproduce).

Every table between ``<!-- reproduce NAME -->`` markers is recomputed here, row by
row, from the command the file names, and must match character for character.
The suite runs each block's cheap rows (about 20 s of CPU in all); the rest —
every row of ``sim-rows`` past gsp_8w, the knee's other KV sizes,
``prefix-load-tuning`` and ``feedback-ablation`` (minutes) — are the CI job's:
``radixfleet bench reproduce --all``.
"""

from __future__ import annotations

import pytest

from radixfleet_tools.bench.reproduce import RESULTS, _key, blocks, check, read_blocks

BLOCKS = blocks()


def test_every_block_in_the_file_is_known_and_complete():
    in_file = read_blocks(RESULTS.read_text())
    assert set(in_file) == set(BLOCKS)
    for name, b in BLOCKS.items():
        lines = in_file[name]
        assert tuple(lines[:2]) == b.header, name
        assert [_key(line) for line in lines[2:]] == list(b.rows), name
        assert set(b.suite) <= set(b.rows), name


@pytest.mark.parametrize("name", [n for n, b in BLOCKS.items() if b.suite])
def test_seeded_figures_reproduce(name):
    problems = check([name], suite=True)
    assert not problems, "\n".join(problems) + (
        "\nA seeded figure in bench/RESULTS.md no longer reproduces: if the change is meant, "
        "re-measure with `radixfleet bench reproduce --write` and say why in the section."
    )


def test_a_changed_figure_is_reported(tmp_path):
    text = RESULTS.read_text()
    lines = read_blocks(text)["agent-cost"]
    row = lines[2]
    altered = row.replace(row.rstrip(" |").split("|")[-1].strip(), "999")
    path = tmp_path / "RESULTS.md"
    path.write_text(text.replace(row, altered))
    problems = check(["agent-cost"], suite=True, path=path)
    assert len(problems) == 1 and "999" in problems[0] and _key(row) in problems[0]
    path.write_text(text.replace("<!-- /reproduce -->", "", 1))
    with pytest.raises(ValueError, match="opens inside"):
        check(["agent-cost"], suite=True, path=path)
