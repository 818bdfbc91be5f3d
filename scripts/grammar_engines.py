"""Mask time per token of the two grammar engines on a model's vocabulary.

    python scripts/grammar_engines.py [--model smollm2] [--out FILE.json]

Both engines get the same raw-byte vocabulary (``Tokenizer.token_bytes``). For each JSON
schema of ``lodestar.bench.structured_schemas`` a canonical instance is tokenized and
walked token by token: each step computes the next-token bitmask (timed), checks the
instance's next token is allowed, and consumes it. Grammar compile time is timed apart.
xgrammar is not a dependency (it imports transformers and triton); install it in a
scratch environment to run its half. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _vocab(tok, n_vocab: int) -> list[bytes]:
    out = []
    for i in range(n_vocab):
        try:
            out.append(tok.token_bytes(i))
        except Exception:
            out.append(b"")
    return out


def _summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median_us": statistics.median(xs) * 1e6, "p90_us": xs[int(0.9 * (len(xs) - 1))] * 1e6,
            "max_us": xs[-1] * 1e6, "mean_us": statistics.fmean(xs) * 1e6}


def run_llguidance(tok, vocab, cases, n_vocab):
    import llguidance
    import llguidance.torch as lt
    from lodestar.engine.grammar import GrammarCompiler  # the engine's own wrapper

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, n_vocab)
    compiler.ll_tokenizer                    # built on first use; timed here, not in the first compile
    setup = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, n_vocab)
    steps, compiles, rejects = [], [], 0
    for schema, ids in cases:
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = llguidance.LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
        compiles.append(time.perf_counter() - t)
        for tid in ids:
            t = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            steps.append(time.perf_counter() - t)
            if not (int(mask[0, tid // 32]) >> (tid % 32)) & 1:
                rejects += 1
                break
            m.consume_token(tid)
    return {"setup_s": setup, "mask": _summary(steps), "compile": _summary(compiles), "rejected_walks": rejects}


def run_xgrammar(tok, vocab, cases, n_vocab, eos):
    import torch
    import xgrammar as xg

    t0 = time.perf_counter()
    info = xg.TokenizerInfo(vocab, vocab_type=xg.VocabType.RAW, vocab_size=n_vocab, stop_token_ids=sorted(eos))
    compiler = xg.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    mask = xg.allocate_token_bitmask(1, n_vocab)
    steps, compiles, rejects = [], [], 0
    for schema, ids in cases:
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        m = xg.GrammarMatcher(compiled)
        compiles.append(time.perf_counter() - t)
        for tid in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            steps.append(time.perf_counter() - t)
            if not (int(mask[0, tid // 32]) >> (tid % 32)) & 1:
                rejects += 1
                break
            m.accept_token(tid)
    del torch
    return {"setup_s": setup, "mask": _summary(steps), "compile": _summary(compiles), "rejected_walks": rejects}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out")
    args = ap.parse_args()
    from lodestar.bench.structured_schemas import SCHEMAS, instance_text
    from lodestar.formats.catalog import known_model_path
    from lodestar.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(known_model_path(args.model))
    n_vocab = tok.vocab_size
    vocab = _vocab(tok, n_vocab)
    cases = [(s.schema, tok.encode(instance_text(s), add_special_tokens=False)) for s in SCHEMAS]
    report = {"model": args.model, "vocab": n_vocab, "schemas": len(cases),
              "tokens_walked": sum(len(c[1]) for c in cases), "python": sys.version.split()[0]}
    report["llguidance"] = run_llguidance(tok, vocab, cases, n_vocab)
    try:
        report["xgrammar"] = run_xgrammar(tok, vocab, cases, n_vocab, tok.eos_ids)
    except ImportError as e:
        report["xgrammar"] = {"skipped": f"not installed ({e})"}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
