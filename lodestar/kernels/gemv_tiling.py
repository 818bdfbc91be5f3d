"""How the packed matrix-vector kernels tile each weight, and the shipped table of tilings.

A tiling (``GemvConfig``) is a function of the weight's type and shape and of the GPU model,
never of the number of rows, so a row's result does not depend on the batch it is in.
Selection, first match wins (policy fields, ``kernels/policy.py``):

1. ``gemv``: one tiling for every shape (tests and tuning tools);
2. ``gemv_table``: ``off`` skips tables; a path names a JSON file of entries
   (``python -m lodestar.bench.gemv_variants`` writes one); unset, the shipped table
   ``gemv_tuned.json`` for this GPU model;
3. the rule (``default_gemv_config``): 16 rows x up to 16 groups (word tiles: 32), K split
   until there are ``PROGRAMS_PER_SM`` programs an SM.

Table keys: ``TYPE:n,k`` (a tiling), ``GLU:TYPE:n,k`` (the gate|up tiling of the fusion
``glu_quant``; a shape without one keeps the separate activation kernel) and
``SCALES:TYPE:n,k`` (the Q4_K / Q5_K scale form, ``quant_layout.KQUANT_SCALE_FORMS``).
Entries are what measured fastest on that GPU in one decode chain; docs/tuning.md says how to
make a table for another GPU.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType

from lodestar.kernels.launch import num_sms
from lodestar.kernels.policy import active
from lodestar.kernels.quant_layout import GROUP, KQUANT_SCALE_FORMS, SMALL_M_MAX, PackedWeight

T = GGMLQuantizationType

# Types the rule gives the word-tile kernel; Q5_K runs it where the table says so.
WORDS_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0)
WORDS_CAPABLE = WORDS_TYPES + (T.Q5_K,)
PROGRAMS_PER_SM = 4
# The word-tile kernel loads its first tile before waiting for the previous kernel for weights
# with a side of at most this (small models), and for tilings of whole rows.
GEMV_EARLY_MAX_DIM = 2048
# A q|k|v kernel that rotates and stores (``qkv_rope``) lets decode attention launch as soon as
# its programs started for models up to this wide; wider ones only when it ends.
QKV_ROPE_EARLY_LAUNCH_MAX_K = 1024
TUNED_TABLE = Path(__file__).with_name("gemv_tuned.json")


@dataclass(frozen=True)
class GemvConfig:
    block_n: int        # weight rows per program
    tile_groups: int    # 32-weight groups per loaded tile (a power of two)
    split_k: int        # programs along K per row block
    num_warps: int
    # word-tile kernel only: the next tile's code words and scales are loaded before this tile's
    # math (``prefetch``), or the whole tile loop is unrolled (``unroll``). Same products, same order.
    prefetch: bool = False
    unroll: bool = False
    words: bool = False     # the tile held as code words (``_gemv_words_kernel``)
    # registers a thread at most (ptxas ``.maxnreg``; 0: the compiler's choice). Same bits; it
    # sets how many programs an SM holds at once (``lodestar.bench.kernel_regs``)
    maxnreg: int = 0

    def __post_init__(self) -> None:
        if self.prefetch and self.unroll:
            raise ValueError(f"{self}: prefetch and unroll are alternative forms of the tile loop; set one")
        if (self.prefetch or self.unroll) and not self.words:
            raise ValueError(f"{self}: prefetch and unroll are forms of the word-tile kernel (words=1)")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"{self}: maxnreg is 0 (the compiler's choice) or 24..255 registers")


def parse_gemv_config(text: str) -> GemvConfig:
    """``block_n,tile_groups,split_k,num_warps[,prefetch,unroll,words,maxnreg]`` -> GemvConfig."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not 4 <= len(values) <= 8:
        raise ValueError(f"GEMV config {text!r}: give block_n,tile_groups,split_k,num_warps"
                         f"[,prefetch,unroll,words,maxnreg] as integers")
    fields = ("prefetch", "unroll", "words", "maxnreg")
    extra = {f: (v if f == "maxnreg" else bool(v)) for f, v in zip(fields, values[4:])}
    return GemvConfig(*values[:4], **extra)


def config_text(cfg: GemvConfig) -> str:
    """The ``parse_gemv_config`` form of ``cfg`` (what the tables hold)."""
    text = f"{cfg.block_n},{cfg.tile_groups},{cfg.split_k},{cfg.num_warps},{int(cfg.prefetch)},{int(cfg.unroll)}"
    if cfg.maxnreg:
        return text + f",{int(cfg.words)},{cfg.maxnreg}"
    return text + (",1" if cfg.words else "")


