"""Shared pieces of the Triton kernel tests: where they run, and random GGUF bytes.

The kernels run on the GPU when there is one, else in Triton's interpreter on CPU tensors
when ``TRITON_INTERPRET=1`` is set and triton is importable; otherwise the tests skip.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from lodestar.kernels.launch import triton_enabled

F16_SCALE_OFFSETS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}


def kernel_device() -> str:
    """'cuda' on a GPU machine, 'cpu' under the interpreter; skips the test otherwise."""
    if not triton_enabled() or importlib.util.find_spec("triton") is None:
        pytest.skip("no CUDA device (set TRITON_INTERPRET=1 with triton installed to run on the CPU)")
    return "cuda" if torch.cuda.is_available() else "cpu"


def random_gguf(qtype: T, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF bytes [rows, bytes_per_row] with finite, varied fp16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for off in F16_SCALE_OFFSETS.get(qtype, ()):
        scales = rng.standard_normal(blocks.shape[0]) * rng.choice([1e-3, 1e-2, 0.05], blocks.shape[0])
        scales[::7] = 0.0
        blocks[:, off:off + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw)
