"""Load a model file into a ready-to-run (model, tokenizer) pair."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from lodestar.formats.catalog import resolve_model_path
from lodestar.formats.config import ModelConfig
from lodestar.formats.gguf import GGUFFile
from lodestar.models import WEIGHT_MODES, build_model
from lodestar.tokenizer import Tokenizer

DEVICES = ("cpu", "cuda", "auto")


class DeviceError(ValueError):
    """A --device that this machine cannot provide."""


@dataclass
class LoadedModel:
    path: Path
    file: object            # GGUFFile, or a Hugging Face checkpoint (formats.safetensors)
    config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer
    mode: str
    load_seconds: float
    device: str = "cpu"


def resolve_device(device: str | None) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    device = device or "cpu"
    if device not in DEVICES and not device.startswith("cuda:"):
        raise DeviceError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    return device


def load_model(spec: str | Path | None = None, mode: str = "packed", progress: bool = True,
               device: str = "cpu") -> LoadedModel:
    """Open ``spec`` (GGUF path, Hugging Face folder, known name or None for the default) and
    build model + tokenizer on ``device`` (cpu, cuda or auto).

    ``mode``: ``packed`` keeps quantized blocks packed; ``fp32``/``bf16`` dequantize at load.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"--dtype {mode!r}: choose one of {', '.join(WEIGHT_MODES)}")
    device = resolve_device(device)
    t0 = time.perf_counter()
    folder = Path(str(spec)).expanduser() if spec is not None else None
    if folder is not None and folder.is_dir():
        from lodestar.formats.safetensors import HFCheckpoint
        source = HFCheckpoint(folder)
        path, tokenizer = folder, source.tokenizer()
    else:
        path = resolve_model_path(spec)
        source = GGUFFile(path)
        tokenizer = Tokenizer.from_metadata(source.metadata)
    total = sum(t.n_bytes for t in source.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}", leave=False,
              disable=not progress) as bar:
        model = build_model(source.config, source, mode, on_tensor=lambda t: bar.update(t.n_bytes), device=device)
    if device != "cpu":
        torch.cuda.synchronize()
    return LoadedModel(path, source, source.config, model, tokenizer, mode, time.perf_counter() - t0, device)
