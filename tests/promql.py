"""A small PromQL evaluator over two scrapes of Prometheus text pages, for checking
that the Grafana dashboard's queries return data without a Prometheus server.

Covers the subset the dashboard uses: selectors with label matchers (``=``, ``!=``,
``=~``, ``!~``) and range selectors, ``rate``/``increase`` (the difference between
the two scrapes; a series missing from the first counts from 0, as a new counter
does), ``histogram_quantile`` (Prometheus' linear interpolation within a bucket),
``vector``, the aggregations ``sum``/``max``/``min``/``avg``/``count``/``topk`` with
``by``/``without``, arithmetic (``+ - * /``), comparisons as filters, and the set
operators ``or``/``and``/``unless`` with ``on``/``ignoring``. Anything else raises
``PromQLError`` naming it, so a panel using more is noticed, not silently passed.

An instant vector is a list of ``(labels, value)``, labels a dict without
``__name__``; a scalar is a float.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


class PromQLError(ValueError):
    pass


Series = dict[tuple[str, frozenset], float]


def scrape(pages: dict[str, str]) -> Series:
    """Samples of several pages, each series labelled with its page's ``instance``
    (as Prometheus labels a target)."""
    out: Series = {}
    for instance, text in pages.items():
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = {**s.labels, "instance": instance}
                out[(s.name, frozenset(labels.items()))] = s.value
    return out


_TOKEN = re.compile(
    r"""\s*(?:(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?![\w:])
                     |(?P<str>"(?:[^"\\]|\\.)*")
                     |(?P<dur>\[[^\]]*\])
                     |(?P<op>=~|!~|==|!=|>=|<=|[-+*/(){},=<>])
                     |(?P<id>[A-Za-z_:][A-Za-z0-9_:]*))""",
    re.X,
)

_AGGS = {"sum", "max", "min", "avg", "count", "topk"}
_FUNCS = {"rate", "increase", "histogram_quantile", "vector"}
_CMP = {"==", "!=", ">", "<", ">=", "<="}


@dataclass
class _Range:
    rows: list  # (labels, first value or None, last value)


class Evaluator:
    """Evaluates expressions over ``before`` and ``after`` (``scrape`` results)
    taken ``dt`` seconds apart."""

    def __init__(self, before: Series, after: Series, dt: float) -> None:
        self.before, self.after, self.dt = before, after, dt

    def eval(self, expr: str):
        self.toks = []
        pos = 0
        expr = expr.strip()
        while pos < len(expr):
            m = _TOKEN.match(expr, pos)
            if m is None or m.end() == pos:
                raise PromQLError(f"cannot tokenize at {expr[pos : pos + 20]!r}")
            kind = m.lastgroup
            self.toks.append((kind, m.group(kind)))
            pos = m.end()
            while pos < len(expr) and expr[pos].isspace():
                pos += 1
        self.i = 0
        v = self._or()
        if self.i != len(self.toks):
            raise PromQLError(f"unexpected {self.toks[self.i][1]!r}")
        return v

    # ----------------------------------------------------------------- parser

    def _peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def _take(self, value=None):
        tok = self._peek()
        if value is not None and tok[1] != value:
            raise PromQLError(f"expected {value!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def _labels_list(self) -> list[str]:
        self._take("(")
        out = []
        while self._peek()[1] != ")":
            out.append(self._take()[1])
            if self._peek()[1] == ",":
                self._take(",")
        self._take(")")
        return out

    def _matching(self):
        kind = self._peek()[1]
        if kind in ("on", "ignoring"):
            self._take()
            return kind, self._labels_list()
        return None

    def _or(self):
        left = self._and()
        while self._peek()[1] == "or":
            self._take()
            match = self._matching()
            left = self._set("or", left, self._and(), match)
        return left

    def _and(self):
        left = self._cmp()
        while self._peek()[1] in ("and", "unless"):
            op = self._take()[1]
            match = self._matching()
            left = self._set(op, left, self._cmp(), match)
        return left

    def _cmp(self):
        left = self._add()
        while self._peek()[1] in _CMP:
            op = self._take()[1]
            if self._peek()[1] == "bool":
                raise PromQLError("bool modifier not supported")
            match = self._matching()
            left = self._binary(op, left, self._add(), match)
        return left

    def _add(self):
        left = self._mul()
        while self._peek()[1] in ("+", "-"):
            op = self._take()[1]
            match = self._matching()
            left = self._binary(op, left, self._mul(), match)
        return left

    def _mul(self):
        left = self._primary()
        while self._peek()[1] in ("*", "/"):
            op = self._take()[1]
            match = self._matching()
            left = self._binary(op, left, self._primary(), match)
        return left

    def _primary(self):
        kind, val = self._peek()
        if kind == "num":
            self._take()
            return float(val)
        if val == "(":
            self._take()
            v = self._or()
            self._take(")")
            return v
        if val == "-":
            self._take()
            return self._binary("*", -1.0, self._primary(), None)
        if kind != "id":
            raise PromQLError(f"unexpected {val!r}")
        if val in _AGGS:
            return self._aggregate()
        nxt = self.toks[self.i + 1][1] if self.i + 1 < len(self.toks) else None
        if val in _FUNCS and nxt == "(":
            return self._function()
        if nxt == "(":
            raise PromQLError(f"function {val} not supported")
        return self._selector()

    def _selector(self):
        name = self._take()[1]
        matchers = []
        if self._peek()[1] == "{":
            self._take("{")
            while self._peek()[1] != "}":
                label = self._take()[1]
                op = self._take()[1]
                value = self._take()[1][1:-1].encode().decode("unicode_escape")
                matchers.append((label, op, value))
                if self._peek()[1] == ",":
                    self._take(",")
            self._take("}")
        ranged = self._peek()[0] == "dur"
        if ranged:
            self._take()
        rows = []
        for (n, lb), v in self.after.items():
            if n != name or not all(_matches(dict(lb), m) for m in matchers):
                continue
            if ranged:
                rows.append((dict(lb), self.before.get((n, lb)), v))
            else:
                rows.append((dict(lb), v))
        return _Range(rows) if ranged else rows

    def _function(self):
        name = self._take()[1]
        self._take("(")
        args = [self._or()]
        while self._peek()[1] == ",":
            self._take(",")
            args.append(self._or())
        self._take(")")
        if name == "vector":
            return [({}, float(args[0]))]
        if name in ("rate", "increase"):
            r = args[0]
            if not isinstance(r, _Range):
                raise PromQLError(f"{name} needs a range selector")
            out = []
            for lb, first, last in r.rows:
                d = last - (first or 0.0)
                if d < 0:  # a counter reset
                    d = last
                out.append((lb, d / self.dt if name == "rate" else d))
            return out
        q, vec = args
        groups: dict[frozenset, list] = {}
        for lb, v in vec:
            key = frozenset((k, x) for k, x in lb.items() if k != "le")
            groups.setdefault(key, []).append((float(lb["le"]), v))
        return [(dict(k), _quantile(q, sorted(b))) for k, b in groups.items()]

    def _aggregate(self):
        op = self._take()[1]
        grouping = None
        if self._peek()[1] in ("by", "without"):
            grouping = (self._take()[1], self._labels_list())
        self._take("(")
        param = None
        if op == "topk":
            param = self._or()
            self._take(",")
        vec = self._or()
        self._take(")")
        if self._peek()[1] in ("by", "without"):
            grouping = (self._take()[1], self._labels_list())
        if op == "topk":
            return sorted(vec, key=lambda s: -s[1])[: int(param)]
        groups: dict[frozenset, list[float]] = {}
        for lb, v in vec:
            if grouping is None:
                key = frozenset()
            elif grouping[0] == "by":
                key = frozenset((k, x) for k, x in lb.items() if k in grouping[1])
            else:
                key = frozenset((k, x) for k, x in lb.items() if k not in grouping[1])
            groups.setdefault(key, []).append(v)
        fn = {"sum": sum, "max": max, "min": min, "count": len, "avg": lambda xs: sum(xs) / len(xs)}[op]
        return [(dict(k), float(fn(vs))) for k, vs in groups.items()]

    # ------------------------------------------------------------- operators

    def _binary(self, op, a, b, match):
        fn = {
            "+": lambda x, y: x + y,
            "-": lambda x, y: x - y,
            "*": lambda x, y: x * y,
            "/": _div,
            "==": lambda x, y: x == y,
            "!=": lambda x, y: x != y,
            ">": lambda x, y: x > y,
            "<": lambda x, y: x < y,
            ">=": lambda x, y: x >= y,
            "<=": lambda x, y: x <= y,
        }[op]
        cmp = op in _CMP
        if isinstance(a, float) and isinstance(b, float):
            return float(fn(a, b))
        if isinstance(b, float):
            return [(lb, v) if cmp else (lb, fn(v, b)) for lb, v in a if not cmp or fn(v, b)]
        if isinstance(a, float):
            return [(lb, v) if cmp else (lb, fn(a, v)) for lb, v in b if not cmp or fn(a, v)]
        right = {_key(lb, match): v for lb, v in b}
        out = []
        for lb, v in a:
            k = _key(lb, match)
            if k in right and (not cmp or fn(v, right[k])):
                out.append((lb if cmp else dict(k), v if cmp else fn(v, right[k])))
        return out

    def _set(self, op, a, b, match):
        keys = {_key(lb, match) for lb, _ in b}
        if op == "and":
            return [(lb, v) for lb, v in a if _key(lb, match) in keys]
        if op == "unless":
            return [(lb, v) for lb, v in a if _key(lb, match) not in keys]
        left = {_key(lb, match) for lb, _ in a}
        return a + [(lb, v) for lb, v in b if _key(lb, match) not in left]


def _key(labels: dict, match) -> frozenset:
    if match is None:
        return frozenset(labels.items())
    kind, names = match
    if kind == "on":
        return frozenset((k, v) for k, v in labels.items() if k in names)
    return frozenset((k, v) for k, v in labels.items() if k not in names)


def _div(x: float, y: float) -> float:
    if y == 0:
        return math.nan if x == 0 else math.copysign(math.inf, x)
    return x / y


def _matches(labels: dict, matcher) -> bool:
    label, op, value = matcher
    have = labels.get(label, "")
    if op == "=":
        return have == value
    if op == "!=":
        return have != value
    if op == "=~":
        return re.fullmatch(value, have) is not None
    if op == "!~":
        return re.fullmatch(value, have) is None
    raise PromQLError(f"matcher {op}")


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    if not buckets or buckets[-1][0] != math.inf:
        return math.nan
    total = buckets[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == math.inf:
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound
