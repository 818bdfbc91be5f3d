"""Find tool calls in generated text, in the model's own syntax, whole or as it streams.

Recognised syntaxes (one parser reads all of them, so a sloppy small model still works):

- Hermes / Qwen: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, repeatable;
- Llama 3: ``{"name": "f", "parameters": {...}}`` as the whole output, or after
  ``<|python_tag|>``; several calls joined by ``;``;
- Mistral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` and the newer
  ``[TOOL_CALLS]f[ARGS]{...}``.

Only names of the tools the request declared count as calls. Streaming emits a call's
start as soon as its name is read and then its arguments as they arrive (the JSON text
as the model writes it). Markup that turns out not to be a valid call is given back as
plain content. A call whose arguments break after streaming started is closed as it
stands and marked ``complete=False``; the whole-text parse (``parse_tool_calls``) then
returns the output as plain content instead.
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Iterable

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_START, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
MARKERS = {HERMES_START: "hermes", PYTHON_TAG: "llama", MISTRAL_START: "mistral"}
# Special tokens whose text the detokenizer drops but the parsers need to see.
MARKUP_TOKENS = frozenset({HERMES_START, HERMES_END, PYTHON_TAG, MISTRAL_START, MISTRAL_ARGS})

_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")
_MAX_NAME = 256
_STRING = object()
# {"name": "<name>", "arguments": -- the head of a call object whose arguments can stream.
_OPENER = ("{", '"name"', ":", _STRING, ",", ('"arguments"', '"parameters"'), ":")


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str = ""       # JSON text as the model wrote it
    complete: bool = False    # the arguments closed and parse as JSON


@dataclass(frozen=True)
class ToolEvent:
    """``content`` (text), ``start`` (index, name), ``args`` (index, text) or ``end`` (index)."""

    kind: str
    text: str = ""
    index: int = 0
    name: str = ""


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _match_opener(s: str) -> tuple[str, str, int]:
    """("ok", name, end) when ``s`` starts with a call head, ("need", ...) when it may, else ("fail", ...)."""
    i, name = 0, ""
    for tok in _OPENER:
        while i < len(s) and s[i].isspace():
            i += 1
        if i == len(s):
            return "need", "", 0
        if tok is _STRING:
            if s[i] != '"':
                return "fail", "", 0
            j, escaped = i + 1, False
            while j < len(s):
                c = s[j]
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    break
                j += 1
            else:
                return ("fail" if j - i > _MAX_NAME else "need"), "", 0
            try:
                name = json.loads(s[i:j + 1])
            except ValueError:
                return "fail", "", 0
            i = j + 1
            continue
        options = tok if isinstance(tok, tuple) else (tok,)
        rest = s[i:]
        for option in options:
            if rest.startswith(option):
                i += len(option)
                break
        else:
            return ("need" if any(o.startswith(rest) for o in options) else "fail"), "", 0
    return "ok", name, i


class _JSONScanner:
    """Finds where one JSON value ends, fed in pieces; tracks nesting and strings only."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.in_string = False
        self.escaped = False
        self.paused: int | None = None

    def scan(self, s: str, stop: str | None = None) -> int | None:
        """Index just past the value's end in ``s``, or None when it goes on.

        With ``stop``, the scan also pauses where ``stop`` (or, at the end of ``s``, a prefix of
        it) starts outside a JSON string; ``paused`` is then that index, and nothing from it on
        was read. Inside a string the same text is just text."""
        self.paused = None
        for i, c in enumerate(s):
            if stop is not None and not self.in_string and c == stop[0] and stop.startswith(s[i:i + len(stop)]):
                self.paused = i
                return None
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


