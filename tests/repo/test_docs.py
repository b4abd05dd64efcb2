"""The repository explains itself: what the code cites exists in the repository.

- Every "contract N" the code, tests and docs cite is defined in docs/DESIGN.md (a
  ``### N. title`` heading), and the design is cited at that path, never at a file
  outside the repository.
- ARCHITECTURE.md names only modules that exist, and every module of every package
  has its row in its "Where things live" table.
- Code, tests and benchmarks describe behaviour, not the work log that produced them:
  no "Stop N", "issue N" or "probe N" (those belong in git history and RESULTS.md).

Files are read from the working tree, no process is started.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
#: the project's Python packages (each has an __init__.py and a row per module)
PACKAGES = ("radixfleet", "radixfleet_tools")
SKIP_DIRS = {".git", ".cache", "__pycache__", ".pytest_cache", "node_modules"}


def _files(*suffixes: str) -> list[Path]:
    """The tree's files with these suffixes, hidden and cache folders pruned."""
    out = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        out += [Path(folder) / n for n in names if os.path.splitext(n)[1] in suffixes]
    return sorted(out)


def _defined_contracts() -> dict[int, str]:
    found = re.findall(r"^### (\d+)\. (.+)$", DESIGN.read_text(), flags=re.M)
    return {int(n): title for n, title in found}


def test_contracts_are_numbered_in_order():
    numbers = list(_defined_contracts())
    assert numbers == list(range(1, len(numbers) + 1)), numbers


def test_every_cited_contract_is_defined_in_docs_design():
    defined = _defined_contracts()
    cited: dict[int, list[str]] = {}
    for path in _files(".py", ".md", ".json", ".yaml", ".yml"):
        if path == DESIGN:
            continue
        for m in re.finditer(r"\bcontracts? (\d+)\b", path.read_text(errors="replace")):
            cited.setdefault(int(m.group(1)), []).append(str(path.relative_to(ROOT)))
    assert cited, "no contract is cited anywhere: the pattern is wrong"
    missing = {n: sorted(set(where)) for n, where in cited.items() if n not in defined}
    assert not missing, f"contracts cited but not defined in docs/DESIGN.md: {missing}"


def test_the_design_is_cited_where_it_is():
    wrong = []
    for path in _files(".py", ".md", ".json", ".yaml", ".yml", ".toml"):
        if path in (DESIGN, Path(__file__).resolve()):
            continue
        text = path.read_text(errors="replace")
        for m in re.finditer(r"(?<!docs/)\bDESIGN\.md", text):
            lineno = text.count("\n", 0, m.start()) + 1
            wrong.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not wrong, "cite the design as docs/DESIGN.md:\n" + "\n".join(wrong)


# -- ARCHITECTURE.md ---------------------------------------------------------------------


def _package_modules() -> set[str]:
    mods = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "__pycache__" not in path.parts and path.name != "__init__.py":
                mods.add(str(path.relative_to(ROOT)))
    return mods


def _table_rows() -> list[tuple[str, str]]:
    """(first cell, rest) of every row of ARCHITECTURE.md's tables."""
    rows = []
    for line in ARCHITECTURE.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| module") and "---" not in line:
            first, _, rest = line[2:].partition(" | ")
            rows.append((first, rest))
    return rows


def _named_in_first_cells() -> set[str]:
    """Every path a row's first cell names. A bare ``name.py`` is in the folder of the
    path before it in the same cell (``radixfleet/engines/link.py``, ``manager.py``)."""
    named = set()
    for first, _ in _table_rows():
        folder = ""
        for token in re.findall(r"`([^`]+)`", first):
            if "/" in token:
                folder = token if token.endswith("/") else token.rsplit("/", 1)[0] + "/"
                named.add(token)
            elif token.endswith(".py"):
                named.add(folder + token)
    return named


def test_every_module_architecture_names_exists():
    text = ARCHITECTURE.read_text()
    named = _named_in_first_cells()
    named |= {
        t
        for t in re.findall(r"`([\w./-]+)`", text)
        if "/" in t and not t.startswith(("/", "http")) and re.search(r"\.py$|/$", t)
    }
    missing = sorted(n for n in named if not (ROOT / n.rstrip("/")).exists())
    assert not missing, f"ARCHITECTURE.md names modules that do not exist: {missing}"


def test_every_module_of_every_package_has_its_row():
    named = _named_in_first_cells()
    unmapped = sorted(m for m in _package_modules() if m not in named)
    assert not unmapped, (
        f"modules without a row in ARCHITECTURE.md's tables (name them in a row's first cell): {unmapped}"
    )


