"""Split ``<think>...</think>`` spans out of generated text, whole or as it streams.

Reasoning models (Qwen3, DeepSeek-R1, SmolLM3 ...) write their chain of thought between
think tags before the answer. Some chat templates open the tag in the prompt itself
(the generation prompt ends with ``<think>``); then the output starts inside a span.
The parser returns ``("reasoning", text)`` and ``("content", text)`` pieces; no tag and
no piece of a tag ever reaches either side, and the whitespace that templates put just
inside and just after the tags is dropped.
"""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """Incremental splitter: ``feed`` text deltas, then ``flush`` once at the end."""

    def __init__(self, in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END) -> None:
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self._buf = ""                       # a tail that may be the start of a tag
        self._trailing_ws = ""               # reasoning whitespace held until more reasoning follows
        self._strip_lead = in_reasoning      # drop the whitespace that follows a tag

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._buf += text
        while True:
            tag = self.end if self.in_reasoning else self.start
            at = self._buf.find(tag)
            if at < 0:
                hold = _partial_suffix(self._buf, tag)
                self._emit(out, self._buf[:len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold:]
                return out
            self._emit(out, self._buf[:at])
            self._buf = self._buf[at + len(tag):]
            self._trailing_ws = ""
            self.in_reasoning = not self.in_reasoning
            self._strip_lead = True

    def flush(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(out, self._buf)
        self._buf = ""
        return out

    def _emit(self, out: list[tuple[str, str]], text: str) -> None:
        if self._strip_lead:
            text = text.lstrip()
            if not text:
                return
            self._strip_lead = False
        if not text:
            return
        if self.in_reasoning:
            text = self._trailing_ws + text
            body = text.rstrip()
            self._trailing_ws = text[len(body):]
            text = body
            if not text:
                return
        kind = "reasoning" if self.in_reasoning else "content"
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    parser = ReasoningParser(in_reasoning)
    parts = parser.feed(text) + parser.flush()
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    content = "".join(t for kind, t in parts if kind == "content")
    return reasoning, content


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt leaves a think span open for the model to continue."""
    return prompt_text.rstrip().endswith(THINK_START)
