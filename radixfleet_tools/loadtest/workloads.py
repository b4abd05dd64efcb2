"""Workloads: deterministic request streams whose prefixes repeat the way real traffic's do.

A workload is a list of *sessions*; a session is a sequence of turns, each turn a
``RequestSpec``. Single-shot workloads (gsp, zipf, rag, trace) are sessions of one
turn. A multi-turn session hands out its next turn only after the previous one's
answer is known, because the next prompt contains that answer::

    session = workload.sessions()[i]
    spec = session.first()            # turn 0
    spec = session.follow(answer)     # turn 1: history + answer + a new question
    ...                               # None: the session is over

Everything is a pure function of ``(params, seed)``: the same seed yields the same
sessions, the same texts and the same arrival offsets, so A/B runs and the offline
simulator see identical traffic (answers aside, which the fleet writes).

Text of ``n`` tokens is ``n * BYTES_PER_TOKEN`` ASCII bytes (the byte-chunk tokenizer
of ``radixfleet.keys``), derived from a *text key*: equal keys give equal text,
different keys give unrelated text (a shared prefix longer than a token or two is
astronomically unlikely). Prefix sharing is therefore exactly what each workload
says it is — shared system prompts, shared trace hash ids, growing histories.

Registry: ``WORKLOADS[name]`` is the class. Each class's ``Params`` is a settings
class (``radixfleet.wire.settings``): every option's name, type, bounds, default and doc
are declared once there, and ``--list-workloads`` is generated from them.
``make_workload(name, options, seed)`` validates options (strings from the CLI or
typed values) against it and raises one ``WorkloadError`` naming every bad option
by its path::

    workload option gsp.groups: expected an integer >= 1, got 'x'
    workload options: 2 errors: mixed.alpha: expected a number >= 0, got -1; ...
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import xxhash

from radixfleet.keys import BYTES_PER_TOKEN
from radixfleet.wire.errors import ConfigError, WorkloadError
from radixfleet.wire.settings import (
    document_check,
    internal,
    keys_of,
    setting,
    settings,
    validate,
    value_check,
)

API_CHAT = "chat"
API_COMPLETIONS = "completions"
APIS = (API_CHAT, API_COMPLETIONS)
#: the ``api`` option's type: which endpoint the requests go to
Api = Literal["chat", "completions"]
_API_DOC = "endpoint the requests go to"

# 32 symbols: every random byte maps onto one (b % 32), so a run of random bytes
# becomes printable, JSON-safe text in one C-level translate() call. No '<' or '|',
# so generated text can never look like the chat template's markers.
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz ,. e "
_TABLE = bytes(_ALPHABET[b % 32] for b in range(256))


def text_of(tokens: int, key: str, seed: int = 0) -> str:
    """Deterministic text of exactly ``tokens`` tokens (``tokens * 4`` ASCII bytes).

    O(tokens). Equal ``(key, seed)`` give equal text; a longer run with the same key
    extends a shorter one (so a partial trace block is a prefix of the full block).
    """
    if tokens <= 0:
        return ""
    rng = random.Random(xxhash.xxh3_64_intdigest(key.encode(), seed=seed & (2**64 - 1)))
    return rng.randbytes(tokens * BYTES_PER_TOKEN).translate(_TABLE).decode("ascii")


def token_count(text: str) -> int:
    """Tokens of a text under the byte-chunk tokenizer: ceil(utf-8 bytes / 4)."""
    return -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


#: the Mooncake synthetic trace shipped in the package (radixfleet_tools/loadtest/data/README.md)
MOONCAKE_TRACE = str(Path(__file__).with_name("data") / "mooncake_synthetic_trace.jsonl")


@dataclass(slots=True)
class RequestSpec:
    """One request to send. Built by a ``Session``; read-only to senders.

    ``body`` holds the prompt part only (``messages`` [+ ``tools``] for chat,
    ``prompt`` for completions); the client adds model, max_tokens and streaming.
    """

    #: unique within a workload: "<session>.<turn>"
    id: str
    #: 'chat' | 'completions'
    api: str
    body: dict
    max_tokens: int
    session: str
    turn: int
    #: seconds from the start of the run (trace replay), else None (the arrival
    #: process decides)
    arrival_s: float | None = None
    #: tokens the workload meant the prompt to have (template overhead aside)
    nominal_prompt_tokens: int = 0
    #: seconds the prompt (its ``prefetch`` part) is known before the request is due:
    #: the sender waits this long after the arrival, and with prefetching on sends
    #: ``prefetch`` to ``POST /v1/prefetch`` at the arrival (None: sent at arrival)
    lead_s: float | None = None
    #: the prompt part known ``lead_s`` ahead (``body``'s shape, a prefix of it)
    prefetch: dict | None = None


class Session:
    """A sequence of turns. ``first()`` once, then ``follow(answer)`` until None."""

    __slots__ = ("id",)

    def __init__(self, id: str) -> None:
        self.id = id

    def first(self) -> RequestSpec:
        raise NotImplementedError

    def follow(self, answer: str) -> RequestSpec | None:
        """The next turn, given the previous turn's actual answer; None when over."""
        return None

    @property
    def planned_requests(self) -> int:
        """Turns this session sends if every one succeeds (a failed turn ends it)."""
        return 1


