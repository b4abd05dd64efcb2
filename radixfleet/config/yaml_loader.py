"""Reading a config file: PyYAML's safe loader bounded (aliases counted as what
they expand to, recursive documents refused), duplicate keys found with their
lines, the document validated (``load_config``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from radixfleet.config.document import Config, parse_config
from radixfleet.wire.errors import ConfigError
from radixfleet.wire.settings import join, typename

#: Most nodes a config document may stand for, every alias counted as the whole
#: node it names. A real config is a few thousand (4,096 workers of ~10 nodes each
#: is 41k); nine lines of nested aliases stand for 9**8 = 43 million, which froze a
#: reload for 10 s and check-config for minutes before this bound.
MAX_YAML_NODES = 200_000


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: while composing it counts the nodes the
    document stands for (an alias counts as the whole node it names, so a tree of
    nested aliases counts as what it expands to) and refuses the document past
    ``MAX_YAML_NODES``, or with an alias inside the node it names (a recursive
    document), naming the line. Composition itself never expands an alias, so the
    count costs one pass over the text. One class per module: no global state."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        #: id(node) -> nodes it stands for, for every node composed so far
        self._expanded: dict[int, int] = {}
        self._total = 0  # nodes of the document so far, aliases expanded

    def compose_node(self, parent, index):
        event = self.peek_event()
        alias = isinstance(event, yaml.AliasEvent)
        if alias:
            named = self.anchors.get(event.anchor)
            if named is not None and id(named) not in self._expanded:
                raise _Refused(
                    event.start_mark,
                    f"alias *{event.anchor} is used inside the node it names (a recursive document)",
                )
        node = super().compose_node(parent, index)
        if alias:
            self._total += self._expanded[id(node)]
        else:  # every child went through here first
            self._expanded[id(node)] = 1 + sum(self._expanded[id(c)] for c in _children(node))
            self._total += 1
        if self._total > MAX_YAML_NODES:
            raise _Refused(
                event.start_mark,
                f"the document stands for more than "
                f"{MAX_YAML_NODES:,} nodes once its aliases are expanded "
                "(nested aliases multiply: an alias bomb?)",
            )
        return node


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    return []


class _Refused(yaml.YAMLError):
    """The bounded loader refuses the document (``_Loader``)."""

    def __init__(self, mark, problem: str) -> None:
        super().__init__(problem)
        self.problem_mark = mark
        self.problem = problem


def _duplicate_keys(node: Any, path: str, out: list[ConfigError]) -> None:
    """Records every key that appears twice in one mapping of the composed YAML
    (PyYAML would keep the last silently), with its dotted path and lines."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            p = join(path, str(key))
            if key is not None:
                if key in seen:
                    out.append(
                        ConfigError(
                            p,
                            f"duplicate key at line {k.start_mark.line + 1} "
                            f"(also at line {seen[key]}); remove one",
                        )
                    )
                else:
                    seen[key] = k.start_mark.line + 1
            _duplicate_keys(v, p, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _duplicate_keys(v, f"{path}[{i}]", out)


def load_yaml(text: bytes | str, path: str) -> tuple[Any, list[ConfigError]]:
    """The document in ``text`` (None when empty) and its duplicate keys, composed
    once by the bounded loader (``_Loader``). Raises ``ConfigError`` naming the line
    for invalid YAML or a document past ``MAX_YAML_NODES``."""
    dups: list[ConfigError] = []
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, dups
        _duplicate_keys(node, "", dups)
        return loader.construct_document(node), dups
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        kind = "YAML refused" if isinstance(exc, _Refused) else "invalid YAML"
        raise ConfigError("", f"{path}: {kind}{where}: {problem}") from None
    finally:
        loader.dispose()


def read_document(path: str) -> tuple[Mapping | None, list[ConfigError]]:
    """The YAML document of file ``path`` (None when it holds none: empty, blank,
    comments only, ``null``) and its duplicate keys (``load_yaml``). Raises
    ``ConfigError`` for a file that cannot be read, invalid YAML, or a document that
    is not a mapping."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError("", f"cannot read {path}: {exc.strerror or exc}") from None
    raw, dups = load_yaml(text, path)
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError("", f"{path}: expected a mapping at the top level, got {typename(raw)}")
    return raw, dups


def load_config(path: str) -> Config:
    """Reads and validates a YAML file (an empty one: every default). Raises
    ``ConfigError``."""
    raw, dups = read_document(path)
    return parse_config(raw, path, errors=dups)
