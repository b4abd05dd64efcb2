"""Watching an OpenAI-style SSE response as it passes through the router.

The data plane relays a worker's stream to the client byte for byte, except that it
needs three facts from it and may hide one event::

    data: {"choices":[{"delta":{"role":"assistant","content":""}}]}   role chunk: no token
    data: {"choices":[{"delta":{"content":"Hel"}}]}                   FIRST CONTENT TOKEN
    ...
    data: {"choices":[],"usage":{"prompt_tokens":..,                   USAGE (asked for by
           "prompt_tokens_details":{"cached_tokens":..}}}              the router: hidden)
    data: [DONE]

- ``first_token``: the first event that carries generated output (text, content,
  reasoning, tool calls, or SGLang ``/generate``'s ``text``). A chat stream's first
  event is an empty role chunk that engines send *before* prefill (vLLM and our
  agent both do): the request's prompt is still queued prefill work until a real
  token arrives, so the router keeps its load counted until then (contract 10, docs/DESIGN.md).
- ``usage``: ``(prompt_tokens, cached_tokens)`` from the usage event (OpenAI) or
  from ``meta_info`` (SGLang ``/generate``), when present.
- ``output_events``: the events passed from the first one carrying output on (that
  one included): what a stream cut off before its usage cost at least, one token
  each (radixfleet.route.tenancy). An engine may put several tokens in one event, and the
  closing events (finish reason, usage, ``[DONE]``) are counted too.
- With ``strip_usage`` the usage-only event (``"choices": []``) is removed: the
  router asked for it (``stream_options.include_usage``) where the client did not.
- An event carrying ``kv_transfer_params`` (the P/D hand-off's engine, host and
  port: ``radixfleet.server.edge``) is passed on without it, re-encoded as one ``data:`` line.

Events end at a blank line, and SSE lets a line end in CRLF, LF or a lone CR, so a
blank line is any two line ends in a row: ``\n\n``, ``\r\n\r\n``, ``\r\r`` or a
mix (``\r\n\n``, ``\n\r\n``, ...). sse-starlette, for one, writes CRLF. A lone CR
at the very end of a read is taken as a line end at once (waiting for the next read
would hold the event one token longer); an LF that then opens the next read is the
rest of that CRLF and is passed on as it is.

Cost: events are parsed as JSON only until the first token is seen; after that only
events containing ``"usage"``, ``"meta_info"`` or ``"kv_transfer_params"`` are. ``feed`` forwards whole
events: an event cut across two reads is held until its end arrives (engines write
whole events, so this adds no delay in practice); ``pending`` says how many bytes
are held, which the caller bounds. Lines that are not ``data:`` (comments,
``event:``, ``id:``) pass through untouched. Malformed JSON in an event is passed
through and ignored for the facts above — the client sees exactly what the worker
sent. When the stream breaks, ``flush(complete=False)`` drops the unfinished event
(a cut ``data: {"content":"hel`` line is not JSON, and the error event that follows
must not be glued onto it).
"""

from __future__ import annotations

import json
import re

from radixfleet.server.edge import scrub

#: a blank line: a line end (LF, or CR not followed by LF in this read, or the LF of
#: a CRLF) followed by another line end (see the module docstring)
_BLANK = re.compile(rb"\n\n|\n\r\n?|\r\r\n?")
#: an event that may carry P/D hand-off fields (radixfleet.server.edge), parsed to drop them
_KV = b'"kv_transfer_params"'


def _has_output(obj) -> bool:
    """True if a parsed stream event carries generated output."""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices")
    if isinstance(choices, list):
        for c in choices:
            if not isinstance(c, dict):
                continue
            if c.get("text"):  # completions
                return True
            d = c.get("delta")
            if isinstance(d, dict) and (
                d.get("content")
                or d.get("reasoning_content")
                or d.get("reasoning")
                or d.get("tool_calls")
                or d.get("refusal")
            ):
                return True
        return False
    # SGLang /generate streams {"text": ..., "meta_info": {...}}
    return bool(obj.get("text")) and isinstance(obj.get("meta_info"), dict)