class SingleShot(Session):
    """A session of one request."""

    __slots__ = ("spec",)

    def __init__(self, spec: RequestSpec) -> None:
        super().__init__(spec.session)
        self.spec = spec

    def first(self) -> RequestSpec:
        return self.spec


class ChatSession(Session):
    """A conversation whose history grows by each answer and the next question.

    Turn t sends ``prefix + history + [user: questions[t]]`` where history holds every
    earlier question and the actual answer to it, in order — so turn t's prompt
    extends turn t-1's prompt plus its answer exactly (the chat template is
    prefix-stable: ``radixfleet.keys.render_chat``).

    A turn may open with another role than a user question — the agent workload's
    tool results. ``calls[t]`` (optional) is then the tool call that the answer
    before turn t made: the history's assistant message carries it as
    ``tool_calls`` and turn t's tool message answers it by ``tool_call_id``, as the
    OpenAI API requires (SGLang's gateway and vLLM refuse a tool message that
    answers no call).
    """

    __slots__ = ("prefix", "tools", "turns", "max_tokens", "history", "turn", "api", "nominal", "calls")

    def __init__(
        self,
        id: str,
        *,
        prefix: list[dict],
        turns: list[dict],
        max_tokens: list[int],
        api: str = API_CHAT,
        tools: list | None = None,
        nominal: list[int] | None = None,
        calls: list[dict | None] | None = None,
    ) -> None:
        super().__init__(id)
        assert len(turns) == len(max_tokens) and turns, f"{id=} {len(turns)=}"
        self.prefix = prefix  # messages every turn starts with (system prompt)
        self.tools = tools  # chat 'tools' (a schema prefix), or None
        self.turns = turns  # the message that opens each turn
        self.max_tokens = max_tokens
        self.history: list[dict] = []  # messages of completed turns (only follow() grows it)
        self.turn = 0  # index of the turn handed out last
        self.api = api
        self.nominal = nominal or [0] * len(turns)
        assert calls is None or len(calls) == len(turns), f"{id=} {len(calls)=}"
        self.calls = calls

    def _spec(self) -> RequestSpec:
        t = self.turn
        messages = [*self.prefix, *self.history, self.turns[t]]
        if self.api == API_CHAT:
            body: dict = {"messages": messages}
            if self.tools is not None:
                body["tools"] = self.tools
        else:
            # completions: the conversation flattened, still prefix-stable
            body = {"prompt": "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "}
        return RequestSpec(
            f"{self.id}.{t}", self.api, body, self.max_tokens[t], self.id, t, None, self.nominal[t]
        )

    def first(self) -> RequestSpec:
        self.turn = 0
        self.history = []
        return self._spec()

    @property
    def planned_requests(self) -> int:
        return len(self.turns)

    def follow(self, answer: str) -> RequestSpec | None:
        if self.turn + 1 >= len(self.turns):
            return None
        self.history.append(self.turns[self.turn])
        answered: dict[str, Any] = {"role": "assistant", "content": answer}
        call = self.calls[self.turn + 1] if self.calls else None
        if call is not None:
            answered["tool_calls"] = [call]
        self.history.append(answered)
        self.turn += 1
        return self._spec()


