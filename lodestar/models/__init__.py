"""Model families, chosen from the checkpoint's ``general.architecture``."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from lodestar.formats.config import ModelConfig
from lodestar.layers.cuda_linear import CudaEmbedding, CudaQuantLinear, compute_dtype
from lodestar.models.gemma3 import Gemma3Model
from lodestar.models.llama import LlamaModel
from lodestar.models.validate import CheckpointError, check_blocks, check_tensors
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


def _family(arch: str) -> type[nn.Module]:
    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return cls


def validate(config: ModelConfig, tensors: Mapping[str, Any]) -> None:
    """Check hyper-parameters and tensor names/shapes against the family before anything is
    built; ``CheckpointError`` names the first key or tensor that does not fit."""
    cls = _family(config.arch)
    cls.check_config(config)
    check_blocks(config.arch, config.n_layers, list(tensors))
    check_tensors(cls.expected_tensors(config), tensors)


def build_model(config: ModelConfig, source, mode: str = "packed", on_tensor=None,
                device: str | torch.device = "cpu", loader: WeightLoader | None = None) -> nn.Module:
    """Instantiate the family's module with weights from ``source`` in ``mode`` on ``device``.

    ``loader`` replaces the default ``WeightLoader(source, mode, on_tensor, device)``, e.g. a
    ``ShardedWeightLoader`` that builds one tensor-parallel rank's slice.
    """
    cls = _family(config.arch)
    device = torch.device(device)
    model = cls(config, loader or WeightLoader(source, mode, on_tensor, device))
    model = model.eval().requires_grad_(False)
    if device.type != "cpu":
        _finish_on_device(model, mode, device)
    return model


def _finish_on_device(model: nn.Module, mode: str, device: torch.device) -> None:
    """Norm weights, biases and rope tables follow the (already placed) linear layers."""

    model.to(device)
    head = getattr(model, "head", None)
    if isinstance(head, CudaQuantLinear):
        # fp32 logits: rounding them to bf16 (steps of 1/16 to 1/8 at typical magnitudes)
        # makes near-ties exact ties and lets rounding pick the greedy token
        head.out_dtype = torch.float32
    dtype = compute_dtype(mode)
    for m in model.modules():
        bias = getattr(m, "qkv_bias", None)
        if isinstance(bias, nn.Parameter):
            m.qkv_bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        if isinstance(m, CudaEmbedding):
            m.release_bytes()   # the head, tied or not, is built by now


__all__ = ["ARCHITECTURES", "WEIGHT_MODES", "CheckpointError", "build_model", "validate",
           "UnsupportedArchitectureError"]
