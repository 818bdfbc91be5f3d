"""Model families, chosen from the checkpoint's ``general.architecture``."""
from __future__ import annotations

from torch import nn

from lodestar.formats.config import ModelConfig
from lodestar.models.gemma3 import Gemma3Model
from lodestar.models.llama import LlamaModel
from lodestar.models.weights import WEIGHT_MODES, WeightLoader

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "smollm": LlamaModel,
    "gemma3": Gemma3Model,
}


class UnsupportedArchitectureError(ValueError):
    pass


def build_model(config: ModelConfig, source, mode: str = "packed", on_tensor=None) -> nn.Module:
    """Instantiate the family's module with weights from ``source`` in ``mode``."""
    cls = ARCHITECTURES.get(config.arch)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"architecture {config.arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    model = cls(config, WeightLoader(source, mode, on_tensor))
    return model.eval().requires_grad_(False)


__all__ = ["ARCHITECTURES", "WEIGHT_MODES", "build_model", "UnsupportedArchitectureError"]