def synthetic_answer(spec: RequestSpec, tokens: int | None = None) -> str:
    """A deterministic stand-in answer (for the simulator, which has no engine text)."""
    return text_of(spec.max_tokens if tokens is None else tokens, f"answer/{spec.id}")


# ---------------------------------------------------------------- parameters ----


class Workload:
    """Base of workloads. Subclasses set ``name``, ``Params`` and ``_build``."""

    name: ClassVar[str] = ""
    #: the options' schema (a ``radixfleet.wire.settings`` class; ``make_workload`` checks
    #: options against it)
    Params: ClassVar[type] = object

    def __init__(self, params: Any, seed: int = 0) -> None:
        self.params = params
        self.seed = seed
        self.prepare()

    def prepare(self) -> None:
        """Reads what valid parameters point at (a trace file, a base workload);
        raises ``WorkloadError`` when that cannot be done."""

    @property
    def max_active_sessions(self) -> int | None:
        """How many sessions may be in progress at once (None: all of them): the
        ``max_parallel`` option where a workload has one."""
        return getattr(self.params, "max_parallel", 0) or None

    def sessions(self) -> list[Session]:
        """A fresh list of sessions, in the order they should start."""
        return self._build(random.Random(self.seed))

    def _build(self, rng: random.Random) -> list[Session]:
        raise NotImplementedError

    def describe(self) -> dict:
        """Name, seed and every parameter (the report's ``workload`` field)."""
        return {"name": self.name, "seed": self.seed, "params": dataclasses.asdict(self.params)}

    def text(self, tokens: int, key: str) -> str:
        return text_of(tokens, f"{self.name}/{key}", self.seed)


def _ranged(rng: random.Random, length: int, ratio: float) -> int:
    """A length drawn uniformly from [ratio * length, length] (SGLang's range ratio)."""
    if ratio >= 1.0 or length <= 1:
        return length
    return rng.randint(max(1, int(length * ratio)), length)


def _zipf_weights(n: int, alpha: float) -> list[float]:
    return list(_accumulate(1.0 / (k**alpha) for k in range(1, n + 1)))


def _accumulate(xs: Iterable[float]) -> Iterable[float]:
    total = 0.0
    for x in xs:
        total += x
        yield total


# ---------------------------------------------------------------- workloads -----


@settings
class GspParams:
    groups: int = setting(64, "groups, each one system prompt", lo=1)
    prompts_per_group: int = setting(16, "prompts per group, each a unique question", lo=1)
    system_tokens: int = setting(2048, "tokens of each group's system prompt", lo=0)
    question_tokens: int = setting(128, "tokens of each question", lo=1)
    output_tokens: int = setting(256, "max_tokens of each request", lo=1)
    range_ratio: float = setting(
        1.0,
        "lengths drawn from [ratio * L, L]; 1 = fixed lengths (SGLang's --gsp-range-ratio)",
        lo=0,
        lo_open=True,
        hi=1,
    )
    order: Literal["shuffled", "ordered"] = setting(
        "shuffled", "shuffled (SGLang's default) or ordered (group after group)"
    )
    api: Api = setting(API_COMPLETIONS, _API_DOC)


