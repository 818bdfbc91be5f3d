"""The GPU path's tuning switches, declared once, read once.

Every environment switch the kernels honour is a row of ``SWITCHES`` (name, default, meaning);
``KernelPolicy.from_env`` parses them into a frozen object when a model is loaded
(``engine.loader``), and the kernels read that object (``active()``), never ``os.environ``.
Tests and benchmarks build policies directly (``using(KernelPolicy(pdl=False))``).
docs/tuning.md lists the same table.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator, Mapping

# Decode fusions: each removes kernel launches; results are the same bits with any of them off,
# except glu_quant, whose gate|up tiling adds a row's products in another order.
FUSIONS = (
    "quant",         # RMSNorm and the gated activation also emit the quantized x of the projection they feed
    "split_sum",     # K splits are added inside the matrix-vector kernel
    "residual",      # a block's last residual add runs inside the next RMSNorm
    "dense_norm",    # a small one-row dense projection computes the RMSNorm feeding it in its prologue
    "attn_quant",    # the decode-attention reduce also quantizes x for the output projection
    "glu_epilogue",  # a one-row dense gate|up projection applies the gated activation itself
    "qkv_rope",      # a packed q|k|v projection rotates q and k and stores k and v itself
    "norm_sum",      # a packed down projection leaves its K-split partial sums to the next RMSNorm
    "glu_quant",     # a packed gate|up projection applies the activation and quantizes for down
)

MIB = 1 << 20


@dataclass(frozen=True)
class Switch:
    env: str
    default: str
    meaning: str


SWITCHES = (
    Switch("LODESTAR_FUSE", "1", "decode fusions: 1 all, 0 none, or a comma list of " + ", ".join(FUSIONS)),
    Switch("LODESTAR_PDL", "1", "programmatic dependent launch on Hopper and later: 1 on, 0 off"),
    Switch("LODESTAR_GEMV_TABLE", "", "matrix-vector tilings: unset, the shipped table for this GPU model; off, "
           "the tiling rule only; or a JSON file written by python -m lodestar.bench.gemv_variants"),
    Switch("LODESTAR_WEIGHT_PREFETCH", "4", "MiB: a projection up to this size is asked into L2 whole by the "
           "small kernel before it; 0 off"),
    Switch("LODESTAR_SIDE_PREFETCH", "16", "MiB of a larger packed gate|up's weights asked into L2 from a second "
           "stream while attention runs; 0 off"),
)


@dataclass(frozen=True)
class KernelPolicy:
    """Tuning choices of the GPU kernels. The first five fields come from ``SWITCHES``; the
    rest are set by tests and benchmarks only."""

    fusions: frozenset[str] = field(default_factory=lambda: frozenset(FUSIONS))
    pdl: bool = True
    gemv_table: str = ""                    # "", "off" or a path
    weight_prefetch_bytes: int = 4 * MIB
    side_prefetch_bytes: int = 16 * MIB
    gemv: str = ""                          # one tiling for every packed shape (``parse_gemv_config`` text)
    dense_gemv: bool = True                 # one-row bf16 products on the Triton kernel (else cuBLAS)
    prefill_attention: str = "paged"        # "paged" (varlen kernel over the pool) or "sdpa" (torch's)

    def __post_init__(self) -> None:
        unknown = set(self.fusions) - set(FUSIONS)
        if unknown:
            raise ValueError(f"unknown fusions {', '.join(sorted(unknown))}; known: {', '.join(FUSIONS)}")
        if self.weight_prefetch_bytes < 0 or self.side_prefetch_bytes < 0:
            raise ValueError("prefetch sizes are bytes >= 0")
        if self.prefill_attention not in ("paged", "sdpa"):
            raise ValueError(f"prefill_attention={self.prefill_attention!r}; use paged or sdpa")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelPolicy":
        """The policy the ``SWITCHES`` in ``environ`` (default ``os.environ``) ask for; a bad
        value raises ``ValueError`` naming the switch and what it takes."""
        env = os.environ if environ is None else environ
        get = lambda s: env.get(s.env, s.default).strip() or s.default  # noqa: E731
        fuse, pdl, table, wp, sp = (get(s) for s in SWITCHES)
        return cls(fusions=_fusions(fuse), pdl=_flag("LODESTAR_PDL", pdl), gemv_table=table,
                   weight_prefetch_bytes=_mib("LODESTAR_WEIGHT_PREFETCH", wp),
                   side_prefetch_bytes=_mib("LODESTAR_SIDE_PREFETCH", sp))

    def with_fusions(self, names) -> "KernelPolicy":
        return replace(self, fusions=frozenset(names))


def _fusions(text: str) -> frozenset[str]:
    if text in ("1", "default"):
        return frozenset(FUSIONS)
    if text == "0":
        return frozenset()
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = names - set(FUSIONS)
    if unknown:
        raise ValueError(f"LODESTAR_FUSE names {', '.join(sorted(unknown))}; use 1, 0 or a comma list of "
                         f"{', '.join(FUSIONS)}")
    return names


def _flag(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r}; use 0 or 1")
    return text == "1"


def _mib(name: str, text: str) -> int:
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if mib < 0:
        raise ValueError(f"{name}={text!r}; give MiB (a number >= 0, 0: off)")
    return int(mib * MIB)


_ACTIVE: KernelPolicy | None = None


def active() -> KernelPolicy:
    """The policy in force: the one ``install``ed when the model was loaded, else the
    environment's, read on first use."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = KernelPolicy.from_env()
    return _ACTIVE


def install(policy: KernelPolicy) -> KernelPolicy:
    """Make ``policy`` the one in force (a model load does this once); returns it."""
    global _ACTIVE
    _ACTIVE = policy
    return policy


@contextmanager
def using(policy: KernelPolicy) -> Iterator[KernelPolicy]:
    """``policy`` in force inside the block, the previous one after it (tests, A/B runs)."""
    global _ACTIVE
    prev = _ACTIVE
    _ACTIVE = policy
    try:
        yield policy
    finally:
        _ACTIVE = prev
