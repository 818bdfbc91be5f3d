"""Per-layer CPU operations of a step through the compiled kernels (``lodestar.kernels._native``).

Each function does in one call what takes several torch operations, for fp32 tensors on the
CPU, and returns None where it does not apply (extension not built, another dtype or
layout); the caller then runs its torch form. Rows are computed independently, so batching
changes nothing. ``rope_store`` gives torch's bits; the norm's mean, the activations and
attention's sums round differently from torch's kernels in the last bits.
"""
from __future__ import annotations

import torch

from lodestar.kernels import native

GLU_SILU, GLU_GELU_TANH = 0, 1


def _ok(*ts: torch.Tensor) -> bool:
    """Callers pass CPU tensors; the kernels take fp32."""
    return native.available() and all(t.dtype == torch.float32 for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(h, weight * (h * rsqrt(mean(h^2) + eps)))`` with ``h = x (+ residual)`` over the last dim."""
    if not _ok(x, weight) or not x.is_contiguous() or (residual is not None and (
            not _ok(residual) or not residual.is_contiguous() or residual.shape != x.shape)):
        return None
    dim = x.shape[-1]
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    native._ext.rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                         0 if residual is None else h.data_ptr(), out.data_ptr(), weight.data_ptr(),
                         x.numel() // dim, dim, eps)
    return h, out


def glu(gate_up: torch.Tensor, ffn: int, kind: int) -> torch.Tensor | None:
    """``act(gate) * up`` of a fused ``[rows, 2*ffn]`` projection output (gate first)."""
    if not _ok(gate_up) or not gate_up.is_contiguous() or gate_up.shape[-1] != 2 * ffn:
        return None
    out = torch.empty(*gate_up.shape[:-1], ffn, dtype=torch.float32)
    native._ext.glu(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * ffn), ffn, kind)
    return out


def _rows(t: torch.Tensor) -> int | None:
    """Row stride of ``[T, H, D]`` whose heads are contiguous, else None."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        return None
    return t.stride(0)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place (the first ``cos.shape[1]`` dims
    of each head, rotate-half layout) and store k and v at ``slots`` of the caches. False
    (nothing done) where it does not apply."""
    strides = [_rows(t) for t in (q, k, v)]
    if (None in strides or not _ok(q, k, v, cos, sin, k_cache, v_cache) or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k.shape[1:] != k_cache.shape[1:] or v.shape[1:] != v_cache.shape[1:]
            or positions.dtype != torch.int64 or slots.dtype != torch.int64 or not cos.is_contiguous()
            or not sin.is_contiguous()):
        return False
    positions, slots = positions.contiguous(), slots.contiguous()
    t, hq, d = q.shape
    native._ext.rope_store(q.data_ptr(), k.data_ptr(), v.data_ptr(), *strides, t, hq, k.shape[1], d, cos.shape[1],
                           positions.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr())
    return True


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, scale: float,
           rows: torch.Tensor, seqs: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor,
           tables: torch.Tensor, block_size: int) -> bool:
    """Attention of single query rows: for each i, row ``rows[i]`` of ``q [T, Hq, D]`` over
    positions ``starts[i] .. lens[i]-1`` of sequence ``seqs[i]`` (block table ``tables``),
    written to the same row of ``out [T, Hq, D]``. False where it does not apply."""
    stride = _rows(q)
    if (stride is None or not _ok(q, k_cache, v_cache, out) or not out.is_contiguous()
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or tables.dtype != torch.int64
            or not tables.is_contiguous()):
        return False
    t, hq, d = q.shape
    native._ext.attend(q.data_ptr(), stride, hq, k_cache.shape[1], d, k_cache.data_ptr(), v_cache.data_ptr(),
                       out.data_ptr(), scale, rows.numel(), rows.data_ptr(), seqs.data_ptr(), lens.data_ptr(),
                       starts.data_ptr(), tables.data_ptr(), tables.shape[1], block_size)
    return True