class Gsp(Workload):
    """SGLang bench_serving's generated-shared-prefix: groups x prompts, one system
    prompt per group, a unique question per prompt: ``system + "\\n\\n" + question``."""

    name = "gsp"
    Params = GspParams

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        out: list[Session] = []
        for g in range(p.groups):
            sys_len = _ranged(rng, p.system_tokens, p.range_ratio)
            system = self.text(sys_len, f"system/{g}")
            for i in range(p.prompts_per_group):
                q_len = _ranged(rng, p.question_tokens, p.range_ratio)
                out_len = _ranged(rng, p.output_tokens, p.range_ratio)
                question = self.text(q_len, f"question/{g}/{i}")
                sid = f"g{g}p{i}"
                if p.api == API_CHAT:
                    body: dict[str, Any] = {
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": question},
                        ]
                    }
                else:
                    body = {"prompt": system + "\n\n" + question}
                out.append(
                    SingleShot(RequestSpec(f"{sid}.0", p.api, body, out_len, sid, 0, None, sys_len + q_len))
                )
        if p.order == "shuffled":
            rng.shuffle(out)
        return out


@settings
class MultiturnParams:
    clients: int = setting(64, "clients, each one conversation", lo=1)
    rounds: int = setting(5, "rounds (turns) per client", lo=1)
    question_tokens: int = setting(
        512, "tokens of each round's new question (SGLang bench_multiturn --request-length)", lo=1
    )
    output_tokens: int = setting(64, "max_tokens of each turn", lo=1)
    max_parallel: int = setting(0, "sessions in progress at once (SGLang's --max-parallel); 0 = all", lo=0)
    api: Api = setting(API_CHAT, _API_DOC)


class Multiturn(Workload):
    """SGLang bench_multiturn: each client's round r sends its whole history (every
    earlier question and answer) plus a new question."""

    name = "multiturn"
    Params = MultiturnParams

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        out: list[Session] = []
        for c in range(p.clients):
            turns = [
                {"role": "user", "content": self.text(p.question_tokens, f"q/{c}/{r}")}
                for r in range(p.rounds)
            ]
            out.append(
                ChatSession(
                    f"c{c}",
                    prefix=[],
                    turns=turns,
                    max_tokens=[p.output_tokens] * p.rounds,
                    api=p.api,
                    nominal=[p.question_tokens * (r + 1) + p.output_tokens * r for r in range(p.rounds)],
                )
            )
        return out


@settings
class ZipfParams:
    prompts: int = setting(32, "distinct system prompts", lo=1)
    alpha: float = setting(
        1.1, "Zipf exponent of their popularity (rank k drawn with weight 1 / k^alpha)", lo=0
    )
    system_tokens: int = setting(1024, "tokens of each system prompt", lo=0)
    suffix_tokens: int = setting(64, "tokens of each request's unique suffix", lo=1)
    output_tokens: int = setting(64, "max_tokens of each request", lo=1)
    requests: int = setting(2000, "requests", lo=1)
    api: Api = setting(API_CHAT, _API_DOC)


class Zipf(Workload):
    """N system prompts with Zipf(alpha) popularity, each request a short unique suffix."""

    name = "zipf"
    Params = ZipfParams

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        cum = _zipf_weights(p.prompts, p.alpha)
        systems = [self.text(p.system_tokens, f"system/{k}") for k in range(p.prompts)]
        ranks = rng.choices(range(p.prompts), cum_weights=cum, k=p.requests)
        out: list[Session] = []
        for i, k in enumerate(ranks):
            suffix = self.text(p.suffix_tokens, f"suffix/{i}")
            sid = f"z{i}"
            if p.api == API_CHAT:
                body: dict[str, Any] = {
                    "messages": [
                        {"role": "system", "content": systems[k]},
                        {"role": "user", "content": suffix},
                    ]
                }
            else:
                body = {"prompt": systems[k] + "\n" + suffix}
            out.append(
                SingleShot(
                    RequestSpec(
                        f"{sid}.0",
                        p.api,
                        body,
                        p.output_tokens,
                        sid,
                        0,
                        None,
                        p.system_tokens + p.suffix_tokens,
                    )
                )
            )
        return out


