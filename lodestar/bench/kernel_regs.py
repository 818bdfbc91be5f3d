"""Registers of the quantized matrix-vector kernels, compiled offline for a GPU architecture.

Needs no GPU: Triton compiles the word-tile kernel (``quant_kernels._gemv_words_kernel``) for
the target with the ptxas it ships, exactly as a launch of ``quant_matmul`` / ``quant_glu``
with the given tiling would on that device (same arguments, specialization and options),
and ``cuobjdump -res-usage`` reads the registers, stack and local memory (spills) of the
cubin. From the registers follows how many programs an SM holds at once, and so in how
many waves a projection's programs run.

    python -m lodestar.bench.kernel_regs                      # the 8B cases below
    python -m lodestar.bench.kernel_regs glu:Q4_0:28672,4096:64,16,1,4,0,0,1,128 \\
        gemv-sum:Q4_0:4096,14336:32,32,7,4,0,0,1

A case is ``KIND:TYPE:N,K:CONFIG`` (``CONFIG`` as ``gemv_tiling.parse_gemv_config`` reads it:
``block_n,tile_groups,split_k,num_warps[,prefetch,unroll,words,maxnreg]``): ``gemv`` the plain
product, ``gemv-sum`` with its K splits left to the next RMSNorm (fusion ``norm_sum``),
``glu`` the gate|up product of ``glu_quant`` (N = 2 x the FFN width). Prints one JSON line a
case. A Q4_K / Q5_K weight's scales are laid out in the form ``--scales`` names, else as
``gemv_tiling.kquant_scales`` would on the GPU named by ``--gpu`` (its ``SCALES`` table entry,
or the file ``LODESTAR_GEMV_TABLE`` names), reported as ``scales``. ``--sass`` adds
instruction counts of the compiled kernel (``sass_counts``: the whole kernel's, and a pass of
its tile loop). Runs in a process of its own: the kernels are defined when ``quant_kernels``
is first imported, and only if a GPU seems present, which this tool pretends.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

# The 8B (Llama-3.1-8B geometry) word-tile products in their shipped H200 tilings, and other
# tilings of the same shapes to compare them with.
CASES = (
    "glu:Q4_0:28672,4096:64,16,1,4,0,1,1,128",
    "glu:Q4_0:28672,4096:64,16,1,4,0,0,1",
    "gemv:Q4_0:28672,4096:8,32,1,1,0,0,1",
    "gemv-sum:Q4_0:4096,14336:16,16,7,1,0,0,1",
    "gemv-sum:Q4_0:4096,14336:32,32,7,4,0,0,1",
    "gemv:Q4_0:6144,4096:8,128,1,1,0,0,1",
    "gemv:Q4_0:4096,4096:32,128,1,8,0,0,1",
    "gemv:Q4_K:28672,4096:16,64,1,2,0,0,1,200",
    "gemv:Q4_K:28672,4096:8,32,1,1,0,0,1",
    "gemv:Q4_K:4096,14336:8,64,1,4,0,0,1",
    "gemv-sum:Q4_K:4096,14336:16,32,2,4,0,0,1",
    "gemv:Q4_K:6144,4096:8,128,1,2,0,0,1",
    "gemv:Q4_K:6144,4096:16,32,1,4,0,0,1",
    "gemv:Q4_K:4096,4096:16,128,1,8,0,0,1",
)
KINDS = ("gemv", "gemv-sum", "glu")


def programs_per_sm(registers: int, num_warps: int, regs_per_sm: int = 65536, max_warps: int = 64,
                    max_programs: int = 32) -> int:
    """Programs of ``num_warps`` warps an SM holds at once when a thread takes ``registers``:
    registers are given out per warp in units of 256 (8 a thread); an SM runs at most
    ``max_warps`` warps and ``max_programs`` programs (compute capability 9.0: 64 and 32)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(regs_per_sm // (per_warp * num_warps), max_warps // num_warps, max_programs)


def parse_case(text: str) -> tuple[str, str, int, int, str]:
    """``KIND:TYPE:N,K:CONFIG`` -> (kind, type name, n, k, config text)."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] not in KINDS:
        raise ValueError(f"case {text!r}: give KIND:TYPE:N,K:CONFIG with KIND one of {', '.join(KINDS)}")
    kind, qtype, shape, config = parts
    try:
        n, k = (int(v) for v in shape.split(","))
    except ValueError:
        raise ValueError(f"case {text!r}: the shape is N,K (integers)") from None
    return kind, qtype, n, k, config


def _cuobjdump() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _usage(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL of the one kernel in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": int(fields["SHARED"]),
            "local": int(fields["LOCAL"])}


def sass_counts(sass: str) -> dict:
    """Instruction counts of a kernel's SASS (``cuobjdump -sass`` text): the whole kernel's
    instructions and global loads, and for its longest loop (the span of its longest backward
    branch; None without one, e.g. a program of one tile) the instructions, global loads and
    dp4a (``IDP``) a pass takes."""
    ops: list[tuple[int, str, int | None]] = []          # (address, opcode, backward target)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if not m:
            continue
        addr, op = int(m.group(1), 16), m.group(2)
        target = re.match(r"\s+0x([0-9a-f]+)", m.group(3)) if op.startswith("BRA") else None
        back = int(target.group(1), 16) if target and int(target.group(1), 16) < addr else None
        ops.append((addr, op, back))
    loads = lambda span: sum(op.startswith("LDG") for _, op, _ in span)     # noqa: E731
    out = {"instructions": len(ops), "loads": loads(ops), "loop": None}
    loops = [(addr - back, back, addr) for addr, _, back in ops if back is not None]
    if loops:
        _, lo, hi = max(loops)
        body = [o for o in ops if lo <= o[0] <= hi]
        out["loop"] = {"instructions": len(body), "loads": loads(body),
                       "dp4a": sum(op.startswith("IDP") for _, op, _ in body)}
    return out


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def measure(cases: list[str], arch: int, sms: int, gpu: str = "NVIDIA H200", sass: bool = False,
            scales: str | None = None) -> list[dict]:
    """Compile each case for ``sm_<arch>``; its resource use, programs per SM and waves, or
    ``error`` where the launch refuses the tiling (as ``quant_glu`` does a gate|up tiling
    whose programs do not hold whole 32-unit groups). ``scales``: the Q4_K / Q5_K scale form
    of every case (None: the ``gpu`` table's)."""
    if "lodestar.kernels.launch" in sys.modules:     # its Triton helpers too are defined at import
        raise RuntimeError("kernel_regs must run in a process of its own (python -m lodestar.bench.kernel_regs)")
    import torch
    torch.cuda.is_available = lambda: True          # the kernels are defined for a GPU target
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from lodestar.kernels import quant_kernels as qk
    from lodestar.kernels import triton_quant as tq
    from lodestar.kernels.launch import PDL_ON
    from lodestar.kernels.quant_layout import KQUANT_SCALE_FORMS

    if scales is not None and scales not in KQUANT_SCALE_FORMS:
        raise ValueError(f"--scales {scales!r}: use one of {', '.join(KQUANT_SCALE_FORMS)}")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    calls: list[tuple] = []

    class Capture:          # stands in for the kernel: keeps the launch's arguments
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    kernel = qk._gemv_words_kernel
    qk._gemv_words_kernel = Capture()
    tq.pdl = lambda launch_next=False: dict(PDL_ON)     # as on a Hopper GPU
    out = []
    for text in cases:
        calls.clear()
        try:
            out.append(_measure_case(text, tq, kernel, calls, backend, target, sms, gpu, sass, scales))
        except ValueError as e:     # a tiling the launch refuses: say so, go on with the others
            out.append({"case": text, "error": str(e)})
    return out


def _measure_case(text: str, tq, kernel, calls: list, backend, target, sms: int, gpu: str, sass: bool,
                  scales: str | None = None) -> dict:
    import torch
    import triton
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    from lodestar.kernels.gemv_tiling import kquant_scales, parse_gemv_config
    from lodestar.kernels.quant_layout import QuantizedRows, pack

    kind, qname, n, k, config = parse_case(text)
    cfg = parse_gemv_config(config)
    qtype = T[qname]
    rows = min(n, 2 * max(cfg.block_n, 32))     # the kernel does not depend on N; a small weight will do
    blocks, size = GGML_QUANT_SIZES[qtype]
    kquant = qtype in (T.Q4_K, T.Q5_K)
    # the [n, k] weight's layout, for the smaller one
    form = scales if scales and kquant else kquant_scales(qtype, n, k, None, gpu)
    pw = pack(qtype, torch.zeros(rows, k // blocks * size, dtype=torch.uint8), rows, k, scales=form)
    words, d1, sums = QuantizedRows.empty(1, k, torch.device("cpu"))
    x = QuantizedRows(torch.zeros(1, k, dtype=torch.bfloat16), words, d1, sums)
    if kind == "glu":
        tq.quant_glu(x, pw, rows // 2, 0, config=cfg)
    else:
        tq.quant_matmul(x, pw, torch.bfloat16, config=cfg, defer_sum=kind == "gemv-sum")
    _, args, kwargs = calls[0]
    bound, spec, options = create_function_from_signature(kernel.signature, kernel.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    use = _usage(compiled.asm["cubin"])
    per_sm = programs_per_sm(use["registers"], cfg.num_warps)
    programs = n // cfg.block_n * (1 if kind == "glu" else cfg.split_k)
    row = {"case": text, **use, "programs_per_sm": per_sm, "programs": programs,
           "waves": round(programs / (per_sm * sms), 2) if per_sm else None} | ({"scales": form} if kquant else {})
    if sass:
        row["sass"] = sass_counts(_sass(compiled.asm["cubin"]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help="KIND:TYPE:N,K:CONFIG (default: the 8B cases)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for sm_90 (H100/H200)")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU, for the waves (H200: 132)")
    ap.add_argument("--gpu", default="NVIDIA H200", help="GPU model whose SCALES table entries set the Q4_K layout")
    ap.add_argument("--scales", default=None, help="Q4_K / Q5_K scale form of every case: split, pair or block "
                    "(default: the --gpu table's entry for its shape)")
    ap.add_argument("--sass", action="store_true", help="also count the SASS instructions (whole kernel, longest loop)")
    a = ap.parse_args()
    try:
        for c in a.cases:
            parse_case(c)
    except ValueError as e:
        ap.error(str(e))
    cases = a.cases or list(CASES)
    failed = 0
    try:
        rows = measure(cases, a.arch, a.sms, a.gpu, a.sass, a.scales)
    except ValueError as e:
        ap.error(str(e))
    for row in rows:
        print(json.dumps(row), flush=True)
        failed += "error" in row
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
