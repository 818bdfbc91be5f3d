"""Decode and prefill of two source trees side by side on one GPU: greedy tokens and speed.

    python scripts/ab_trees.py --tree base=DIR --tree head=. --rounds 3 --json OUT.json

Each (tree, cell) runs in its own process with that tree first on ``PYTHONPATH`` (so two
versions of the package never share a process), and the trees alternate within each round so
that clock and thermal drift fall on both. A cell is a synthetic model (random weights, real
geometry and GGUF layout) built on the GPU: one-stream decode (prompt 128, 256 new tokens,
median of 5 after a warm-up), prefill of 512 tokens (median of 5), and the greedy tokens of
two prompts (64 new each). Only the public engine API is used (``SyntheticCheckpoint``,
``build_model``, ``LoadedModel``, ``LLMEngine``), which both trees have.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CELLS = ("llama-3.1-8b:F16", "llama-3.1-8b:Q4_0", "llama-3.1-8b:Q4_K_M", "llama-3.1-8b:Q4_K",
         "smollm2-135m:F16")
SEED = 1234

CHILD = r'''
import json, statistics, sys, time
from pathlib import Path
import torch
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.loader import LoadedModel
from lodestar.engine.sampling import SamplingParams
from lodestar.formats.synthetic import SyntheticCheckpoint, tokenizer_metadata_or_synthetic
from lodestar.models import build_model
from lodestar.tokenizer import Tokenizer

geometry, qtype, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
ck = SyntheticCheckpoint(geometry, qtype, device="cuda", seed=seed)
model = build_model(ck.config, ck, "packed", device="cuda")
meta, _ = tokenizer_metadata_or_synthetic(ck.config.vocab_size)
torch.cuda.synchronize()
loaded = LoadedModel(Path(f"synthetic-{geometry}-{qtype}"), ck, ck.config, model, Tokenizer.from_metadata(meta),
                     "packed", time.perf_counter() - t0, "cuda")
engine = LLMEngine(loaded, EngineConfig(max_num_seqs=8, max_num_batched_tokens=8192, block_size=16,
                                        max_model_len=4096, kv_tokens=4096, enable_prefix_cache=False,
                                        device="cuda"))
vocab = ck.config.vocab_size
g = torch.Generator().manual_seed(seed)
prompt = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()


def run(p, new):
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    rid = engine.add_request(p, params)
    toks, first = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                toks += list(out.token_ids)
        if first is None and toks:
            first = time.perf_counter()
    end = time.perf_counter()
    return toks, first - t, (len(toks) - 1) / max(end - first, 1e-9)


greedy = [run(prompt(n), 64)[0] for n in (17, 130)]
p128, p512 = prompt(128), prompt(512)
run(p128, 16)
decode = [run(p128, 256)[2] for _ in range(5)]
run(p512, 1)
prefill = [512 / run(p512, 1)[1] for _ in range(5)]
print("RESULT " + json.dumps({"greedy": greedy, "decode_tok_s": decode, "prefill_512_tok_s": prefill,
                              "load_s": loaded.load_s if hasattr(loaded, "load_s") else None}))
'''


def run_cell(tree: str, cell: str, timeout: float) -> dict:
    geometry, qtype = cell.split(":")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, geometry, qtype, str(SEED)], env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"error": f"exit {p.returncode}: {(p.stderr or p.stdout)[-2000:]}"}
    out = json.loads(lines[-1][7:])
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


def summary(runs: list[dict], key: str) -> dict | None:
    vals = [v for r in runs if "error" not in r for v in r[key]]
    if not vals:
        return None
    med = [statistics.median(r[key]) for r in runs if "error" not in r]
    return {"median": round(statistics.median(vals), 1), "min": round(min(vals), 1), "max": round(max(vals), 1),
            "round_medians": [round(m, 1) for m in med]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR (the first is the baseline)")
    ap.add_argument("--cells", default=",".join(CELLS), help="GEOMETRY:TYPE,... (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    names = list(trees)
    cells = a.cells.split(",")
    start = time.perf_counter()
    raw: dict[str, dict[str, list[dict]]] = {c: {n: [] for n in names} for c in cells}
    doc = {"trees": trees, "cells": cells, "raw": raw, "summary": {}}
    for rnd in range(a.rounds):
        for cell in cells:
            order = names if rnd % 2 == 0 else names[::-1]
            for name in order:
                left = a.budget - (time.perf_counter() - start)
                if left < 30:
                    doc["stopped"] = f"budget spent in round {rnd}"
                    break
                r = run_cell(trees[name], cell, min(180.0, left))
                raw[cell][name].append(r)
                print(f"[{time.perf_counter() - start:5.0f}s] round {rnd} {cell} {name}: "
                      + (r["error"][-300:] if "error" in r else
                         f"decode {statistics.median(r['decode_tok_s']):.1f} tok/s, "
                         f"prefill {statistics.median(r['prefill_512_tok_s']):.0f} tok/s"), flush=True)
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)
    base = names[0]
    for cell in cells:
        s = {}
        for name in names:
            s[name] = {"decode_tok_s": summary(raw[cell][name], "decode_tok_s"),
                       "prefill_512_tok_s": summary(raw[cell][name], "prefill_512_tok_s"),
                       "errors": [r["error"][-500:] for r in raw[cell][name] if "error" in r]}
        ok = [r for n in names for r in raw[cell][n] if "error" not in r]
        gb = next((r["greedy"] for r in raw[cell][base] if "error" not in r), None)
        for name in names[1:]:
            d0, d1 = s[base]["decode_tok_s"], s[name]["decode_tok_s"]
            p0, p1 = s[base]["prefill_512_tok_s"], s[name]["prefill_512_tok_s"]
            gn = next((r["greedy"] for r in raw[cell][name] if "error" not in r), None)
            s[f"{name}_vs_{base}"] = {
                "decode_ratio": round(d1["median"] / d0["median"], 4) if d0 and d1 else None,
                "prefill_ratio": round(p1["median"] / p0["median"], 4) if p0 and p1 else None,
                "greedy_identical": gb is not None and gb == gn,
                "greedy_repeatable": len({json.dumps(r["greedy"]) for r in ok}) == 1 if ok else None}
        doc["summary"][cell] = s
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
