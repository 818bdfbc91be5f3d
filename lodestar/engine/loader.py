"""Load a model file into a ready-to-run (model, tokenizer) pair."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from tqdm import tqdm

from lodestar.formats.catalog import resolve_model_path
from lodestar.formats.config import ModelConfig
from lodestar.formats.gguf import GGUFFile
from lodestar.models import WEIGHT_MODES, build_model
from lodestar.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    path: Path
    file: GGUFFile
    config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer
    mode: str
    load_seconds: float


def load_model(spec: str | Path | None = None, mode: str = "packed", progress: bool = True) -> LoadedModel:
    """Open ``spec`` (path, known name or None for the default) and build model + tokenizer.

    ``mode``: ``packed`` keeps quantized blocks packed; ``fp32``/``bf16`` dequantize at load.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"--dtype {mode!r}: choose one of {', '.join(WEIGHT_MODES)}")
    t0 = time.perf_counter()
    path = resolve_model_path(spec)
    gguf = GGUFFile(path)
    total = sum(t.n_bytes for t in gguf.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}", leave=False,
              disable=not progress) as bar:
        tokenizer = Tokenizer.from_metadata(gguf.metadata)
        model = build_model(gguf.config, gguf, mode, on_tensor=lambda t: bar.update(t.n_bytes))
    return LoadedModel(path, gguf, gguf.config, model, tokenizer, mode, time.perf_counter() - t0)
