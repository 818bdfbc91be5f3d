"""Linear layers and embedding tables on a CUDA device.

Activations are bf16 (``packed``/``bf16`` weight modes) or fp32 (``fp32`` mode).

==================================  ===============================================
weight type (mode ``packed``)       module
==================================  ===============================================
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K  ``CudaQuantLinear``: GGUF blocks repacked once
                                    (same bits, ``triton_quant.PackedWeight``); up to
                                    64 rows run the fused Triton kernel (x may come
                                    quantized already: ``QuantizedRows`` from a fused
                                    RMSNorm or activation), more rows dequantize to
                                    bf16 and run one cuBLAS matmul
F16, BF16, F32                      ``CudaDenseLinear`` over a bf16 copy (one bf16
                                    row runs the Triton matrix-vector kernel, which
                                    may compute x itself: ``PendingNorm`` or
                                    ``PendingGlu`` from ``triton_dense``; a gate|up
                                    projection may apply the gated activation to
                                    its own output: ``forward_glu``)
Q5_0, Q5_1, Q2_K, Q3_K              ``CudaDenseLinear`` dequantized to bf16 at load
==================================  ===============================================

Projections of one input packed in several types (q|k|v of a llama.cpp Q4_K_M file, whose
attn_v is Q6_K in half the layers) form one ``CudaQuantStack``: neighbours of one type
fused, the input quantized once, and each part's kernel writing its columns of one output
(and, with ``qkv_rope``, rotating and storing its own rows).

Modes ``bf16`` / ``fp32`` dequantize every weight at load (dense cuBLAS matmuls).
Embedding tables are dense (bf16 or fp32) so a lookup is a plain gather; a tied head in
``packed`` mode is a ``CudaQuantLinear`` over the same GGUF bytes, since the head is read
in full every step and its bytes are what decode speed pays for.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from torch import nn

from lodestar.kernels import dequant as dq
from lodestar.kernels import triton_dense as _td   # imports without Triton; runs only on CUDA

T = GGMLQuantizationType
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def compute_dtype(mode: str) -> torch.dtype:
    """Activation (and KV) dtype on the GPU for a weight mode."""
    return torch.float32 if mode == "fp32" else torch.bfloat16


def _gpu_types():
    from lodestar.kernels.triton_quant import GPU_QUANT_TYPES
    return GPU_QUANT_TYPES


def dense_weight(qtype: GGMLQuantizationType, data: torch.Tensor, rows: int, cols: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """GGUF bytes -> dense [rows, cols] ``dtype`` on ``device`` (dequantized on the device when it can)."""
    qtype = T(int(qtype))
    if qtype in FLOAT_TYPES:
        raw = data.to(device).reshape(-1)
        view = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        return raw.view(view).reshape(rows, cols).to(dtype).contiguous()
    if qtype in _gpu_types() and device.type == "cuda":
        from lodestar.kernels import triton_quant as tq
        return tq.dequantize_packed(tq.pack(qtype, data.to(device), rows, cols), dtype)
    return dq.dequantize(data.cpu(), qtype, (rows, cols)).to(device=device, dtype=dtype)


class CudaQuantLinear(nn.Module):
    """``y = x @ W.T`` with W packed for the Triton kernels; y in x's dtype."""

    def __init__(self, qtype: GGMLQuantizationType | int, data: torch.Tensor, in_features: int,
                 out_features: int, device: torch.device) -> None:
        super().__init__()
        from lodestar.kernels import triton_quant as tq
        self._tq = tq
        self.qtype = T(int(qtype))
        self.in_features, self.out_features = in_features, out_features
        self.weight = tq.pack(self.qtype, data.to(device), out_features, in_features)
        tq.reserve_tile_counters(self.weight)       # before any CUDA-graph capture
        self.out_dtype: torch.dtype | None = None   # None: x's dtype; the head sets float32

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def forward(self, x) -> torch.Tensor:
        """``x``: a tensor [..., in_features], ``QuantizedRows`` [rows, in_features], or a
        ``triton_dense.PendingNorm`` of such rows (computed in the kernel when it can)."""
        if isinstance(x, self._tq.QuantizedRows):
            return self._tq.quant_matmul(x, self.weight, self.out_dtype)
        if isinstance(x, _td.PendingNorm):
            if x.x.dim() == 2 and x.x.shape[0] <= self._tq.SMALL_M_MAX:
                return self._tq.quant_matmul(x, self.weight, self.out_dtype)
            x = x.materialize()
        x2 = x.reshape(-1, self.in_features)
        y = self._tq.matmul(x2, self.weight, self.out_dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def forward_partials(self, x):
        """``forward`` of ``QuantizedRows``, leaving the sum of a K-split tiling's partial products
        to the kernel that reads them (``triton_quant.SplitPartials``; fusion ``norm_sum``);
        a tiling without K splits returns the product itself."""
        if isinstance(x, self._tq.QuantizedRows):
            return self._tq.quant_matmul(x, self.weight, self.out_dtype, defer_sum=True)
        return self.forward(x)

    def forward_glu_quant(self, x, ffn: int, act: int):
        """This gate|up projection (gate rows, then up rows, ``ffn`` each) with the gated
        activation (``triton_dense.SILU`` / ``GELU_TANH``) applied to its output and quantized
        for the next projection in the same kernel (``triton_quant.quant_glu``): a
        ``QuantizedRows`` of [rows, ffn]. Only where ``takes_glu_quant``."""
        return self._tq.quant_glu(x, self.weight, ffn, act)

    def rope_store(self, x, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, n_q: int, n_k: int, head_dim: int):
        """A ``triton_quant.RopeStore`` with which ``forward_rope`` runs rows like ``x`` (this being a
        q|k|v projection of ``n_q + 2 * n_k`` rows, heads of ``head_dim``, in the caches' dtype),
        or None when the kernel cannot (fusion ``qkv_rope`` off, another tiling, too many rows)."""
        tq = self._tq
        if (not _rope_inputs_ok(x, k_cache, v_cache, self.out_dtype)
                or not tq.rope_epilogue_ok(self.weight, x.shape[0], head_dim, n_q, n_k)):
            return None
        return tq.RopeStore(positions, slots, cos, sin, k_cache, v_cache, n_q, n_k, head_dim)

    def forward_rope(self, x, rope) -> torch.Tensor:
        """``forward`` whose kernel also rotates q and k and stores k and v (``rope``, from
        ``rope_store``); returns the whole q|k|v output [rows, out_features]."""
        return self._tq.quant_matmul(x, self.weight, self.out_dtype, rope=rope)

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, in_features={self.in_features}, out_features={self.out_features}, cuda"


def _rope_inputs_ok(x, k_cache: torch.Tensor, v_cache: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    """The fusion ``qkv_rope`` is on and rows ``x`` (a tensor or ``QuantizedRows``) can feed a
    q|k|v kernel that stores into these caches: 2-D, in the caches' dtype, as the output."""
    from lodestar.kernels import triton_quant as tq
    dtype = x.x.dtype if isinstance(x, tq.QuantizedRows) else x.dtype
    return ("qkv_rope" in tq.fusions() and len(x.shape) == 2 and k_cache.dtype == dtype
            and v_cache.dtype == dtype and out_dtype in (None, dtype))


class CudaQuantStack(nn.Module):
    """Packed projections of one input, of different weight types, as one projection whose
    output holds theirs side by side (``parts``, in order). Up to 64 rows quantize x once
    (or take it quantized: ``QuantizedRows``) and each part's kernel writes its columns of one
    output (``triton_quant.quant_matmul(out=, row0=)``); more rows, or a part whose tiling
    cannot write at its offset, run the parts apart and concatenate. The same bits as the
    parts apart either way."""

    def __init__(self, parts: list[CudaQuantLinear]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1 or not all(isinstance(p, CudaQuantLinear) for p in parts):
            raise ValueError("a stack takes packed projections of one input width")
        from lodestar.kernels import triton_quant as tq
        self._tq = tq
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.row0s = [sum(p.out_features for p in parts[:i]) for i in range(len(parts))]
        self.out_features = sum(p.out_features for p in parts)
        self.out_dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _writes_in_place(self, rows: int) -> bool:
        """Each part's kernel can write its columns of one output for ``rows`` rows."""
        tq = self._tq
        if not 0 < rows <= tq.SMALL_M_MAX or self.in_features % tq.GROUP:
            return False
        for p, r0 in zip(self.parts, self.row0s):
            cfg = tq.gemv_config(p.weight.n, p.weight.k, p.weight.device, p.weight.qtype)
            if not (cfg.words and p.weight.qtype in tq.WORDS_CAPABLE and r0 % cfg.block_n == 0):
                return False
        return True

    def _quantized(self, x):
        """``x`` as ``QuantizedRows`` when the parts can write in place, else None."""
        tq = self._tq
        if isinstance(x, _td.PendingNorm):
            x = x.materialize()
        if isinstance(x, tq.QuantizedRows):
            return x if self._writes_in_place(x.shape[0]) else None
        if x.dim() != 2 or x.dtype != torch.bfloat16 or not self._writes_in_place(x.shape[0]):
            return None
        return tq.QuantizedRows(x, *tq.quantize_x(x.contiguous()))

    def forward(self, x) -> torch.Tensor:
        """As ``CudaQuantLinear.forward``: a tensor [..., in_features], ``QuantizedRows`` or a
        ``triton_dense.PendingNorm``."""
        xq = self._quantized(x)
        if xq is None:
            if isinstance(x, _td.PendingNorm):
                x = x.materialize()
            return torch.cat([p(x) for p in self.parts], dim=-1)
        return self._run(xq)

    def rope_store(self, x, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, n_q: int, n_k: int, head_dim: int):
        """``CudaQuantLinear.rope_store`` for a q|k|v stack: a ``triton_quant.RopeStore`` when
        every part's kernel can rotate and store its rows, else None."""
        tq = self._tq
        if (not _rope_inputs_ok(x, k_cache, v_cache, self.out_dtype) or not self._writes_in_place(x.shape[0])
                or not all(tq.rope_epilogue_ok(p.weight, x.shape[0], head_dim, n_q, n_k, n_out=self.out_features)
                           for p in self.parts)):
            return None
        return tq.RopeStore(positions, slots, cos, sin, k_cache, v_cache, n_q, n_k, head_dim)

    def forward_rope(self, x, rope) -> torch.Tensor:
        """``forward`` whose kernels also rotate q and k and store k and v (``rope``, from
        ``rope_store``); the whole q|k|v output [rows, out_features]."""
        xq = self._quantized(x)
        if xq is None:
            raise ValueError("CudaQuantStack.forward_rope: rows the parts cannot write in place (see rope_store)")
        return self._run(xq, rope)

    def _run(self, xq, rope=None) -> torch.Tensor:
        """Each part's kernel over ``QuantizedRows`` writing its columns of one output."""
        out = torch.empty(xq.shape[0], self.out_features, device=xq.x.device, dtype=self.out_dtype or xq.x.dtype)
        for p, r0 in zip(self.parts, self.row0s):
            self._tq.quant_matmul(xq, p.weight, out.dtype, out=out, row0=r0, rope=rope)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, cuda"


def takes_quantized_input(module: object) -> bool:
    """Whether ``module`` accepts ``QuantizedRows`` (a fused producer may quantize for it)."""
    return isinstance(module, (CudaQuantLinear, CudaQuantStack))


def takes_pending_input(module: object, x: torch.Tensor) -> bool:
    """Whether ``module`` runs rows like ``x`` (the residual stream: row count, dtype,
    device) through the dense matrix-vector kernel and is small enough
    (``triton_dense.FUSE_MAX_WEIGHT``) that the RMSNorm or gated activation feeding it is
    best left to that kernel (``triton_dense.PendingNorm`` / ``PendingGlu``)."""
    return (isinstance(module, CudaDenseLinear) and module.weight.numel() <= _td.FUSE_MAX_WEIGHT
            and module.runs_gemv(x))


def takes_norm_prologue(module: object, x: torch.Tensor) -> bool:
    """Whether ``module`` is a packed projection whose word-tile kernel computes the RMSNorm
    feeding it for rows like ``x`` (bf16, on the GPU) in its own prologue (fusion
    ``quant_norm``, ``triton_quant.norm_prologue_ok``)."""
    if not (isinstance(module, CudaQuantLinear) and x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16):
        return False
    from lodestar.kernels.triton_quant import norm_prologue_ok
    return norm_prologue_ok(module.weight, x.shape[0])


def takes_glu_epilogue(module: object, x) -> bool:
    """Whether ``module`` is a dense gate|up projection whose matrix-vector kernel applies the
    gated activation to its own output for rows like ``x`` (a tensor or a
    ``triton_dense.PendingNorm``): ``CudaDenseLinear.forward_glu`` in one kernel (fusion
    ``glu_epilogue``)."""
    return isinstance(module, CudaDenseLinear) and module.fuses_glu(x)


def takes_glu_quant(module: object, x, ffn: int) -> bool:
    """Whether ``module`` is a packed gate|up projection (2 * ``ffn`` rows) that applies the
    gated activation to its own output and quantizes it for down, for rows like ``x``
    (``QuantizedRows`` or a bf16 tensor; fusion ``glu_quant``, ``triton_quant.glu_epilogue_ok``)."""
    if not isinstance(module, CudaQuantLinear) or len(x.shape) != 2:
        return False
    from lodestar.kernels.triton_quant import fusions, glu_epilogue_ok
    return "glu_quant" in fusions() and glu_epilogue_ok(module.weight, x.shape[0], ffn)


PREFETCH_SITES = ("qkv", "o", "gate_up", "down", "head")


def prefetch_sites() -> frozenset[str]:
    """Projections whose weights the kernel before them asks L2 for (env
    ``LODESTAR_WEIGHT_PREFETCH_SITES``, a comma list of ``PREFETCH_SITES``; unset: all)."""
    env = os.environ.get("LODESTAR_WEIGHT_PREFETCH_SITES", "").strip()
    sites = frozenset(s.strip() for s in env.split(",") if s.strip()) if env else frozenset(PREFETCH_SITES)
    if not sites <= set(PREFETCH_SITES):
        raise ValueError(f"LODESTAR_WEIGHT_PREFETCH_SITES={env!r}; use a comma list of {', '.join(PREFETCH_SITES)}")
    return sites


# Types whose down projection launches before the activation kernel ahead of it waits (unless
# LODESTAR_PDL_EARLY says otherwise; see ``launch_early``).
EARLY_DOWN_TYPES = (T.Q4_K,)


def launch_early(site: str, module: object = None, rows: int = 0) -> bool:
    """Whether the small kernel before projection ``site`` (one of ``PREFETCH_SITES``;
    ``module`` for ``rows`` rows) lets that projection's kernel launch before its own wait
    (``triton_quant.pdl(launch_next=True)``): the projection's programs become resident
    while the kernel before the small one drains, and read the weights they read before
    their wait then. Env ``LODESTAR_PDL_EARLY``, a comma list of sites or ``none``; unset:
    the quantized projections whose programs read all their weights before the wait
    (``triton_quant.loads_all_before_wait``: at 8B, the q|k|v of Q4_0 and Q4_K), and a
    down projection of a type in ``EARLY_DOWN_TYPES``. Read at each call; same bits either
    way.

    H200, 8B one-stream decode, same tokens on every side: run 67, Q4_0 559.9 -> 564.4
    tok/s with q|k|v (gate|up 559.1; all of q|k|v, gate|up, down and the head 567.5); run
    68, q|k|v with down and the head 565.1, with down 565.0, with the head 564.2; Q4_K
    (whose q|k|v tiles are not whole rows) 535.0 -> 529.9 with q|k|v, 536.7 with down. With
    Q4_K's q|k|v in whole rows, down launched early too (after the SiLU·mul kernel): run 154
    585.2 / 585.1 -> 586.8, run 158 586.6 / 586.5 -> 587.7 / 587.9; Q4_K_M 536.6 / 535.4 ->
    535.2 / 536.0, Q5_K_M 457.4 / 457.2 -> 456.8 / 456.5, Q8_0 404.0 / 403.8 -> 404.3 / 403.9
    (run 158), hence Q4_K only."""
    env = os.environ.get("LODESTAR_PDL_EARLY", "").strip()
    if not env:
        from lodestar.kernels.triton_quant import loads_all_before_wait
        if isinstance(module, CudaQuantStack):     # its first part's kernel follows the small one
            module = module.parts[0]
        if not isinstance(module, CudaQuantLinear):
            return False
        return loads_all_before_wait(module.weight, rows) or (site == "down" and module.qtype in EARLY_DOWN_TYPES)
    sites = frozenset(s.strip() for s in env.split(",") if s.strip())
    if not sites <= set(PREFETCH_SITES) | {"none"}:
        raise ValueError(f"LODESTAR_PDL_EARLY={env!r}; use none or a comma list of {', '.join(PREFETCH_SITES)}")
    return site in sites


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_SIDE_PENDING: set[torch.device] = set()


def fork_side_prefetch(module: object, rows: int) -> bool:
    """Ask L2 for the first bytes of a quantized projection's weights
    (``triton_quant.side_prefetch``, ``side_prefetch_limit()`` bytes) from a second stream
    forked from the current one here, so that no kernel of the current stream waits for it;
    ``join_side_prefetch`` joins it back (required before a CUDA-graph capture ends). False
    (nothing launched) when off, for more ``rows`` than a decode step's matrix-vector
    kernels take, for dense weights, or for weights the small kernel before the projection
    prefetches whole (``prefetch_launch``: at most ``weight_prefetch_limit()`` bytes)."""
    from lodestar.kernels.triton_quant import SMALL_M_MAX, side_prefetch, side_prefetch_limit, weight_prefetch_limit
    mods = list(module) if isinstance(module, (list, nn.ModuleList)) else [module]
    limit = side_prefetch_limit()
    if limit <= 0 or rows > SMALL_M_MAX or not all(isinstance(m, (CudaQuantLinear, CudaQuantStack)) for m in mods):
        return False
    arrays = prefetch_arrays(module)
    if not arrays or sum(a.numel() * a.element_size() for a in arrays) <= weight_prefetch_limit():
        return False
    dev = arrays[0].device
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        side_prefetch(arrays, limit)
    _SIDE_PENDING.add(dev)
    return True


def join_side_prefetch() -> None:
    """Make the current stream wait for every side prefetch forked since the last join."""
    for dev in list(_SIDE_PENDING):
        torch.cuda.current_stream(dev).wait_stream(_SIDE_STREAMS[dev])
        _SIDE_PENDING.discard(dev)


def prefetch_arrays(module: object, site: str | None = None) -> list[torch.Tensor] | None:
    """The GPU weight arrays of a projection (``CudaQuantLinear``: codes and scales;
    ``CudaDenseLinear``: the matrix; a list of projections: all of theirs, in order) for
    a kernel running before it to ask L2 for (``triton_quant.prefetch_launch``); None for
    anything else, with the prefetch off, or for a ``site`` not in ``prefetch_sites()``."""
    from lodestar.kernels.triton_quant import weight_prefetch_limit
    if weight_prefetch_limit() <= 0 or (site is not None and site not in prefetch_sites()):
        return None
    if isinstance(module, (list, nn.ModuleList)):
        arrays = [a for m in module for a in (prefetch_arrays(m) or [])]
        return arrays or None
    if isinstance(module, CudaQuantLinear):
        w = module.weight
        return [t for t in (w.codes, w.d, w.high, w.dmin, w.sc, w.m) if t is not None]
    if isinstance(module, CudaQuantStack):
        return prefetch_arrays(module.parts)
    if isinstance(module, CudaDenseLinear):
        return [module.weight]
    return None


class CudaDenseLinear(nn.Module):
    """``y = x @ W.T`` with W dense (bf16 or fp32); y in x's dtype. ``x`` may also be a
    ``triton_dense.PendingNorm`` / ``PendingGlu``, computed inside the matrix-vector kernel
    when it runs (else materialized first). A gate|up projection (gate rows, then as many
    up rows) also has ``forward_glu``: ``act(gate) * up`` in one kernel for one row."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.gemv_config = _td.config_for(self.out_features, self.in_features, weight.device)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def runs_gemv(self, x: torch.Tensor) -> bool:
        """Rows like ``x`` go through the Triton matrix-vector kernel (one-row bf16 decode:
        cuBLAS's costs ~2x on small matrices)."""
        return (x.is_cuda and x.dtype == self.weight.dtype == torch.bfloat16
                and x.numel() <= _td.MAX_ROWS * x.shape[-1] and _td.enabled())

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, (_td.PendingNorm, _td.PendingGlu)):
            rows = x.x if isinstance(x, _td.PendingNorm) else x.gate
            if rows.dim() == 2 and self.runs_gemv(rows):
                return _td.dense_gemv(x, self.weight, config=self.gemv_config)
            x = x.materialize()
        if x.dtype == self.weight.dtype:
            if self.runs_gemv(x):
                x2 = x.reshape(-1, self.in_features)
                y = _td.dense_gemv(x2, self.weight, config=self.gemv_config)
                return y.view(*x.shape[:-1], self.out_features)
            return F.linear(x, self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)

    def fuses_glu(self, x) -> bool:
        """``forward_glu`` runs rows like ``x`` (tensor or ``PendingNorm``) as one kernel:
        the weight is small (``triton_dense.FUSE_MAX_WEIGHT``), the rows go through the
        matrix-vector kernel (``runs_gemv``) and its tiling for this weight can apply the
        activation (``triton_dense.glu_epilogue_fits``: one K split). H200, one-stream decode
        (run 20, same tokens): SmolLM2-135M 1,508 -> 1,612 tok/s with it, the 8B's gate|up
        (117M weights) 254.8 -> 247.3, so large weights keep the separate activation kernel."""
        if isinstance(x, _td.PendingNorm):
            if x.x.dim() != 2:
                return False
            x = x.x
        elif not isinstance(x, torch.Tensor):
            return False
        return (self.weight.numel() <= _td.FUSE_MAX_WEIGHT and self.runs_gemv(x)
                and _td.glu_epilogue_fits(self.gemv_config, self.out_features, self.in_features))

    def forward_glu(self, x, act: int = _td.SILU) -> torch.Tensor:
        """``act(gate) * up`` (``act``: ``triton_dense.SILU`` / ``GELU_TANH``) of this
        projection's output halves ``gate | up``, for ``x`` a tensor or a ``PendingNorm``.
        One kernel (``triton_dense.dense_gemv_glu``) when ``fuses_glu(x)``, else the
        projection then the activation kernel: the same bits either way."""
        if self.fuses_glu(x):
            if isinstance(x, _td.PendingNorm):
                return _td.dense_gemv_glu(x, self.weight, act, self.gemv_config)
            y = _td.dense_gemv_glu(x.reshape(-1, self.in_features), self.weight, act, self.gemv_config)
            return y.view(*x.shape[:-1], self.out_features // 2)
        from lodestar.layers.activation import gelu_tanh_mul, silu_mul
        gate, up = self(x).split(self.out_features // 2, dim=-1)
        return (silu_mul if act == _td.SILU else gelu_tanh_mul)(gate, up)


# Token ids (a decode step's) whose rows ``CudaEmbedding`` copies with its own kernel.
EMBED_KERNEL_MAX_IDS = 64


def embed_kernel_on() -> bool:
    """Whether a decode step's embedding runs ``triton_fused.embedding_rows`` (env
    ``LODESTAR_EMBED_KERNEL``, unset or 1; 0: ``F.embedding``; the same rows; read at each call).
    Launched as the decode kernels are, it waits in place for the graph's input kernel
    (``triton_step_inputs``) instead of being launched after it. H200 run 161, one stream,
    same tokens, against ``F.embedding``: 8B Q4_K 588.4 / 588.2 -> 588.8 / 589.2 tok/s,
    SmolLM2-135M F16 1,786.3 / 1,780.3 -> 1,789.2 / 1,789.6."""
    env = os.environ.get("LODESTAR_EMBED_KERNEL", "1").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"LODESTAR_EMBED_KERNEL={env!r}; use 0 or 1")
    return env != "0"


class CudaEmbedding(nn.Module):
    """Dense embedding table on the device; rows come back in the table's dtype."""

    def __init__(self, qtype: GGMLQuantizationType | int, data: torch.Tensor, num_embeddings: int, dim: int,
                 mode: str, device: torch.device) -> None:
        super().__init__()
        self.qtype = T(int(qtype))
        self.num_embeddings, self.dim, self.mode, self.device = num_embeddings, dim, mode, device
        self.register_buffer("weight", dense_weight(self.qtype, data, num_embeddings, dim, compute_dtype(mode), device),
                             persistent=False)
        # The bytes, kept only until the tied head (if any) is built from them.
        self._data = data if mode == "packed" and self.qtype in _gpu_types() else None
        self._head: nn.Module | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_cuda and ids.dtype == torch.int64 and ids.numel() <= EMBED_KERNEL_MAX_IDS and embed_kernel_on():
            from lodestar.kernels.triton_fused import embedding_rows
            return embedding_rows(ids, self.weight)
        return F.embedding(ids, self.weight)

    def as_linear(self) -> nn.Module:
        if self._head is None:
            if self._data is not None:
                self._head = CudaQuantLinear(self.qtype, self._data, self.dim, self.num_embeddings, self.device)
            else:
                self._head = CudaDenseLinear(self.weight)
        self._data = None
        return self._head

    def release_bytes(self) -> None:
        """Drop the GGUF bytes once it is known that no tied head needs them."""
        self._data = None


def packs(qtype: GGMLQuantizationType | int, mode: str) -> bool:
    """Whether ``make_linear`` keeps a weight of ``qtype`` packed (a ``CudaQuantLinear``)."""
    return mode == "packed" and T(int(qtype)) in _gpu_types()


def make_linear(qtype: GGMLQuantizationType | int, data: torch.Tensor, in_features: int, out_features: int,
                mode: str, device: torch.device) -> nn.Module:
    """A linear layer over GGUF bytes on a CUDA device (see the module table)."""
    qtype = T(int(qtype))
    if packs(qtype, mode):
        return CudaQuantLinear(qtype, data, in_features, out_features, device)
    return CudaDenseLinear(dense_weight(qtype, data, out_features, in_features, compute_dtype(mode), device))


def make_embedding(qtype: GGMLQuantizationType | int, data: torch.Tensor, num_embeddings: int, dim: int,
                   mode: str, device: torch.device) -> nn.Module:
    return CudaEmbedding(qtype, data, num_embeddings, dim, mode, device)
