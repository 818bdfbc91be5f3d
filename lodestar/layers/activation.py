"""Gated activations of the MLPs: ``act(gate) * up`` (one fused kernel on the GPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lodestar.kernels import triton_fused


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.is_cuda:
        return triton_fused.silu_mul(gate, up)
    return F.silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.is_cuda:
        return triton_fused.gelu_tanh_mul(gate, up)
    return F.gelu(gate, approximate="tanh") * up
