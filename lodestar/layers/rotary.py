"""Rotary position embeddings (NeoX / rotate-half layout)."""
from __future__ import annotations

import torch
from torch import nn

from lodestar.kernels.triton_fused import rope_


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position.

    The tables are built with the same fp32 arithmetic as the reference
    (``inv_freq = 1 / base ** (arange(0, d, 2) / d)``, ``freqs = pos * inv_freq``) so
    rotated queries and keys match it bit for bit. ``freq_factors`` (GGUF
    ``rope_freqs.weight``) divide the base frequencies, as llama.cpp does; so does a linear
    scaling factor ``scale``.
    """

    def __init__(
        self,
        rotary_dim: int,
        base: float,
        max_positions: int,
        freq_factors: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.float()
        if scale != 1.0:                  # linear scaling: position p turns as p / scale did
            inv_freq = inv_freq / scale
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_positions = 0
        self._step: tuple | None = None   # (positions, dtype, cos, sin) of the current step
        self._covered: torch.Tensor | None = None   # the positions the tables were last extended for
        self._extend(max_positions)

    def _extend(self, n: int) -> None:
        # Built on the CPU (its fp32 cos/sin are the reference's), then moved to the device.
        device = self.inv_freq.device
        pos = torch.arange(n, dtype=torch.float32)
        freqs = (self.inv_freq.cpu()[:, None] @ pos[None, :]).T  # [n, d/2], as the reference's matmul
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)
        self.max_positions = n

    def ensure_positions(self, n: int) -> None:
        """Tables for positions < n. The GPU path needs them up front: it never checks
        positions on the host (that would synchronise and break CUDA graphs)."""
        if n > self.max_positions:
            self._extend(n)

    def covers(self, positions: torch.Tensor) -> bool:
        """Extend the CPU tables to ``positions`` (once per positions tensor); True when the
        tables (``cos``, ``sin``: ``[max_positions, rotary_dim]``) are on the CPU."""
        if self.cos.is_cuda:
            return False
        if self._covered is not positions:
            if positions.numel() and int(positions.max()) >= self.max_positions:
                self._extend(max(int(positions.max()) + 1, 2 * self.max_positions))
            self._covered = positions
        return True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` at ``positions [T]``."""
        if q.is_cuda:  # in place, fp32 math; tables sized by ensure_positions
            return rope_(q, k, positions, self.cos, self.sin, self.rotary_dim)
        # Every layer of a step passes the same positions tensor: look the rows up once.
        cached = self._step
        if cached is not None and cached[0] is positions and cached[1] == q.dtype:
            cos, sin = cached[2], cached[3]
        else:
            if positions.numel() and int(positions.max()) >= self.max_positions:
                self._extend(max(int(positions.max()) + 1, 2 * self.max_positions))
            cos = self.cos[positions].unsqueeze(1).to(q.dtype)
            sin = self.sin[positions].unsqueeze(1).to(q.dtype)
            self._step = (positions, q.dtype, cos, sin)
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)


    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                         prefetch: list[torch.Tensor] | None = None) -> torch.Tensor:
        """CUDA: rotate q and k in place and store k, v at ``slots`` of the caches, one kernel
        (which also asks L2 for ``prefetch``, the next projection's weight arrays). Returns
        the rotated q."""
        rope_(q, k, positions, self.cos, self.sin, self.rotary_dim, v=v, k_cache=k_cache, v_cache=v_cache,
              slots=slots, prefetch=prefetch)
        return q


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((rot * cos) + (_rotate_half(rot) * sin), rest), dim=-1)
