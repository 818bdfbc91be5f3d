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
        # Proper prefixes of the stop strings: the only tails worth holding back.
        self._stop_prefixes = frozenset(s[:k] for s in self._stop for k in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self._stop), default=0)
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
        # Any stop string that ends in new_text starts inside held + new_text, because
        # the held tail is the longest one that is a prefix of a stop string.
        window = self._held + new_text
        self._held = ""
        end, stop_str = self._first_stop(window)
        if stop_str is not None:
            self.stopped = True
            self.stop_str = stop_str
            out = window[:end] if self._include_stop else window[:end - len(stop_str)]
        elif final:
            out = window
        else:
            hold = self._hold_length(window)
            out = window[:len(window) - hold]
            self._held = window[len(window) - hold:]
        if out:
            self._chunks.append(out)
        return out

    def _first_stop(self, window: str) -> tuple[int, str | None]:
        best_end, best = -1, None
        for s in self._stop:
            start = window.find(s)
            if start < 0:
                continue
            end = start + len(s)
            if best is None or end < best_end or (end == best_end and len(s) > len(best)):
                best_end, best = end, s
        return best_end, best

    def _hold_length(self, window: str) -> int:
        for k in range(min(len(window), self._longest_prefix), 0, -1):
            if window[-k:] in self._stop_prefixes:
                return k
        return 0