def test_every_package_opens_with_a_module_map():
    """Each package's __init__ docstring names every module of the package."""
    lacking = {}
    inits = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")]
    for init in sorted(inits):
        rel = init.relative_to(ROOT)
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = sorted(p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py")
        names += sorted(p.name for p in init.parent.iterdir() if p.is_dir() and (p / "__init__.py").exists())
        absent = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", doc)]
        if absent:
            lacking[str(rel)] = absent
    assert not lacking, f"package docstrings missing modules in their map: {lacking}"


# -- no work log in the code -------------------------------------------------------------

#: "Stop 17", "issue 12", "Issue 13's", "probe 7", "item 5" of a work log, matched in
#: lower-cased text (``work_log``: not preceded by a letter)
WORK_LOG = re.compile(r"(?:stop|issue|probe|item)s?[ _#-]?\d+(?!\d)|(?:this|the) issue\b")


def work_log(text: str) -> list[tuple[int, str]]:
    """(offset, words) of every work-log reference in ``text``."""
    low = text.lower()
    return [(m.start(), m[0]) for m in WORK_LOG.finditer(low) if not low[m.start() - 1 : m.start()].isalpha()]


def test_code_and_tests_carry_no_work_log_references():
    found = []
    for path in _files(".py", ".sh"):
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        for offset, words in work_log(text):
            lineno = text.count("\n", 0, offset) + 1
            found.append(f"{path.relative_to(ROOT)}:{lineno}: {words!r}")
    assert not found, (
        "describe the behaviour instead of the issue or stop that brought it "
        "(history lives in git and bench/RESULTS.md):\n" + "\n".join(found)
    )


def test_the_work_log_pattern_catches_what_it_must():
    for text in (
        'bench/RESULTS.md, "Stop 20"',
        "Target (issue 15)",
        "Issue 13's findings",
        "def test_probe_7_holds",
        "the issue's targets",
    ):
        assert work_log(text), text
    for text in (
        "the loop does not stop",
        "probe(worker)",
        "a stop token",
        "items = 3",
        "a backstop 2 s later",
    ):
        assert not work_log(text), text


# -- bench/RESULTS.md --------------------------------------------------------------------

RESULTS = ROOT / "bench" / "RESULTS.md"


def test_every_cited_results_section_exists():
    """``bench/RESULTS.md, "Section"`` and ``bench/RESULTS.md ("A", "B")`` name headings."""
    headings = re.findall(r"^#{2,3} (.+)$", RESULTS.read_text(), flags=re.M)
    cited = []
    for path in _files(".py", ".md"):
        if path in (RESULTS, Path(__file__).resolve()):
            continue
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(errors="replace"))
        for m in re.finditer(r'RESULTS\.md`?(?:, | \()((?:"[^"]+"(?:, )?)+)', text):
            cited += [(path.relative_to(ROOT), name) for name in re.findall(r'"([^"]+)"', m[1])]
    assert cited, "no section citation found: the pattern is wrong"
    missing = [f"{where}: {name!r}" for where, name in cited if not any(h.startswith(name) for h in headings)]
    assert not missing, "cited sections missing from bench/RESULTS.md:\n" + "\n".join(missing)


def test_results_hold_no_stop_by_stop_sections():
    text = RESULTS.read_text()
    assert not re.search(r"^#+ .*\b(?:stop|issue|item) \d+", text, flags=re.I | re.M)
    assert not re.search(r"\b(?:stop|issue) \d+", text, flags=re.I)


def test_every_contract_names_modules_that_exist():
    """Each numbered contract of docs/DESIGN.md says where the code that keeps it
    lives, and every module it names exists: a contract that describes moved code
    fails here."""
    text = DESIGN.read_text()
    sections = re.split(r"^### (\d+)\. ", text, flags=re.M)
    missing, bare = [], []
    for number, body in zip(sections[1::2], sections[2::2]):
        body = body.split("\n## ", 1)[0]
        named = {t for t in re.findall(r"`([\w./-]+\.py)", body) if "/" in t}
        if not named:
            bare.append(number)
        missing += [f"contract {number}: {n}" for n in sorted(named) if not (ROOT / n).exists()]
    assert not bare, f"contracts that name no module: {bare}"
    assert not missing, "contracts naming modules that do not exist:\n" + "\n".join(missing)
