"""The offline register count of the word-tile kernel (no GPU needed; skips without Triton)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from lodestar.bench import kernel_regs as kr


def test_programs_per_sm_follows_the_register_file():
    assert kr.programs_per_sm(130, 4) == 3           # 136 a thread, 4,352 a warp: 3 x 4 warps in 65,536
    assert kr.programs_per_sm(128, 4) == 4
    assert kr.programs_per_sm(96, 1) == 21
    assert kr.programs_per_sm(32, 2) == 32           # then the 64 warps an SM runs are the limit
    assert kr.programs_per_sm(32, 1) == 32           # and the 32 programs it runs
    assert kr.programs_per_sm(255, 8) == 1


def test_cases_are_checked():
    assert kr.parse_case("glu:Q4_0:28672,4096:64,16,1,4") == ("glu", "Q4_0", 28672, 4096, "64,16,1,4")
    for bad in ("glu:Q4_0:28672:64,16,1,4", "mm:Q4_0:8,8:8,8,1,1", "glu:Q4_0:a,b:64,16,1,4", "glu:Q4_0"):
        with pytest.raises(ValueError, match="case"):
            kr.parse_case(bad)
    for case in kr.CASES:
        kr.parse_case(case)


def _run_tool(*args: str) -> tuple[int, list[dict]]:
    """``python -m lodestar.bench.kernel_regs ARGS`` in a process of its own (compiled for the
    GPU target even where the tests run the interpreter): exit status and one row a case."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LODESTAR_GEMV_TABLE")}
    out = subprocess.run([sys.executable, "-m", "lodestar.bench.kernel_regs", *args], capture_output=True,
                         text=True, env=env, timeout=600)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == sum(":" in a for a in args), out.stderr[-2000:]     # cases are KIND:TYPE:N,K:CONFIG
    return out.returncode, rows


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its ptxas and cuobjdump)")
def test_a_cap_on_registers_reaches_the_compiled_kernel():
    """Compiled offline for sm_90: the 8B Q4_0 gate|up of glu_quant, as shipped and capped at
    96 registers; the cap holds and raises the programs an SM holds."""
    code, (free, capped) = _run_tool("glu:Q4_0:28672,4096:64,16,1,4,0,0,1", "glu:Q4_0:28672,4096:64,16,1,4,0,0,1,96")
    assert code == 0
    assert capped["registers"] <= 96 < free["registers"]
    assert capped["programs_per_sm"] > free["programs_per_sm"] and free["programs"] == capped["programs"] == 448
    assert free["waves"] == round(448 / (free["programs_per_sm"] * 132), 2)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its ptxas and cuobjdump)")
def test_a_refused_tiling_is_reported_and_the_others_still_run():
    """A gate|up tiling split along K cannot apply the activation in its kernel: its line names
    the error, the next case is still compiled, and the exit status says one failed."""
    code, (bad, good) = _run_tool("glu:Q4_0:28672,4096:64,16,2,4,0,0,1", "gemv:Q4_0:4096,14336:16,16,7,1,0,0,1")
    assert code == 1
    assert "glu_epilogue_ok" in bad["error"] and "registers" not in bad
    assert good["registers"] > 0 and good["programs"] == 4096 // 16 * 7


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its ptxas and cuobjdump)")
def test_kquant_scale_layout_follows_the_gpu_table():
    """A Q4_K weight is compiled in the scale layout the H200 table gives its shape (q|k|v in
    pairs, down split), or the one --scales names; Q4_0 has none."""
    qkv, down = "gemv:Q4_K:6144,4096:8,128,1,2,0,0,1", "gemv-sum:Q4_K:4096,14336:16,32,2,4,0,0,1"
    code, (a, b, c) = _run_tool(qkv, down, "gemv:Q4_0:6144,4096:8,128,1,1,0,0,1")
    assert code == 0 and a["scales"] == "pair" and b["scales"] == "split" and "scales" not in c
    code, (a, c) = _run_tool("--scales", "block", qkv, "gemv:Q4_0:6144,4096:8,128,1,1,0,0,1")
    assert code == 0 and a["scales"] == "block" and "scales" not in c


def test_sass_counts_find_the_longest_loop():
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;",
        "        /*0020*/                   IDP.4A.S8.S8 R3, R2, R2, RZ ;",           # loop 1: 0x20-0x40
        "        /*0030*/                   LDG.E.128 R8, desc[UR4][R6.64] ;",
        "        /*0040*/              @!P0 BRA 0x20 ;",
        "        /*0050*/                   IDP.4A.S8.S8 R3, R2, R2, RZ ;",           # loop 2: 0x50-0x60
        "        /*0060*/              @P1 BRA 0x50 ;",
        "        /*0070*/                   EXIT ;",
        "        /*0080*/                   BRA 0x80;",                                # the end's self-branch
    ])
    got = kr.sass_counts(sass)
    assert got == {"instructions": 9, "loads": 2, "loop": {"instructions": 3, "loads": 1, "dp4a": 1}}
    assert kr.sass_counts("        /*0000*/                   EXIT ;")["loop"] is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its ptxas and cuobjdump)")
def test_sass_option_counts_the_tile_loop():
    """--sass: a looping tiling reports its loop (dp4a: 16 a group), a one-tile program none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "lodestar.bench.kernel_regs", "--sass",
                          "gemv:Q4_0:28672,4096:8,32,1,1,0,0,1", "gemv:Q4_0:6144,4096:8,128,1,1,0,0,1"],
                         capture_output=True, text=True, env=env, timeout=600)
    loop, whole = (json.loads(line)["sass"] for line in out.stdout.splitlines())
    assert out.returncode == 0
    assert loop["loop"]["dp4a"] % 16 == 0 and 0 < loop["loop"]["instructions"] < loop["instructions"]
    assert whole["loop"] is None and whole["loads"] > 0
