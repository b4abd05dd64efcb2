"""Exact token keys ("precise mode", contract 8 of docs/DESIGN.md): a request keyed the
way the engine itself sees it, block for block equal to the keys of the engine's KV events.

Pipeline (one ``TokenKeyer`` per tokenizer, shared by every worker serving it)::

    body ──> prompt token ids, exactly as vLLM 0.32 builds them
             /v1/completions       prompt (str | ids | list of either: the first is
                                   keyed, as radixfleet.keys does), add_special_tokens
                                   (default true), truncate_prompt_tokens
             /v1/chat/completions  messages + tools + flags -> chat_render -> text,
                                   add_special_tokens (default false), or
                                   kv_transfer_params.prompt_token_ids when forwarded
             /generate (SGLang)    text (special tokens added) | input_ids
         ──> text encoded by PieceEncoder (== tokenizer(text), pieces cached)
         ──> h_0 = token_namespace_seed(model, cache_salt, adapter, block_size)
             h_k = xxh3_64(uint32-le(block k), seed=h_{k-1})   whole blocks only
             (radixfleet.keys.token_block_hashes, the same function the events use)

``key()`` returns a ``TokenKey``; a valid request this module cannot reproduce (media
parts, prompt embeddings, a fill-in-the-middle suffix, a model vLLM renders with its
own code) is a ``TokenKey`` with no hashes and ``unkeyed`` saying why: the router
routes it by load. Bad input raises ``MalformedRequest`` naming the field, never
anything else; a tokenizer that cannot be loaded raises ``TokenizerLoadError``.

Nothing is downloaded unless asked (``download``, the router's
``tokenizers.download``): a tokenizer comes from a local folder or from the local
Hugging Face cache (``local_files_only``).

Public API::

    TokenKeyer.load(source, *, revision, cache_dir, require_chat_template=True, download=False,
                    chat_template, content_format, trust_request_chat_template,
                    default_chat_template_kwargs, exclude_tools_when_tool_choice_none,
                    max_model_len, cache_bytes, tokenizer_backend) -> TokenKeyer
    keyer.key(endpoint, body, *, block_size, model=FROM_BODY, salt=FROM_BODY,
              adapter=FROM_BODY)                                -> TokenKey
    keyer.token_ids(endpoint, body)                             -> (array('I'), unkeyed)
    keyer.chat_prompt(body)                                     -> ChatPrompt
    TokenKey(model, salt, adapter, block_tokens, token_ids, hashes, unkeyed)
        .prompt_tokens .exact
    request_cache_salt(body) -> str;  TokenizerLoadError(ConfigError): .source .cause
"""

from __future__ import annotations

import logging
import os
from array import array
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixfleet.engines.chat_render import (
    HF_NAMED_PARAMS,
    REASONING_EFFORTS,
    TOKENIZE_OPTIONS,
    ChatTemplate,
    developer_as_system,
    find_surrogate,
    lax_bool,
    merge_kwargs,
    parse_messages,
    template_error_reason,
    tool_dicts,
)
from radixfleet.engines.piece_encoder import PieceEncoder
from radixfleet.keys import (
    Endpoint,
    request_adapter,
    request_model,
    token_block_hashes,
    token_namespace_seed,
)
from radixfleet.wire.errors import ConfigError, MalformedRequest
from radixfleet.wire.extras import require

log = logging.getLogger(__name__)

