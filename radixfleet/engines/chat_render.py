"""vLLM 0.32's chat rendering, reproduced: request messages -> the conversation its
chat template sees -> the prompt text the engine tokenizes.

What vLLM does to a ``/v1/chat/completions`` body before its template runs (read in
``vllm/renderers/chat_utils.py``, ``renderers/hf.py``, ``renderers/params.py``,
``entrypoints/openai/chat_completion/protocol.py``), and so what this module does::

    messages ──(1) parse───────> conversation ──(2) developer role──> conversation'
    tools ─────(3) model_dump──> tool dicts                                 │
    flags + chat_template_kwargs ─(4) merge, filter by template variables ──┤
                                                                            v
                 template.render(messages=, tools=, documents=, add_generation_prompt=,
                                 **special tokens, **kwargs)  (5, transformers 5.16-5.19)

1. Each message becomes ``{role, content}`` plus, for assistants, ``tool_calls`` (key
   order of the validated request: ``id, function{arguments, name, ...}, type, ...``;
   ``arguments`` parsed from its JSON string into an object, ``{}`` if not an object)
   and ``reasoning``/``reasoning_content``; for tools ``tool_call_id``; ``name`` and
   ``task`` when strings; for developers ``tools``. Content is, by the template's
   *content format* (detected from its AST, as vLLM does): ``string`` -> the text
   parts joined with ``"\\n"``; ``openai`` -> ``[{"type": "text", "text": ...}, ...]``
   (every text-like part — text, input_text, output_text, refusal, thinking — becomes
   type ``text``). A tool message's text parts are always joined into a string. A
   system message's leading ``x-anthropic-billing-header`` line is dropped.
2. Templates that never mention ``developer`` get developer messages as ``system``,
   all system messages merged into the first (``"\\n\\n"``-joined).
3. Tools are dumped as vLLM's pydantic models dump them: ``{"type": "function",
   "function": {"name", "description", "parameters"[, "strict"][, "defer_loading"]}}``
   with ``None`` for absent description/parameters, unknown keys dropped.
4. Request flags (``add_generation_prompt``, ``continue_final_message``,
   ``documents``, ``reasoning_effort``) override ``chat_template_kwargs``, which
   override the defaults (``tools``); ``None`` and ``"auto"`` never override. Only the
   template's own variables and transformers' named parameters pass.
5. Rendered by the compiled template itself (no copy of the conversation), with
   ``continue_final_message`` cut exactly as transformers 5.16-5.19 cut it — the
   versions vLLM 0.32 pins, whatever transformers the router runs.

Media content parts are not rendered: the engine expands them through its
multimodal processor into tokens a router cannot reproduce; the request is marked
``media`` and is not keyed (``token_keys``).

Everything a client can send wrongly raises ``MalformedRequest`` naming the field;
a template that raises (``raise_exception``, a type error on odd input, a sandbox
violation) is the engine's 400 too, and becomes ``MalformedRequest`` with the
template's own message.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from radixfleet.wire.errors import MalformedRequest, MissingExtra

try:
    import jinja2
    import jinja2.meta
    import jinja2.nodes as jn
except ImportError as exc:  # chat templates are the engines extra's (radixfleet.wire.extras)
    raise MissingExtra("chat templates", "engines", str(exc)) from exc

#: Text-like content part types and the key holding their text (vLLM MM_PARSER_MAP).
TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
#: Media part types: expanded by the engine's processor, never reproduced here.
MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)
#: Keys of vLLM's content-part types; any other key of a text part is kept as an
#: "extra field" next to type/text in the ``openai`` format (vLLM's
#: _KNOWN_CONTENT_PART_FIELDS, 0.32).
KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
#: transformers' apply_chat_template named parameters (5.16-5.19, pinned by vLLM
#: 0.32): they pass vLLM's kwarg filter whatever the template reads, and are consumed
#: by apply_chat_template instead of reaching the template.
HF_NAMED_PARAMS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
#: Of those, the ones that change the ids when a request asks for ``tokenize``.
TOKENIZE_OPTIONS = ("padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs")
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
_BILLING_HEADER = "x-anthropic-billing-header"
_NO_EXTRAS: dict = {}  # shared, never written
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_UNSET = (None, "auto")


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _bad(message: str, param: str) -> MalformedRequest:
    return MalformedRequest(message, param=param)


def lax_bool(value: Any, field: str, param: str) -> bool:
    """A boolean as vLLM's pydantic models accept one (lax mode: 1, 0, "true", "no",
    ...). Raises ``MalformedRequest`` for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    raise _bad(f"'{field}' must be a boolean, got {value!r}"[:200], param)


