"""The compiled CPU kernels (lodestar.kernels._native); everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the packed
CPU path runs its pure-torch forms (the same bits for the matrix products), more slowly."""
import sys

from setuptools import Extension, setup

SOURCES = ["module.c", "decoder.c", "ops.c", "pack.c", "qmatmul_generic.c", "qmatmul_x86.c"]
if sys.platform == "win32":
    ARGS, LINK = ["/O2", "/openmp", "/fp:strict"], []
else:
    # -ffp-contract=off: no fused multiply-add, so every kernel rounds exactly as the torch form.
    ARGS, LINK = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno"], []
    if sys.platform != "darwin":      # Apple's clang has no OpenMP: the kernels then run on one thread
        ARGS, LINK = ARGS + ["-fopenmp"], ["-fopenmp"]

HEADERS = ["qmatmul.h", "ops.h", "decoder.h", "pack.h", "vmath.h"]

setup(ext_modules=[Extension("lodestar.kernels._native", [f"lodestar/kernels/native/{s}" for s in SOURCES],
                             depends=[f"lodestar/kernels/native/{h}" for h in HEADERS], extra_compile_args=ARGS,
                             extra_link_args=LINK, optional=True)])
