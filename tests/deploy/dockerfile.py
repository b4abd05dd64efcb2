"""The Dockerfile read as instructions and stages, for the image and manifest tests."""

from __future__ import annotations

import json

from tests.deploy_tools import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if buf and s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(ins: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for i in ins:
        if i[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(i)
    return out


def exec_form(args: str) -> list[str]:
    argv = json.loads(args)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), args
    return argv