#: vLLM's limits on ``cache_salt`` (entrypoints/generate/base/protocol.py).
MAX_CACHE_SALT_CHARS = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")
#: Files that make vLLM pick mistral_common instead of the HF tokenizer.
_MISTRAL_FILES = ("tekken.json",)
#: Architectures vLLM 0.32 renders with its own code, not the HF chat template.
_OWN_RENDERERS = frozenset(
    {
        "MoonshotKimiaForCausalLM",
        "KimiK3ForConditionalGeneration",
        "DeepseekV32ForCausalLM",
        "DeepseekV4ForCausalLM",
        "DeepseekV4ForConditionalGeneration",
        "DeepseekV41ForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
    }
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: The field that holds each endpoint's prompt (named by errors about it).
_PROMPT_FIELD = {Endpoint.CHAT: "messages", Endpoint.COMPLETIONS: "prompt", Endpoint.GENERATE: "text"}
#: A request may bring its own template (when trusted): compiled ones kept, bounded.
_REQUEST_TEMPLATES_MAX = 32


class _FromBody:
    __slots__ = ()

    def __repr__(self) -> str:
        return "FROM_BODY"


#: Default of ``key()``'s model, salt and adapter: read them from the request body.
FROM_BODY: Any = _FromBody()


class TokenizerLoadError(ConfigError):
    """A tokenizer folder or cached repo that cannot be used; names it and the cause."""

    def __init__(self, source: str, cause: str) -> None:
        super().__init__("", f"tokenizer {source!r}: {cause}")
        self.source = source
        self.cause = cause


@dataclass(frozen=True, slots=True)
class TokenKey:
    """A request's exact key: its prompt token ids and their chained block hashes."""

    model: str
    salt: str
    adapter: str | None
    #: the engine's KV block size in tokens
    block_tokens: int
    #: the prompt token ids the engine will see (uint32)
    token_ids: array
    #: one chained hash per whole block of token_ids; the partial tail is not keyed
    hashes: list[int]
    #: why this valid request has no exact key (then hashes is empty); None if exact
    unkeyed: str | None = None

    @property
    def prompt_tokens(self) -> int:
        """Exact prompt tokens (a lower bound when ``unkeyed``: media not counted)."""
        return len(self.token_ids)

    @property
    def exact(self) -> bool:
        return self.unkeyed is None


class ChatPrompt(NamedTuple):
    """A chat body rendered as the engine renders it (``TokenKeyer.chat_prompt``)."""

    #: the prompt text the engine tokenizes
    text: str
    #: True when the template call itself tokenizes (``chat_template_kwargs.tokenize``)
    tokenize: bool
    #: tokenizer options that call was given (padding, truncation, ...): not reproduced
    tokenize_options: tuple[str, ...]
    #: why the text is not exactly the engine's (media parts dropped); None if it is
    unkeyed: str | None


def request_cache_salt(body: dict) -> str:
    """The body's ``cache_salt`` as vLLM accepts it ('' when absent).
    Raises ``MalformedRequest`` (param ``cache_salt``) where vLLM answers 400."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise MalformedRequest("'cache_salt' must be a non-empty string if provided", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS or any(c in _SALT_FORBIDDEN for c in salt):
        raise MalformedRequest(
            f"'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} "
            "characters and must not contain '@', '/', '\\' or NUL",
            param="cache_salt",
        )
    return salt


def _flag(body: dict, field: str, default: bool) -> bool:
    v = body.get(field)
    return default if v is None else lax_bool(v, field, field)


def _ids(value: list, field: str, where: str) -> array:
    try:
        if any(type(t) is not int for t in value):
            raise OverflowError
        return array("I", value)
    except OverflowError:
        bad = next((t for t in value if type(t) is not int or not 0 <= t < 2**32), None)
        raise MalformedRequest(
            f"'{where}' must hold token ids (integers in [0, 2^32)), got {bad!r}", param=field
        ) from None


def _first_prompt(prompt: Any, field: str) -> str | array:
    """The prompt vLLM serves first among ``prompt``'s forms (radixfleet.keys'
    rule: a list of prompts is keyed on its first); every element is validated."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if type(first) is int:
            return _ids(prompt, field, field)
        if isinstance(first, str):
            for i, p in enumerate(prompt):
                if not isinstance(p, str):
                    raise MalformedRequest(f"'{field}[{i}]' must be a string", param=field)
            return first
        if isinstance(first, list):
            out = None
            for i, p in enumerate(prompt):
                if not isinstance(p, list) or not p:
                    raise MalformedRequest(
                        f"'{field}[{i}]' must be a non-empty list of token ids", param=field
                    )
                ids = _ids(p, field, f"{field}[{i}]")
                out = ids if out is None else out
            assert out is not None, "prompt has a first element"
            return out
    if isinstance(prompt, list):
        raise MalformedRequest(f"'{field}' must not be empty", param=field)
    raise MalformedRequest(
        f"'{field}' must be a string, a list of strings, token ids or "
        f"lists of token ids, got {type(prompt).__name__}",
        param=field,
    )