def usage_of(obj) -> tuple[int, int] | None:
    """``(prompt_tokens, cached_tokens)`` from a response object (OpenAI ``usage`` or
    SGLang ``meta_info``), or None when it reports no cached tokens."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if isinstance(u, dict):
        pt = u.get("prompt_tokens")
        det = u.get("prompt_tokens_details")
        ct = det.get("cached_tokens") if isinstance(det, dict) else None
        if type(pt) is int and type(ct) is int and 0 <= ct <= pt:
            return pt, ct
        return None
    mi = obj.get("meta_info")
    if isinstance(mi, dict):
        pt, ct = mi.get("prompt_tokens"), mi.get("cached_tokens")
        if type(pt) is int and type(ct) is int and 0 <= ct <= pt:
            return pt, ct
    return None


def completion_tokens_of(obj) -> int | None:
    """Generated tokens a response object reports (OpenAI ``usage.completion_tokens``
    or SGLang ``meta_info.completion_tokens``), or None."""
    if not isinstance(obj, dict):
        return None
    for part in ("usage", "meta_info"):
        u = obj.get(part)
        if isinstance(u, dict):
            n = u.get("completion_tokens")
            return n if type(n) is int and n >= 0 else None
    return None


class StreamWatch:
    """Scans one SSE response (see the module docstring). Not reusable."""

    __slots__ = ("strip_usage", "first_token", "usage", "output_tokens", "output_events", "_tail", "_cr")

    def __init__(self, strip_usage: bool = False) -> None:
        self.strip_usage = strip_usage  # hide the usage-only event the router asked for
        self.first_token = False  # an event with generated output has passed
        self.usage: tuple[int, int] | None = None  # (prompt_tokens, cached_tokens)
        self.output_tokens: int | None = None  # completion_tokens, where reported
        self.output_events = 0  # events from the first with output on (module docstring)
        self._tail = b""  # an incomplete event held until its end arrives
        #: the last event ended in a CR taken as a line end: 1 passed on, 2 dropped
        #: (an LF opening the next read is the rest of it and goes the same way), 0 no
        self._cr = 0

    @property
    def pending(self) -> int:
        """Bytes of an unfinished event held back."""
        return len(self._tail)

    def feed(self, chunk: bytes) -> bytes:
        """Takes bytes from the worker; returns the bytes to send to the client now."""
        lead = b""
        if self._cr:
            if chunk[:1] == b"\n":  # the rest of a CRLF: goes where its CR went
                lead = b"\n" if self._cr == 1 else b""
                chunk = chunk[1:]
            self._cr = 0
        data = self._tail + chunk if self._tail else chunk
        end = -1
        events = 0
        for m in _BLANK.finditer(data):
            end = m.end()
            events += 1
        if end < 0:
            self._tail = data
            return lead
        self._tail = data[end:]
        cr = end == len(data) and data[end - 1] == 13  # ends in b"\r"
        whole = data[:end]
        if self.first_token and not (b'"usage"' in whole or b'"meta_info"' in whole or _KV in whole):
            self.output_events += events
            self._cr = cr
            return lead + whole if lead else whole
        out = [lead]
        changed = kept = False
        start = 0
        for m in _BLANK.finditer(whole):
            ev = whole[start : m.end()]
            start = m.end()
            sent = self._scan(ev)
            kept = sent is ev
            if self.first_token:
                self.output_events += 1
            if kept:
                out.append(ev)
            else:
                changed = True
                if sent:
                    out.append(sent)
        # a rewritten event ends in its own LF LF: the rest of a CRLF goes with it
        self._cr = (1 if kept else 2) if cr else 0
        if not changed:
            return lead + whole if lead else whole
        return b"".join(out)

    def flush(self, complete: bool = True) -> bytes:
        """The stream ended. ``complete`` (it ended as its framing says): whatever
        incomplete event is held, as it came. Otherwise (it broke) the unfinished
        event is dropped: b"" so that what follows starts on a fresh line."""
        tail, self._tail = self._tail, b""
        if not complete or not tail:
            return b""
        return self._scan(tail) or b""

    def _scan(self, ev: bytes) -> bytes | None:
        """Reads one event's facts. Returns what to send: ``ev`` itself, ``ev``
        without P/D hand-off fields (re-encoded), or None to drop it (the stripped
        usage)."""
        if self.first_token and b'"usage"' not in ev and b'"meta_info"' not in ev and _KV not in ev:
            return ev
        lines = ev.splitlines()
        parts = [line[5:] for line in lines if line.startswith(b"data:")]
        if not parts:
            return ev
        # one space after the colon is not part of the value; data lines join with LF
        payload = b"\n".join(p[1:] if p[:1] == b" " else p for p in parts).strip()
        if not payload or payload == b"[DONE]":
            return ev
        try:
            obj = json.loads(payload)
        except ValueError:
            return ev
        if not self.first_token and _has_output(obj):
            self.first_token = True
        n = completion_tokens_of(obj)
        if n is not None:
            self.output_tokens = n
        u = usage_of(obj)
        if u is not None:
            self.usage = u
            if self.strip_usage and obj.get("choices") == []:
                return None
        if _KV in payload and scrub(obj):
            other = [line for line in lines if line and not line.startswith(b"data:")]
            data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
            return b"\n".join([*other, b"data: " + data]) + b"\n\n"
        return ev
