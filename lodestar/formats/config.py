"""Typed model configuration read from checkpoint metadata (GGUF today)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters shared by every model family.

    Family-specific extras (Gemma's sliding-window pattern, ...) live in ``extra``
    so the common fields stay small and typed.
    """

    arch: str                   # general.architecture: "llama", "qwen2", "qwen3", "gemma3", ...
    name: str                   # general.name (or file stem)
    n_layers: int               # {arch}.block_count
    d_model: int                # {arch}.embedding_length
    n_heads: int                # {arch}.attention.head_count
    n_kv_heads: int             # {arch}.attention.head_count_kv (defaults to n_heads)
    head_dim: int               # {arch}.attention.key_length or d_model // n_heads
    v_head_dim: int             # {arch}.attention.value_length or head_dim
    ffn_dim: int                # {arch}.feed_forward_length
    vocab_size: int             # {arch}.vocab_size or len(tokenizer.ggml.tokens)
    context_length: int         # {arch}.context_length
    rms_eps: float              # {arch}.attention.layer_norm_rms_epsilon
    rope_theta: float           # {arch}.rope.freq_base (10000.0 when absent)
    rope_dim: int               # {arch}.rope.dimension_count or head_dim
    sliding_window: int | None  # {arch}.attention.sliding_window
    tie_embeddings: bool        # True when the file has no output.weight tensor
    file_type: int | None = None
    rope_scale: float = 1.0     # linear rope scaling: {arch}.rope.scaling.factor when .type is "linear"
    extra: dict[str, Any] = field(default_factory=dict)
