"""Structured output: grammars compiled against the model's vocabulary, one matcher per request.

The grammar engine is llguidance (a Rust library with CPU wheels and no Python
dependencies). It compiles JSON Schema, regular expressions, Lark grammars (which may
embed JSON schemas with ``%json``) and llama.cpp GBNF against the tokenizer, and for a
matcher state fills the next-token bitmask (one bit per token id, int32 words) in tens
of microseconds. ``scripts/grammar_engines.py`` measures it against xgrammar on this
project's vocabularies; docs/structured-output.md has the figures and why it was picked.

- ``GrammarSpec``: what a request asked for (kind, value, and the request field it came
  from, which every error names).
- ``GrammarCompiler``: one per engine. ``compile`` validates a spec and keeps the compiled
  matcher by content hash (LRU); thread-safe, so the server compiles on a worker thread
  before the request reaches the engine thread. ``matcher`` hands out a fresh copy.
- ``GrammarMatcher``: one request's parser state. It advances only on tokens the engine
  accepts (``accept``) and can step back (``rollback``) for speculative decoding;
  ``forced`` gives the tokens the grammar forces next (jump-forward).
- ``fill_masks`` / ``apply_masks``: the step's bitmask on the host, and applied to the
  logits rows that have a grammar, on the logits' device.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

KINDS = ("json_schema", "regex", "grammar", "choice")
MAX_CACHED = 128
# JSON as ``json.dumps`` writes it: ", " and ": " between items, no other whitespace. Free
# whitespace lets a small model pad an object with newlines until max_tokens; fixed
# separators also make each required key a forced run for jump-forward.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SOURCE_CHARS = 1 << 20     # a grammar or schema text larger than this is refused


class GrammarError(ValueError):
    """A grammar, schema or regex that cannot constrain this model's output.

    ``field`` is the request field it came from; ``reason`` the library's message."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to.

    kind: ``json_schema`` (value: a schema dict, or its JSON text), ``regex`` (a pattern that
    must match the whole output), ``grammar`` (a Lark grammar, or llama.cpp GBNF, as text) or
    ``choice`` (value: a list of strings, one of which is the whole output).
    field: the request field named in errors (``response_format.json_schema.schema``).
    """

    kind: str
    value: Any
    field: str = "grammar"

    def source(self) -> str:
        """The spec as llguidance grammar text (raises GrammarError for a malformed value)."""
        import llguidance

        kind, value = self.kind, self.value
        if kind not in KINDS:
            raise GrammarError(self.field, f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise GrammarError(self.field, f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise GrammarError(self.field, f"a JSON schema must be an object, got {type(value).__name__}")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(bounded(value)),
                                                                     defaults=JSON_OPTIONS)
            except ValueError as e:
                raise GrammarError(self.field, str(e)) from None
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(v, str) and v for v in value)):
                raise GrammarError(self.field, "choices must be a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in value))
        if not isinstance(value, str) or not value:
            raise GrammarError(self.field, f"the {kind} must be a non-empty string")
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        try:
            return llguidance.grammar_from("grammar", value)     # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise GrammarError(self.field, str(e)) from None

    def key(self) -> str:
        """Content hash: equal specs share one compiled grammar whatever field they came from."""
        text = json.dumps([self.kind, self.value], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# Bounds a JSON schema leaves open get these, so a small model cannot write digits until
# max_tokens (as llama.cpp's schema grammars bound numbers): at most 16 integer digits
# (what a double holds exactly), at most 10 decimals and no exponent (llguidance's
# ``multipleOf`` takes a power of ten down to 1e-10), at most 9 fractional-second digits.
MAX_INTEGER = 10**16 - 1
DECIMAL_STEP = 1e-10
FORMAT_MAX_LENGTH = {"time": 24, "date-time": 35}     # HH:MM:SS.fffffffff+HH:MM, with a date
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def bounded(schema: Any) -> Any:
    """A copy of ``schema`` with open number ranges, decimals and time fractions bounded
    (``MAX_INTEGER``, ``DECIMAL_STEP``, ``FORMAT_MAX_LENGTH``); bounds it sets are kept."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded(s) for k, s in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = bounded(out[key])
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if types & {"number", "integer"}:
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_INTEGER
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = DECIMAL_STEP
    if out.get("format") in FORMAT_MAX_LENGTH and "maxLength" not in out:
        out["maxLength"] = FORMAT_MAX_LENGTH[out["format"]]
    return out


