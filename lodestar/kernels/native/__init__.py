"""The compiled CPU kernels (C, built by setup.py into ``lodestar.kernels._native``).

``available()`` says whether they are built and allowed; ``LODESTAR_NATIVE=0`` in the
environment at import turns them off (the pure-torch forms then run: the same bits for the
matrix products, the last bits of norms, activations and attention differ). The sources beside this file
split by instruction set: ``qmatmul_generic.c`` (portable C, the reference),
``qmatmul_x86.c`` (AVX2, AVX-512 VNNI); ``module.c`` picks the best one the CPU has.
"""
from __future__ import annotations

import os

import torch  # noqa: F401  (first: the extension's OpenMP then binds to torch's runtime)

try:
    from lodestar.kernels import _native as _ext
except ImportError:          # not built (no C compiler at install): the torch forms run
    _ext = None

TILE_ROWS = 16
ENV = "LODESTAR_NATIVE"


def built() -> bool:
    """The extension is importable."""
    return _ext is not None


_AVAILABLE = _ext is not None and os.environ.get(ENV, "1") != "0"


def available() -> bool:
    """The extension is built and not switched off with LODESTAR_NATIVE=0."""
    return _AVAILABLE


def isa() -> str | None:
    """The instruction set the kernels use (None: not built)."""
    return _ext.isa() if _ext is not None else None


def quantize(*args) -> None:
    """x's digits as the matrix products make them (tests compare with ``cpu_quant.quantize_x``)."""
    _ext.quantize(*args)


def isas() -> list[str]:
    return _ext.isas() if _ext is not None else []


def set_isa(name: str) -> str:
    """Use another instruction set this CPU has (tests compare them); returns the previous one."""
    return _ext.set_isa(name)
