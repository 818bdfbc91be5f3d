"""``lodestar bench ...``: the benchmark commands' arguments; each runs ``lodestar.bench.<module>.main``."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from lodestar.cli import CLIError, _add_model_args, _add_spec_args


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib
    module = {"decode": "decode", "serve-load": "serve_load", "cache": "cache", "http": "http",
              "gguf-fuzz": "fuzz_gguf", "fuzz": "fuzz_http", "structured": "structured",
              "spec": "spec", "agent": "agent", "report": "report", "profile": "step_profile",
              "startup": "startup"}[a.bench]
    if a.tensor_parallel != 1:
        from lodestar.engine.loader import TENSOR_PARALLEL_ENV
        if a.tensor_parallel < 1:
            raise CLIError(f"--tensor-parallel {a.tensor_parallel}: needs at least 1")
        # The benchmarks build their engines with load_model(), whose default this sets.
        os.environ[TENSOR_PARALLEL_ENV] = str(a.tensor_parallel)
    return importlib.import_module(f"lodestar.bench.{module}").main(a)


def _add_fuzz_args(p: argparse.ArgumentParser, model_help: str, count: int, count_help: str, unit: str) -> None:
    p.add_argument("--model", "-m", default="default", help=f"{model_help} (default: default)")
    p.add_argument("--count", type=int, default=count, help=f"{count_help} (default {count})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help=f"seconds {unit} may take before it counts as a "
                   "hang (default 30)")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=cmd_bench, tensor_parallel=1)


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bd = bsub.add_parser("decode", help="load time, prefill and decode speed (vs llama.cpp when installed)")
    _add_model_args(bd)
    bd.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024])
    bd.add_argument("--gen-tokens", type=int, default=256)
    bd.add_argument("--runs", type=int, default=3)
    bd.add_argument("--peer", choices=["auto", "none", "llama.cpp"], default="auto",
                    help="also measure llama-cpp-python on the same file (auto: when installed)")
    bd.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    bd.set_defaults(func=cmd_bench)
    bf = bsub.add_parser("profile", help="where one decode step's time goes, per operation, at 1 and 8 rows")
    _add_model_args(bf)
    bf.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="sequences decoding together")
    bf.add_argument("--steps", type=int, default=32, help="decode steps timed per row count")
    bf.add_argument("--prompt-len", type=int, default=64)
    bf.add_argument("--prefill", type=int, nargs="*", default=[], metavar="N",
                    help="also profile the prefill of one N-token prompt (e.g. 128 1024)")
    bf.add_argument("--json", type=Path, default=None)
    bf.set_defaults(func=cmd_bench)
    bs = bsub.add_parser("startup", help="time to the first token seen from outside: lodestar generate from "
                         "process start, lodestar chat from sending a message (vs import torch, llama.cpp)")
    _add_model_args(bs)
    bs.add_argument("--runs", type=int, default=5)
    bs.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take (default 120)")
    bs.add_argument("--json", type=Path, default=None)
    bs.set_defaults(func=cmd_bench)
    bl = bsub.add_parser("serve-load", help="aggregate decode tok/s and TTFT with concurrent streams")
    _add_model_args(bl)
    bl.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    bl.add_argument("--prompt-len", type=int, default=64)
    bl.add_argument("--gen-tokens", type=int, default=128)
    bl.add_argument("--runs", type=int, default=3)
    bl.add_argument("--json", type=Path, default=None)
    bl.set_defaults(func=cmd_bench)
    bc = bsub.add_parser("cache", help="second-turn and after-restart time to first token vs cold")
    _add_model_args(bc)
    bc.add_argument("--context", type=int, default=1500, help="conversation length in tokens")
    bc.add_argument("--runs", type=int, default=3)
    bc.add_argument("--json", type=Path, default=None)
    bc.set_defaults(func=cmd_bench)
    bg = bsub.add_parser("agent", help="the coding agent's time to first token: cold, second turn, after a "
                         "restart with and without the disk KV tier")
    _add_model_args(bg)
    bg.add_argument("--runs", type=int, default=3)
    bg.add_argument("--json", type=Path, default=None)
    bg.set_defaults(func=cmd_bench)
    bh = bsub.add_parser("http", help="HTTP server overhead: streamed tok/s and TTFT over HTTP vs the engine directly")
    _add_model_args(bh)
    bh.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8], help="concurrent clients per level")
    bh.add_argument("--prompt-len", type=int, default=64)
    bh.add_argument("--gen-tokens", type=int, default=128)
    bh.add_argument("--runs", type=int, default=3)
    bh.add_argument("--json", type=Path, default=None)
    bh.set_defaults(func=cmd_bench)
    bs = bsub.add_parser("structured", help="constrained decoding: output validity, cost vs unconstrained, "
                         "jump-forward gain, batch exactness")
    _add_model_args(bs)
    bs.add_argument("--parts", default="validity,cost,jump,exact",
                    help="comma-separated parts to run: validity, cost, jump, exact (default all)")
    bs.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up (cost, jump; default 3)")
    bs.add_argument("--batch", type=int, default=16, help="validity: requests decoded together (default 16)")
    bs.add_argument("--schemas", type=int, default=None, help="validity: use the first N schemas (default all)")
    bs.add_argument("--seeds", type=int, default=7,
                    help="validity: sampled requests per schema, besides the greedy one (default 7)")
    bs.add_argument("--temperature", type=float, default=0.8, help="of the sampled requests (default 0.8)")
    bs.add_argument("--tools", type=int, default=None,
                    help="validity: forced calls of the first N tools (default all)")
    bs.add_argument("--tool-seeds", type=int, default=3,
                    help="validity: sampled requests per tool, besides the greedy one (default 3)")
    bs.add_argument("--max-tokens", type=int, default=384,
                    help="new tokens per request at most (validity, jump, exact's jump-forward check; default 384)")
    bs.add_argument("--cost-tokens", type=int, default=64, help="cost: new tokens per request (default 64)")
    bs.add_argument("--cost-batches", type=int, nargs="+", default=[1, 16], help="cost: batch sizes (default 1 16)")
    bs.add_argument("--jump-schemas", type=int, default=None,
                    help="jump: use the first N KEY_HEAVY schemas (default all)")
    bs.add_argument("--exact-targets", type=int, default=3,
                    help="exact: requests checked per mode, the last one sampled with a seed (default 3)")
    bs.add_argument("--exact-tokens", type=int, default=48,
                    help="exact: new tokens per request of the batch comparison (default 48)")
    bs.add_argument("--exact-jump", type=int, default=1,
                    help="exact: KEY_HEAVY schemas whose tokens with jump-forward on and off are compared, per "
                         "mode (default 1)")
    bs.add_argument("--exact-modes", nargs="+", default=["fp32", "packed"], choices=["packed", "fp32", "bf16"],
                    help="exact: weight modes to check (default fp32 packed)")
    bs.add_argument("--strict", action="store_true",
                    help="exit 1 when an output is not valid (cut off at --max-tokens included), a batched request "
                         "differs or jump-forward changes the text")
    bs.add_argument("--json", "--out", dest="json", type=Path, default=None, help="write results as JSON here")
    bs.set_defaults(func=cmd_bench)
    bp = bsub.add_parser("spec", help="speculative decoding: decode tok/s on vs off (edit, chat, batch), same "
                         "greedy tokens, acceptance")
    _add_model_args(bp)
    _add_spec_args(bp)
    bp.add_argument("--parts", default="edit,chat,batch",
                    help="comma-separated parts to run: edit, chat, batch (default all)")
    bp.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up (default 3)")
    bp.add_argument("--max-tokens", type=int, default=512,
                    help="new tokens per request at most (default 512)")
    bp.add_argument("--streams", type=int, default=8, help="batch: edit requests decoded together (default 8)")
    bp.add_argument("--prompts", type=int, default=None, help="edit, chat: use the first N prompts (default all)")
    bp.add_argument("--strict", action="store_true",
                    help="exit 1 when greedy tokens differ on vs off or between runs, a part crashes, or a "
                         "request that opted out drafted")
    bp.add_argument("--json", "--out", dest="json", type=Path, default=None, help="write results as JSON here")
    bp.set_defaults(func=cmd_bench)
    br = bsub.add_parser("report", help="one self-contained HTML page (tables, charts, failures) from every "
                         "result JSON under a folder")
    br.add_argument("dir", type=Path, help="folder of result JSON files (searched recursively), e.g. bench/results")
    br.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="HTML file to write "
                    "(default report.html)")
    br.set_defaults(func=cmd_bench, tensor_parallel=1)
    bz = bsub.add_parser("fuzz", help="hostile and malformed HTTP requests against a local server: no 5xx, no "
                         "hang, memory and latency back where they started")
    _add_fuzz_args(bz, "model to serve", 10_000, "requests to send", "a request")
    bz.add_argument("--warmup", type=int, default=300, help="requests before the first memory reading (default 300)")
    bz.add_argument("--workers", type=int, default=8, help="concurrent clients (default 8)")
    bz.add_argument("--max-seconds", type=float, default=None, help="stop sending after this long")
    bz.add_argument("--max-growth", type=float, default=0.10, help="memory growth that fails the run (default 0.10)")
    bf = bsub.add_parser("gguf-fuzz", help="load mutated copies of a GGUF file: every one must load or fail "
                         "with a one-line error")
    _add_fuzz_args(bf, "source GGUF file or known model", 1000, "mutations to try", "one mutation")
    bf.add_argument("--keep", type=Path, default=None, help="copy files that crash or hang into this folder")
    bf.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the runs are tiny)")