class _Vocabulary:
    """The tokenizer as llguidance's ``TokenizerWrapper`` expects it: raw bytes per token id."""

    def __init__(self, tokenizer, n_vocab: int) -> None:
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eos_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (n_vocab - len(self.tokens))      # rows of a padded head no text maps to
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False)


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_m", "spec", "forced_total")

    def __init__(self, matcher, spec: GrammarSpec) -> None:
        self._m = matcher
        self.spec = spec
        self.forced_total = 0          # tokens appended by jump-forward

    @property
    def llmatcher(self):
        return self._m

    def accept(self, token_id: int) -> bool:
        """Advance over one accepted token; False if the grammar does not allow it."""
        return bool(self._m.consume_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""
        if num_tokens and not self._m.rollback(int(num_tokens)):
            raise RuntimeError(f"grammar matcher could not roll back {num_tokens} tokens: {self._m.get_error()}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar would accept from here (state unchanged)."""
        return int(self._m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def forced(self) -> list[int]:
        """Tokens the grammar forces next, tokenized canonically (empty when there is a choice)."""
        return list(self._m.compute_ff_tokens())

    def is_stopped(self) -> bool:
        """The output is complete: only end-of-sequence may follow."""
        return bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class GrammarCompiler:
    """Compiles specs for one tokenizer and hands out matchers; compiled grammars are cached."""

    def __init__(self, tokenizer, n_vocab: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = max(n_vocab or tokenizer.vocab_size, tokenizer.vocab_size)
        self.words = (self.n_vocab + 31) // 32
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def ll_tokenizer(self):
        """llguidance's view of the vocabulary, built on first use (about 0.2 s for 49k tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                vocab = _Vocabulary(self.tokenizer, self.n_vocab)
                self._ll_tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(vocab), n_vocab=self.n_vocab,
                    eos_token=sorted(self.tokenizer.eos_ids) or [vocab.eos_token_id])
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec):
        """The compiled grammar for ``spec`` (an llguidance matcher in its start state).

        Raises GrammarError naming ``spec.field`` for anything the library refuses, and for
        a grammar no token of this vocabulary can start."""
        import llguidance

        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        text = spec.source()
        if len(text) > MAX_SOURCE_CHARS:
            raise GrammarError(spec.field, f"the grammar is {len(text)} characters; at most {MAX_SOURCE_CHARS} "
                                           "are allowed")
        tok = self.ll_tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tok)
        if is_error:
            raise GrammarError(spec.field, _one_line(messages[0] if messages else "invalid grammar"))
        matcher = llguidance.LLMatcher(tok, text, log_level=0)
        mask = torch.zeros((1, self.words), dtype=torch.int32)
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if matcher.is_error() or not bool(mask.any()):
            reason = matcher.get_error()
            if not reason or reason.startswith("NoExtension"):   # a language no token can start
                reason = "no token of the model's vocabulary can start this grammar, so nothing can be generated"
            raise GrammarError(spec.field, _one_line(reason))
        with self._lock:
            self.misses += 1
            self._cache[key] = matcher
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for one request (a copy of the cached compiled grammar)."""
        return GrammarMatcher(self.compile(spec).deep_copy(), spec)

    # -- one step's masks ------------------------------------------------------------
    def fill_masks(self, matchers: Sequence[GrammarMatcher | None], out: torch.Tensor) -> None:
        """Row i of ``out`` (int32 [>= len(matchers), words], CPU) gets matcher i's next-token
        bitmask; rows without a matcher are left as they are.

        One row after another on this thread: a request's matcher is a copy of its grammar's
        compiled one and shares its lexer cache, so rows of one grammar mostly hit it (about
        8 us each on an H200 host for 16 rows), where llguidance's thread pool measured 2-20x
        slower (scripts/grammar_engines.py; docs/structured-output.md)."""
        row_bytes = self.words * 4
        for i, m in enumerate(matchers):
            if m is not None:
                m.llmatcher.unsafe_compute_mask_ptr(out[i].data_ptr(), row_bytes)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


@torch.inference_mode()       # the logits may be an inference tensor (the model ran in that mode)
def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask forbids, in the listed rows.

    ``rows``: ascending row indices; ``masks``: int32 [len(rows), words] on the CPU (pinned
    when the logits are on a GPU, so the copy does not wait); bit j of word w allows token
    32 * w + j. Vocabulary columns past the mask are forbidden. About five kernels on a GPU."""
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = masks.to(device, non_blocking=True)
    banned = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1) == 0
    if banned.shape[1] < vocab:
        banned = torch.nn.functional.pad(banned, (0, vocab - banned.shape[1]), value=True)
    banned = banned[:, :vocab]
    if len(rows) == logits.shape[0]:            # every row (ascending, unique): no gather
        logits.masked_fill_(banned, float("-inf"))
        return
    index = torch.tensor(rows, device=device)
    logits[index] = logits[index].masked_fill(banned, float("-inf"))


def _one_line(message: str) -> str:
    lines = [ln.strip() for ln in str(message).strip().splitlines() if ln.strip()]
    text = " ".join(lines[:6])
    return text if len(text) <= 600 else text[:597] + "..."
