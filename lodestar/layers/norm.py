"""RMSNorm variants, written to match the reference implementations' fp32 arithmetic."""
from __future__ import annotations

import torch
from torch import nn

from lodestar.kernels import cpu_ops
from lodestar.kernels.triton_dense import PendingNorm
from lodestar.kernels.triton_fused import rms_norm
from lodestar.kernels.triton_quant import SplitPartials


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: ``weight * (x / rms(x))`` computed in fp32."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, quantize: bool = False, prefetch: list[torch.Tensor] | None = None,
                launch_next: bool = False):
        """``quantize`` (GPU, bf16 [rows, D]): return the norm as ``quant_layout.QuantizedRows``,
        quantized for a ``CudaQuantLinear`` by the same kernel. ``prefetch`` (GPU): the next
        projection's weight arrays, asked of L2 by the same kernel (``decode_plan``).
        ``launch_next`` (GPU): the next kernel may launch before this one waits
        (``decode_plan``)."""
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, quantize=quantize, prefetch=prefetch, launch_next=launch_next)
        fast = cpu_ops.rms_norm(x, self.weight, self.eps)
        if fast is not None:
            return fast[1]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, quantize: bool = False,
                 prefetch: list[torch.Tensor] | None = None, launch_next: bool = False) -> tuple[torch.Tensor, object]:
        """``(h, norm(h))`` with ``h = x + delta``; one fused kernel on the GPU (``quantize``,
        ``prefetch`` and ``launch_next`` as for ``forward``)."""
        if x.is_cuda:
            y, h = rms_norm(delta, self.weight, self.eps, residual=x, quantize=quantize, prefetch=prefetch,
                            launch_next=launch_next)
            return h, y
        fast = cpu_ops.rms_norm(x, self.weight, self.eps, residual=delta)
        if fast is not None:
            return fast
        h = x + delta
        return h, self(h)

    def run(self, x: torch.Tensor, delta, step) -> tuple[torch.Tensor, object]:
        """``(h, norm(h))`` with ``h = x + delta`` (``delta`` None: ``x`` itself) on the GPU, as
        ``step`` (``decode_plan.NormStep``) says. ``delta`` may be ``SplitPartials``."""
        if step.pending:
            if isinstance(delta, SplitPartials):
                delta = delta.materialize()
            return self.pending(x, delta)
        if delta is None:
            return x, self(x, quantize=step.quantize, prefetch=step.prefetch, launch_next=step.launch_next)
        return self.add_norm(x, delta, quantize=step.quantize, prefetch=step.prefetch, launch_next=step.launch_next)

    def pending(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """``add_norm`` (or, without ``delta``, ``(x, norm(x))``) with the norm left to the dense
        matrix-vector kernel that reads it (``triton_dense.PendingNorm``; GPU, bf16 rows).
        That kernel also writes ``h``, so it must run before ``h`` is read."""
        if delta is None:
            p = PendingNorm.of(x, self.weight, self.eps)
        else:
            p = PendingNorm.of(delta, self.weight, self.eps, residual=x)
        return p.h, p


class OffsetRMSNorm(RMSNorm):
    """Gemma-style RMSNorm: ``(x / rms(x)) * (1 + w)``.

    GGUF files store ``1 + w`` already; the reference loader subtracts 1 and adds it back
    at run time, so we do the same once at load to get its exact fp32 rounding.
    """

    def __init__(self, stored_weight: torch.Tensor, eps: float) -> None:
        w = stored_weight.float() - 1.0
        super().__init__(1.0 + w, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, offset=True)
        fast = cpu_ops.rms_norm(x, self.weight, self.eps)
        if fast is not None:
            return fast[1]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(dtype)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            y, h = rms_norm(delta, self.weight, self.eps, offset=True, residual=x)
            return h, y
        fast = cpu_ops.rms_norm(x, self.weight, self.eps, residual=delta)
        if fast is not None:
            return fast
        h = x + delta
        return h, self(h)

    def pending(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        raise NotImplementedError("the dense matrix-vector kernel fuses the Llama-form RMSNorm only; "
                                  "call add_norm")
