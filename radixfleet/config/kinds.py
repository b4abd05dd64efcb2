"""The engine kinds a worker may have and the roles it may play, declared once: every
section that names a kind or a role takes its type, and its choices in messages and
tables, from here (docs/DESIGN.md contract 7). The kinds themselves are
``radixfleet.engines.kinds``'s (``KindName``, each with its adapter in
``radixfleet.engines.adapters``; that module probes an ``auto`` worker).
"""

from __future__ import annotations

from typing import Literal, get_args

from radixfleet.engines.kinds import KindName

#: an engine kind: ``agent`` (ours), ``vllm``, ``sglang`` or ``openai`` (anything else)
EngineKind = KindName
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
