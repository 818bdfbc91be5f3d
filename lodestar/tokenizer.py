"""Tokenizer built from a GGUF file's vocabulary, and chat templates rendered with Jinja.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary, the merges (byte-level BPE) or
scores (SentencePiece-style), the token types and the special token ids as metadata. This module
rebuilds the tokenizer those describe with the ``tokenizers`` library, the same way the oracle
(transformers' GGUF tokenizer builder) does, so that token ids match the goldens exactly:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. Tokens are respelled into the GPT-2 byte
  alphabet where needed; the split regex comes from ``tokenizer.ggml.pre`` (GPT-2's own regex
  for ``default``/``smollm``/unknown values, Llama-3's, Qwen2's, ... for the others).
- ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE with byte fallback (``<0xXX>``
  tokens). Merges come from the file or are rebuilt from the vocabulary and scores. Gemma files
  get Gemma's normalizer (spaces become ``▁``, no prefix space); other files get Llama's
  ``Metaspace`` pre-tokenizer, which puts ``▁`` before the first word.

Control tokens (token type 3) become special added tokens and user-defined tokens (type 4) plain
added tokens, so text such as ``<|im_start|>`` or ``<start_of_turn>`` encodes to one id.

Chat templates are rendered in the same sandboxed Jinja environment transformers uses
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``strftime_now``,
a ``tojson`` that does not escape HTML), with the special token strings and any extra keyword
arguments (``enable_thinking`` ...) in the template context.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from os import PathLike
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from lodestar.merges import merges_for

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SPIECE_UNDERLINE = "\u2581"

# Split regexes by tokenizer.ggml.pre. A value not listed keeps GPT-2's own regex (the byte-level
# pre-tokenizer's default), which is what the oracle does for "default", "gpt2", "smollm", ...
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}

# Tokens that close a turn in common chat formats; those the template writes stop generation.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "</s>", "<eos>",
)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

_TOKEN_TYPES = frozenset(range(7))   # llama_token_type: undefined, normal, ..., byte
_SPECIAL_IDS = ("bos", "eos", "unknown", "padding", "eot", "eom")


class TokenizerError(ValueError):
    """A GGUF vocabulary this module cannot build, or a chat template that cannot be applied."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte to the printable character that spells it in the vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


# ---------------------------------------------------------------------------------------------
# Building the backend tokenizer
# ---------------------------------------------------------------------------------------------


