"""``@triton.jit`` helpers shared by the kernel files: x quantization for the integer matrix-vector
kernels (``_quant_groups``), RMSNorm pieces that give the same bits in every kernel, gated
activations, ``dp4a``, and inline-PTX loads that keep their users' register layout.

Defined only when Triton can run (``launch.triton_enabled``). Under Triton's CPU interpreter the
inline assembly is replaced by plain loads and integer arithmetic (``ASM=False``).
"""
from __future__ import annotations

from lodestar.kernels.launch import triton_enabled

if triton_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _dp4a(a, b, c, ASM: tl.constexpr):
        """``c + sum of the four signed byte products of a and b`` (int32 tensors)."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        r = c
        for j in tl.static_range(4):
            r += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return r

    @triton.jit
    def _quant_groups(x, GB: tl.constexpr):
        """fp32 ``x [GB, 32]`` (one 32-element group a row) -> (term 1 words [GB, 8], term 2
        words [GB, 8], d1 [GB], sum of elements 0..15 [GB], sum of 16..31 [GB]).

        Element-wise steps and an exact max and integer packing, then half sums in a fixed
        pairwise order (adjacent pairs, then pairs of pairs...), so the bits do not depend on
        the register layout of whichever kernel calls this."""
        amax = tl.max(tl.abs(x), axis=1)                                   # [GB]
        d1 = amax / 127.0
        inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        q1 = tl.floor(x * inv[:, None] + 0.5)
        rest = x - q1 * d1[:, None]
        q2 = tl.minimum(tl.maximum(tl.floor(rest * (inv * 254.0)[:, None] + 0.5), -127.0), 127.0)
        shift = (tl.arange(0, 4) * 8)[None, None, :]
        # bytes never overlap, so the integer sums are exact ORs
        w1 = tl.sum(tl.reshape(q1.to(tl.int32) & 255, (GB, 8, 4)) << shift, axis=2)
        w2 = tl.sum(tl.reshape(q2.to(tl.int32) & 255, (GB, 8, 4)) << shift, axis=2)
        a, b = tl.split(tl.reshape(x, (GB, 16, 2)))
        s16 = a + b
        a, b = tl.split(tl.reshape(s16, (GB, 8, 2)))
        s8 = a + b
        a, b = tl.split(tl.reshape(s8, (GB, 4, 2)))
        s4 = a + b
        a, b = tl.split(tl.reshape(s4, (GB, 2, 2)))
        s2 = a + b                                                         # [GB, 2]: the two halves
        sa, sb = tl.split(s2)
        return w1, w2, d1, sa, sb

    @triton.jit
    def _store_quant_groups(words_ptr, d1_ptr, sums_ptr, row, mask_g, w1, w2, d1, sa, sb):
        """Store ``_quant_groups``' output for groups ``row`` (flat index m * G + g) [GB]."""
        wo = row[:, None] * 16 + tl.arange(0, 8)[None, :]
        tl.store(words_ptr + wo, w1, mask=mask_g[:, None])
        tl.store(words_ptr + wo + 8, w2, mask=mask_g[:, None])
        tl.store(d1_ptr + row, d1, mask=mask_g)
        tl.store(sums_ptr + row * 2, sa, mask=mask_g)
        tl.store(sums_ptr + row * 2 + 1, sb, mask=mask_g)


    @triton.jit
    def _quant_store(words_ptr, d1_ptr, sums_ptr, y, row, g0, D, BLOCK: tl.constexpr):
        """Quantize the bf16 values ``y [BLOCK]`` (columns ``32 * g0 ..``; groups past D are
        masked) of row ``row`` as ``quantize_x`` does, into its [rows, D/32] outputs."""
        GB: tl.constexpr = BLOCK // 32
        g = g0 + tl.arange(0, GB)
        w1, w2, d1, sa, sb = _quant_groups(tl.reshape(y.to(tl.float32), (GB, 32)), GB)
        _store_quant_groups(words_ptr, d1_ptr, sums_ptr, row * (D // 32) + g, g < D // 32, w1, w2, d1, sa, sb)


    @triton.jit
    def _residual_chunk(x_ptr, r_ptr, cols, mask, HAS_RES: tl.constexpr):
        """x (plus the residual, rounded to x's dtype as the unfused add is) at ``cols``."""
        x = tl.load(x_ptr + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _rms_rstd(h, eps, D: tl.constexpr):
        """``1 / rms`` of the fp32 row ``h`` (padding lanes 0), the same bits in every kernel.

        ``tl.sum``'s order of float adds follows the register layout (num_warps, tiling,
        alignment), so two kernels would round the sum of squares differently. Here the
        squares, scaled by the row's max, are truncated to 2^-40 units and summed as int64:
        exact, so any order gives the same total (rounding error at most D * 2^-40 of the
        largest square, below fp32 accumulation's); the max is exact too."""
        amax = tl.max(tl.abs(h), 0)
        inv = tl.where(amax > 0, 1.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        t = h * inv
        total = tl.sum((t * t * 1099511627776.0).to(tl.int64), 0)               # 2^40
        ss = total.to(tl.float32) * 9.094947017729282e-13 * amax * amax          # 2^-40
        return tl.rsqrt(ss / D + eps)

    @triton.jit
    def _rms_apply(x, rstd, w, OFFSET: tl.constexpr):
        """Normalized x in x's dtype: ``w * y.to(dtype)`` (Llama) or ``(y * w).to(dtype)``
        (``OFFSET``, Gemma); ``w`` fp32."""
        h = x.to(tl.float32) * rstd
        if OFFSET:
            y = h * w
        else:
            y = w * h.to(x.dtype).to(tl.float32)
        return y.to(x.dtype)

    @triton.jit
    def _glu_act(g, u, ACT: tl.constexpr):
        """``act(g) * u`` in fp32 from fp32 g, u (ACT 0: silu, 1: gelu_tanh)."""
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))
        else:
            # 0.5 * (1 + tanh(z)) == sigmoid(2z): no cancellation for negative z
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)   # sqrt(2/pi) * (...)
            a = g / (1.0 + tl.exp(-2.0 * z))
        return a * u






    # ---------------------------------------------------------------- inline-PTX loads

    @triton.jit
    def _ld_x(ptr, mask, ASM: tl.constexpr, EVEN: tl.constexpr):
        """int32 x words at ``ptr`` (0 where masked; masked pointers must still be readable), four
        consecutive words per 16-byte load. As inline assembly the load keeps the register
        layout of its users (each thread holds whole groups), with no shared-memory shuffle.
        A coherent load, not ``ld.global.nc`` as the weights' scales: x is the previous
        kernel's output, and ptxas moves read-only (``.nc``) loads above
        ``griddepcontrol.wait`` (seen with the first tile loaded early and no
        ``launch_dependents`` after the wait: x read before the kernel that writes it ended)."""
        if ASM:
            v = tl.inline_asm_elementwise("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
                                          "=r,=r,=r,=r,l,l,l,l", [ptr], dtype=tl.int32, is_pure=True, pack=4)
            return v if EVEN else tl.where(mask, v, 0)
        return tl.load(ptr) if EVEN else tl.load(ptr, mask=mask, other=0)

    @triton.jit
    def _ld_f16(ptr, ASM: tl.constexpr):
        """fp32 value of the fp16 at each of ``ptr`` (read-only path). As inline assembly the load
        keeps its operand's register layout (no shared-memory shuffle to a load layout)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ptr], dtype=tl.float16,
                                             is_pure=True, pack=1).to(tl.float32)
        return tl.load(ptr).to(tl.float32)

    @triton.jit
    def _ld_f16x2(ptr, ASM: tl.constexpr):
        """fp32 values of the fp16 pair at each of ``ptr`` (4-byte aligned), one load (as
        ``_ld_f16``)."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 a, b; ld.global.nc.v2.b16 {a, b}, [$2]; cvt.f32.f16 $0, a; cvt.f32.f16 $1, b; }",
                "=r,=r,l", [ptr], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        return tl.load(ptr).to(tl.float32), tl.load(ptr + 1).to(tl.float32)

    @triton.jit
    def _ld_u8x2(ptr, ASM: tl.constexpr):
        """fp32 values of the uint8 pair at each of ``ptr`` (2-byte aligned), one load (as
        ``_ld_f16``)."""
        if ASM:     # int32 out, converted as signed (I2FP; cvt.rn.f32.u32 is the slower I2F.U32)
            a, b = tl.inline_asm_elementwise(
                "{ .reg .b32 t; ld.global.nc.u16 t, [$2]; and.b32 $0, t, 255; shr.u32 $1, t, 8; }",
                "=r,=r,l", [ptr], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
            return a.to(tl.float32), b.to(tl.float32)
        return tl.load(ptr).to(tl.float32), tl.load(ptr + 1).to(tl.float32)

    @triton.jit
    def _ld_i32(ptr, ASM: tl.constexpr):
        """The int32 at each of ``ptr`` (as ``_ld_f16``)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=True, pack=1)
        return tl.load(ptr)

    @triton.jit
    def _ld_s8(ptr, ASM: tl.constexpr):
        """fp32 value of the int8 at each of ``ptr`` (as ``_ld_f16``)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.s8 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=True, pack=1).to(tl.float32)
        return tl.load(ptr).to(tl.float32)

    @triton.jit
    def _ld_u8(ptr, ASM: tl.constexpr):
        """fp32 value of the uint8 at each of ``ptr`` (as ``_ld_f16``)."""
        if ASM:
            return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=True, pack=1).to(tl.float32)
        return tl.load(ptr).to(tl.float32)

