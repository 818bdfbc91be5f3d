"""GPU benchmark stages for ``scripts/device_bench.sh`` (one H200, no network).

Each stage runs in its own process (``python -m lodestar.bench.gpu STAGE --json FILE``)
and merges its results into one JSON file after every cell, so a stage that fails or
runs out of time still leaves what it measured (and its error). Models are synthetic
(``formats.synthetic``: random weights of real geometries built in GPU memory, the same
tensor types and kernels as a GGUF file of that type); EOS is ignored and sampling is
greedy. Every cell reports min / median / max of 3 runs after a warm-up run, and the
peak GPU memory. Kernel switches come from the environment (``kernels.policy.SWITCHES``);
what a stage compares is set by the options below.

Stages:
  env     device, versions, device-copy bandwidth (a 2 GiB torch copy, read + write bytes)
  small   SmolLM2-135M geometry, F16 and Q4_0: single-stream decode, prefill 512 / 4096
  8b-f16  Llama-3.1-8B geometry, F16 (bf16 weights): decode, prefill, aggregate decode at
          batch 1..64 (prompt 128, 256 new)
  8b-q4k  Llama-3.1-8B, Q4_K (Q6_K head): decode, prefill
  8b-q4km Llama-3.1-8B, Q4_K_M (llama.cpp's mix: attn_v and ffn_down in Q6_K on 16 of the
          32 layers, Q6_K head; the peer's Q4_K file): decode, prefill
  8b-q4_0 Llama-3.1-8B, Q4_0 (Q8_0 head): decode, prefill
  sweep   Llama-3.1-8B decode at each --contexts, one file per --qtypes (--csv, --svg); the
          context is filled with zeros rather than prefilled, which changes no byte read per token
  hf      Hugging Face transformers (eager generate, sdpa attention) against lodestar on
          the same synthetic safetensors folders (SmolLM2, Llama-3.2-1B; --workdir)
  gemv    quantized matrix-vector kernel on 8B shapes: every type at its tiling in force
          (M = 1, 8, 32), then a tiling sweep for Q4_0 / Q4_K at M = 1
  dense   bf16 matrix-vector at M = 1: cuBLAS vs the Triton kernel (tiling sweep)
  prefillattn  prefill attention alone, paged kernel vs SDPA forms (--prefill-attn-cases),
          then an 8B F16 engine's time to first token of 32 prompts both ways
  profile wall time per decode step (overlapped, and step by step) vs GPU time of its
          graph replay (host gap) and the per-kernel times of eager decode steps (SmolLM2
          F16, 8B F16, Q4_K and Q4_0)
  chain   the decode step's kernel chain from graph replays under torch.profiler: per
          kernel and its place in the layer, how far it moved the end of the chain, and the
          projections' weight streams (--chain-cells)
  hostprof  cProfile of one 8B F16 prefill step and of eager decode steps
  prefill 8B F16 prefill 512 / 4096: wall vs CUDA-event time around the step, fusions off and on
  fuse    decode fusions --fuse-off vs --fuse-on: same tokens and log-probabilities, decode
          tok/s (--fuse-cells)
  gemvform  8B Q4_0 / Q4_K decode, the shipped tilings vs --gemv-ab
  ab      two settings of the kernel policy or environment (--ab), one engine each, runs
          interleaved: decode tok/s and greedy-token agreement (--ab-cells)
  densegemv  decode with bf16 weights, the layers' Triton matrix-vector kernel off vs on
  overlap overlapped decode off vs on, one engine, runs interleaved: same greedy tokens,
          decode tok/s at 1 and 8 streams (SmolLM2 F16, 8B F16, 8B Q4_0)
  prefillgraph  one prompt's prefill eagerly vs from a CUDA graph, one engine
  tp      tensor parallelism (needs 2 GPUs): Llama-3.1-8B bf16 single-stream decode and
          batch 32 with --tensor-parallel 1 and 2 (symmetric-memory and NCCL all-reduce)
          in the same run
  tp70    a 70B-geometry bf16 model (138.5 GB of weights; with a 128k-token cache,
          181 GB: more than one H200 holds) with --tensor-parallel 2, decode at 1k / 32k /
          128k context; per-GPU memory from nvidia-smi

Roofline: decode tok/s <= copy bandwidth / (weight bytes + KV bytes read per token), with the
weight bytes those a decode step reads in this engine's layout (``read_bytes_per_token``:
every projection and the head, not the token embedding; ``fraction_of_roofline``). The CUDA
issue's targets take the file's weight bytes instead (``file_weight_bytes``: every tensor as
stored, the token embedding included, no KV; ``fraction_of_file_roofline``), as its llama.cpp
fractions do. The two differ by the embedding table (in the file, not read) and by packed
layouts larger than the file's blocks (Q4_K / Q5_K scales in pairs or split: 148 bytes a
block of 256 weights read against the file's 144).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lodestar.bench import gpu_ab, gpu_kernels, gpu_models
from lodestar.bench.gpu_cells import Results, parse_cells

STAGES = {
    "env": gpu_models.stage_env, "small": gpu_models.stage_small, "8b-f16": gpu_models.stage_8b_f16,
    "8b-q4k": gpu_models.stage_8b_q4k, "8b-q4km": gpu_models.stage_8b_q4km, "8b-q4_0": gpu_models.stage_8b_q4_0,
    "sweep": gpu_models.stage_sweep, "hf": gpu_models.stage_hf, "tp": gpu_models.stage_tp,
    "tp70": gpu_models.stage_tp70,
    "gemv": gpu_kernels.stage_gemv, "dense": gpu_kernels.stage_dense, "prefillattn": gpu_kernels.stage_prefillattn,
    "profile": gpu_kernels.stage_profile, "chain": gpu_kernels.stage_chain, "hostprof": gpu_kernels.stage_hostprof,
    "prefill": gpu_kernels.stage_prefill,
    "fuse": gpu_ab.stage_fuse, "gemvform": gpu_ab.stage_gemvform, "ab": gpu_ab.stage_ab,
    "densegemv": gpu_ab.stage_densegemv, "overlap": gpu_ab.stage_overlap, "prefillgraph": gpu_ab.stage_prefillgraph,
}


def _checked(parse):
    """An argparse ``type`` that reports ``parse``'s ValueError as the option's error."""
    def check(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    check.__name__ = parse.__name__
    return check


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lodestar.bench.gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=list(STAGES))
    ap.add_argument("--json", type=Path, required=True, help="results file (merged into)")
    ap.add_argument("--seconds", type=float, default=120.0, help="time this stage may take")
    ap.add_argument("--csv", type=Path, default=None, help="sweep: a row per file type and context")
    ap.add_argument("--svg", type=Path, default=None, help="sweep: the plot")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/lodestar-bench"), help="hf: where folders are written")
    ap.add_argument("--contexts", type=_checked(gpu_models.sweep_contexts), default=gpu_models.SWEEP_CONTEXTS,
                    help="sweep: ascending contexts, comma-separated (default %(default)s)")
    ap.add_argument("--qtypes", type=_checked(gpu_models.sweep_qtypes), default=gpu_models.SWEEP_QTYPES,
                    help="sweep: 8B file types, comma-separated (default %(default)s)")
    ap.add_argument("--chain-cells", type=_checked(parse_cells), default="llama-3.1-8b/Q4_0 llama-3.1-8b/F16",
                    help="chain: geometry/type cells, space-separated (default %(default)s)")
    ap.add_argument("--fuse-cells", type=_checked(parse_cells),
                    default="smollm2-135m/F16 llama-3.1-8b/F16 llama-3.1-8b/Q4_0 smollm2-135m/Q4_0",
                    help="fuse: geometry/type cells (default %(default)s)")
    ap.add_argument("--fuse-off", type=_checked(gpu_ab.fusion_text), default="0",
                    help="fuse: the fusions of the 'off' side, as LODESTAR_FUSE takes them (default %(default)s)")
    ap.add_argument("--fuse-on", type=_checked(gpu_ab.fusion_text), default="default",
                    help="fuse: the fusions of the 'on' side (default %(default)s: the shipped set)")
    ap.add_argument("--gemv-ab", type=_checked(gpu_ab.gemv_tilings), default="off",
                    help="gemvform: the tilings set against the shipped ones: off (the tiling rule), a table "
                         "file, or one tiling for every shape (default %(default)s)")
    ap.add_argument("--ab", type=_checked(gpu_ab.parse_sides), default="LODESTAR_PDL=0|LODESTAR_PDL=1",
                    help="ab: sides A|B, each NAME=value ... with NAME a policy switch, gemv, dense_gemv, "
                         "prefill_attention or another environment variable; no | measures one side "
                         "(default %(default)s)")
    ap.add_argument("--ab-cells", type=_checked(parse_cells),
                    default="llama-3.1-8b/F16 llama-3.1-8b/Q4_0 smollm2-135m/F16",
                    help="ab: geometry/type cells (default %(default)s)")
    ap.add_argument("--prefill-attn-cases", type=_checked(gpu_kernels.prefill_attn_cases), default="",
                    help="prefillattn: case names, space-separated; given, only those and no engine "
                         f"(default: all and the engine; {', '.join(gpu_kernels.PREFILL_ATTN_CASES)})")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("lodestar.bench.gpu: no CUDA device", file=sys.stderr)
        return 2
    # leave a few seconds for the process to exit cleanly
    r = Results(a.json, a.stage, time.time() + a.seconds - 5)
    import faulthandler   # a stage that hangs prints every thread's stack before it is killed
    faulthandler.dump_traceback_later(max(a.seconds - 12, 5), exit=False)
    try:
        STAGES[a.stage](r, a)
    except Exception as e:
        r.error("stage", e)
        return 1
    r.section["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    r.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
