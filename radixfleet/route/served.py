"""Which workers serve which models: the filter applied before every pick.

A worker's served models come from its agent's registration (``models``) or, for
any other worker, from its own ``GET /v1/models`` (the pool asks after health
checks, every ``MODELS_REFRESH_S``). A worker whose models are not known yet (an
empty tuple) is a candidate for every model: a YAML worker is routable as soon as
it is healthy, and the first answer of ``/v1/models`` narrows it.

A request for model M (with LoRA adapter A, if any) goes only to workers whose
models include M or A — vLLM lists each loaded adapter as a model of its own —
or are not known. When none is routable::

    some routable worker serves other models  -> 404 naming the served ones
      (during STARTUP_GRACE_S after the router started: 503 + Retry-After, since
       self-registering agents re-register within a second of a restart)
    no routable worker at all                  -> 503 no_worker_available + Retry-After

``/generate`` requests that name no model go to any worker.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from radixfleet.wire.errors import MalformedRequest, NotFound, NoWorkerAvailable, RequestError
from radixfleet.wire.identifiers import MAX_MODELS, name_problem

#: seconds between two fetches of a (non-agent) worker's /v1/models
MODELS_REFRESH_S = 30.0
#: after a (re)start, unknown models answer 503 + Retry-After for this long, not 404
STARTUP_GRACE_S = 3.0


def serves(models: tuple[str, ...], model: str, adapter: str | None) -> bool:
    """True if a worker with ``models`` may take a request for (model, adapter).
    O(len(models))."""
    return not models or not model or model in models or (adapter is not None and adapter in models)


def served_models(workers: Iterable) -> list[str]:
    """The sorted union of known served models of ``workers`` (``.models``)."""
    out: set[str] = set()
    for w in workers:
        out.update(w.models)
    return sorted(out)


def unavailable(
    routable: list, model: str, adapter: str | None, *, in_grace: bool, retry_after_s: float
) -> RequestError:
    """The error for a request no routable worker may take. ``routable``: the
    routable workers (``pool.routable_workers(now)``), whatever they serve."""
    if routable and model and not in_grace:
        names = served_models(routable)
        shown = ", ".join(repr(n) for n in names[:20]) + (" ..." if len(names) > 20 else "")
        want = repr(model[:100]) + (f" (adapter {adapter[:100]!r})" if adapter else "")
        return NotFound(f"model {want} is not served by this router; served: {shown}", param="model")
    if routable and model:
        return NoWorkerAvailable(
            f"no routable worker serves model {model[:100]!r} yet", retry_after_s=retry_after_s
        )
    return NoWorkerAvailable("no healthy worker available", retry_after_s=retry_after_s)


def parse_models_answer(data: Any) -> tuple[str, ...]:
    """The model ids of an OpenAI ``/v1/models`` answer (parsed JSON). Raises
    ``MalformedRequest`` naming what is wrong with it."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise MalformedRequest('expected {"data": [{"id": ...}, ...]}')
    items = data["data"]
    if len(items) > MAX_MODELS:
        raise MalformedRequest(f"lists {len(items)} models; at most {MAX_MODELS}")
    out = []
    for i, m in enumerate(items):
        mid = m.get("id") if isinstance(m, dict) else None
        problem = name_problem(mid, f"data[{i}].id")
        if problem:
            raise MalformedRequest(problem)
        assert isinstance(mid, str), "name_problem refuses anything else"
        out.append(mid)
    return tuple(dict.fromkeys(out))
