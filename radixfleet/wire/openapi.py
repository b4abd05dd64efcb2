"""The OpenAPI 3 descriptions of the router's and the agent's HTTP surfaces.

Served at ``GET /openapi.json`` by both (``router_spec()``, ``agent_spec()``), kept
true by ``tests/repo/test_openapi.py`` (every registered route is described, every
described operation is registered) and exercised by ``tests/chaos/test_fuzz.py``
(schemathesis generates requests from these schemas against a live router and
agents: no answer may be a 5xx).

Request schemas say what the servers accept, loosely where the engines behind
them decide (sampling knobs pass through untouched: ``additionalProperties``);
every error answer is the OpenAI-style body ``{"error": {message, type, code,
param}}``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from radixfleet.wire.events import MAX_LOAD_COUNT, MAX_RATE
from radixfleet.wire.identifiers import MAX_ID_CHARS, MAX_MODELS, MAX_NAME_CHARS, MAX_URL_CHARS

OPENAPI_VERSION = "3.0.3"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string", "nullable": True},
                "param": {"type": "string", "nullable": True},
            },
        }
    },
}
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}
_TOKEN_IDS = {"type": "array", "items": _TOKEN_ID, "minItems": 1}
_PROMPT = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ]
}
_ADAPTER = {"type": "string", "description": "SGLang LoRA adapter (part of the cache key)"}
_NULLABLE_STR = {"type": "string", "nullable": True}
#: vLLM's disaggregated prefill/decode params (radixfleet.route.pd sends them, agents answer them)
_KV_TRANSFER = {
    "type": "object",
    "nullable": True,
    "description": "vLLM P/D: do_remote_decode on a prefill leg, do_remote_prefill + remote_* "
    "(what the prefill answer named) on a decode leg",
    "properties": {
        "do_remote_decode": {"type": "boolean"},
        "do_remote_prefill": {"type": "boolean"},
        "remote_engine_id": _NULLABLE_STR,
        "remote_block_ids": {"type": "array", "items": {"type": "integer"}, "nullable": True},
        "remote_host": _NULLABLE_STR,
        "remote_port": {"type": "integer", "nullable": True},
    },
}
_COMMON = {
    "kv_transfer_params": _KV_TRANSFER,
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 0},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "temperature": {"type": "number"},
    "seed": {"type": "integer"},
    "priority": {
        "type": "integer",
        "minimum": -(2**63),
        "maximum": 2**63 - 1,
        "description": "vLLM's scheduling priority, lower first; non-zero only for an engine that "
        "schedules by priority (agent --schedule priority); the router replaces it by the request's "
        "class for such workers",
    },
    "n": {"type": "integer", "minimum": 1},
    "user": {"type": "string", "description": "session affinity key"},
    "lora_path": _ADAPTER,
    "lora_adapter": _ADAPTER,
}
_CONTENT_PART = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["text", "refusal", "image_url", "input_audio", "file"]},
        "text": {"type": "string"},
        "refusal": {"type": "string"},
        "image_url": {"type": "object"},
        "input_audio": {"type": "object"},
        "file": {"type": "object"},
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "minLength": 1},
        "content": {
            "nullable": True,
            "oneOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART}],
        },
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
}
COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {**_COMMON, "prompt": _PROMPT},
}
CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 0},
        "tools": {"type": "array", "items": {"type": "object"}},
    },
}
GENERATE_REQUEST = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "text": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "input_ids": {"oneOf": [_TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS}]},
        "sampling_params": {
            "type": "object",
            "properties": {"max_new_tokens": {"type": "integer", "minimum": 0}},
        },
        "stream": {"type": "boolean"},
        "lora_path": _ADAPTER,
    },
}
_WORKER_ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_ID_CHARS,
    "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:@+=\[\]-]*$",
}
_URL = {"type": "string", "maxLength": MAX_URL_CHARS, "description": "http://host:port"}
WORKER_SPEC = {
    "type": "object",
    "required": ["url"],
    "additionalProperties": False,
    "properties": {
        "url": _URL,
        "id": _WORKER_ID,
        "weight": {"type": "number", "minimum": 0.01, "maximum": 100},
        "prefill_tokens_per_s": {"type": "number", "minimum": 1, "maximum": MAX_RATE},
    },
}
REGISTRATION = {
    "type": "object",
    "required": ["worker_id", "url", "epoch"],
    "properties": {
        "worker_id": _WORKER_ID,
        "url": _URL,
        "epoch": _WORKER_ID,
        "models": {
            "type": "array",
            "maxItems": MAX_MODELS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS},
        },
        "block_bytes": {"type": "integer", "minimum": 1},
        "role": {"type": "string", "enum": ["prefill", "decode", "both"]},
        "scheduling_policy": {"type": "string", "maxLength": 32, "description": "fcfs, lpm or priority"},
    },
}
_HASH = {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}
_COUNT = {"type": "integer", "minimum": 0, "maximum": MAX_LOAD_COUNT}
EVENT_BATCH = {
    "type": "object",
    "required": ["worker_id", "url", "epoch", "seq"],
    "properties": {
        "worker_id": _WORKER_ID,
        "url": _URL,
        "epoch": _WORKER_ID,
        "seq": {"type": "integer", "minimum": 0},
        "events": {
            "type": "array",
            "items": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["type", "hashes"],
                        "properties": {
                            "type": {"type": "string", "enum": ["stored"]},
                            "parent": {**_HASH, "nullable": True},
                            "hashes": {"type": "array", "items": _HASH},
                        },
                    },
                    {
                        "type": "object",
                        "required": ["type", "hashes"],
                        "properties": {
                            "type": {"type": "string", "enum": ["removed"]},
                            "hashes": {"type": "array", "items": _HASH},
                        },
                    },
                    {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"type": "string", "enum": ["cleared"]}},
                    },
                    {
                        "type": "object",
                        "required": ["type", "blocks"],
                        "properties": {
                            "type": {"type": "string", "enum": ["snapshot"]},
                            "blocks": {
                                "type": "array",
                                "items": {
                                    "type": "array",
                                    "minItems": 2,
                                    "maxItems": 2,
                                    "items": {**_HASH, "nullable": True},
                                },
                            },
                        },
                    },
                ]
            },
        },
        "load": {
            "type": "object",
            "properties": {
                "queued_requests": _COUNT,
                "queued_tokens": _COUNT,
                "queued_prefill_tokens": _COUNT,
                "running_requests": _COUNT,
                "kv_used_tokens": _COUNT,
                "kv_capacity_tokens": _COUNT,
                "prefill_tokens_per_s": {"type": "number", "minimum": 0, "maximum": MAX_RATE},
            },
        },
    },
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    words = {
        400: "malformed request",
        401: "missing or wrong token",
        404: "not found",
        405: "method not allowed",
        408: "head or body too slow",
        403: "refused: a tokenless agent API off loopback, a worker host outside registration.allow",
        409: "conflict",
        413: "body too large",
        429: "overloaded, or over a tenancy rate limit (Retry-After; a rate limit adds x-ratelimit-*)",
        503: "no worker available (Retry-After)",
        508: "the request came back to the router that sent it (x-radixfleet-hop)",
    }
    return {str(s): {"description": words[s], **_json(_ERROR)} for s in statuses}


def _ok(description: str, schema: dict[str, Any] | None = None, status: int = 200) -> dict[str, Any]:
    r: dict[str, Any] = {"description": description}
    if schema is not None:
        r.update(_json(schema))
    return {str(status): r}


_OBJECT = {"type": "object"}
#: ``radixfleet.route.decisions``' bounds (MAX_SIZE, MAX_CANDIDATES; a test keeps them equal)
DECISIONS_MAX = 4096
CANDIDATES_MAX = 1024
_NULLABLE_INT = {"type": "integer", "nullable": True}
_NULLABLE_NUM = {"type": "number", "nullable": True}
DECISIONS = {
    "type": "object",
    "required": ["size", "kept", "decisions"],
    "properties": {
        "size": {"type": "integer", "description": "decisions kept at most (decisions.size; 0: off)"},
        "kept": {"type": "integer"},
        "decisions": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "time": {"type": "number", "description": "arrival, UNIX seconds"},
                    "request_id": {"type": "string"},
                    "model": {"type": "string"},
                    "tenant": {"type": "string"},
                    "session": {**_NULLABLE_STR, "description": "keyed digest of the session id"},
                    "prefix": {**_NULLABLE_STR, "description": "keyed digest of the first routing block"},
                    "prompt_tokens": {"type": "integer"},
                    "policy": {"type": "string"},
                    "rule": {"type": "string"},
                    "reason": {"type": "string"},
                    "worker": _NULLABLE_STR,
                    "rank": _NULLABLE_INT,
                    "eligible": _NULLABLE_INT,
                    "candidates": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "worker": {"type": "string"},
                                "matched_tokens": {"type": "integer"},
                                "counted_tokens": _NULLABLE_INT,
                                "queue_s": {"type": "number"},
                                "in_flight": {"type": "integer"},
                                "saturated": {"type": "boolean"},
                                "score": _NULLABLE_NUM,
                                "expected_ttft_s": _NULLABLE_NUM,
                            },
                        },
                    },
                    "available_tokens": _NULLABLE_INT,
                    "predicted_tokens": _NULLABLE_INT,
                    "cached_tokens": _NULLABLE_INT,
                    "outcome": {
                        "type": "object",
                        "properties": {
                            "status": {"type": "integer"},
                            "ttft_ms": _NULLABLE_NUM,
                            "broken": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def _data_plane(summary: str, schema: dict[str, Any], *, router: bool) -> dict[str, Any]:
    statuses = (400, 401, 404, 413, 429, 503, 508) if router else (400, 404, 429, 503)
    ok = {
        "description": "the completion (JSON), or with stream: true an SSE stream",
        "content": {
            "application/json": {"schema": _OBJECT},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, **_json(schema)},
            "responses": {"200": ok, **_errors(*statuses)},
        }
    }


def _get(
    summary: str, schema: dict[str, Any] | None = None, *errors: int, text: bool = False
) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": summary}
    if text:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif schema is not None:
        ok.update(_json(schema))
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def _metrics_get() -> dict[str, Any]:
    """The router's ``GET /metrics``: the metrics or admin token, or none from a
    loopback peer while no metrics token is set (radixfleet.server.auth.check_metrics)."""
    op = _get("Prometheus text", None, 401, text=True)
    op["get"]["security"] = [{"metricsToken": []}, {"adminToken": []}, {}]
    return op


def _data_plane_paths(router: bool) -> dict[str, Any]:
    return {
        "/v1/completions": _data_plane("OpenAI completions", COMPLETION_REQUEST, router=router),
        "/v1/chat/completions": _data_plane("OpenAI chat completions", CHAT_REQUEST, router=router),
        "/generate": _data_plane("SGLang generate", GENERATE_REQUEST, router=router),
        "/v1/models": _get("served models", {"type": "object", "required": ["data"]}),
    }


@functools.cache
def _router_spec() -> dict[str, Any]:
    admin: list[dict[str, list[str]]] = [{"adminToken": []}]
    agent: list[dict[str, list[str]]] = [{"agentToken": []}]
    wid = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    paths = {
        **_data_plane_paths(True),
        "/v1/prefetch": {
            "post": {
                "summary": "warm the worker a chat or completion request (or its prefix) would go to",
                "requestBody": {"required": True, **_json({"oneOf": [CHAT_REQUEST, COMPLETION_REQUEST]})},
                "responses": {
                    **_ok(
                        "accepted (the worker is sent the prompt with max_tokens 1), or deduplicated; "
                        "'deduplicated' only for a client a credential names a tenant for",
                        {
                            "type": "object",
                            "required": ["accepted"],
                            "properties": {
                                "accepted": {"type": "boolean"},
                                "deduplicated": {"type": "boolean"},
                                "worker": {"type": "string"},
                            },
                        },
                        202,
                    ),
                    **_errors(400, 401, 404, 413, 429, 503, 508),
                },
            }
        },
        "/health": _get("the router process is up", _OBJECT),
        "/readiness": _get("at least one worker is healthy", _OBJECT, 503),
        "/metrics": _metrics_get(),
        "/openapi.json": _get("this document", _OBJECT),
        "/admin/workers": {
            "get": {
                "summary": "the pool",
                "security": admin,
                "responses": {**_ok("workers", _OBJECT), **_errors(401)},
            },
            "post": {
                "summary": "add a worker",
                "security": admin,
                "requestBody": {"required": True, **_json(WORKER_SPEC)},
                "responses": {**_ok("added", _OBJECT, 201), **_errors(400, 401, 409)},
            },
        },
        "/admin/workers/{id}": {
            "delete": {
                "summary": "remove a worker",
                "security": admin,
                "parameters": [wid],
                "responses": {**_ok("removed", _OBJECT), **_errors(401, 404)},
            }
        },
        "/admin/workers/{id}/drain": {
            "post": {
                "summary": "drain (or undrain) a worker",
                "security": admin,
                "parameters": [wid],
                "requestBody": {
                    "required": False,
                    **_json({"type": "object", "properties": {"drain": {"type": "boolean"}}}),
                },
                "responses": {**_ok("drained", _OBJECT), **_errors(400, 401, 404)},
            }
        },
        "/admin/index": {
            "get": {
                "summary": "index stats, hot prefixes (hashes: admin only), the policy",
                "security": admin,
                "responses": {**_ok("index", _OBJECT), **_errors(401)},
            }
        },
        "/admin/decisions": {
            "get": {
                "summary": "the recent routing decisions, newest first (radixfleet.route.decisions)",
                "description": (
                    "Per client request (the last decisions.size kept): the eligible workers' "
                    "figures (matched and credited tokens, queue, the policy's score and expected "
                    "TTFT; the chosen worker first), the rule that decided (affinity, load, "
                    "replication, saturation, placement, fallback, failed, shed, refused), the "
                    "three routing-quality numbers (available, predicted, cached tokens) and the "
                    "outcome. Sessions and prefixes appear only as keyed digests."
                ),
                "security": admin,
                "parameters": [
                    {
                        "name": "n",
                        "in": "query",
                        "required": False,
                        "description": "decisions to return (default 20)",
                        "schema": {"type": "integer", "minimum": 1, "maximum": DECISIONS_MAX},
                    },
                    {
                        "name": "candidates",
                        "in": "query",
                        "required": False,
                        "description": "candidates per decision (default 8)",
                        "schema": {"type": "integer", "minimum": 1, "maximum": CANDIDATES_MAX},
                    },
                ],
                "responses": {**_ok("decisions", DECISIONS), **_errors(400, 401)},
            }
        },
        "/admin/reload": {
            "post": {
                "summary": "re-read the config file",
                "description": (
                    "An invalid file, one that holds no settings, or one that lowers security "
                    "(client authentication, admin or agent tokens, tenants' or keys' rules, rate "
                    "limits, the limits section) is refused with 400 and the running config kept; "
                    "allow_security_downgrade: true applies a downgrade for this one reload "
                    "(logged at ERROR)."
                ),
                "security": admin,
                "requestBody": {
                    "required": False,
                    **_json(
                        {
                            "type": "object",
                            "properties": {"allow_security_downgrade": {"type": "boolean"}},
                            "additionalProperties": False,
                        }
                    ),
                },
                "responses": {**_ok("reloaded", _OBJECT), **_errors(400, 401, 409)},
            }
        },
        "/internal/v1/register": {
            "post": {
                "summary": "an agent announces itself",
                "security": agent,
                "requestBody": {"required": True, **_json(REGISTRATION)},
                "responses": {**_ok("registered", _OBJECT), **_errors(400, 401, 403, 409, 429)},
            }
        },
        "/internal/v1/events": {
            "post": {
                "summary": "an agent's cache events and load",
                "security": agent,
                "requestBody": {"required": True, **_json(EVENT_BATCH)},
                "responses": {**_ok("applied", _OBJECT), **_errors(400, 401, 403, 404, 409)},
            }
        },
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "radixfleet router",
            "version": "0.1.0",
            "description": "Cache-aware router: OpenAI data plane, admin and agent APIs.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "adminToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "$RADIXFLEET_ADMIN_TOKEN (open on loopback if unset)",
                },
                "agentToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "$RADIXFLEET_AGENT_TOKEN (open on loopback if unset)",
                },
                "metricsToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "$RADIXFLEET_METRICS_TOKEN (unset: loopback peers need none)",
                },
            }
        },
    }


@functools.cache
def _agent_spec() -> dict[str, Any]:
    probe = _get("SGLang worker probe", _OBJECT)
    paths = {
        **_data_plane_paths(False),
        "/health": _get("the agent is up", text=True),
        "/health_generate": _get("the agent can generate", text=True),
        "/get_server_info": probe,
        "/server_info": probe,
        "/get_model_info": probe,
        "/model_info": probe,
        "/get_load": _get("load per data-parallel rank", {"type": "array"}),
        "/metrics": _get("Prometheus text", text=True),
        "/openapi.json": _get("this document", _OBJECT),
        "/flush_cache": {
            m: {
                "summary": "flush the radix cache (refused while requests run)",
                "responses": {
                    "200": {
                        "description": "flushed",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(400),
                },
            }
            for m in ("get", "post")
        },
        "/internal/v1/engine_config": {
            "post": {
                "summary": "adopt new engine settings (flushes the cache)",
                "security": [{"agentToken": []}],
                "requestBody": {
                    "required": True,
                    **_json(
                        {
                            "type": "object",
                            "required": ["rope_scaling"],
                            "properties": {"rope_scaling": {"nullable": True}},
                        }
                    ),
                },
                "responses": {**_ok("adopted", _OBJECT), **_errors(400, 401)},
            }
        },
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "radixfleet agent",
            "version": "0.1.0",
            "description": "Worker agent: OpenAI data plane on the simulated engine, "
            "SGLang probes, engine settings.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "agentToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "$RADIXFLEET_AGENT_TOKEN (open on loopback if unset)",
                }
            }
        },
    }


def router_spec() -> dict[str, Any]:
    """The router's OpenAPI 3 document (a fresh copy: callers may modify it)."""
    return copy.deepcopy(_router_spec())


def agent_spec() -> dict[str, Any]:
    """The agent's OpenAPI 3 document (a fresh copy)."""
    return copy.deepcopy(_agent_spec())


def operations(spec: dict[str, Any]) -> set[tuple[str, str]]:
    """(METHOD, path) of every operation a document describes."""
    return {
        (m.upper(), p)
        for p, item in spec["paths"].items()
        for m in item
        if m in ("get", "post", "put", "patch", "delete")
    }
