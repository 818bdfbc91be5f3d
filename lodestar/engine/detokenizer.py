"""Incremental detokenizer: token ids in, printable text out, stop strings applied.

Text is released only when it can no longer change:
- bytes of an unfinished UTF-8 character wait for the rest; a sequence that can no
  longer complete becomes U+FFFD, exactly as `bytes.decode("utf-8", "replace")` of
  the whole output would give;
- a trailing piece of text that could be the start of a stop string waits until the
  next tokens show whether the stop string follows.

The stop string that ends first in the text wins (the moment a streaming client
would see it); when several end at the same character, the longest one counts.
Nothing after it is ever emitted. The concatenation of all `push` results and the
final `flush` is therefore the whole decoded output cut at its first stop string,
however the bytes were split into tokens.
"""

from __future__ import annotations

import codecs
from typing import Callable, Iterable


class StopMatcher:
    """Streaming Aho-Corasick automaton over the stop strings.

    ``feed`` reads text one character at a time (amortized O(1) each, whatever the
    number or length of the stop strings) and keeps ``held``: the length of the longest
    suffix of everything read that is a proper prefix of a stop string. Building it costs
    O(total length of the stop strings).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        match_len = [0]                      # length of the stop string spelled by a node, 0 if none
        for s in stops:
            node = 0
            for ch in s:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    match_len.append(0)
                node = nxt
            match_len[node] = len(s)
        # Failure links breadth first; _out[node] = the longest stop string ending at node.
        self._fail = [0] * len(self._goto)
        self._out = list(match_len)
        frontier = list(self._goto[0].values())
        while frontier:
            later = []
            for node in frontier:
                for ch, child in self._goto[node].items():
                    f = self._fail[node]
                    while f and ch not in self._goto[f]:
                        f = self._fail[f]
                    target = self._goto[f].get(ch, 0) if node else 0
                    self._fail[child] = target if target != child else 0
                    if not self._out[child]:
                        self._out[child] = self._out[self._fail[child]]
                    later.append(child)
            frontier = later
        self._state = 0

    @property
    def held(self) -> int:
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, int]:
        """Read ``text``; return (end offset in ``text``, stop length) of the first stop string
        that ends in it (the longest of those ending at that character), or (-1, 0)."""
        goto, fail, out = self._goto, self._fail, self._out
        state = self._state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if out[state]:
                self._state = state
                return i + 1, out[state]
        self._state = state
        return -1, 0


class IncrementalDetokenizer:
    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        skip_ids: Iterable[int] = (),
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._token_bytes = token_bytes
        self._skip_ids = frozenset(skip_ids)
        self._stop = tuple(dict.fromkeys(stop))
        if not all(isinstance(s, str) and s for s in self._stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self._stop)!r}")
        self._include_stop = include_stop_str_in_output
        self._matcher = StopMatcher(self._stop) if self._stop else None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self._chunks: list[str] = []
        self._flushed = False
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final with it (maybe "")."""
        if self._flushed:
            raise RuntimeError("push() after flush(): use one IncrementalDetokenizer per output")
        if self.stopped or token_id in self._skip_ids:
            return ""
        return self._advance(self._decoder.decode(self._token_bytes(token_id)), final=False)

    def flush(self) -> str:
        """End of output: release everything held back, dangling bytes as U+FFFD."""
        if self._flushed:
            return ""
        self._flushed = True
        if self.stopped:
            return ""
        return self._advance(self._decoder.decode(b"", final=True), final=True)

    def _advance(self, new_text: str, final: bool) -> str:
        if not new_text and not final:
            return ""
        window = self._held + new_text
        self._held = ""
        if self._matcher is None:
            out = window
        else:
            end, length = self._matcher.feed(new_text)
            if length:
                self.stopped = True
                end += len(window) - len(new_text)          # offset in window
                self.stop_str = window[end - length:end]
                out = window[:end] if self._include_stop else window[:end - length]
            elif final:
                out = window
            else:
                # Hold back the tail that may still become a stop string; at most the
                # longest stop string's length, so the window stays small.
                hold = self._matcher.held
                out = window[:len(window) - hold]
                self._held = window[len(window) - hold:]
        if out:
            self._chunks.append(out)
        return out