@settings
class RagParams:
    header_tokens: int = setting(256, "tokens of the instruction header every request shares", lo=0)
    documents: int = setting(200, "M: document chunks in the corpus", lo=1)
    k: int = setting(4, "k: chunks retrieved per request (at most documents)", lo=1)
    chunk_tokens: int = setting(512, "tokens of each chunk", lo=1)
    alpha: float = setting(0.8, "Zipf exponent of chunk popularity (0 = uniform)", lo=0)
    question_tokens: int = setting(64, "tokens of each request's unique question", lo=1)
    output_tokens: int = setting(128, "max_tokens of each request", lo=1)
    requests: int = setting(1000, "requests", lo=1)
    api: Api = setting(API_CHAT, _API_DOC)
    lead_ms: float = setting(
        300.0,
        "the retriever's lead: its chunks are known this long before the generation request "
        "is sent (0: sent at once, nothing to prefetch)",
        lo=0,
        hi=60_000,
    )

    @document_check
    def _k_within_documents(self) -> None:
        if self.k > self.documents:
            raise ConfigError("k", f"must be <= documents ({self.documents}), got {self.k}")


class Rag(Workload):
    """A shared instruction header, then k of M document chunks (popular chunks are
    retrieved more often, in retrieval order), then a unique question.

    The retriever runs ``lead_ms`` ahead of the generator: each request arrives at
    retrieval time and is sent ``lead_ms`` later; its header and chunks (the prompt
    without the question) are its ``prefetch`` part, which ``loadtest --prefetch``
    posts to ``/v1/prefetch`` at retrieval time."""

    name = "rag"
    Params = RagParams

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        lead = p.lead_ms / 1000.0 if p.lead_ms > 0 else None
        header = self.text(p.header_tokens, "header")
        chunks = [self.text(p.chunk_tokens, f"doc/{d}") for d in range(p.documents)]
        cum = _zipf_weights(p.documents, p.alpha)
        out: list[Session] = []
        for i in range(p.requests):
            picked: list[int] = []
            while len(picked) < p.k:  # k distinct, popularity-weighted, in draw order
                d = rng.choices(range(p.documents), cum_weights=cum, k=1)[0]
                if d not in picked:
                    picked.append(d)
            context = "".join(f"[doc {d}] {chunks[d]}\n" for d in picked)
            question = self.text(p.question_tokens, f"question/{i}")
            sid = f"r{i}"
            if p.api == API_CHAT:
                system = {"role": "system", "content": header}
                body: dict[str, Any] = {"messages": [system, {"role": "user", "content": context + question}]}
                known: dict[str, Any] = {"messages": [system, {"role": "user", "content": context}]}
            else:
                body = {"prompt": header + "\n" + context + question}
                known = {"prompt": header + "\n" + context}
            out.append(
                SingleShot(
                    RequestSpec(
                        f"{sid}.0",
                        p.api,
                        body,
                        p.output_tokens,
                        sid,
                        0,
                        None,
                        p.header_tokens + p.k * p.chunk_tokens + p.question_tokens,
                        lead,
                        known if lead else None,
                    )
                )
            )
        return out


@settings
class AgentParams:
    sessions: int = setting(16, "agent sessions", lo=1)
    steps: int = setting(8, "steps (turns) per session", lo=1)
    tools_tokens: int = setting(
        2048, "tokens of the tool-schema prefix every session shares (at least tools)", lo=1
    )
    tools: int = setting(8, "tool functions the schema text is split into", lo=1)
    task_tokens: int = setting(256, "tokens of each session's task", lo=1)
    step_tokens: int = setting(256, "tokens of each tool result appended to the trajectory", lo=1)
    output_tokens: int = setting(64, "max_tokens of each step", lo=1)
    max_parallel: int = setting(0, "sessions in progress at once; 0 = all", lo=0)

    @document_check
    def _tools_tokens_cover_tools(self) -> None:
        if self.tools_tokens < self.tools:
            raise ConfigError("tools_tokens", f"must be >= tools ({self.tools}), got {self.tools_tokens}")