class ToolCallParser:
    """Incremental tool-call parser: ``feed`` text deltas, then ``finish`` once."""

    def __init__(self, tool_names: Iterable[str] | None = None) -> None:
        self.names = frozenset(tool_names) if tool_names is not None else None
        self.calls: list[ToolCall] = []
        self._buf = ""            # text not yet consumed
        self._state = "content"
        self._style = ""          # hermes | llama | json | mistral_list | mistral_name
        self._raw = ""            # markup consumed by the attempt in progress (given back on failure)
        self._obj = ""            # a whole call object read before deciding
        self._scanner: _JSONScanner | None = None
        self._call: ToolCall | None = None
        self._seen_text = False   # non-blank content so far: a bare JSON call can only open the output
        self._lead_ws = ""        # leading blank content, dropped when a call comes first

    # -- public -------------------------------------------------------------------
    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self._buf += text
        while getattr(self, "_step_" + self._state)(out):
            pass
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        state, buf = self._state, self._buf
        self._buf = ""
        if self._call is not None:
            if state in ("value", "args", "args_string", "close_skip"):
                self._call.complete = False        # cut short
            self._end_call(out)
            if buf.strip() and state not in ("close", "args", "args_string", "close_skip"):
                self._content(out, buf)
        elif state == "content":
            self._content(out, buf)
        elif state == "after":
            rest = buf.strip()
            if rest and not (self._style == "hermes" and HERMES_END.startswith(rest)):
                self._content(out, buf)
        else:                                       # markup that never became a call
            self._content(out, self._raw + self._obj + buf)
        self._raw = self._obj = ""
        self._state = "content"
        if self._lead_ws and not self.calls:
            out.append(ToolEvent("content", self._lead_ws))
        self._lead_ws = ""
        return _merge(out)

    # -- helpers ------------------------------------------------------------------
    def _content(self, out: list[ToolEvent], text: str) -> None:
        if not text:
            return
        if not self._seen_text:
            if not text.strip():
                self._lead_ws += text
                return
            text, self._lead_ws = self._lead_ws + text, ""
            self._seen_text = True
        if out and out[-1].kind == "content":
            out[-1] = ToolEvent("content", out[-1].text + text)
        else:
            out.append(ToolEvent("content", text))

    def _known(self, name: object) -> bool:
        return isinstance(name, str) and bool(name) and (self.names is None or name in self.names)

    def _start_call(self, out: list[ToolEvent], name: str) -> ToolCall:
        call = ToolCall(len(self.calls), name)
        self.calls.append(call)
        self._call = call
        out.append(ToolEvent("start", index=call.index, name=name))
        return call

    def _args(self, out: list[ToolEvent], text: str) -> None:
        if text and self._call is not None:
            self._call.arguments += text
            out.append(ToolEvent("args", text, index=self._call.index))

    def _end_call(self, out: list[ToolEvent]) -> None:
        if self._call is not None:
            out.append(ToolEvent("end", index=self._call.index))
            self._call = None

    def _fail(self, out: list[ToolEvent]) -> bool:
        """The markup is not a call: give it back as content and read on."""
        if self._call is not None:
            self._call.complete = False
            self._end_call(out)
        else:
            self._content(out, self._raw + self._obj)
        self._raw = self._obj = ""
        self._scanner = None
        self._state = "content"
        return True

    def _skip_ws(self) -> str:
        s = self._buf.lstrip()
        self._raw += self._buf[:len(self._buf) - len(s)]
        self._buf = s
        return s

    # -- states (each returns True when it made progress) --------------------------
    def _step_content(self, out: list[ToolEvent]) -> bool:
        buf = self._buf
        if not buf:
            return False
        if not self._seen_text and self.names is not None:
            stripped = buf.lstrip()
            if not stripped:
                self._content(out, buf)
                self._buf = ""
                return False
            if stripped[0] == "{":
                self._content(out, buf[:len(buf) - len(stripped)])
                self._buf, self._raw, self._style, self._state = stripped, "", "json", "object"
                return True
        at, marker = -1, ""
        for m in MARKERS:
            i = buf.find(m)
            if i >= 0 and (at < 0 or i < at):
                at, marker = i, m
        if at >= 0:
            self._content(out, buf[:at])
            self._buf, self._raw = buf[at + len(marker):], marker
            style = MARKERS[marker]
            self._style = style
            self._state = "mistral_start" if style == "mistral" else "object"
            return True
        hold = max(_partial_suffix(buf, m) for m in MARKERS)
        self._content(out, buf[:len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _step_mistral_start(self, out: list[ToolEvent]) -> bool:
        s = self._skip_ws()
        if not s:
            return False
        if s[0] == "[":
            self._raw += "["
            self._buf = s[1:]
            self._style, self._state = "mistral_list", "object"
            return True
        if s[0] in _NAME_CHARS:
            self._style, self._state = "mistral_name", "mistral_name"
            return True
        return self._fail(out)

    def _step_mistral_name(self, out: list[ToolEvent]) -> bool:
        buf = self._buf
        at = buf.find(MISTRAL_ARGS)
        head = buf if at < 0 else buf[:at]
        if at < 0:
            head = head[:len(head) - _partial_suffix(head, MISTRAL_ARGS)]
        if len(head.strip()) > _MAX_NAME or not all(c in _NAME_CHARS for c in head.strip()):
            return self._fail(out)
        if at < 0:
            return False
        name = head.strip()
        if not self._known(name):
            return self._fail(out)
        self._raw += buf[:at + len(MISTRAL_ARGS)]
        self._buf = buf[at + len(MISTRAL_ARGS):]
        self._start_call(out, name)
        self._state = "value"
        return True

    def _step_object(self, out: list[ToolEvent]) -> bool:
        s = self._skip_ws()
        if not s:
            return False
        if s[0] != "{":
            return self._fail(out)
        status, name, end = _match_opener(s)
        if status == "need":
            return False
        if status == "ok":
            if not self._known(name):
                return self._fail(out)
            self._raw += s[:end]
            self._buf = s[end:]
            self._start_call(out, name)
            self._state = "value"
            return True
        # Another key order or shape: read the whole object, then decide.
        self._scanner, self._obj, self._state = _JSONScanner(), "", "whole"
        return True

    def _take_json(self) -> tuple[bool, bool, object]:
        """Feed the buffer to the JSON scanner: (complete?, parsed?, value)."""
        end = self._scanner.scan(self._buf)
        if end is None:
            self._obj += self._buf
            self._buf = ""
            return False, False, None
        self._obj += self._buf[:end]
        self._buf = self._buf[end:]
        try:
            return True, True, json.loads(self._obj)
        except ValueError:
            return True, False, None

    def _step_whole(self, out: list[ToolEvent]) -> bool:
        if not self._buf:
            return False
        done, ok, obj = self._take_json()
        if not done:
            return False
        if not ok:
            return self._fail(out)
        if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
            obj = obj["function"]               # {"type": "function", "function": {...}}
        args = None
        if isinstance(obj, dict):
            args = obj.get("arguments", obj.get("parameters"))
        if not isinstance(obj, dict) or not self._known(obj.get("name")) or not isinstance(args, (dict, str)):
            return self._fail(out)
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call = self._start_call(out, obj["name"])
        self._args(out, text)
        call.complete = _valid_json(text)
        self._end_call(out)
        self._raw = self._obj = ""
        self._state = "after"
        return True

    def _step_value(self, out: list[ToolEvent]) -> bool:
        s = self._skip_ws()
        if not s:
            return False
        if s[0] in "{[":
            self._scanner, self._state = _JSONScanner(), "args"
            return True
        if s[0] == '"':                         # arguments given as a JSON string
            self._scanner, self._obj, self._state = _JSONScanner(), "", "args_string"
            return True
        return self._fail(out)

    def _step_args(self, out: list[ToolEvent]) -> bool:
        buf = self._buf
        if not buf:
            return False
        # A closing tag inside the arguments (outside a JSON string) cuts them short.
        end = self._scanner.scan(buf, HERMES_END if self._style == "hermes" else None)
        paused = self._scanner.paused
        chunk = buf[:end] if end is not None else buf[:paused] if paused is not None else buf
        self._buf = buf[len(chunk):]
        self._args(out, chunk)
        if end is None:
            if not self._buf.startswith(HERMES_END):
                return False                    # the value goes on, or a closing tag may be arriving
            self._buf = self._buf[len(HERMES_END):]
            return self._fail(out)
        self._call.complete = _valid_json(self._call.arguments)
        self._value_done(out)
        return True

    def _step_args_string(self, out: list[ToolEvent]) -> bool:
        if not self._buf:
            return False
        done, ok, text = self._take_json()
        if not done:
            return False
        if not ok:
            return self._fail(out)
        self._obj = ""
        self._args(out, text)
        self._call.complete = _valid_json(text)
        self._value_done(out)
        return True

    def _value_done(self, out: list[ToolEvent]) -> None:
        self._scanner = None
        if self._style == "mistral_name":       # no object around the arguments
            self._end_call(out)
            self._state = "after"
        else:
            self._state = "close"

    def _step_close(self, out: list[ToolEvent]) -> bool:
        s = self._skip_ws()
        if not s:
            return False
        if s[0] == "}":
            self._buf = s[1:]
            self._end_call(out)
            self._state = "after"
        elif s[0] == ",":                       # more keys after the arguments: skip them
            self._buf = s[1:]
            self._scanner, self._state = _JSONScanner(depth=1), "close_skip"
        else:
            self._end_call(out)
            self._state = "content"
        return True

    def _step_close_skip(self, out: list[ToolEvent]) -> bool:
        if not self._buf:
            return False
        end = self._scanner.scan(self._buf)
        if end is None:
            self._buf = ""
            return False
        self._buf = self._buf[end:]
        self._scanner = None
        self._end_call(out)
        self._state = "after"
        return True

    def _step_after(self, out: list[ToolEvent]) -> bool:
        s = self._buf.lstrip()
        if not s:
            return False
        style = self._style
        self._raw = ""
        if style == "hermes":
            if s.startswith(HERMES_END):
                self._buf = s[len(HERMES_END):]
            elif HERMES_END.startswith(s):
                return False
            self._state = "content"             # a missing closing tag is forgiven
            return True
        if style in ("llama", "json") and s[0] == ";":
            self._buf, self._state = s[1:], "object"
            return True
        if style == "mistral_list" and s[0] in ",]":
            self._buf = s[1:]
            self._state = "object" if s[0] == "," else "content"
            return True
        self._state = "content"
        return True


def _merge(events: list[ToolEvent]) -> list[ToolEvent]:
    out: list[ToolEvent] = []
    for e in events:
        if out and e.kind == out[-1].kind == "content":
            out[-1] = ToolEvent("content", out[-1].text + e.text)
        else:
            out.append(e)
    return out


def parse_tool_calls(text: str, tool_names: Iterable[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output; malformed markup leaves the whole text as content."""
    parser = ToolCallParser(tool_names)
    events = parser.feed(text) + parser.finish()
    if not parser.calls:
        return text, []
    if not all(c.complete for c in parser.calls):
        return text, []
    return "".join(e.text for e in events if e.kind == "content"), parser.calls