def merge_kwargs(defaults: dict | None, overrides: dict | None) -> dict:
    """vLLM's merge: ``overrides`` win unless their value is None or "auto"."""
    out = dict(defaults or {})
    for k, v in (overrides or {}).items():
        if not (v is None or (isinstance(v, str) and v == "auto")):
            out[k] = v
    return out


# ----------------------------------------------------------------- templates


def _strip(node: jn.Node) -> jn.Node:
    """``x | f``, ``x is t`` and ``x[a:b]`` all refer to x (vLLM's rule)."""
    while True:
        # two tests, so each narrows node's type (Filter.node may be None)
        if isinstance(node, (jn.Filter, jn.Test)) and node.node is not None:
            node = node.node
            continue
        if isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice):
            node = node.node
            continue
        return node


def _is_name(node: jn.Node, names: set[str] | frozenset[str]) -> bool:
    return isinstance(node, jn.Name) and node.ctx == "load" and node.name in names


def _is_content_of(node: jn.Node, names: set[str]) -> bool:
    """``m.content`` or ``m['content']`` for a name in ``names`` (through filters)."""
    node = _strip(node)
    if isinstance(node, jn.Getattr):
        return node.attr == "content" and _is_name(node.node, names)
    if isinstance(node, jn.Getitem):
        return isinstance(node.arg, jn.Const) and node.arg.value == "content" and _is_name(node.node, names)
    return False


def detect_content_format(ast: jn.Template) -> str:
    """``openai`` when the template loops over a message's content, else ``string``.

    The same rule as vLLM's detection: names bound (transitively, by ``set``) to
    ``messages`` or its slices; loops over those give message names; a loop over a
    message's ``content``, over a bare ``content`` outside macros, or over a macro
    parameter that some call passes a message's content means list content.
    """
    msg_lists = {"messages"}
    todo = deque(["messages"])
    assigns = list(ast.find_all(jn.Assign))
    while todo:
        src = todo.popleft()
        for a in assigns:
            if isinstance(a.target, jn.Name) and _is_name(_strip(a.node), {src}):
                if a.target.name not in msg_lists:
                    msg_lists.add(a.target.name)
                    todo.append(a.target.name)
    loops = list(ast.find_all(jn.For))
    msg_names = {
        lp.target.name
        for lp in loops
        if isinstance(lp.target, jn.Name) and _is_name(_strip(lp.iter), msg_lists)
    }
    in_macro: set[int] = set()
    params_of_loop: dict[int, set[str]] = {}
    calls = list(ast.find_all(jn.Call))
    for macro in ast.find_all(jn.Macro):
        names = [a.name for a in macro.args]
        bound: set[str] = set()
        for c in calls:
            if not _is_name(c.node, {macro.name}):
                continue
            for i, arg in enumerate(c.args):
                if i < len(names) and _is_content_of(arg, msg_names):
                    bound.add(names[i])
            for kw in c.kwargs:
                if kw.key in names and _is_content_of(kw.value, msg_names):
                    bound.add(kw.key)
        for lp in macro.find_all(jn.For):
            in_macro.add(id(lp))
            if bound:
                params_of_loop[id(lp)] = bound
    for lp in loops:
        it = lp.iter
        if _is_content_of(it, msg_names):
            return "openai"
        if isinstance(it, jn.Name):
            if it.name in params_of_loop.get(id(lp), ()):
                return "openai"
            if id(lp) not in in_macro and it.name == "content":
                return "openai"
    return "string"