class Agent(Workload):
    """An agent loop: a shared tool-schema prefix (chat ``tools``), a task, then per
    step the model's action (its actual answer) and a tool result appended."""

    name = "agent"
    Params = AgentParams

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        per_tool = p.tools_tokens // p.tools
        tools = [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{t}",
                    "description": self.text(per_tool, f"tool/{t}"),
                    "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
                },
            }
            for t in range(p.tools)
        ]
        out: list[Session] = []
        for s in range(p.sessions):
            tool_calls: list[dict] = [
                {
                    "id": f"call_a{s}_{k}",
                    "type": "function",
                    "function": {
                        "name": f"tool_{(s + k) % p.tools}",
                        "arguments": json.dumps({"arg": f"step {k}"}),
                    },
                }
                for k in range(1, p.steps)
            ]
            calls: list[dict | None] = [None, *tool_calls]
            turns = [{"role": "user", "content": self.text(p.task_tokens, f"task/{s}")}]
            turns += [
                {
                    "role": "tool",
                    "tool_call_id": tool_calls[k - 1]["id"],
                    "content": self.text(p.step_tokens, f"result/{s}/{k}"),
                }
                for k in range(1, p.steps)
            ]
            nominal = [
                p.tools_tokens + p.task_tokens + k * (p.step_tokens + p.output_tokens) for k in range(p.steps)
            ]
            out.append(
                ChatSession(
                    f"a{s}",
                    prefix=[],
                    turns=turns,
                    tools=tools,
                    max_tokens=[p.output_tokens] * p.steps,
                    nominal=nominal,
                    calls=calls,
                )
            )
        return out


@settings
class MixedParams:
    """The demo's traffic: chat sessions of a few turns, each behind one of a few
    shared system prompts (Zipf popularity) — an assistant product's traffic."""

    system_prompts: int = setting(8, "distinct system prompts", lo=1)
    alpha: float = setting(1.0, "Zipf exponent of their popularity", lo=0)
    system_tokens: int = setting(1024, "tokens of each system prompt", lo=0)
    sessions: int = setting(96, "chat sessions", lo=1)
    min_turns: int = setting(2, "turns per session drawn uniformly from [min_turns, max_turns]", lo=1)
    max_turns: int = setting(8, "see min_turns", lo=1)
    question_tokens: int = setting(128, "tokens of each question (ShareGPT-like: short)", lo=1)
    output_tokens: int = setting(256, "max_tokens of each answer (about twice the question)", lo=1)
    max_parallel: int = setting(
        24, "sessions in progress at once (users chatting concurrently); 0 = all", lo=0
    )

    @document_check
    def _turns_ordered(self) -> None:
        if self.min_turns > self.max_turns:
            raise ConfigError("min_turns", f"must be <= max_turns ({self.max_turns}), got {self.min_turns}")


class Mixed(Workload):
    name = "mixed"
    Params = MixedParams

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        systems = [self.text(p.system_tokens, f"system/{k}") for k in range(p.system_prompts)]
        cum = _zipf_weights(p.system_prompts, p.alpha)
        out: list[Session] = []
        for s in range(p.sessions):
            k = rng.choices(range(p.system_prompts), cum_weights=cum, k=1)[0]
            n = rng.randint(p.min_turns, p.max_turns)
            turns = [
                {"role": "user", "content": self.text(p.question_tokens, f"q/{s}/{t}")} for t in range(n)
            ]
            nominal = [p.system_tokens + p.question_tokens * (t + 1) + p.output_tokens * t for t in range(n)]
            out.append(
                ChatSession(
                    f"m{s}",
                    prefix=[{"role": "system", "content": systems[k]}],
                    turns=turns,
                    max_tokens=[p.output_tokens] * n,
                    nominal=nominal,
                )
            )
        return out


def _bases() -> list[str]:
    """Workloads another can be built on (``pollution``'s ``base``)."""
    return [n for n in WORKLOADS if n not in ("pollution", "trace")]


def _a_base(name: str) -> None:
    if name not in _bases():
        raise ConfigError("", f"{name!r} is not one of {', '.join(_bases())}")