def table_file(path: str) -> dict:
    """The entries of a tiling table file: its ``table`` member (what
    ``lodestar.bench.gemv_variants`` prints), or the file itself."""
    with open(path) as f:
        doc = json.load(f)
    return doc.get("table", doc)


def shipped_table(gpu: str) -> dict:
    """One GPU model's entries in the shipped table ``gemv_tuned.json`` ({} for a model it lacks)."""
    return json.loads(TUNED_TABLE.read_text()).get(gpu, {})


def table_entry(key: str, device: torch.device | None, gpu: str | None = None) -> str | None:
    """Entry ``key`` of the tiling table in force (policy ``gemv_table``: a file, none with
    ``off``, else the shipped table for the GPU model ``gpu``, else ``device``'s; none off the GPU)."""
    table = active().gemv_table
    if table == "off":
        return None
    if table:
        return table_file(table).get(key)
    if gpu is None:
        if device is None or device.type != "cuda":
            return None
        gpu = torch.cuda.get_device_name(device)
    return shipped_table(gpu).get(key)


def _entry_config(key: str, device: torch.device, gpu: str | None = None) -> GemvConfig | None:
    text = table_entry(key, device, gpu)
    return parse_gemv_config(text) if text else None


def default_gemv_config(n: int, k: int, device: torch.device,
                        qtype: GGMLQuantizationType | None = None) -> GemvConfig:
    """The tiling rule alone: 16 rows x up to 16 groups (``WORDS_TYPES``: the word-tile kernel,
    up to 32 groups), K split until PROGRAMS_PER_SM programs/SM."""
    groups = k // GROUP
    words = qtype is not None and T(int(qtype)) in WORDS_TYPES
    tile = 32 if words else 16
    while tile > 1 and tile > groups:
        tile //= 2
    block_n = 16
    split = 1
    while (-(-n // block_n) * split < PROGRAMS_PER_SM * num_sms(device)
           and groups // (split * 2) >= 4 * tile and split < 8):
        split *= 2
    return GemvConfig(block_n, tile, split, 4, words=words)


_CONFIGS: dict[tuple, GemvConfig] = {}


def gemv_config(n: int, k: int, device: torch.device, qtype: GGMLQuantizationType | None = None) -> GemvConfig:
    """Tiling for an [n, k] weight of ``qtype`` on ``device`` (see the module docstring)."""
    pol = active()
    key = (n, k, device.type, None if qtype is None else int(qtype), pol.gemv, pol.gemv_table)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if pol.gemv:
            cfg = parse_gemv_config(pol.gemv)
        else:   # a table file may also hold untyped ``n,k`` entries
            keys = ([f"{T(int(qtype)).name}:{n},{k}"] if qtype is not None else []) + (
                [f"{n},{k}"] if pol.gemv_table not in ("", "off") else [])
            for key_text in keys:
                cfg = _entry_config(key_text, device)
                if cfg is not None:
                    break
        if cfg is None:
            cfg = default_gemv_config(n, k, device, qtype)
        _CONFIGS[key] = cfg
    return cfg


def kquant_scales(qtype: GGMLQuantizationType, n: int, k: int, device: torch.device | None,
                  gpu: str | None = None) -> str:
    """The scale form ``quant_layout.pack`` gives an [n, k] Q4_K / Q5_K weight: the table's
    ``SCALES:TYPE:n,k`` entry for this GPU model, else ``split`` (other types: ``split``)."""
    if qtype not in (T.Q4_K, T.Q5_K):
        return "split"
    entry = table_entry(f"SCALES:{T(qtype).name}:{n},{k}", device, gpu)
    return entry if entry in KQUANT_SCALE_FORMS else "split"


def whole_rows(cfg: GemvConfig, k: int) -> bool:
    """A program of ``cfg`` holds whole rows of ``k`` weights in one tile (no K split)."""
    return cfg.split_k == 1 and k // GROUP <= cfg.tile_groups


def gemv_early(n: int, k: int, whole: bool = False) -> bool:
    """The word-tile kernel over an [n, k] weight loads its first tile's code words before it
    waits for the previous kernel (its programs are resident early under dependent launch, so
    the first weight read overlaps that kernel; same bits): for tilings of whole rows, and for
    weights with a side of at most ``GEMV_EARLY_MAX_DIM`` (larger ones measured slower)."""
    return whole or min(n, k) <= GEMV_EARLY_MAX_DIM


def loads_all_before_wait(pw: PackedWeight, rows: int) -> bool:
    """``quant_matmul`` over ``pw`` for ``rows`` rows runs the word-tile kernel with every weight
    of a program read before its wait (whole rows in one tile, loaded early): the kernel before
    it may then let it launch before its own wait (``decode_plan``)."""
    if not 0 < rows <= SMALL_M_MAX or pw.qtype not in WORDS_CAPABLE:
        return False
    cfg = gemv_config(pw.n, pw.k, pw.device, pw.qtype)
    return cfg.words and whole_rows(cfg, pw.k) and gemv_early(pw.n, pw.k, True)


def qkv_rope_waits(k: int) -> bool:
    """A q|k|v kernel that rotates and stores (``qkv_rope``) over rows of ``k`` weights lets the
    next kernel (decode attention) launch only when it ends (else as soon as its programs start)."""
    return not 0 < k <= QKV_ROPE_EARLY_LAUNCH_MAX_K


def rope_epilogue_ok(pw: PackedWeight, rows: int, head_dim: int, n_q: int, n_k: int,
                     config: GemvConfig | None = None, n_out: int | None = None) -> bool:
    """Whether ``quant_matmul(rope=...)`` can run for ``rows`` tokens over ``pw``: the word-tile
    kernel, tiles of whole rotation pairs (an even ``block_n`` dividing the head dim), a
    q|k|v output of ``n_q + 2 * n_k`` columns (``n_out``: the stack's whose part ``pw`` is;
    default ``pw.n``)."""
    n_out = pw.n if n_out is None else n_out
    if not 0 < rows <= SMALL_M_MAX or pw.k % GROUP or n_out != n_q + 2 * n_k or n_q % head_dim or n_k % head_dim:
        return False
    cfg = config or gemv_config(pw.n, pw.k, pw.device, pw.qtype)
    return cfg.words and pw.qtype in WORDS_CAPABLE and cfg.block_n % 2 == 0 and head_dim % cfg.block_n == 0


_GLU_CONFIGS: dict[tuple, GemvConfig | None] = {}


def glu_gemv_config(pw: PackedWeight) -> GemvConfig | None:
    """Tiling of a gate|up product that applies the gated activation itself (fusion
    ``glu_quant``): the table's ``GLU:TYPE:n,k`` entry, its tile cut to the row's groups, or
    None where the table has none (the separate activation kernel measured faster there)."""
    table = active().gemv_table
    key = (pw.n, pw.k, int(pw.qtype), pw.device.type, table)
    if key in _GLU_CONFIGS:
        return _GLU_CONFIGS[key]
    cfg = None if table == "off" else _entry_config(f"GLU:{T(pw.qtype).name}:{pw.n},{pw.k}", pw.device)
    if cfg is not None:
        tile = cfg.tile_groups
        while tile > 1 and tile > pw.k // GROUP:
            tile //= 2
        cfg = replace(cfg, tile_groups=tile)
    _GLU_CONFIGS[key] = cfg
    return cfg


def glu_entry(table: dict, n: int, k: int, qtype: GGMLQuantizationType) -> GemvConfig | None:
    """The ``GLU:TYPE:n,k`` entry of one GPU model's tiling table, parsed, or None."""
    text = table.get(f"GLU:{T(qtype).name}:{n},{k}")
    return parse_gemv_config(text) if text else None


def glu_epilogue_ok(pw: PackedWeight, rows: int, ffn: int, config: GemvConfig | None = None) -> bool:
    """Whether ``quant_glu`` runs ``rows`` rows over ``pw`` as a gate|up weight of 2 * ``ffn``
    rows (gate rows, then up rows; ``ffn`` a multiple of 32): a word-tile type with a tiling
    (``config``, else ``glu_gemv_config``) without K splits whose programs hold whole 32-unit
    groups of both halves, or a whole fraction of one (1, 2, 4, 8 or 16 units of each half:
    the group's last program quantizes it), at most ``SMALL_M_MAX`` rows."""
    if not 0 < rows <= SMALL_M_MAX or pw.qtype not in WORDS_CAPABLE or pw.n != 2 * ffn or ffn % GROUP:
        return False
    cfg = config or glu_gemv_config(pw)
    if cfg is None:
        return False
    half = cfg.block_n // 2
    return cfg.words and cfg.split_k == 1 and half > 0 and (half % GROUP == 0 or GROUP % half == 0) and ffn % half == 0