class ChatTemplate:
    """One compiled chat template and what vLLM derives from its source."""

    __slots__ = ("source", "compiled", "content_format", "variables", "supports_developer")

    def __init__(self, source: str, content_format: str = "auto") -> None:
        """Raises ``jinja2.TemplateSyntaxError`` for a template that does not compile."""
        # transformers' own sandboxed environment (tojson, raise_exception,
        # strftime_now, loop controls, {% generation %}): the template renders here
        # as in the engine
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.source = source
        self.compiled = _compile_jinja_template(source)
        ast = self.compiled.environment.parse(source)
        #: 'string' or 'openai': the shape of message content the template reads
        self.content_format = detect_content_format(ast) if content_format == "auto" else content_format
        #: the template's free variables: the chat_template_kwargs that reach it
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.supports_developer = '"developer"' in source or "'developer'" in source

    def render(
        self,
        conversation: list[dict],
        *,
        tools: list | None,
        documents: list | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        kwargs: dict,
    ) -> str:
        """The prompt text, as transformers 5.16-5.19's apply_chat_template(tokenize=
        False) renders it. ``conversation`` is consumed (its last message may be
        edited). Raises whatever the template or the continuation rules raise."""
        if not conversation:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        if tools is not None and any(not isinstance(t, dict) for t in tools):
            raise ValueError("Tools should either be a JSON schema, or a callable function")
        if documents is not None and any(not isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        final = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            last = conversation[-1] = dict(conversation[-1])
            final = last.get(field)
            if final is None:
                raise ValueError(
                    f'continue_final_message is set but the final message has no "{field}" to continue!'
                )
            if field not in self.source:
                raise ValueError(
                    f'continue_final_message is set to "{field}" but this is '
                    "not an accepted field in the chat_template"
                )
            if isinstance(final, (list, tuple)):
                blocks = last[field] = [dict(b) if isinstance(b, dict) else b for b in final]
                for block in reversed(blocks):
                    if "text" in block:
                        final = block["text"]
                        block["text"] = block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise ValueError(
                        "continue_final_message is set but we could not find "
                        "any text to continue in the final message!"
                    )
            else:
                last[field] = final + _CONTINUE_TAG
        text = self.compiled.render(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if final is not None:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ValueError(
                    "continue_final_message is set but the final message does "
                    "not appear in the chat after applying the chat template!"
                )
            at = text.rindex(tag)
            if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                text = text[:at]
            else:
                text = text[:at].rstrip()
        return text


def template_error_reason(exc: BaseException) -> str:
    """The most specific message of a template failure (the first jinja error in the
    chain, as vLLM reports it)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, jinja2.TemplateError):
            return str(cur) or type(cur).__name__
        cur = cur.__cause__ or cur.__context__
    return str(exc) or type(exc).__name__


# ------------------------------------------------------------------ messages


def _text_of(part: dict, kind: str, where: str) -> str:
    key = TEXT_PARTS[kind]
    value = part.get(key)
    if not isinstance(value, str):
        raise _bad(f"'{where}.{key}' must be a string, got {type(value).__name__}", "messages")
    return value


def _parts(content: Any, role: str, where: str) -> tuple[list[tuple[str, Any, dict]], bool]:
    """Content -> [(kind, value, extras)] with kind 'text' or 'tool_reference', and
    whether media parts were dropped."""
    if content is None:
        return [], False
    if type(content) is str and not (role == "system" and content.startswith(_BILLING_HEADER)):
        return [("text", content, _NO_EXTRAS)], False  # the common case, short-cut
    if isinstance(content, str):
        raw: list = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        raw = content
    else:
        raise _bad(
            f"'{where}' must be a string, a list of content parts or null, got {type(content).__name__}",
            "messages",
        )
    if role == "system":
        raw = _strip_billing_header(raw)
    out: list[tuple[str, Any, dict]] = []
    media = False
    for j, part in enumerate(raw):
        pw = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"'{pw}' must be an object, got {type(part).__name__}", "messages")
        kind = part.get("type")
        if kind is None:
            raise _bad(f"'{pw}.type' is required", "messages")
        if not isinstance(kind, str):
            raise _bad(f"'{pw}.type' must be a string", "messages")
        if kind in TEXT_PARTS:
            extras = (
                {k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS} if len(part) > 2 else _NO_EXTRAS
            )
            out.append(("text", _text_of(part, kind, pw), extras))
        elif kind in MEDIA_PARTS:
            media = True
        elif kind == "tool_reference":
            name = part.get("name")
            if not isinstance(name, str):
                raise _bad(f"'{pw}.name' must be a string", "messages")
            out.append(("tool_reference", name, {}))
        else:
            raise _bad(
                f"'{pw}.type' {kind!r} is not a supported content part type "
                f"({', '.join(sorted([*TEXT_PARTS, *MEDIA_PARTS, 'tool_reference']))})",
                "messages",
            )
    return out, media


def _strip_billing_header(parts: list) -> list:
    """Drops the per-request attribution line Claude Code puts in system text."""
    out = []
    for part in parts:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append({**part, "text": rest})
    return out


def _content(parts: list[tuple[str, Any, dict]], fmt: str) -> Any:
    if fmt == "openai":
        return [
            ({"type": "text", "text": v, **x} if x else {"type": "text", "text": v})
            if k == "text"
            else {"type": "tool_reference", "name": v}
            for k, v, x in parts
        ]
    if len(parts) == 1:
        return parts[0][1]
    return "\n".join(v for _, v, _ in parts)


def _tool_call(item: Any, where: str) -> dict:
    """One assistant tool call as vLLM validates and post-processes it."""
    if not isinstance(item, dict):
        raise _bad(f"'{where}' must be an object", "messages")
    if item.get("type", "function") != "function":
        raise _bad(
            f"'{where}.type' must be 'function' (chat completions support function tool calls only)",
            "messages",
        )
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"'{where}.function' must be an object", "messages")
    if not isinstance(item.get("id"), str):
        raise _bad(f"'{where}.id' must be a string", "messages")
    if "type" not in item:
        raise _bad(f"'{where}.type' is required", "messages")
    name, args = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str):
        raise _bad(f"'{where}.function.name' must be a string", "messages")
    if not isinstance(args, str):
        raise _bad(f"'{where}.function.arguments' must be a JSON string", "messages")
    parsed: Any = {}
    if args:
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = {}  # vLLM keeps such a turn, with empty arguments
        except RecursionError:
            raise _bad(f"'{where}.function.arguments' nests too deeply", "messages") from None
        if not isinstance(parsed, dict):
            parsed = {}
    function = {
        "arguments": parsed,
        "name": name,
        **{k: v for k, v in fn.items() if k not in ("arguments", "name")},
    }
    return {
        "id": item["id"],
        "function": function,
        "type": "function",
        **{k: v for k, v in item.items() if k not in ("id", "function", "type")},
    }


def parse_messages(messages: Any, content_format: str) -> tuple[list[dict], bool]:
    """The conversation vLLM hands its template, and whether media parts were dropped
    (steps 1 and the tool-call post-processing of the module docstring).
    Raises ``MalformedRequest`` naming the field."""
    if messages is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise _bad(f"'messages' must be a list, got {type(messages).__name__}", "messages")
    out: list[dict] = []
    media = False
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(f"'{where}' must be an object", "messages")
        role = msg.get("role")
        if not isinstance(role, str):
            raise _bad(f"'{where}.role' must be a string", "messages")
        parts, m = _parts(msg.get("content"), role, f"{where}.content")
        media = media or m
        res: dict[str, Any] = {"role": role, "content": _content(parts, content_format)}
        if role == "assistant":
            calls = msg.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise _bad(f"'{where}.tool_calls' must be a list", "messages")
                if calls:  # an empty list is dropped: the template's plain path
                    res["tool_calls"] = [
                        _tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)
                    ]
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:  # passed on unchecked, as vLLM does
                res["reasoning"] = reasoning
                res["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                tcid = msg["tool_call_id"]
                if tcid is not None and not isinstance(tcid, str):
                    raise _bad(f"'{where}.tool_call_id' must be a string", "messages")
                res["tool_call_id"] = tcid
            if all(k == "text" for k, _, _ in parts):
                res["content"] = "\n".join(v for _, v, _ in parts)
        if "name" in msg:
            if not isinstance(msg["name"], str):
                raise _bad(f"'{where}.name' must be a string", "messages")
            res["name"] = msg["name"]
        if isinstance(msg.get("task"), str):
            res["task"] = msg["task"]
        if role == "developer":
            res["tools"] = msg.get("tools")
        out.append(res)
    return out, media


def developer_as_system(conversation: list[dict]) -> list[dict]:
    """Step 2: developer -> system, every system message merged into the first."""
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    conv = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        conv.append(m)
    contents: list[str] = []
    rest: list[dict] = []
    merge = False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or contents:
            merge = True
        c = m.get("content", "")
        if isinstance(c, list):
            texts = []
            for p in c:
                if isinstance(p, dict) and "text" in p:
                    texts.append(p["text"])
                elif isinstance(p, str):
                    texts.append(p)
            c = "\n".join(texts)
        if c:
            contents.append(c)
    if not merge:
        return conv
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]


def tool_dicts(tools: Any) -> list[dict] | None:
    """Step 3: the request's ``tools`` as vLLM dumps them. Raises ``MalformedRequest``."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"'{where}' must be an object", "tools")
        if tool.get("type", "function") != "function":
            raise _bad(f"'{where}.type' must be 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"'{where}.function' must be an object", "tools")
        if not isinstance(fn.get("name"), str):
            raise _bad(f"'{where}.function.name' must be a string", "tools")
        for key, types in (("description", str), ("parameters", dict)):
            v = fn.get(key)
            if v is not None and not isinstance(v, types):
                raise _bad(f"'{where}.function.{key}' must be a {types.__name__}", "tools")
        strict, fdl, tdl = (
            None if v is None else lax_bool(v, f"{where}.{name}", "tools")
            for name, v in (
                ("function.strict", fn.get("strict")),
                ("function.defer_loading", fn.get("defer_loading")),
                ("defer_loading", tool.get("defer_loading")),
            )
        )
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        if strict is not None:
            f["strict"] = strict
        if fdl is None:
            fdl = tdl  # the tool-level flag propagates into the function
        if fdl is not None:
            f["defer_loading"] = fdl
        d: dict[str, Any] = {"type": "function", "function": f}
        if tdl is not None:
            d["defer_loading"] = tdl
        out.append(d)
    return out


def find_surrogate(value: Any, path: str, limit: int = 100_000) -> str | None:
    """The path of the first string holding a lone surrogate (not valid UTF-8), if
    any; visits at most ``limit`` values."""
    stack: list[tuple[Any, str]] = [(value, path)]
    seen = 0
    while stack and seen < limit:
        v, p = stack.pop()
        seen += 1
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            stack.extend((x, f"{p}.{k}") for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None