@settings
class PollutionParams:
    base: Annotated[str, value_check(_a_base)] = setting(
        "zipf", "the workload polluted; options this one does not know go to it"
    )
    fraction: float = setting(
        0.1, "share of sessions that are one-off long documents", lo=0, hi=1, hi_open=True
    )
    doc_tokens: int = setting(8192, "tokens of each long document", lo=1)
    output_tokens: int = setting(32, "max_tokens of each document request", lo=1)
    #: base workload options (the options this class does not know, set by make_workload)
    base_options: dict = internal(dict)


class Pollution(Workload):
    """Another workload with one-off long documents mixed in: cache pollution that an
    LRU cache admits and a good router should keep from flushing the hot prefixes."""

    name = "pollution"
    Params = PollutionParams

    def prepare(self) -> None:
        self.base = make_workload(self.params.base, self.params.base_options, self.seed)

    @property
    def max_active_sessions(self) -> int | None:
        return self.base.max_active_sessions

    def describe(self) -> dict:
        d = super().describe()
        d["params"]["base_options"] = self.base.describe()["params"]
        return d

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        base = self.base.sessions()
        # n docs so that docs / (docs + base) == fraction
        n_docs = round(len(base) * p.fraction / (1.0 - p.fraction))
        slots = sorted(rng.sample(range(len(base) + n_docs), n_docs))
        out: list[Session] = []
        it = iter(base)
        di = 0
        for i in range(len(base) + n_docs):
            if di < len(slots) and slots[di] == i:
                sid = f"doc{di}"
                body = {"messages": [{"role": "user", "content": self.text(p.doc_tokens, f"doc/{di}")}]}
                out.append(
                    SingleShot(
                        RequestSpec(f"{sid}.0", API_CHAT, body, p.output_tokens, sid, 0, None, p.doc_tokens)
                    )
                )
                di += 1
            else:
                out.append(next(it))
        return out


@settings
class TraceParams:
    path: str = setting(MOONCAKE_TRACE, "JSONL trace file (default: the Mooncake trace shipped)")
    time_scale: float = setting(1.0, "arrival offsets are timestamp * time_scale (0.5 = twice as fast)", lo=0)
    max_requests: int = setting(0, "first N requests only (0 = all)", lo=0)
    skip_bad_lines: bool = setting(False, "skip unparsable lines instead of refusing the trace")
    block_tokens: int = setting(512, "tokens per hash id (Mooncake: 512; a traffic log sets its own)", lo=1)
    max_output_tokens: int = setting(0, "cap on output tokens per request (0 = as in the trace)", lo=0)
    api: Api = setting(API_COMPLETIONS, _API_DOC)


class Trace(Workload):
    """JSONL trace replay: Mooncake's format, or a radixfleet traffic log
    (``radixfleet.server.traffic_log``). Each hash id becomes a deterministic text run of
    ``block_tokens`` tokens (the last block cut to the request's input length), so
    requests sharing their first k ids share their first k blocks of text."""

    name = "trace"
    Params = TraceParams

    #: generated block texts kept (LRU), so popular ids are not regenerated
    _CACHE_BLOCKS = 4096

    def prepare(self) -> None:
        self.records = self.load()
        if not self.records:
            raise WorkloadError(f"trace {self.params.path}: no requests")

    @classmethod
    def from_records(
        cls, records: list, *, block_tokens: int, path: str = "", time_scale: float = 1.0, seed: int = 0
    ) -> Trace:
        """A trace of records already read (``radixfleet_tools.loadtest.trace_format``), e.g. from
        several traffic-log files: the same object ``Trace(params)`` builds from one."""
        self = cls.__new__(cls)
        self.params = TraceParams(path=path, time_scale=time_scale, block_tokens=block_tokens)
        self.seed = seed
        self.records = list(records)
        self.skipped = []
        if not self.records:
            raise WorkloadError(f"trace {path}: no requests")
        return self

    def load(self) -> list[tuple[float, int, int, list[int]]]:
        """Parses the trace: (timestamp_ms, input_length, output_length, hash_ids).

        Reads Mooncake traces and radixfleet traffic logs (``radixfleet_tools.loadtest.trace_format``;
        a traffic log sets ``block_tokens`` to its own). Raises ``WorkloadError``
        naming the first bad line (1-based), unless ``skip_bad_lines`` is set, in
        which case bad lines are skipped and their numbers kept in ``self.skipped``.
        """
        from radixfleet_tools.loadtest.trace_format import read_trace

        p = self.params
        data = read_trace([p.path], p.block_tokens, skip_bad=p.skip_bad_lines, max_requests=p.max_requests)
        self.skipped: list[int] = [line for _, line in data.skipped]
        self.kind = data.kind
        self.params = dataclasses.replace(p, block_tokens=data.block_tokens)
        return data.records

    def _build(self, rng: random.Random) -> list[Session]:
        p = self.params
        cache: OrderedDict[int, str] = OrderedDict()

        def block(h: int) -> str:
            s = cache.get(h)
            if s is None:
                s = self.text(p.block_tokens, f"block/{h}")
                cache[h] = s
                if len(cache) > self._CACHE_BLOCKS:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(h)
            return s

        t0 = self.records[0][0]
        return [_TraceSession(f"t{i}", rec, t0, p, block) for i, rec in enumerate(self.records)]