def _merges(meta: Mapping[str, Any], tokens: Sequence[str], vocab_scores: Mapping[str, float] | None = None):
    if "tokenizer.ggml.merges" in meta:
        merges = meta["tokenizer.ggml.merges"]
        if not isinstance(merges, list):
            raise TokenizerError(f"tokenizer.ggml.merges must be an array of strings, got {_kind(merges)}")
        pairs = [tuple(m.split(" ")) if isinstance(m, str) else () for m in merges]
        bad = next((i for i, p in enumerate(pairs) if len(p) != 2 or not p[0] or not p[1]), None)
        if bad is not None:
            raise TokenizerError(f"tokenizer.ggml.merges[{bad}] is {merges[bad]!r}; expected two tokens separated "
                                 "by one space")
        return pairs
    if vocab_scores is None:
        if "tokenizer.ggml.scores" not in meta:
            raise TokenizerError("GGUF vocabulary has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
        vocab_scores = dict(zip(tokens, meta["tokenizer.ggml.scores"]))
    return merges_for({t: i for i, t in enumerate(tokens)}, vocab_scores)


def _bpe(meta: Mapping[str, Any], **options: Any) -> BPE:
    """``tokenizers``' BPE model; its refusals (a merge of unknown tokens ...) name the keys."""
    try:
        return BPE(**options)
    except Exception as e:  # the Rust side raises a bare Exception
        keys = "tokenizer.ggml.merges" if "tokenizer.ggml.merges" in meta else "tokenizer.ggml.scores"
        raise TokenizerError(f"{keys} does not fit tokenizer.ggml.tokens: {_one_line(e)}") from None


def _kind(value: Any) -> str:
    """A short description of a metadata value for messages."""
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value[:1000]})
        return f"an array of {len(value)} {'/'.join(kinds) or 'values'}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def check_metadata(meta: Mapping[str, Any]) -> None:
    """Types, lengths and ranges of the tokenizer keys, so that a corrupt file fails with the
    key named instead of deep inside the tokenizer library."""
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError("GGUF file has no tokenizer.ggml.tokens: it carries no vocabulary to build a tokenizer")
    tokens = meta["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"tokenizer.ggml.tokens must be a non-empty array of strings, got {_kind(tokens)}")
    n = len(tokens)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in meta and not isinstance(meta[key], str):
            raise TokenizerError(f"{key} must be a string, got {_kind(meta[key])}")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise TokenizerError(f"tokenizer.ggml.token_type must hold one type per token ({n}), got {_kind(types)}")
        if not set(map(type, types)) <= {int} or not set(types) <= _TOKEN_TYPES:
            bad = next(t for t in types if type(t) is not int or t not in _TOKEN_TYPES)
            raise TokenizerError(f"tokenizer.ggml.token_type holds {bad!r}; token types are ints "
                                 f"{min(_TOKEN_TYPES)}..{max(_TOKEN_TYPES)}")
    scores = meta.get("tokenizer.ggml.scores")
    if scores is not None and (not isinstance(scores, list) or len(scores) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores)):
        raise TokenizerError(f"tokenizer.ggml.scores must hold one number per token ({n}), got {_kind(scores)}")
    for name in _SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key not in meta:
            continue
        tid = meta[key]
        if isinstance(tid, bool) or not isinstance(tid, int):
            raise TokenizerError(f"{key} must be a token id, got {_kind(tid)}")
        if name in ("bos", "eos") and not 0 <= tid < n:
            raise TokenizerError(f"{key} is {tid}, outside the vocabulary of {n} tokens")
    for name in ("add_bos_token", "add_eos_token"):
        key = f"tokenizer.ggml.{name}"
        if key in meta and not isinstance(meta[key], (bool, int)):
            raise TokenizerError(f"{key} must be a bool, got {_kind(meta[key])}")
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        try:
            compile_chat_template(template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"tokenizer.chat_template does not compile: {_one_line(e)}") from None


def _byte_level_backend(meta: Mapping[str, Any]) -> tuple[_Backend, tuple[str, ...], dict[str, int]]:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    backend = _Backend(
        _bpe(meta, vocab=vocab, merges=_merges(meta, tokens), dropout=None, continuing_subword_prefix="",
             end_of_word_suffix="", fuse_unk=False)
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend, ("<|endoftext|>",), vocab  # GPT2Tokenizer's default unk/bos/eos


def _llama_backend(meta: Mapping[str, Any], tokens: Sequence[str] | None = None,
                   vocab_scores: Mapping[str, float] | None = None) -> tuple[_Backend, tuple[str, ...], dict[str, int]]:
    tokens = meta["tokenizer.ggml.tokens"] if tokens is None else tokens
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _Backend(
        _bpe(meta, vocab=vocab, merges=_merges(meta, tokens, vocab_scores), fuse_unk=True, byte_fallback=True,
             dropout=None)
    )
    # The oracle always puts a prefix space before the first word of a Llama-style vocabulary.
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_UNDERLINE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(content=" ", left=1)]
    )
    return backend, ("<s>", "</s>", "<unk>"), vocab  # LlamaTokenizer's defaults


def _phi3_backend(meta: Mapping[str, Any]) -> tuple[_Backend, tuple[str, ...], dict[str, int]]:
    # Prefix space from a normalizer: "  hi" -> "▁▁▁hi" (Metaspace would give "▁▁hi").
    backend, defaults, vocab = _llama_backend(meta)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(prepend=SPIECE_UNDERLINE), normalizers.Replace(pattern=" ", content=SPIECE_UNDERLINE)]
    )
    backend.pre_tokenizer = None
    return backend, defaults, vocab


