#!/usr/bin/env python3
"""Regenerate the model goldens under tests/goldens/ with the fp32 reference oracle.

Needs the ``oracle`` extra (transformers + accelerate). For each model: a set of chat and
raw prompts (short and >= 1000 tokens), 64 greedy tokens from a plain fp32 forward loop,
and the top-5 log-probabilities of each step's raw logits. Tests read these files; they
never import transformers.

    python scripts/make_goldens.py [--models default gemma3-270m] [--steps 64]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lodestar.formats.catalog import file_sha256, known_model_path  # noqa: E402

GOLDEN_DIR = ROOT / "tests" / "goldens"

LONG_TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let the same hardware run any "
    "algorithm expressible as a sequence of instructions. Assemblers gave names to opcodes, "
    "compilers translated structured languages into machine code, and operating systems hid the "
    "details of devices behind files and processes. Each step traded a little efficiency for a "
    "great deal of expressiveness. "
)
LONG_CODE = '''def merge_sort(items):
    """Sort a list with merge sort and return a new list."""
    if len(items) <= 1:
        return list(items)
    mid = len(items) // 2
    left = merge_sort(items[:mid])
    right = merge_sort(items[mid:])
    out, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i]); i += 1
        else:
            out.append(right[j]); j += 1
    out.extend(left[i:]); out.extend(right[j:])
    return out

'''


def prompts() -> list[dict]:
    """Prompt specs: raw text or chat messages; long ones are built to exceed 1000 tokens."""
    long_story = "".join(f"Chapter {i}. " + LONG_TEXT for i in range(1, 14))
    long_code = "".join(LONG_CODE.replace("merge_sort", f"merge_sort_{i}") for i in range(9))
    return [
        {"name": "raw_capital", "raw": "The capital of France is"},
        {"name": "raw_count", "raw": "1, 2, 3, 4, 5,"},
        {"name": "raw_code", "raw": "def fibonacci(n):\n    "},
        {"name": "raw_unicode", "raw": "Les élèves étudient l'histoire de la Révolution française. 日本語も少し話せます。"},
        {"name": "raw_list", "raw": "Here is a list of fruits:\n1. Apple\n2."},
        {"name": "raw_long_story", "raw": long_story + "\nIn summary,"},
        {"name": "raw_long_code", "raw": long_code + "def binary_search(items, target):\n"},
        {"name": "chat_hello", "chat": [{"role": "user", "content": "Hello! Who are you?"}]},
        {"name": "chat_math", "chat": [{"role": "user", "content": "What is 17 times 23? Explain briefly."}]},
        {"name": "chat_system", "chat": [
            {"role": "system", "content": "You are a pirate. Answer in pirate speak."},
            {"role": "user", "content": "How do I boil an egg?"}]},
        {"name": "chat_multiturn", "chat": [
            {"role": "user", "content": "Name a primary color."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Name another one."}]},
        {"name": "chat_code", "chat": [{"role": "user", "content": "Write a Python function that reverses a string."}]},
        {"name": "chat_long", "chat": [{"role": "user", "content": long_story + "\nSummarize the text above in one sentence."}]},
    ]


def encode(tok, spec: dict) -> list[int]:
    if "raw" in spec:
        return tok(spec["raw"])["input_ids"]
    if not getattr(tok, "chat_template", None):
        # Base models: the same conversation as plain text, so every model gets every case.
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in spec["chat"])
        return tok(text + "Assistant:")["input_ids"]
    return list(tok.apply_chat_template(spec["chat"], add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


@torch.inference_mode()
def greedy(model, ids: list[int], steps: int, top_k: int) -> dict:
    """Plain greedy loop on the oracle: argmax of fp32 logits, KV cache reused."""
    out = model(torch.tensor([ids]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    tokens, top = [], []
    for _ in range(steps):
        lp = torch.log_softmax(logits.float(), dim=-1)
        vals, idx = lp.topk(top_k)
        nxt = int(idx[0])
        tokens.append(nxt)
        top.append([[int(i), float(v)] for i, v in zip(idx, vals)])
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return {"tokens": tokens, "top_logprobs": top}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["default", "gemma3-270m"])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=5)
    args = ap.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        path = known_model_path(name)
        t0 = time.time()
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        model.eval()
        print(f"{name}: loaded in {time.time() - t0:.1f}s", file=sys.stderr)
        cases = []
        for spec in prompts():
            ids = encode(tok, spec)
            t1 = time.time()
            res = greedy(model, ids, args.steps, args.top_k)
            kind = "raw" if "raw" in spec or not getattr(tok, "chat_template", None) else "chat"
            cases.append({"name": spec["name"], "kind": kind,
                          "prompt": spec.get("raw", spec.get("chat")), "prompt_ids": ids, **res})
            print(f"  {spec['name']}: {len(ids)} prompt tokens, {time.time() - t1:.1f}s", file=sys.stderr)
        doc = {
            "model": name, "model_file": path.name, "model_sha256": file_sha256(path),
            "oracle": "transformers fp32, greedy, raw logits",
            "attn_implementation": model.config._attn_implementation,
            "steps": args.steps, "top_k": args.top_k,
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                         "python": platform.python_version()},
            "cases": cases,
        }
        out = GOLDEN_DIR / f"generate_{known_name(name)}.json"
        out.write_text(json.dumps(doc, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n")
        print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size // 1024} KiB)", file=sys.stderr)


def known_name(name: str) -> str:
    from lodestar.formats.catalog import ALIASES
    return ALIASES.get(name, name)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
