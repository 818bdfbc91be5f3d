"""Model faults: logits that are NaN or infinite as the model computed them.

Such logits come from the weights (a corrupt file: NaN or infinite values, bad tensor
offsets or types), not from the request, so the error names the model file and, found by
one scan after the fault, the first tensor holding a non-finite value. The scan reads
only what can be non-finite: every value of float tensors, the fp16 scales of block types
(a block's values are finite when its scales are).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

T = GGMLQuantizationType

# Byte offsets of the fp16 scale fields inside one block (ggml-common.h).
SCALE_OFFSETS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}
_FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
_CHUNK_BYTES = 1 << 24


class ModelFaultError(ValueError):
    """The model computed NaN or infinite logits: its weights are broken, not the request."""


class NonFiniteLogitsError(ValueError):
    """The sampler's finding: rows whose logits, before any bias or penalty, have a NaN or
    infinite maximum. The engine turns it into a ``ModelFaultError`` naming the file."""

    def __init__(self, rows: list[int], values: list[float]) -> None:
        self.rows, self.values = list(rows), list(values)
        super().__init__(describe_rows(self.values, self.rows))


def tensor_is_finite(t: Any) -> bool:
    """Whether a checkpoint tensor (``qtype``, ``data`` uint8 rows, ``dequantize()``) holds
    only finite values."""
    qtype = GGMLQuantizationType(int(t.qtype))
    raw = t.data.reshape(-1)
    if qtype in _FLOAT_DTYPES:
        values = raw.view(_FLOAT_DTYPES[qtype])
        step = _CHUNK_BYTES // values.element_size()
        return all(bool(torch.isfinite(values[i:i + step]).all()) for i in range(0, values.numel(), step))
    if qtype in SCALE_OFFSETS:
        size = GGML_QUANT_SIZES[qtype][1]
        blocks = raw.view(-1, size)
        step = _CHUNK_BYTES // size
        for i in range(0, blocks.shape[0], step):
            chunk = blocks[i:i + step]
            for off in SCALE_OFFSETS[qtype]:
                scales = chunk[:, off:off + 2].contiguous().view(torch.float16)
                if not bool(torch.isfinite(scales).all()):
                    return False
        return True
    return bool(torch.isfinite(t.dequantize()).all())


def first_nonfinite_tensor(tensors: dict[str, Any] | None) -> str | None:
    """Name of the first tensor, in file order, holding a NaN or infinite value (None: none)."""
    for name, t in (tensors or {}).items():
        try:
            if not tensor_is_finite(t):
                return name
        except Exception:  # a tensor the scan cannot read says nothing about the others
            continue
    return None


def model_fault(path: Path | str, detail: str, tensors: dict[str, Any] | None) -> ModelFaultError:
    """The error for non-finite logits of the model in ``path``; ``detail`` says which rows."""
    name = first_nonfinite_tensor(tensors)
    if name is not None:
        cause = f"tensor {name} holds NaN or infinite values: the file is corrupt (re-download or re-convert it)"
    else:
        cause = "no weight holds NaN or infinite values, so the activations overflowed"
    return ModelFaultError(f"{path}: model fault: {detail}; {cause}")


def describe_rows(values: Iterable[float], rows: Iterable[int]) -> str:
    """'NaN logits (batch row 0)' style summary of the largest logit of the faulty rows."""
    kinds = sorted({"NaN" if v != v else ("+inf" if v > 0 else "-inf") for v in values})
    rows = list(rows)
    where = f"batch row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:8]))}"
    return f"the model computed {'/'.join(kinds)} logits ({where})"
