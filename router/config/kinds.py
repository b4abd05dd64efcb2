"""The engine kinds a worker may have and the roles it may play, declared once: every
section that names a kind or a role takes its type, and its choices in messages and
tables, from here (docs/DESIGN.md contract 7; ``router.engines.kinds`` probes an
``auto`` worker). ``WORKER_KINDS`` is the one list of kinds: the engine adapters'
registry may later supply it.
"""

from __future__ import annotations

from typing import Literal, get_args

#: an engine kind: ``agent`` (ours), ``vllm``, ``sglang`` or ``openai`` (anything else)
EngineKind = Literal["agent", "vllm", "sglang", "openai"]
#: the engine kinds, in declaration order (a discovered worker has one of them)
WORKER_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)
#: a worker entry's kind: an engine kind, or ``auto`` (probe the worker)
KindOrAuto = Literal["auto", EngineKind]
#: the doc of a worker entry's ``kind``
KIND_DOC = f"{', '.join(WORKER_KINDS[:-1])} or {WORKER_KINDS[-1]}; auto: probe the worker"

#: a worker's side of a disaggregated fleet, or ``both`` (colocated)
Role = Literal["prefill", "decode", "both"]
#: the doc of every ``role`` key
ROLE_DOC = (
    "prefill, decode or both: a disaggregated fleet's prefill or decode side, or colocated "
    "(a model served by prefill workers needs a decode worker too, and vice versa)"
)