def _looks_like_path(source: str) -> bool:
    """A folder path rather than a repo id (``org/name``)."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1


def key_from_ids(
    token_ids, endpoint: Endpoint, body: Any, block_size: int, model: Any, salt: Any, adapter: Any
) -> TokenKey:
    """A request's ``TokenKey`` from ``token_ids(endpoint, body) -> (ids, unkeyed)``
    (a tokenizer here, or the engine's own /tokenize: radixfleet.engines.engine_keys):
    its namespace (``model``, ``salt``, ``adapter``, each read from the body where
    ``FROM_BODY``) and block hashes. Raises ``MalformedRequest`` for a body that is
    not an object or a bad ``cache_salt``."""
    if not isinstance(body, dict):
        raise MalformedRequest(f"request body must be a JSON object, got {type(body).__name__}")
    if model is FROM_BODY:
        model = request_model(body, endpoint)
    body_salt = request_cache_salt(body)
    if salt is FROM_BODY:
        salt = body_salt
    if adapter is FROM_BODY:
        adapter = request_adapter(body)
    ids, unkeyed = token_ids(endpoint, body)
    if unkeyed is not None:
        return TokenKey(model, salt, adapter, block_size, ids, [], unkeyed)
    seed = token_namespace_seed(model, salt, adapter, block_size)
    return TokenKey(model, salt, adapter, block_size, ids, token_block_hashes(ids, block_size, seed))


class TokenKeyer:
    """Keys requests for one tokenizer (and chat template) exactly as vLLM 0.32 does.

    Shared by every worker that serves a model with this tokenizer (the model name,
    block size, salt and adapter are per call). Holds a ``PieceEncoder`` whose cache
    makes a conversation's next turn cost its new messages only. Not thread-safe.
    """

    __slots__ = (
        "source",
        "tokenizer",
        "encoder",
        "templates",
        "default_template",
        "chat_blocked",
        "trust_request_chat_template",
        "default_chat_template_kwargs",
        "exclude_tools_when_tool_choice_none",
        "max_model_len",
        "_special_map",
        "_request_templates",
        "_template_names",
        "_content_format",
    )

    def __init__(
        self,
        tokenizer: Any,
        *,
        source: str,
        content_format: str = "auto",
        trust_request_chat_template: bool = False,
        default_chat_template_kwargs: dict | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
        max_model_len: int | None = None,
        chat_template: str | None = None,
        chat_blocked: str | None = None,
        cache_bytes: int = 64 << 20,
        tokenizer_backend: str = "auto",
    ) -> None:
        """From a loaded transformers tokenizer; ``load()`` is the usual way in.

        The keyword arguments mirror the engine's flags: ``--chat-template`` (a file or
        the template itself, replacing the tokenizer's), ``--chat-template-content-
        format``, ``--trust-request-chat-template``, ``--default-chat-template-kwargs``,
        ``--exclude-tools-when-tool-choice-none``, ``--max-model-len`` (needed only for
        ``truncate_prompt_tokens: -1``). ``cache_bytes`` bounds the piece cache;
        ``tokenizer_backend`` chooses who tokenizes (radixfleet.engines.piece_encoder).
        Raises ``TokenizerLoadError`` for a chat template that cannot be read or does
        not compile."""
        if content_format not in ("auto", "string", "openai"):
            raise ValueError(f"content_format must be auto, string or openai, got {content_format!r}")
        self.source = source
        self.tokenizer = tokenizer
        try:
            self.encoder = PieceEncoder(tokenizer, max_cache_bytes=cache_bytes, backend=tokenizer_backend)
        except RuntimeError as exc:  # fastokens asked for and unusable
            raise TokenizerLoadError(source, str(exc)) from None
        self.trust_request_chat_template = trust_request_chat_template
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.max_model_len = max_model_len
        #: why chat requests cannot be keyed for this model (vLLM renders it with
        #: its own code); None when they can
        self.chat_blocked = chat_blocked
        self._special_map = dict(tokenizer.special_tokens_map)
        self._request_templates: dict[str, ChatTemplate] = {}
        raw = tokenizer.chat_template
        if chat_template is not None:
            raw = _read_template(source, chat_template)
        #: name -> ChatTemplate for tokenizers with several; {"": t} for one
        self.templates: dict[str, ChatTemplate] = {}
        try:
            if isinstance(raw, dict):
                for name, src in raw.items():
                    self.templates[name] = ChatTemplate(src, content_format)
            elif isinstance(raw, str):
                self.templates[""] = ChatTemplate(raw, content_format)
        except Exception as exc:  # a jinja syntax error in the model's own template
            raise TokenizerLoadError(source, f"chat template does not compile: {exc}") from None
        self._template_names = isinstance(raw, dict)
        self.default_template = self.templates.get("") or self.templates.get("default")
        self._content_format = content_format  # for templates a request brings

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        source: str,
        *,
        revision: str | None = None,
        cache_dir: str | None = None,
        require_chat_template: bool = True,
        download: bool = False,
        **options: Any,
    ) -> TokenKeyer:
        """The keyer of a tokenizer folder, or of a repo id already in the local Hugging
        Face cache (``local_files_only``: nothing is downloaded unless ``download``,
        which lets transformers fetch a repo from the hub). ``options`` are the
        constructor's. Raises ``TokenizerLoadError`` naming ``source`` and the cause:
        a missing or unreadable folder, a folder without a tokenizer, a repo not in the
        cache, a tokenizer that needs remote code, no chat template (when
        ``require_chat_template``)."""
        if not isinstance(source, str) or not source:
            raise TokenizerLoadError(str(source), "empty tokenizer source")
        folder = os.path.expanduser(source)
        files: set[str] = set()
        if os.path.isdir(folder):
            try:
                files = set(os.listdir(folder))
            except OSError as exc:
                raise TokenizerLoadError(source, f"folder is not readable ({exc.strerror or exc})") from None
            if not files & set(_TOKENIZER_FILES):
                raise TokenizerLoadError(source, f"folder holds no tokenizer ({', '.join(_TOKENIZER_FILES)})")
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if name in files:
                    try:
                        with open(os.path.join(folder, name), "rb") as f:
                            f.read(1)
                    except OSError as exc:
                        raise TokenizerLoadError(
                            source, f"{name} is not readable ({exc.strerror or exc})"
                        ) from None
            where = folder
        elif os.path.exists(folder):
            raise TokenizerLoadError(source, "not a folder")
        elif _looks_like_path(source):
            raise TokenizerLoadError(source, "no such folder")
        else:
            where = source
        try:
            AutoTokenizer = require("transformers", "engines", "an engine's tokenizer").AutoTokenizer

            # vLLM loads generation tokenizers with truncation_side="left"
            tok = AutoTokenizer.from_pretrained(
                where,
                local_files_only=not download,
                trust_remote_code=False,
                revision=revision,
                cache_dir=cache_dir,
                truncation_side="left",
            )
        except Exception as exc:
            msg = " ".join(str(exc).split()) or type(exc).__name__
            inner = exc.__cause__ or exc.__context__
            if inner is not None and str(inner):
                msg = f"{msg} ({' '.join(str(inner).split())})"
            if where is source and not files:
                msg = (
                    f"not a folder, and not loadable from the Hugging Face hub: {msg}"
                    if download
                    else f"not a folder, and not loadable from the local Hugging Face cache "
                    f"(nothing is downloaded at run time): {msg}"
                )
            raise TokenizerLoadError(source, msg[:500]) from None
        if require_chat_template and tok.chat_template is None and options.get("chat_template") is None:
            raise TokenizerLoadError(
                source, "has no chat template (chat_template.jinja or tokenizer_config.json's chat_template)"
            )
        blocked = options.pop("chat_blocked", None) or _engine_renderer(where, files)
        return cls(tok, source=source, chat_blocked=blocked, **options)

    # ------------------------------------------------------------------ keying

    def key(
        self,
        endpoint: Endpoint,
        body: Any,
        *,
        block_size: int,
        model: Any = FROM_BODY,
        salt: Any = FROM_BODY,
        adapter: Any = FROM_BODY,
    ) -> TokenKey:
        """The exact key of a request body for an engine with ``block_size``-token blocks.

        ``model`` (the served model name), ``salt`` and ``adapter`` form the key's
        namespace with the block size; by default they are read from the body
        (``model``, ``cache_salt``, ``lora_path``/``lora_adapter``). O(prompt) for the
        text split and hashing, plus the tokenization of text pieces not cached.
        Raises ``MalformedRequest`` naming the field."""
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        return key_from_ids(self.token_ids, endpoint, body, block_size, model, salt, adapter)

    def token_ids(self, endpoint: Endpoint, body: dict) -> tuple[array, str | None]:
        """The prompt token ids the engine will see, and why they are not exact (None
        when they are). Raises ``MalformedRequest`` naming the field."""
        try:
            if endpoint is Endpoint.CHAT:
                ids, why = self._chat_ids(body)
            elif endpoint is Endpoint.COMPLETIONS:
                ids, why = self._completion_ids(body)
            else:
                ids, why = self._generate_ids(body)
        except (TypeError, UnicodeError) as exc:
            # the Rust tokenizer refuses text that is not valid UTF-8 (lone surrogates)
            path = find_surrogate(body, "")
            if path is None:
                raise
            field = path.lstrip(".").split(".")[0].split("[")[0]
            raise MalformedRequest(
                f"'{path.lstrip('.')}' is not valid UTF-8 (a lone surrogate)", param=field
            ) from exc
        if not ids and why is None:  # vLLM: "The decoder prompt cannot be empty"
            field = (
                "truncate_prompt_tokens"
                if body.get("truncate_prompt_tokens") == 0
                else _PROMPT_FIELD[endpoint]
            )
            raise MalformedRequest("the prompt is empty: it has no tokens", param=field)
        return ids, why

    # completions / generate

    def _completion_ids(self, body: dict) -> tuple[array, str | None]:
        embeds = body.get("prompt_embeds")
        prompt = body.get("prompt")
        if embeds is not None and embeds != []:
            return array("I"), "prompt_embeds are not token ids"
        if prompt is None or prompt == "":
            raise MalformedRequest(
                "either 'prompt' or 'prompt_embeds' must be provided and non-empty", param="prompt"
            )
        first = _first_prompt(prompt, "prompt")
        if body.get("suffix") is not None:
            return array("I"), "suffix: fill-in-the-middle is rendered by model-specific code"
        add_special = _flag(body, "add_special_tokens", True)
        if isinstance(prompt, list) and isinstance(first, str) and "" in prompt:
            # every prompt of the list is served; an empty one fails the request
            affix = self.encoder.affix
            if not add_special or affix is None or not (affix[0] or affix[1]):
                raise MalformedRequest(f"'prompt[{prompt.index('')}]' is empty", param="prompt")
        if isinstance(first, str):
            return self._encode_truncated(first, add_special, body, max_out=self._max_out(body))
        return self._truncate_ids(first, body, max_out=self._max_out(body))

    def _generate_ids(self, body: dict) -> tuple[array, str | None]:
        """SGLang's /generate: ``text`` tokenized with special tokens, or ``input_ids``."""
        if body.get("text") is not None:
            first = _first_prompt(body["text"], "text")
            if not isinstance(first, str):
                raise MalformedRequest("'text' must be a string or a list of strings", param="text")
            return self.encoder.encode(first, True), None
        if body.get("input_ids") is not None:
            first = _first_prompt(body["input_ids"], "input_ids")
            if isinstance(first, str):
                raise MalformedRequest("'input_ids' must hold token ids", param="input_ids")
            return first, None
        raise MalformedRequest("'text' or 'input_ids' is required", param="text")

    # truncation (vLLM's TokenizeParams): only when a request asks for it

    @staticmethod
    def _max_out(body: dict) -> int:
        for f in ("max_completion_tokens", "max_tokens"):
            v = body.get(f)
            if v is not None:
                return v if type(v) is int else 0
        return 0

    def _truncation(self, body: dict, max_out: int) -> tuple[int | None, str | None, str | None]:
        """(keep, explicit side, unkeyed reason) of ``truncate_prompt_tokens``."""
        n = body.get("truncate_prompt_tokens")
        side = body.get("truncation_side")
        if side is not None and side not in ("left", "right"):
            raise MalformedRequest("'truncation_side' must be 'left' or 'right'", param="truncation_side")
        if n is None:
            return None, side, None
        if type(n) is not int or n < -1:
            raise MalformedRequest(
                "'truncate_prompt_tokens' must be an integer >= -1", param="truncate_prompt_tokens"
            )
        if n == -1:
            if self.max_model_len is None:
                return None, side, "truncate_prompt_tokens=-1 needs the engine's max_model_len"
            n = self.max_model_len if max_out == 0 else max(0, self.max_model_len - 1)
        return n, side, None

    def _truncate_ids(self, ids: array, body: dict, max_out: int) -> tuple[array, str | None]:
        n, side, why = self._truncation(body, max_out)
        if why is not None:
            return ids, why
        if n is None:
            return ids, None
        return self._cut(ids, n, side), None

    def _encode_truncated(
        self, text: str, add_special: bool, body: dict, max_out: int
    ) -> tuple[array, str | None]:
        ids = self.encoder.encode(text, add_special)
        n, side, why = self._truncation(body, max_out)
        if why is not None:
            return ids, why
        if n is None:
            return ids, None
        if side is None and 0 < n < len(ids):
            # vLLM first asks the tokenizer to truncate (its side: left for generation);
            # it keeps room for the special tokens it adds, and does nothing when they
            # alone exceed the length
            if add_special:
                affix = self.encoder.affix
                if affix is None:
                    return ids, "truncation with this tokenizer's post-processor"
                pre, suf = affix
                if n >= len(pre) + len(suf):
                    core = ids[len(pre) : len(ids) - len(suf)]
                    keep = n - len(pre) - len(suf)
                    ids = pre + (core[len(core) - keep :] if keep else array("I")) + suf
            else:
                ids = ids[len(ids) - n :]
        # ... and then cuts what is still too long, on the side asked for
        return self._cut(ids, n, side), None

    @staticmethod
    def _cut(ids: array, n: int, side: str | None) -> array:
        if n >= len(ids):
            return ids
        return ids[:n] if side == "right" else ids[len(ids) - n :]

    # chat

    def _template(self, requested: str | None, tools: list | None) -> ChatTemplate | None:
        if requested is not None:
            if self._template_names and requested in self.templates:
                return self.templates[requested]
            t = self._request_templates.get(requested)
            if t is None:
                try:
                    t = ChatTemplate(requested, self._content_format)
                except Exception as exc:
                    raise MalformedRequest(
                        f"'chat_template' does not compile: {exc}", param="chat_template"
                    ) from None
                if len(self._request_templates) >= _REQUEST_TEMPLATES_MAX:
                    self._request_templates.clear()
                self._request_templates[requested] = t
            return t
        if self._template_names:
            if tools is not None and "tool_use" in self.templates:
                return self.templates["tool_use"]
            return self.templates.get("default")
        return self.default_template

    def chat_prompt(self, body: dict) -> ChatPrompt:
        """A chat body rendered as vLLM renders it (radixfleet.engines.chat_render).
        Raises ``MalformedRequest`` naming the field."""
        ctk = body.get("chat_template_kwargs")
        if ctk is not None and not isinstance(ctk, dict):
            raise MalformedRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        requested = body.get("chat_template")
        if requested is not None and not isinstance(requested, str):
            raise MalformedRequest("'chat_template' must be a string", param="chat_template")
        if not self.trust_request_chat_template and (
            requested is not None or (ctk and ctk.get("chat_template") is not None)
        ):
            raise MalformedRequest(
                "a chat template is passed with the request, but the "
                "engine does not trust request templates "
                "(--trust-request-chat-template)",
                param="chat_template",
            )
        if body.get("tools") == []:  # vLLM's request validation, as OpenAI's
            raise MalformedRequest(
                "'tools' must not be an empty array: provide at least one tool or omit the field",
                param="tools",
            )
        tools = tool_dicts(body.get("tools"))
        if body.get("tool_choice") == "none" and self.exclude_tools_when_tool_choice_none:
            tools = None
        agp = _flag(body, "add_generation_prompt", True)
        cfm = _flag(body, "continue_final_message", False)
        documents = body.get("documents")
        if documents is not None and (
            not isinstance(documents, list)
            or any(
                not isinstance(d, dict) or any(not isinstance(v, str) for v in d.values()) for d in documents
            )
        ):
            raise MalformedRequest("'documents' must be a list of objects of strings", param="documents")
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise MalformedRequest(
                f"'reasoning_effort' must be one of {', '.join(sorted(REASONING_EFFORTS))}",
                param="reasoning_effort",
            )
        # step 4 of chat_render: flags over chat_template_kwargs over the defaults
        extra: dict[str, Any] = {
            "add_generation_prompt": agp,
            "continue_final_message": cfm,
            "documents": documents,
            "reasoning_effort": effort,
        }
        if effort is not None and "enable_thinking" not in (ctk or {}):
            extra["enable_thinking"] = effort != "none"
        kwargs = merge_kwargs(
            merge_kwargs(self.default_chat_template_kwargs, {"tools": tools, "tokenize": False}),
            merge_kwargs(ctk, extra),
        )
        tools = kwargs.pop("tools", None)
        requested = requested if requested is not None else kwargs.pop("chat_template", None)
        kwargs.pop("chat_template", None)
        tokenize = kwargs.pop("tokenize", True)
        template = self._template(requested, tools)
        if template is None:
            raise MalformedRequest(
                "the model has no chat template: the engine cannot serve chat requests", param="messages"
            )
        conversation, media = parse_messages(body.get("messages"), template.content_format)
        if not template.supports_developer:
            conversation = developer_as_system(conversation)
        accept = template.variables | HF_NAMED_PARAMS
        kw = {k: v for k, v in kwargs.items() if k in accept}
        if kw.get("return_assistant_tokens_mask"):
            raise MalformedRequest(
                "'chat_template_kwargs.return_assistant_tokens_mask' "
                "needs return_dict, which the engine never sets",
                param="chat_template_kwargs",
            )
        options = tuple(k for k in TOKENIZE_OPTIONS if kw.get(k))
        for k in (
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "return_assistant_tokens_mask",
            "tokenizer_kwargs",
        ):
            kw.pop(k, None)
        documents = kw.pop("documents", None)
        agp = kw.pop("add_generation_prompt", False)
        cfm = kw.pop("continue_final_message", False)
        try:
            text = template.render(
                conversation,
                tools=tools,
                documents=documents,
                add_generation_prompt=agp,
                continue_final_message=cfm,
                kwargs={**self._special_map, **kw},
            )
        except Exception as exc:  # the template's own refusal, or odd input it chokes on
            raise MalformedRequest(
                f"the chat template rejected the request: {template_error_reason(exc)}"[:1000],
                param="messages",
            ) from None
        return ChatPrompt(
            text,
            bool(tokenize),
            options,
            ("media content is expanded by the engine's processor" if media else None),
        )

    def _chat_ids(self, body: dict) -> tuple[array, str | None]:
        if self.chat_blocked is not None:
            parse_messages(body.get("messages"), "string")  # bad input is still bad
            return array("I"), self.chat_blocked
        messages = body.get("messages")
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("prompt_token_ids") is not None and not body.get("echo"):
            # disaggregated decode: the prefill stage's ids are used as they are
            ids = kv["prompt_token_ids"]
            if not isinstance(ids, list) or not ids:
                raise MalformedRequest(
                    "'kv_transfer_params.prompt_token_ids' must be a non-empty list of token ids",
                    param="kv_transfer_params",
                )
            _, media = parse_messages(messages, "string")
            if not media:
                return _ids(ids, "kv_transfer_params", "kv_transfer_params.prompt_token_ids"), None
        text, tokenize, options, why = self.chat_prompt(body)
        max_out = self._max_out(body)
        if tokenize:
            # the template call tokenizes (no special tokens added), vLLM takes the ids
            ids = self.encoder.encode(text, False)
            if options:
                return ids, f"chat_template_kwargs tokenize with {', '.join(options)}"
            ids, why2 = self._truncate_ids(ids, body, max_out)
        else:
            add_special = _flag(body, "add_special_tokens", False)
            ids, why2 = self._encode_truncated(text, add_special, body, max_out)
        return ids, why or why2

    def check(self) -> None:
        """Asserts the invariants of the parts (the piece cache)."""
        self.encoder.check()
        assert len(self._request_templates) <= _REQUEST_TEMPLATES_MAX


def _read_template(source: str, value: str) -> str:
    """vLLM's ``--chat-template``: a file holding the template, or the template."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeError) as exc:
            raise TokenizerLoadError(
                source, f"chat template file {value!r} is not readable ({exc})"
            ) from None
    return value


def _engine_renderer(where: str, files: set[str]) -> str | None:
    """Why vLLM would render chats for this model with code other than its HF chat
    template (mistral_common, harmony, a model-specific renderer); None if it would not."""
    import json

    if any(f in files for f in _MISTRAL_FILES) or any(f.startswith("tokenizer.model.v") for f in files):
        return "vLLM renders this model's chats with mistral_common"
    config = os.path.join(where, "config.json") if files else None
    if config is None:
        try:
            hub = require("huggingface_hub", "engines", "an engine's tokenizer")
            hit = hub.try_to_load_from_cache(where, "config.json")
            config = hit if isinstance(hit, str) else None
        except Exception:  # not a valid repo id: no config to read
            config = None
    if config is None or not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    if cfg.get("model_type") == "gpt_oss":
        return "vLLM renders gpt-oss chats with harmony"
    archs = cfg.get("architectures")
    if isinstance(archs, list) and any(a in _OWN_RENDERERS for a in archs):
        return f"vLLM renders {archs[0]} chats with its own renderer"
    return None