def _gemma_backend(meta: Mapping[str, Any], respell: bool = True) -> tuple[_Backend, tuple[str, ...], dict[str, int]]:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab_scores = None
    if respell:
        # Gemma files store whitespace-only tokens with real spaces ("  "); the vocabulary spells
        # them with "▁". Their merge order is the order of the tokens in the file, not the scores.
        tokens = [SPIECE_UNDERLINE * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab_scores = {t: -i for i, t in enumerate(tokens)}
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _Backend(
        _bpe(meta, vocab=vocab, merges=_merges(meta, tokens, vocab_scores), fuse_unk=True, unk_token="<unk>",
             dropout=None, byte_fallback=True)
    )
    backend.normalizer = normalizers.Replace(" ", SPIECE_UNDERLINE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend, ("<bos>", "<eos>", "<unk>", "<pad>", "<mask>"), vocab  # GemmaTokenizer's defaults


_SENTENCEPIECE_BY_ARCH = {"gemma": _gemma_backend, "gemma2": _gemma_backend, "gemma3": _gemma_backend,
                          "phi3": _phi3_backend}
_BUILDERS = {"gpt2": _byte_level_backend, "llama": _llama_backend,
             "gemma4": lambda meta: _gemma_backend(meta, respell=False)}


def _with_added(base: set[str], backend: _Backend) -> set[str]:
    """``backend.get_vocab(with_added_tokens=True)``'s keys, from the model's vocabulary ``base``
    (building the whole dict again costs a tenth of a second for a large vocabulary)."""
    return base | {t.content for t in backend.get_added_tokens_decoder().values()}


def _build_backend(meta: Mapping[str, Any]) -> _Backend:
    check_metadata(meta)
    model = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture", "")
    if model == "llama" and arch in _SENTENCEPIECE_BY_ARCH:
        builder = _SENTENCEPIECE_BY_ARCH[arch]
    elif model in _BUILDERS:
        builder = _BUILDERS[model]
    else:
        raise TokenizerError(
            f"GGUF tokenizer.ggml.model {model!r} is not supported; supported: {', '.join(sorted(_BUILDERS))}"
        )
    backend, class_defaults, vocab = builder(meta)     # vocab: the BPE model's (its get_vocab is slower)
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or ()
    base = set(vocab)
    known = base

    # The tokenizer class's own default special tokens. The oracle appends such a token as a new
    # id when the vocabulary lacks it; an id past the embedding table is useless, so only tokens
    # already in the vocabulary are marked.
    defaults = [AddedToken(t, special=True) for t in dict.fromkeys(class_defaults) if t in known]
    if defaults:
        backend.add_tokens(defaults)

    # Control tokens are special. In a byte-level vocabulary every real token is spelled in the
    # byte alphabet, so a "control" token outside it is a mislabel and is skipped.
    alphabet = set(bytes_to_unicode().values()) if meta.get("tokenizer.ggml.model") == "gpt2" else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types)
        if kind == TOKEN_CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    # User-defined tokens (like "<think>" or Gemma's "\n\n") are matched whole but are not special.
    known = _with_added(base, backend)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED and t in known]
    if user:
        backend.add_tokens(user)

    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if model == "gpt2" and split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )

    # The special tokens the file names (bos, eos, unk, pad) are special even when not typed control.
    known = _with_added(base, backend)
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    named = []
    for key in ("bos", "eos", "unknown", "padding"):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= tid < len(tokens) and tokens[tid] in known and tokens[tid] not in added:
            named.append(AddedToken(tokens[tid], special=True))
            added.add(tokens[tid])
    if named:
        backend.add_tokens(named)
    return backend


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; for
    rendering it is transparent."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    # `dict(...)` in a template without exposing the dict type itself
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # A namespace that refuses underscore-prefixed attributes, so templates cannot reach internals.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment chat templates are written for."""
    found = tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3])
    if found < (3, 1, 6):
        # Older versions have known sandbox escapes, and a template inside a model file is untrusted code.
        raise TokenizerError(f"chat templates need jinja2>=3.1.6 (found {jinja2.__version__}): pip install -U jinja2")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """The data a template may see, rebuilt from plain JSON types (pydantic models and dataclasses
    are dumped; anything else becomes an inert ``<TypeName>`` placeholder)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
        return _plain(value.item())
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        return {name: _plain(getattr(value, name)) for name in value.__dataclass_fields__}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _as_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        return {name: _as_dicts(getattr(value, name)) for name in value.__dataclass_fields__}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _normalize_messages(messages: Iterable[Any]) -> list[dict]:
    out = []
    for message in _as_dicts(list(getattr(messages, "messages", messages))):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, dataclasses or pydantic models, got {message!r}")
        # A key set to None (OpenAI's content=None, tool_calls=None) reads as absent.
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            # `reasoning_content` is the name templates read; gpt-oss templates read `thinking`.
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    template: str,
    messages: Iterable[Any],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool | str = False,
    **context: Any,
) -> str:
    """Render one conversation with ``template``; ``context`` holds the special token strings and
    any extra template variables."""
    chat = _normalize_messages(messages)
    if not chat:
        raise TokenizerError("cannot apply a chat template to an empty conversation; give at least one message")
    if continue_final_message and add_generation_prompt:
        raise TokenizerError(
            "continue_final_message and add_generation_prompt cannot both be set: continue the last message, "
            "or open a new assistant turn"
        )
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise TypeError(f"tools must be JSON schemas (dicts), got {type(tool).__name__}")
    if documents is not None:
        for document in documents:
            if not isinstance(document, Mapping):
                raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")

    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise TokenizerError(f"continue_final_message is set but the last message has no {field!r} to continue")
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in template for f in fields):
            raise TokenizerError(f"continue_final_message is set to {field!r} but the chat template never reads it")
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise TokenizerError("continue_final_message is set but the last message has no text to continue")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG

    rendered = compile_chat_template(template).render(
        messages=chat,
        tools=_plain(list(tools) if tools is not None else None),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(context),
    )
    if final is not None:
        if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise TokenizerError("continue_final_message is set but the chat template drops part of the last message")
        at = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:at]
        else:  # the template trimmed the message's trailing space
            rendered = rendered[:at].rstrip()
    return rendered


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode and decode text for one model, and render its chat template."""

    def __init__(self, backend: _Backend, metadata: Mapping[str, Any]):
        self._backend = backend
        self.model_type: str = metadata.get("tokenizer.ggml.model", "")
        self.pre_type: str | None = metadata.get("tokenizer.ggml.pre")
        tokens = metadata["tokenizer.ggml.tokens"]
        self._tokens = tokens
        self.vocab_size: int = len(tokens)

        def token_id(key: str) -> int | None:
            tid = metadata.get(f"tokenizer.ggml.{key}_token_id")
            return int(tid) if tid is not None and 0 <= int(tid) < len(tokens) else None

        self.bos_id = token_id("bos")
        self.eos_id = token_id("eos")
        self.unk_id = token_id("unknown")
        self.pad_id = token_id("padding")
        # A SentencePiece-style vocabulary that does not say otherwise gets BOS, as llama.cpp does.
        default_bos = self.model_type == "llama"
        self.add_bos: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)) and self.bos_id is not None
        if self.model_type == "gemma4":
            self.add_bos = False  # its template writes <bos> itself
        self.add_eos: bool = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None

        template = metadata.get("tokenizer.chat_template")
        self.chat_template: str | None = template if isinstance(template, str) and template.strip() else None

        # The strings templates see as bos_token, eos_token, ... (mask_token for Gemma vocabularies).
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id, "pad_token": self.pad_id}
        self.special_tokens_map: dict[str, str] = {k: tokens[v] for k, v in names.items() if v is not None}
        arch = str(metadata.get("general.architecture", ""))
        if arch.startswith("gemma") and backend.token_to_id("<mask>") is not None:
            self.special_tokens_map["mask_token"] = "<mask>"

        single = "$A:0"
        special = []
        bos, eos = self.special_tokens_map.get("bos_token"), self.special_tokens_map.get("eos_token")
        if self.add_bos:
            single = f"{bos}:0 {single}"
            special.append((bos, self.bos_id))
        if self.add_eos:
            single = f"{single} {eos}:0"
            special.append((eos, self.eos_id))
        pair = f"{single}{(' ' + bos + ':1') if self.add_bos else ''} $B:1{(' ' + eos + ':1') if self.add_eos else ''}"
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

        eos_ids = {self.eos_id} if self.eos_id is not None else set()
        for key in ("eot", "eom"):
            if (tid := token_id(key)) is not None:
                eos_ids.add(tid)
        if self.chat_template is not None:
            for text in END_OF_TURN_TOKENS:
                tid = backend.token_to_id(text)
                if tid is not None and text in self.chat_template and self.is_special(tid):
                    eos_ids.add(tid)
        self.eos_ids: frozenset[int] = frozenset(eos_ids)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata as plain Python values, keyed by GGUF key names
        (``tokenizer.ggml.tokens``: list of str, ``tokenizer.ggml.merges``: list of str,
        ``tokenizer.ggml.scores``: list of float, ``tokenizer.ggml.token_type``: list of int, ids,
        flags, ``tokenizer.chat_template``: str, ``general.architecture``: str)."""
        try:
            return cls(_build_backend(metadata), metadata)
        except TokenizerError:
            raise
        except Exception as e:  # a vocabulary the checks let through but the library refuses
            raise TokenizerError(f"cannot build a tokenizer from the tokenizer.ggml.* metadata: "
                                 f"{type(e).__name__}: {_one_line(e)}") from None

    @classmethod
    def from_gguf(cls, path: str | PathLike) -> Tokenizer:
        """Build from the tokenizer metadata of a GGUF file."""
        return cls.from_metadata(read_tokenizer_metadata(path))

    # -- properties ---------------------------------------------------------------------------

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens, the ones ``skip_special_tokens`` drops."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS (and EOS) the file asks for."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        if len(text) > 4096:
            # The batch call releases the GIL while it works (the single one holds it), so a
            # long text tokenized on a worker thread does not stall the server's event loop.
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry for ``token_id`` as spelled in the vocabulary (``Ġ``, ``▁``, ``<0x0A>``)."""
        piece = self._backend.id_to_token(int(token_id))
        if piece is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return piece

    def piece_to_id(self, piece: str) -> int | None:
        return self._backend.token_to_id(piece)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token, as decoding writes them: byte-level characters mapped back to
        bytes; SentencePiece ``▁`` as a space and ``<0xXX>`` as that byte. A token can be part of a
        UTF-8 character, so an incremental detokenizer joins these before decoding. Decoding a
        Llama-style (non-Gemma) SentencePiece vocabulary also drops one leading space of the text."""
        piece = self.id_to_piece(token_id)
        if self.model_type == "gpt2":
            table = _unicode_to_bytes()
            try:
                return bytes(table[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8")

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Iterable[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool | str = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (or ``chat_template``); extra keyword
        arguments (``enable_thinking=False`` ...) reach the template. With ``tokenize`` the text is
        encoded without adding BOS/EOS: the template writes the special tokens it wants."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise TokenizerError(
                "this model has no chat template (tokenizer.chat_template is missing from the GGUF file; base "
                "models usually have none): prompt it with plain text, or pass chat_template=... explicitly"
            )
        context = {**self.special_tokens_map, **kwargs}
        text = render_chat_template(
            template, messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **context,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model_type!r}, pre={self.pre_type!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos_ids={sorted(self.eos_ids)}, chat_template={self.has_chat_template})")


# ---------------------------------------------------------------------------------------------
# Reading the metadata from a GGUF file
# ---------------------------------------------------------------------------------------------


def read_tokenizer_metadata(path: str | PathLike) -> dict[str, Any]:
    """The ``tokenizer.*`` and ``general.architecture`` fields of a GGUF file as plain Python values."""
    from lodestar.formats.gguf import read_metadata   # the reader is only needed when building from a file
    return read_metadata(path, lambda key: key.startswith("tokenizer.") or key == "general.architecture")


def from_gguf(path: str | PathLike) -> Tokenizer:
    """Build the tokenizer a GGUF file describes."""
    return Tokenizer.from_gguf(path)
