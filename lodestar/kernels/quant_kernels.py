"""Triton kernels of the packed matrix-vector products (launched by ``triton_quant``).

``_gemv_words_kernel`` holds a tile as ``[block_n, 4 * tile_groups]`` code words, four (one
group) per thread in one 16-byte load, so that the x words, the ``dp4a`` products and the
per-group scales share one register layout (no shared-memory shuffle per tile); the two x
terms combine exactly in int32. ``_gemv_kernel`` is the group-tile form the tiling rule picks
for Q5_K where the table has no word tiling. ``_quant_x_kernel`` quantizes x for them,
``_split_sum_kernel`` adds K-split partials, ``_dequant_kernel`` writes a whole weight (prefill).
Layouts: ``quant_layout``; tilings: ``gemv_tiling``.
"""
from __future__ import annotations

from lodestar.kernels.launch import triton_enabled

if triton_enabled():
    import triton
    import triton.language as tl

    from lodestar.kernels.launch import _pdl_enter
    from lodestar.kernels.triton_common import (_dp4a, _glu_act, _ld_f16, _ld_f16x2, _ld_i32, _ld_s8, _ld_u8,
                                                _ld_u8x2, _ld_x, _quant_groups, _store_quant_groups)

    @triton.jit
    def _group_codes(codes_ptr, high_ptr, rows, mask_n, g, K: tl.constexpr, QTYPE: tl.constexpr):
        """Integer codes of group ``g`` for ``rows``: (weights 0..15, weights 16..31), int32 [BN, 16]."""
        h = tl.arange(0, 16)
        if QTYPE == 8:  # Q8_0
            base = codes_ptr + rows[:, None] * K + g * 32 + h[None, :]
            qa = tl.load(base, mask=mask_n[:, None], other=0).to(tl.int32)
            qb = tl.load(base + 16, mask=mask_n[:, None], other=0).to(tl.int32)
        else:
            byte = tl.load(codes_ptr + rows[:, None] * (K // 2) + g * 16 + h[None, :],
                           mask=mask_n[:, None], other=0).to(tl.int32)
            qa = byte & 15
            qb = byte >> 4
            if QTYPE == 2:  # Q4_0
                qa = qa - 8
                qb = qb - 8
            if QTYPE == 13:  # Q5_K: weights h and 16 + h at bits 8 (h % 4) + h // 4 and that + 4
                w = tl.load(high_ptr + rows * (K // 32) + g, mask=mask_n, other=0)
                bit = (8 * (h % 4) + h // 4)[None, :]
                qa = qa | (((w[:, None] >> bit) & 1) << 4)
                qb = qb | (((w[:, None] >> (bit + 4)) & 1) << 4)
            if QTYPE == 14:  # Q6_K: weight h of each half at bits 8 (h % 4) + 2 (h // 4) of its word
                w0 = tl.load(high_ptr + rows * (K // 16) + 2 * g, mask=mask_n, other=0)
                w1 = tl.load(high_ptr + rows * (K // 16) + 2 * g + 1, mask=mask_n, other=0)
                pos = (8 * (h % 4) + 2 * (h // 4))[None, :]
                qa = (qa | (((w0[:, None] >> pos) & 3) << 4)) - 32
                qb = (qb | (((w1[:, None] >> pos) & 3) << 4)) - 32
        return qa, qb

    @triton.jit
    def _group_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, rows, mask_n, g, K: tl.constexpr, QTYPE: tl.constexpr,
                      KPAIR: tl.constexpr = False):
        """(scale of weights 0..15, scale of 16..31, offset) fp32 [BN] of group ``g``.

        w = scale * q + offset for Q4_1, scale * q - offset for Q4_K/Q5_K, scale * q otherwise.
        KPAIR: Q4_K/Q5_K scale form (``PackedWeight.scale_form``).
        """
        if QTYPE == 14:  # Q6_K: one scale per 16 weights
            d = tl.load(d_ptr + rows * (K // 256) + g // 8, mask=mask_n, other=0).to(tl.float32)
            sa = tl.load(sc_ptr + rows * (K // 16) + 2 * g, mask=mask_n, other=0).to(tl.float32)
            sb = tl.load(sc_ptr + rows * (K // 16) + 2 * g + 1, mask=mask_n, other=0).to(tl.float32)
            scale_a = d * sa
            scale_b = d * sb
            offset = d * 0.0
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
            blk = rows * (K // 256) + g // 8
            grp = rows * (K // 32) + g
            if KPAIR == 2:
                d, dmin, sc, mn = _block_scales(d_ptr, blk, g % 8, mask_n)
            elif KPAIR == 1:
                d = tl.load(d_ptr + 2 * blk, mask=mask_n, other=0).to(tl.float32)
                dmin = tl.load(d_ptr + 2 * blk + 1, mask=mask_n, other=0).to(tl.float32)
                sc = tl.load(sc_ptr + 2 * grp, mask=mask_n, other=0).to(tl.float32)
                mn = tl.load(sc_ptr + 2 * grp + 1, mask=mask_n, other=0).to(tl.float32)
            else:
                d = tl.load(d_ptr + blk, mask=mask_n, other=0).to(tl.float32)
                dmin = tl.load(dmin_ptr + blk, mask=mask_n, other=0).to(tl.float32)
                sc = tl.load(sc_ptr + grp, mask=mask_n, other=0).to(tl.float32)
                mn = tl.load(m_ptr + grp, mask=mask_n, other=0).to(tl.float32)
            scale_a = d * sc
            scale_b = scale_a
            offset = dmin * mn              # subtracted (as the reference does)
        else:  # Q4_0, Q4_1, Q8_0
            scale_a = tl.load(d_ptr + rows * (K // 32) + g, mask=mask_n, other=0).to(tl.float32)
            scale_b = scale_a
            if QTYPE == 3:
                offset = tl.load(m_ptr + rows * (K // 32) + g, mask=mask_n, other=0).to(tl.float32)
            else:
                offset = scale_a * 0.0
        return scale_a, scale_b, offset


    @triton.jit
    def _quant_x_kernel(x_ptr, words_ptr, d1_ptr, sums_ptr, stride_xm, G, GB: tl.constexpr, PDL: tl.constexpr):
        """One row of x, GB groups of 32: two int8 terms packed in words, d1, half sums."""
        _pdl_enter(PDL)
        pid_m = tl.program_id(0)
        g = tl.program_id(1) * GB + tl.arange(0, GB)                       # [GB]
        mask_g = g < G
        offs = g[:, None] * 32 + tl.arange(0, 32)[None, :]                  # [GB, 32]
        x = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + offs, mask=mask_g[:, None], other=0.0
                    ).to(tl.float32)
        w1, w2, d1, sa, sb = _quant_groups(x, GB)
        _store_quant_groups(words_ptr, d1_ptr, sums_ptr, pid_m.to(tl.int64) * G + g, mask_g, w1, w2, d1, sa, sb)


    @triton.jit
    def _q5k_lo(h, j):
        """The 5th bits of code word j's low-nibble lane (weights 4j .. 4j + 3) from a Q5_K
        group's high word ``h`` (``Q5K_HIGH_ORDER``: bits 8b + j), at bit 4 of bytes 0..3."""
        return (h << (4 - j)) & 0x10101010

    @triton.jit
    def _q5k_hi(h, j):
        """The same for its high-nibble lane (weights 16 + 4j ..: bits 8b + 4 + j)."""
        return (h >> j) & 0x10101010

    @triton.jit
    def _q6k_lane(h, j):
        """The high 2 bits of code word j's four weights (4j .. 4j + 3 of a half) from a Q6_K
        half's word ``h`` (``Q6K_HIGH_ORDER``: bits 8b + 2j), at bits 4-5 of bytes 0..3. The
        arithmetic shift's copies of bit 31 end up above bit 31 or at bits 30-31, which the
        mask clears."""
        return ((h >> (2 * j)) << 4) & 0x30303030

    @triton.jit
    def _code_words(codes_ptr, rows, g, mask2, i4, K: tl.constexpr, QTYPE: tl.constexpr):
        """Code words of groups ``g`` for ``rows``: ([BN, TG, 4], [BN, TG, 4]); Q8_0: the two
        halves' int8 words, 4-bit types: the group's 4 words (and a dummy second)."""
        mask3 = mask2[:, :, None]
        if QTYPE == 8:
            base = codes_ptr + rows[:, None, None] * (K // 4) + (g[:, None] * 8 + i4[None, :])[None, :, :]
            return tl.load(base, mask=mask3, other=0), tl.load(base + 4, mask=mask3, other=0)
        word = tl.load(codes_ptr + rows[:, None, None] * (K // 8) + (g[:, None] * 4 + i4[None, :])[None, :, :],
                       mask=mask3, other=0)
        return word, word

    @triton.jit
    def _tile_loads(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                    pid_m, rows, mask_n, g, mask_g, K: tl.constexpr, QTYPE: tl.constexpr, KPAIR: tl.constexpr = False):
        """Everything one tile of groups ``g`` reads, as loaded (no arithmetic), so that a
        caller can issue it ahead of the math: (code words lo, hi [BN, TG, 4], high bits h0,
        h1 [BN, TG], scales s0..s3 [BN, TG], x words x1a, x1b, x2a, x2b [TG, 4], d1, half sums
        xsa, xsb [TG]). Places a type has no use for repeat a loaded value (never read).

        Scales: Q4_0/Q8_0 (d, -, -, -), Q4_1 (d, m, -, -), Q4_K/Q5_K (d, dmin, sc, m; KPAIR:
        the scale form, ``PackedWeight.scale_form``; blocks are unpacked here), Q6_K (d, sc of weights 0..15,
        sc of 16..31, -)."""
        G: tl.constexpr = K // 32
        i4 = tl.arange(0, 4)
        mask2 = mask_n[:, None] & mask_g[None, :]                  # [BN, TG]
        r2 = rows[:, None]
        g2 = g[None, :]
        lo, hi = _code_words(codes_ptr, rows, g, mask2, i4, K, QTYPE)
        if QTYPE == 14:  # Q6_K: two high words and two scales per group
            h0 = tl.load(high_ptr + r2 * (K // 16) + 2 * g2, mask=mask2, other=0)
            h1 = tl.load(high_ptr + r2 * (K // 16) + 2 * g2 + 1, mask=mask2, other=0)
            s0 = tl.load(d_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0)
            s1 = tl.load(sc_ptr + r2 * (K // 16) + 2 * g2, mask=mask2, other=0)
            s2 = tl.load(sc_ptr + r2 * (K // 16) + 2 * g2 + 1, mask=mask2, other=0)
            s3 = s0
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
            if KPAIR == 2:     # unpacked here: fp32 (d, dmin, sc, m)
                s0, s1, s2, s3 = _block_scales(d_ptr, r2 * (K // 256) + g2 // 8, g2 % 8, mask2)
            elif KPAIR == 1:
                s0 = tl.load(d_ptr + 2 * (r2 * (K // 256) + g2 // 8), mask=mask2, other=0)
                s1 = tl.load(d_ptr + 2 * (r2 * (K // 256) + g2 // 8) + 1, mask=mask2, other=0)
                s2 = tl.load(sc_ptr + 2 * (r2 * (K // 32) + g2), mask=mask2, other=0)
                s3 = tl.load(sc_ptr + 2 * (r2 * (K // 32) + g2) + 1, mask=mask2, other=0)
            else:
                s0 = tl.load(d_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0)
                s1 = tl.load(dmin_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0)
                s2 = tl.load(sc_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
                s3 = tl.load(m_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
            if QTYPE == 13:  # the group's high word (Q5K_HIGH_ORDER)
                h0 = tl.load(high_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
            else:
                h0 = s2
            h1 = h0
        else:  # Q4_0, Q4_1, Q8_0: one scale per 32 weights
            s0 = tl.load(d_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
            if QTYPE == 3:
                s1 = tl.load(m_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)
            else:
                s1 = s0
            s2 = s0
            s3 = s0
            h0 = s0
            h1 = s0
        xrow = pid_m.to(tl.int64) * G + g
        xo = xrow[:, None] * 16 + i4[None, :]
        x1a = tl.load(xw_ptr + xo, mask=mask_g[:, None], other=0)
        x1b = tl.load(xw_ptr + xo + 4, mask=mask_g[:, None], other=0)
        x2a = tl.load(xw_ptr + xo + 8, mask=mask_g[:, None], other=0)
        x2b = tl.load(xw_ptr + xo + 12, mask=mask_g[:, None], other=0)
        d1 = tl.load(d1_ptr + xrow, mask=mask_g, other=0.0)
        xsa = tl.load(xsum_ptr + xrow * 2, mask=mask_g, other=0.0)
        xsb = tl.load(xsum_ptr + xrow * 2 + 1, mask=mask_g, other=0.0)
        return lo, hi, h0, h1, s0, s1, s2, s3, x1a, x1b, x2a, x2b, d1, xsa, xsb

    @triton.jit
    def _tile_acc(acc, tile, QTYPE: tl.constexpr, ASM: tl.constexpr):
        """``acc [BN, TG]`` plus one tile's per-group products (``tile``: ``_tile_loads``' output):
        integer dot products of the codes with both x terms (dp4a), then
        ``scale * (d1*i1 + d2*i2 - bias*sum(x)) + offset * sum(x)`` in fp32."""
        lo_w, hi_w, h0, h1, s0, s1, s2, s3, x1a, x1b, x2a, x2b, d1, xsa, xsb = tile
        i4 = tl.arange(0, 4)
        zero3 = tl.zeros_like(lo_w)
        # x is the same for every row: broadcast [TG, 4] -> [BN, TG, 4]
        x1a = x1a[None, :, :] + zero3
        x1b = x1b[None, :, :] + zero3
        x2a = x2a[None, :, :] + zero3
        x2b = x2b[None, :, :] + zero3
        d1 = d1[None, :]
        d2 = d1 / 254.0
        xsa = xsa[None, :]
        xsb = xsb[None, :]
        # codes: int32 words [BN, TG, 4], bytes = weights 4i..4i+3 of each half
        if QTYPE == 8:
            lo = lo_w
            hi = hi_w
        else:           # 4-bit codes: low nibbles weights 0..15, high 16..31
            lo = lo_w & 0x0F0F0F0F
            hi = (lo_w >> 4) & 0x0F0F0F0F
            if QTYPE == 13:  # Q5_K: word j's lanes' 5th bits (Q5K_HIGH_ORDER) to bit 4 of each byte
                lo = lo | _q5k_lo(h0[:, :, None], i4[None, None, :])
                hi = hi | _q5k_hi(h0[:, :, None], i4[None, None, :])
            if QTYPE == 14:  # Q6_K: two words per group, 2 bits per weight
                lo = lo | _q6k_lane(h0[:, :, None], i4[None, None, :])
                hi = hi | _q6k_lane(h1[:, :, None], i4[None, None, :])
        if QTYPE == 14:  # two scales per group: keep the halves apart
            ia1 = tl.sum(_dp4a(lo, x1a, zero3, ASM), axis=2)
            ia2 = tl.sum(_dp4a(lo, x2a, zero3, ASM), axis=2)
            ib1 = tl.sum(_dp4a(hi, x1b, zero3, ASM), axis=2)
            ib2 = tl.sum(_dp4a(hi, x2b, zero3, ASM), axis=2)
            dot_a = d1 * ia1.to(tl.float32) + d2 * ia2.to(tl.float32) - 32.0 * xsa
            dot_b = d1 * ib1.to(tl.float32) + d2 * ib2.to(tl.float32) - 32.0 * xsb
            d = s0.to(tl.float32)
            acc += (d * s1.to(tl.float32)) * dot_a + (d * s2.to(tl.float32)) * dot_b
        else:
            i1 = tl.sum(_dp4a(hi, x1b, _dp4a(lo, x1a, zero3, ASM), ASM), axis=2)
            i2 = tl.sum(_dp4a(hi, x2b, _dp4a(lo, x2a, zero3, ASM), ASM), axis=2)
            dot = d1 * i1.to(tl.float32) + d2 * i2.to(tl.float32)
            xs = xsa + xsb
            if QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: w = (d*sc) * q - dmin*m
                acc += ((s0.to(tl.float32) * s2.to(tl.float32)) * dot
                        - (s1.to(tl.float32) * s3.to(tl.float32)) * xs)
            else:  # Q4_0, Q4_1, Q8_0: one scale per 32 weights
                scale = s0.to(tl.float32)
                if QTYPE == 2:    # Q4_0: w = d * (q - 8)
                    acc += scale * (dot - 8.0 * xs)
                elif QTYPE == 3:  # Q4_1: w = d * q + m
                    acc += scale * dot + s1.to(tl.float32) * xs
                else:
                    acc += scale * dot
        return acc

    @triton.jit
    def _store_rows(y, part_ptr, out_ptr, count_ptr, pid_m, pid_n, pid_s, offs_n, mask_n, stride_om, stride_split,
                    SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr, ROPE: tl.constexpr = False, rc=0, rs=0,
                    slot=0, kc_ptr=0, vc_ptr=0, skc0=0, skc1=0, svc0=0, svc1=0,
                    NQ: tl.constexpr = 0, NK: tl.constexpr = 0, HD: tl.constexpr = 0, PID0: tl.constexpr = 0):
        """Store a program's row sums ``y [BN]``: into ``out`` (one split), else into its split's
        fp32 partials; with LAST_SUMS the last of the tile's SPLIT programs to arrive adds the
        partials in split order into ``out`` and puts the tile's counter back to 0. ROPE: the
        final sums go through ``_rope_store`` (rows in ``_rope_rows`` order; ``rc``, ``rs``,
        ``slot`` from ``_rope_inputs``)."""
        row_offs = pid_m.to(tl.int64) * stride_om + offs_n
        if SPLIT == 1:
            if ROPE:
                _rope_store(y, out_ptr, pid_m, pid_n, stride_om, rc, rs, slot, kc_ptr, vc_ptr, skc0, skc1, svc0, svc1,
                            NQ, NK, HD)
            else:
                tl.store(out_ptr + row_offs, y.to(out_ptr.dtype.element_ty), mask=mask_n)
        else:
            tl.store(part_ptr + pid_s * stride_split + row_offs, y, mask=mask_n)
            if LAST_SUMS:
                # Every thread's partial is stored before the counter moves (barrier, then a
                # release); the last arrival reads the others' partials from L2 after its acquire.
                tl.debug_barrier()
                tile = pid_m * tl.num_programs(1) + pid_n - PID0
                arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLIT - 1:
                    tl.debug_barrier()
                    total = tl.load(part_ptr + row_offs, mask=mask_n, other=0.0, cache_modifier=".cg")
                    for s in tl.static_range(1, SPLIT):
                        total += tl.load(part_ptr + s * stride_split + row_offs, mask=mask_n, other=0.0,
                                         cache_modifier=".cg")
                    if ROPE:
                        _rope_store(total, out_ptr, pid_m, pid_n, stride_om, rc, rs, slot, kc_ptr, vc_ptr, skc0, skc1,
                                    svc0, svc1, NQ, NK, HD)
                    else:
                        tl.store(out_ptr + row_offs, total.to(out_ptr.dtype.element_ty), mask=mask_n)
                    tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _rope_rows(pid_n, BLOCK_N: tl.constexpr, HD: tl.constexpr):
        """Rows of q|k|v program ``pid_n`` under the fusion ``qkv_rope``: BLOCK_N/2 dims of one
        head and their rotate-half partners (``d``, then ``d + HD/2``), so that the program that
        writes the tile holds both halves of every rotation it applies."""
        H2: tl.constexpr = BLOCK_N // 2
        n0 = pid_n * BLOCK_N
        i = tl.arange(0, BLOCK_N)
        return (n0 // HD) * HD + (n0 % HD) // 2 + (i % H2) + (i // H2) * (HD // 2)

    @triton.jit
    def _rope_inputs(pid_m, pid_n, pos_ptr, slot_ptr, cos_ptr, sin_ptr, s_cos, BLOCK_N: tl.constexpr,
                     HD: tl.constexpr):
        """cos and sin [BLOCK_N / 2] of program ``pid_n``'s dims at token ``pid_m``'s position,
        and the token's KV slot, loaded as the program starts, before it waits for the previous
        kernel: positions and slots are step inputs (the model runner copies them in before the
        step's first kernel, as decode attention's block tables), and their latency then hides
        behind that wait instead of adding two dependent reads to the program's end."""
        H2: tl.constexpr = BLOCK_N // 2
        d0 = (pid_n * BLOCK_N % HD) // 2
        pos = tl.load(pos_ptr + pid_m).to(tl.int64)
        j = tl.arange(0, H2)
        return (tl.load(cos_ptr + pos * s_cos + d0 + j), tl.load(sin_ptr + pos * s_cos + d0 + j),
                tl.load(slot_ptr + pid_m).to(tl.int64))

    @triton.jit
    def _rope_store(y, out_ptr, pid_m, pid_n, stride_om, c, s, slot, kc_ptr, vc_ptr, skc0, skc1, svc0, svc1,
                    NQ: tl.constexpr, NK: tl.constexpr, HD: tl.constexpr):
        """Final sums ``y [BN]`` of a q|k|v tile in ``_rope_rows`` order, rounded to ``out``'s
        dtype; q and k rows rotated by ``c``, ``s`` (``_rope_inputs``) with the bits of
        ``triton_fused._rope_rows`` (``fma(f1, c, -(f2 * s))``, ``fma(f2, c, f1 * s)``, written
        out as ``triton_attention._rope_cols`` does), written to ``out``; k and v rows also
        stored at ``slot`` of the caches ``[slots, heads, HD]``."""
        BN: tl.constexpr = y.shape[0]
        H2: tl.constexpr = BN // 2
        yb = y.to(out_ptr.dtype.element_ty)
        a, b = tl.split(tl.permute(tl.reshape(yb, (2, H2)), (1, 0)))     # dims d0 + j, d0 + HD/2 + j
        n0 = pid_n * BN
        d0 = (n0 % HD) // 2
        j = tl.arange(0, H2)
        row = pid_m.to(tl.int64) * stride_om + (n0 // HD) * HD + d0 + j
        if n0 < NQ + NK:
            af = a.to(tl.float32)
            bf = b.to(tl.float32)
            a = tl.fma(af, c, (bf * s) * -1.0).to(yb.dtype)
            b = tl.fma(bf, c, af * s).to(yb.dtype)
        tl.store(out_ptr + row, a)
        tl.store(out_ptr + row + HD // 2, b)
        if n0 >= NQ:
            if n0 < NQ + NK:
                dst = kc_ptr + slot * skc0 + ((n0 - NQ) // HD) * skc1 + d0 + j
                tl.store(dst, a.to(kc_ptr.dtype.element_ty))
                tl.store(dst + HD // 2, b.to(kc_ptr.dtype.element_ty))
            else:
                dst = vc_ptr + slot * svc0 + ((n0 - NQ - NK) // HD) * svc1 + d0 + j
                tl.store(dst, a.to(vc_ptr.dtype.element_ty))
                tl.store(dst + HD // 2, b.to(vc_ptr.dtype.element_ty))

    @triton.jit
    def _gemv_kernel(xw_ptr, d1_ptr, xsum_ptr, part_ptr, out_ptr, count_ptr, codes_ptr, high_ptr, d_ptr,
                     dmin_ptr, sc_ptr, m_ptr, N, stride_om, stride_split,
                     K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr,
                     GROUPS_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr,
                     ASM: tl.constexpr, PDL: tl.constexpr, KPAIR: tl.constexpr = False):
        """One row of x (quantized by ``_quant_groups``) against BLOCK_N weight rows over one
        K split, tile by tile (``_tile_loads`` then ``_tile_acc``).

        SPLIT == 1 stores to ``out``; else each program stores its fp32 partial in
        ``part[pid_s]``, and with LAST_SUMS the last of the tile's SPLIT programs to arrive
        adds ``part[0] + part[1] + ...`` in that order into ``out`` (as ``_split_sum_kernel``)
        and puts the tile's counter back to 0.
        """
        _pdl_enter(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        G: tl.constexpr = K // 32
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = offs_n.to(tl.int64)
        tg = tl.arange(0, TG)
        acc = tl.zeros((BLOCK_N, TG), dtype=tl.float32)
        g_start = pid_s * GROUPS_PER_SPLIT
        for t in range(0, GROUPS_PER_SPLIT, TG):
            g = g_start + t + tg
            acc = _tile_acc(acc, _tile_loads(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr,
                                             sc_ptr, m_ptr, pid_m, rows, mask_n, g,
                                             (g < G) & (t + tg < GROUPS_PER_SPLIT), K, QTYPE, KPAIR), QTYPE, ASM)
        _store_rows(tl.sum(acc, axis=1), part_ptr, out_ptr, count_ptr, pid_m, pid_n, pid_s, offs_n, mask_n,
                    stride_om, stride_split, SPLIT, LAST_SUMS)

    @triton.jit
    def _words_codes(codes_ptr, rows, mask_n, g0, t, GROUPS_PER_SPLIT: tl.constexpr, K: tl.constexpr,
                     QTYPE: tl.constexpr, TG: tl.constexpr, EVEN: tl.constexpr):
        """The code words ``_words_tile`` reads for the tile of groups ``g0 ..`` (weights only:
        a caller may load them before it waits for the previous kernel)."""
        G: tl.constexpr = K // 32
        WPG: tl.constexpr = 8 if QTYPE == 8 else 4
        TW: tl.constexpr = TG * WPG
        c = tl.arange(0, TW)
        gl = c // WPG
        offs_w = rows[:, None] * (G * WPG) + (g0 * WPG + c)[None, :]            # [BN, TW] word index
        if EVEN:
            return tl.load(codes_ptr + offs_w)
        mask_c = (g0 + gl < G) & (t + gl < GROUPS_PER_SPLIT)
        return tl.load(codes_ptr + offs_w, mask=mask_n[:, None] & mask_c[None, :], other=0)

    @triton.jit
    def _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                    pid_m, rows, mask_n, g0, t, GROUPS_PER_SPLIT: tl.constexpr, K: tl.constexpr,
                    QTYPE: tl.constexpr, TG: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
                    GIVEN: tl.constexpr = False, w_given=0, KPAIR: tl.constexpr = False,
                    SGIVEN: tl.constexpr = False, s0_given=0, s1_given=0, s2_given=0, s3_given=0):
        """One tile of TG groups starting at group ``g0`` for ``rows``, as a [BN, HG] fp32 array of
        products (HG = TG, or 2*TG half groups of 16 weights for Q8_0, whose groups span 8
        words). The tile is held as [BN, TG*WPG] code words (WPG words a group, each thread
        holding four consecutive words), so x words, code words and their integer dot
        products share one register layout; the two x terms combine exactly in int32
        (``254*i1 + i2``, then one conversion: ``d1*i1 + d2*i2 = d2*(254*i1 + i2)``). Q5_K
        and Q6_K merge their high bits into the 4-bit codes per word, as ``_tile_acc`` does;
        Q6_K keeps the two 16-weight halves (low and high nibbles) apart for their scales.
        GIVEN: the code words are ``w_given`` (``_words_codes``, loaded earlier). KPAIR (Q4_K, Q5_K): the scales in pairs
        (``PackedWeight.paired``), each pair one load (``_ld_f16x2``, ``_ld_u8x2``). SGIVEN: the
        scales are ``s0_given`` .. ``s3_given`` (``_words_scales``, loaded earlier)."""
        G: tl.constexpr = K // 32
        WPG: tl.constexpr = 8 if QTYPE == 8 else 4
        TW: tl.constexpr = TG * WPG
        HG: tl.constexpr = TW // 4
        BN: tl.constexpr = rows.shape[0]
        c = tl.arange(0, TW)
        j = c % WPG
        gl = c // WPG
        mask_c = (g0 + gl < G) & (t + gl < GROUPS_PER_SPLIT)                   # [TW]
        if GIVEN:
            w = w_given
        else:
            w = _words_codes(codes_ptr, rows, mask_n, g0, t, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
        xrow = (pid_m.to(tl.int64) * G + g0 + gl) * 16                        # [TW]
        # 4 words in a row; masked groups point at the buffer's first words (never past its end)
        if EVEN:
            xj = tl.max_contiguous(tl.multiple_of(xrow + j, 4), 4)
        else:
            xj = tl.max_contiguous(tl.multiple_of(tl.where(mask_c, xrow + j, j), 4), 4)
        zero = tl.zeros_like(w)
        if QTYPE == 8:      # int8 codes: words 0..3 weights 0..15, words 4..7 weights 16..31
            x1 = _ld_x(xw_ptr + xj, mask_c, ASM, EVEN)
            x2 = _ld_x(xw_ptr + xj + 8, mask_c, ASM, EVEN)
            i1 = _dp4a(w, x1[None, :] + zero, zero, ASM)
            i2 = _dp4a(w, x2[None, :] + zero, zero, ASM)
        else:
            x1a = _ld_x(xw_ptr + xj, mask_c, ASM, EVEN)
            x1b = _ld_x(xw_ptr + xj + 4, mask_c, ASM, EVEN)
            x2a = _ld_x(xw_ptr + xj + 8, mask_c, ASM, EVEN)
            x2b = _ld_x(xw_ptr + xj + 12, mask_c, ASM, EVEN)
            lo = w & 0x0F0F0F0F
            hi = (w >> 4) & 0x0F0F0F0F
            if QTYPE == 13 or QTYPE == 14:   # the group's high-bit word(s), read once per code word
                hidx = rows[:, None] * (G * (QTYPE - 12)) + ((g0 + gl) * (QTYPE - 12))[None, :]
                if not EVEN:
                    hidx = tl.where(mask_n[:, None] & mask_c[None, :], hidx, 0)
                if QTYPE == 13:  # Q5_K: word j's lanes' 5th bits (Q5K_HIGH_ORDER) to bit 4 of each byte
                    hb = _ld_i32(high_ptr + hidx, ASM)
                    lo = lo | _q5k_lo(hb, j[None, :])
                    hi = hi | _q5k_hi(hb, j[None, :])
                else:            # Q6_K: two words a group, 2 bits a weight
                    lo = lo | _q6k_lane(_ld_i32(high_ptr + hidx, ASM), j[None, :])
                    hi = hi | _q6k_lane(_ld_i32(high_ptr + hidx + 1, ASM), j[None, :])
            if QTYPE == 14:
                i1 = _dp4a(lo, x1a[None, :] + zero, zero, ASM)
                i2 = _dp4a(lo, x2a[None, :] + zero, zero, ASM)
                i1b = _dp4a(hi, x1b[None, :] + zero, zero, ASM)
                i2b = _dp4a(hi, x2b[None, :] + zero, zero, ASM)
                vb = tl.sum(tl.reshape(i1b * 254 + i2b, (BN, HG, 4)), axis=2)
            else:
                i1 = _dp4a(hi, x1b[None, :] + zero, _dp4a(lo, x1a[None, :] + zero, zero, ASM), ASM)
                i2 = _dp4a(hi, x2b[None, :] + zero, _dp4a(lo, x2a[None, :] + zero, zero, ASM), ASM)
        v = tl.sum(tl.reshape(i1 * 254 + i2, (BN, HG, 4)), axis=2)            # [BN, HG] exact
        gidx, gm, xm, gg = _words_gidx(rows, mask_n, g0, t, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
        xg = pid_m.to(tl.int64) * G + g0 + gg
        if EVEN:
            d1 = tl.load(d1_ptr + xg)
            xsa = tl.load(xsum_ptr + xg * 2)
            xsb = tl.load(xsum_ptr + xg * 2 + 1)
        else:
            d1 = tl.load(d1_ptr + xg, mask=xm, other=0.0)
            xsa = tl.load(xsum_ptr + xg * 2, mask=xm, other=0.0)
            xsb = tl.load(xsum_ptr + xg * 2 + 1, mask=xm, other=0.0)
        d2 = (d1 / 254.0)[None, :]
        f = v.to(tl.float32) * d2
        xs = (xsa + xsb)[None, :]
        if SGIVEN:
            s0, s1, s2, s3 = s0_given, s1_given, s2_given, s3_given
        else:
            s0, s1, s2, s3 = _words_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, gidx, QTYPE, ASM, KPAIR, g0 + gg)
        if QTYPE == 12 or QTYPE == 13:   # Q4_K, Q5_K: w = (d*sc) * q - dmin*m
            r = (s0 * s2) * f - (s1 * s3) * xs
        elif QTYPE == 14:                # Q6_K: w = (d*sc) * (q - 32) per 16 weights
            fb = vb.to(tl.float32) * d2
            r = (s0 * s1) * (f - 32.0 * xsa[None, :]) + (s0 * s2) * (fb - 32.0 * xsb[None, :])
        elif QTYPE == 2:
            r = s0 * (f - 8.0 * xs)
        elif QTYPE == 3:
            r = s0 * f + s1 * xs
        else:
            r = s0 * f
        return r if EVEN else tl.where(gm, r, 0.0)

    @triton.jit
    def _words_gidx(rows, mask_n, g0, t, GROUPS_PER_SPLIT: tl.constexpr, K: tl.constexpr, QTYPE: tl.constexpr,
                    TG: tl.constexpr, EVEN: tl.constexpr):
        """Scale indexes of the tile of groups ``g0 ..`` (``_words_tile``'s [BN, HG] layout):
        (``rows * G + group``, 0 where masked unless EVEN; that mask; the groups' mask [HG];
        the group of each of the HG columns)."""
        G: tl.constexpr = K // 32
        HG: tl.constexpr = TG * 2 if QTYPE == 8 else TG
        hg = tl.arange(0, HG)
        if QTYPE == 8:
            gg = hg // 2                                                       # group of each half
        else:
            gg = hg
        xm = (g0 + gg < G) & (t + gg < GROUPS_PER_SPLIT)
        gm = mask_n[:, None] & xm[None, :]
        gidx = rows[:, None] * G + (g0 + gg)[None, :]                          # rows * G + g
        if not EVEN:
            gidx = tl.where(gm, gidx, 0)
        return gidx, gm, xm, gg

    @triton.jit
    def _block_scales(d_ptr, blk, j, mask):
        """fp32 (d, dmin, sc, m) of group ``j`` (0..7) of Q4_K / Q5_K blocks ``blk`` from scales
        in blocks (``PackedWeight.scale_form`` 2: four int32 words a block, (d, dmin) fp16 in
        the first, then the file's 12 bytes q[0..11] of 6-bit fields: group j < 4 has sc =
        q[j] & 63 and m = q[j + 4] & 63; group 4 + i has sc = (q[8 + i] & 15) | (q[i] >> 6) << 4
        and m = (q[8 + i] >> 4) | (q[4 + i] >> 6) << 4). ``mask``: None, or where to load."""
        p = d_ptr + 4 * blk
        if mask is None:
            w0 = tl.load(p)
            w1 = tl.load(p + 1)
            w2 = tl.load(p + 2)
            w3 = tl.load(p + 3)
        else:
            w0 = tl.load(p, mask=mask, other=0)
            w1 = tl.load(p + 1, mask=mask, other=0)
            w2 = tl.load(p + 2, mask=mask, other=0)
            w3 = tl.load(p + 3, mask=mask, other=0)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        px = (j % 4) * 8
        first = j < 4
        sc = tl.where(first, (w1 >> px) & 63, ((w3 >> px) & 15) | (((w1 >> (px + 6)) & 3) << 4))
        m = tl.where(first, (w2 >> px) & 63, ((w3 >> (px + 4)) & 15) | (((w2 >> (px + 6)) & 3) << 4))
        return d, dmin, sc.to(tl.float32), m.to(tl.float32)

    @triton.jit
    def _ld_block_scales(ptr, j):
        """``_block_scales`` as inline assembly: one 16-byte read-only load of the block's
        words at ``ptr`` (16-byte aligned), then per field one byte permute, which puts the
        byte of the 4 low bits in byte 0 (q[j] / q[j + 4] for j < 4, q[8 + i] for j = 4 + i)
        and that of the 2 high bits in byte 1 (q[i] / q[4 + i]), and shifts and masks that
        keep bits 0-5 of byte 0 (j < 4) or bits 0-3 (sc; m: 4-7) of byte 0 and bits 6-7 of
        byte 1 (j = 4 + i). The values keep the register layout of ``j`` (no shared-memory
        shuffle)."""
        sel = j | ((j % 4) << 4)                 # prmt: byte j of (w1|w2, w3), byte j % 4 of w1|w2
        low = tl.where(j < 4, 63, 15)            # bits taken from byte 0; the rest from byte 1
        shift = (j // 4) * 4                     # m of j = 4 + i: the high nibble of q[8 + i]
        return tl.inline_asm_elementwise(
            "{ .reg .b32 w0, w1, w2, w3, r, t; .reg .b16 h0, h1;"
            " ld.global.nc.v4.b32 {w0, w1, w2, w3}, [$4];"
            " mov.b32 {h0, h1}, w0; cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1;"
            " prmt.b32 r, w1, w3, $5; shr.u32 t, r, 10; lop3.b32 r, r, t, $6, 0xE4; and.b32 r, r, 63;"
            " cvt.rn.f32.s32 $2, r;"
            " prmt.b32 r, w2, w3, $5; shr.u32 t, r, 10; shr.u32 r, r, $7; lop3.b32 r, r, t, $6, 0xE4;"
            " and.b32 r, r, 63; cvt.rn.f32.s32 $3, r; }",
            "=r,=r,=r,=r,l,r,r,r", [ptr, sel, low, shift], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)

    @triton.jit
    def _words_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, gidx, QTYPE: tl.constexpr, ASM: tl.constexpr,
                      KPAIR: tl.constexpr, gcol=0):
        """The scales ``_words_tile`` multiplies a tile's products by, fp32 [BN, HG] at ``gidx``
        (``_words_gidx``): Q4_K / Q5_K (d, dmin, sc, m), Q6_K (d, sc of weights 0..15, sc of
        16..31, -), Q4_1 (d, m, -, -), Q4_0 / Q8_0 (d, -, -, -); a place a type has no use
        for repeats a loaded value (never read). ``gcol`` [HG]: the tile's groups (read for
        Q4_K / Q5_K scales in blocks, KPAIR 2: a group's place in its block)."""
        if QTYPE == 12 or QTYPE == 13:
            if KPAIR == 2:
                j = tl.broadcast_to((gcol % 8)[None, :], gidx.shape)
                if ASM:
                    sd, sdm, sc, mm = _ld_block_scales(d_ptr + 4 * (gidx // 8), j)
                else:
                    sd, sdm, sc, mm = _block_scales(d_ptr, gidx // 8, j, None)
            elif KPAIR == 1:
                sd, sdm = _ld_f16x2(d_ptr + 2 * (gidx // 8), ASM)
                sc, mm = _ld_u8x2(sc_ptr + 2 * gidx, ASM)
            else:
                sd = _ld_f16(d_ptr + gidx // 8, ASM)
                sdm = _ld_f16(dmin_ptr + gidx // 8, ASM)
                sc = _ld_u8(sc_ptr + gidx, ASM)
                mm = _ld_u8(m_ptr + gidx, ASM)
            return sd, sdm, sc, mm
        elif QTYPE == 14:
            sd = _ld_f16(d_ptr + gidx // 8, ASM)
            sc0 = _ld_s8(sc_ptr + 2 * gidx, ASM)
            sc1 = _ld_s8(sc_ptr + 2 * gidx + 1, ASM)
            return sd, sc0, sc1, sd
        else:
            scale = _ld_f16(d_ptr + gidx, ASM)
            if QTYPE == 3:
                return scale, _ld_f16(m_ptr + gidx, ASM), scale, scale
            return scale, scale, scale, scale


    @triton.jit
    def _gemv_words_kernel(xw_ptr, d1_ptr, xsum_ptr, part_ptr, out_ptr, count_ptr, codes_ptr, high_ptr, d_ptr,
                           dmin_ptr, sc_ptr, m_ptr, N, stride_om, stride_split,
                           pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, s_cos, skc0, skc1, svc0, svc1,
                           K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, TG: tl.constexpr,
                           GROUPS_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr,
                           ASM: tl.constexpr, UNROLL: tl.constexpr, EVEN: tl.constexpr,
                           EARLY: tl.constexpr, ROPE: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr,
                           HD: tl.constexpr, PDL: tl.constexpr, qw_ptr=None, qd_ptr=None, qs_ptr=None, F=0,
                           GLU: tl.constexpr = -1, KPAIR: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                           PID0: tl.constexpr = 0):
        """``_gemv_kernel``'s product with the tile held as code words (``_words_tile``). EVEN: no
        partial row block or tile (every mask is true, so none is applied). EARLY: the first
        tile's code words are loaded before the wait for the previous kernel (weights only).
        ROPE (fusion ``qkv_rope``; a q|k|v weight of NQ + 2 * NK rows, heads of HD): program
        rows in ``_rope_rows`` order, final sums through ``_rope_store``. GLU (fusion
        ``glu_quant``; the activation, ``triton_dense.SILU`` / ``GELU_TANH``; -1: off): a
        gate|up weight of 2 * F rows, program rows in ``_glu_rows`` order, final sums through
        ``_glu_quant_store`` (the gated activation [M, F] into ``out`` and its quantized form
        into ``qw``, ``qd``, ``qs``). KPAIR: the Q4_K / Q5_K scale form
        (``PackedWeight.scale_form``). PREFETCH: the tile loop loads the next tile's code words
        and scales before this tile's math; UNROLL: the tile loop is unrolled (both
        ``GemvConfig``; the same products in the same order). PID0: this weight is a part of a
        stack whose output rows start at row block PID0 (``quant_matmul(out=, row0=)``):
        program ``pid_n`` computes output rows of block ``pid_n + PID0`` from the weight's
        rows ``PID0 * BLOCK_N`` lower, and N is the end of its rows in ``out``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1) + PID0
        pid_s = tl.program_id(2)
        if ROPE:
            offs_n = _rope_rows(pid_n, BLOCK_N, HD)
        elif GLU >= 0:
            offs_n = _glu_rows(pid_n, BLOCK_N, F)
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = (offs_n - PID0 * BLOCK_N).to(tl.int64)
        HG: tl.constexpr = TG * 2 if QTYPE == 8 else TG
        acc = tl.zeros((BLOCK_N, HG), dtype=tl.float32)
        g_start = pid_s * GROUPS_PER_SPLIT
        FIRST: tl.constexpr = TG if EARLY else 0      # tiles before it: done before the loop
        rc = 0.0
        rs = 0.0
        slot = 0
        if ROPE:    # step inputs (copied in before the step's first kernel) and the tables: before the wait
            rc, rs, slot = _rope_inputs(pid_m, pid_n, pos_ptr, slot_ptr, cos_ptr, sin_ptr, s_cos, BLOCK_N, HD)
        if EARLY:
            w0 = _words_codes(codes_ptr, rows, mask_n, g_start, 0, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
            _pdl_enter(PDL)
            acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                               pid_m, rows, mask_n, g_start, 0, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN, True, w0,
                               KPAIR=KPAIR)
        else:
            _pdl_enter(PDL)
        if FIRST >= GROUPS_PER_SPLIT:
            pass    # one tile, done above
        elif PREFETCH:
            # tile t+1's code words and scales are loaded before tile t's math; the last pass
            # loads its own tile again (in range, never used)
            LAST: tl.constexpr = (GROUPS_PER_SPLIT - 1) // TG * TG
            wn = _words_codes(codes_ptr, rows, mask_n, g_start + FIRST, FIRST, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
            gn, _gm, _xm, gg = _words_gidx(rows, mask_n, g_start + FIRST, FIRST, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
            s0n, s1n, s2n, s3n = _words_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, gn, QTYPE, ASM, KPAIR,
                                               g_start + FIRST + gg)
            for t in range(FIRST, GROUPS_PER_SPLIT, TG):
                w, s0, s1, s2, s3 = wn, s0n, s1n, s2n, s3n
                tn = tl.minimum(t + TG, LAST)
                wn = _words_codes(codes_ptr, rows, mask_n, g_start + tn, tn, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
                gn, _gm, _xm, gg = _words_gidx(rows, mask_n, g_start + tn, tn, GROUPS_PER_SPLIT, K, QTYPE, TG, EVEN)
                s0n, s1n, s2n, s3n = _words_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, gn, QTYPE, ASM, KPAIR,
                                                   g_start + tn + gg)
                acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                                   pid_m, rows, mask_n, g_start + t, t, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN,
                                   True, w, KPAIR=KPAIR, SGIVEN=True, s0_given=s0, s1_given=s1,
                                   s2_given=s2, s3_given=s3)
        elif UNROLL:
            for t in tl.static_range(FIRST, GROUPS_PER_SPLIT, TG):
                acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                                   pid_m, rows, mask_n, g_start + t, t, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN,
                                   KPAIR=KPAIR)
        else:
            for t in range(FIRST, GROUPS_PER_SPLIT, TG):
                acc += _words_tile(xw_ptr, d1_ptr, xsum_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                                   pid_m, rows, mask_n, g_start + t, t, GROUPS_PER_SPLIT, K, QTYPE, TG, ASM, EVEN,
                                   KPAIR=KPAIR)
        if GLU >= 0:
            _glu_quant_store(tl.sum(acc, axis=1), out_ptr, qw_ptr, qd_ptr, qs_ptr, pid_m, pid_n, F, GLU, count_ptr)
        else:
            _store_rows(tl.sum(acc, axis=1), part_ptr, out_ptr, count_ptr, pid_m, pid_n, pid_s, offs_n, mask_n,
                        stride_om, stride_split, SPLIT, LAST_SUMS, ROPE, rc, rs, slot, kc_ptr, vc_ptr, skc0, skc1,
                        svc0, svc1, NQ, NK, HD, PID0)

    @triton.jit
    def _glu_rows(pid_n, BLOCK_N: tl.constexpr, F):
        """Rows of gate|up program ``pid_n`` under the fusion ``glu_quant``: BLOCK_N/2 gate rows
        and the up rows of the same units (``F`` rows further), so the program holds both
        factors of every activation value it writes, whole 32-value groups of them."""
        H2: tl.constexpr = BLOCK_N // 2
        i = tl.arange(0, BLOCK_N)
        return pid_n * H2 + (i % H2) + (i // H2) * F

    @triton.jit
    def _glu_quant_store(y, out_ptr, qw_ptr, qd_ptr, qs_ptr, pid_m, pid_n, F, ACT: tl.constexpr, count_ptr):
        """Final sums ``y [BN]`` of a gate|up tile in ``_glu_rows`` order: each rounded to
        ``out``'s dtype as the product's output would be, then ``act(gate) * up`` rounded
        again and quantized, the bits of ``triton_fused._glu_block`` with QUANT over that
        output (units ``pid_n * BN/2 ..`` of row ``pid_m``; F a multiple of BN/2 and of 32).
        A program of fewer than 32 units (BN/2 < 32) stores its activation values, then
        counts itself in its group's arrival counter (``count``: one int32 per row and
        32-unit group, 0 between launches); the last of the group's 32 / (BN/2) programs to
        arrive reads the group's 32 values back from L2 and quantizes them (the same values,
        so the same bits), then puts the counter back to 0 (as ``_store_rows``' LAST_SUMS)."""
        BN: tl.constexpr = y.shape[0]
        H2: tl.constexpr = BN // 2
        yb = y.to(out_ptr.dtype.element_ty)
        g, u = tl.split(tl.permute(tl.reshape(yb, (2, H2)), (1, 0)))
        a = _glu_act(g.to(tl.float32), u.to(tl.float32), ACT).to(out_ptr.dtype.element_ty)
        row = pid_m.to(tl.int64) * F
        tl.store(out_ptr + row + pid_n * H2 + tl.arange(0, H2), a)
        if H2 >= 32:
            GB: tl.constexpr = H2 // 32
            w1, w2, d1, sa, sb = _quant_groups(tl.reshape(a.to(tl.float32), (GB, 32)), GB)
            grp = pid_m.to(tl.int64) * (F // 32) + pid_n * GB + tl.arange(0, GB)
            _store_quant_groups(qw_ptr, qd_ptr, qs_ptr, grp, grp >= 0, w1, w2, d1, sa, sb)
        else:
            PER: tl.constexpr = 32 // H2            # programs of one 32-unit group
            # every thread's values are stored before the counter moves (barrier, then a
            # release); the last arrival reads the others' values from L2 after its acquire
            tl.debug_barrier()
            gi = pid_m.to(tl.int64) * (F // 32) + pid_n // PER
            arrived = tl.atomic_add(count_ptr + gi, 1, sem="acq_rel", scope="gpu")
            if arrived == PER - 1:
                v = tl.load(out_ptr + row + (pid_n // PER) * 32 + tl.arange(0, 32), cache_modifier=".cg")
                w1, w2, d1, sa, sb = _quant_groups(tl.reshape(v.to(tl.float32), (1, 32)), 1)
                grp = gi + tl.arange(0, 1)
                _store_quant_groups(qw_ptr, qd_ptr, qs_ptr, grp, grp >= 0, w1, w2, d1, sa, sb)
                tl.atomic_xchg(count_ptr + gi, 0, sem="relaxed", scope="gpu")


    @triton.jit
    def _split_sum_kernel(part_ptr, out_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """out = part[0] + part[1] + ... in that order (fp32), cast to out's dtype."""
        _pdl_enter(PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(out_ptr, codes_ptr, high_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, N,
                        K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                        KPAIR: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_g = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows = offs_n.to(tl.int64)
        h = tl.arange(0, 16)
        for u in tl.static_range(GROUPS):
            g = pid_g * GROUPS + u
            qa, qb = _group_codes(codes_ptr, high_ptr, rows, mask_n, g, K, QTYPE)
            scale_a, scale_b, offset = _group_scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, rows, mask_n, g, K, QTYPE, KPAIR)
            wa = qa.to(tl.float32) * scale_a[:, None]
            wb = qb.to(tl.float32) * scale_b[:, None]
            if QTYPE == 3:
                wa = wa + offset[:, None]
                wb = wb + offset[:, None]
            if QTYPE == 12 or QTYPE == 13:
                wa = wa - offset[:, None]
                wb = wb - offset[:, None]
            ptrs = out_ptr + rows[:, None] * K + g * 32 + h[None, :]
            tl.store(ptrs, wa.to(out_ptr.dtype.element_ty), mask=mask_n[:, None])
            tl.store(ptrs + 16, wb.to(out_ptr.dtype.element_ty), mask=mask_n[:, None])