class _TraceSession(Session):
    """One trace request; its text is built when first sent (long traces stay small)."""

    __slots__ = ("rec", "t0", "params", "block")

    def __init__(self, id: str, rec, t0: float, params: TraceParams, block) -> None:
        super().__init__(id)
        self.rec, self.t0, self.params, self.block = rec, t0, params, block

    def first(self) -> RequestSpec:
        p = self.params
        ts, n_in, n_out, ids = self.rec
        last = n_in - p.block_tokens * (len(ids) - 1)
        block = self.block
        # a partial last block is a prefix of the full block's text: same id, same start
        text = "".join(block(h) for h in ids[:-1]) + block(ids[-1])[: last * BYTES_PER_TOKEN]
        if p.max_output_tokens:
            n_out = min(n_out, p.max_output_tokens)
        body = (
            {"prompt": text}
            if p.api == API_COMPLETIONS
            else {"messages": [{"role": "user", "content": text}]}
        )
        return RequestSpec(
            f"{self.id}.0", p.api, body, n_out, self.id, 0, (ts - self.t0) / 1000.0 * p.time_scale, n_in
        )


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (Gsp, Multiturn, Zipf, Rag, Agent, Mixed, Pollution, Trace)
}


def make_workload(name: str, options: Mapping[str, Any] | None = None, seed: int = 0) -> Workload:
    """Builds a workload by name from options (CLI strings or typed values).

    Raises ``WorkloadError`` for an unknown workload (listing the valid ones), or one
    naming every bad option at once: unknown (listing that workload's options), of
    the wrong type, out of bounds, or against a rule across options.
    """
    cls = WORKLOADS.get(name)
    if cls is None:
        raise WorkloadError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    fields = keys_of(cls.Params)
    raw: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if key in fields:
            raw[key] = _from_cli(fields[key].annotation, value)
        elif cls is Pollution:
            rest[key] = value  # the base workload validates these
        else:
            raw[key] = value  # refused below, with the valid options listed
    try:
        params = validate(cls.Params, raw, name)
    except ConfigError as exc:
        message = str(exc).replace("unknown key;", "unknown option;")
        head = "workload options:" if exc.errors[1:] else "workload option"
        raise WorkloadError(f"{head} {message}") from None
    if cls is Pollution:
        params = dataclasses.replace(params, base_options=rest)
    return cls(params, seed)


def _from_cli(annotation: Any, value: Any) -> Any:
    """A CLI string as the number or bool its option declares; anything else as given
    (the schema then refuses it by name)."""
    if not isinstance(value, str):
        return value
    try:
        if annotation is int:
            return int(value)
        if annotation is float:
            return float(value)
    except ValueError:
        return value
    if annotation is bool:
        return _BOOLS.get(value.lower(), value)
    return value


_BOOLS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def parse_options(pairs: Iterable[str]) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; raises ``WorkloadError``."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise WorkloadError(f"option {pair!r} must be NAME=VALUE")
        out[key.strip().replace("-", "_")] = value.strip()
    return out
