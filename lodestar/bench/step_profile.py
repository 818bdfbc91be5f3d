"""``lodestar bench profile``: where one decode step's time goes, per operation.

Runs ``--rows`` sequences decoding together (1 and 8 by default) and, with ``--prefill N``,
the prefill of one N-token prompt (one step), and times, with forward
hooks, every projection (by role and weight type), the head, the norms, attention (rope,
KV store and the attention itself: the attention module less its projections), the MLP's activation, and
what remains of the model's forward (embedding, residual adds, the layer loop). What the
engine's step spends outside the model (scheduling, sampling, detokenizing, Python) is the
step's time less the model's. The table runs the per-operation graph (hooks need it); the
step as it runs by default (the layer loop in one compiled call where the model qualifies,
``models.cpu_layers``) is timed without hooks and printed above it, with the unhooked
per-operation step.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch

from lodestar.bench.common import Stat, device_info, git_commit

ROLES = (("qkv", "q|k|v"), ("attn.o", "o"), ("gate_up", "gate|up"), ("down", "down"), ("head", "head"))


def _role(name: str) -> str:
    for key, role in ROLES:
        if key in name:
            return role
    return name


class Timers:
    """Inclusive times of named module calls, in seconds, summed over the steps."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._start: dict[int, float] = {}
        self.handles = []

    def watch(self, module: torch.nn.Module, key: str) -> None:
        def pre(mod, args):
            self._start[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            self.total[key] += time.perf_counter() - self._start.pop(id(mod))
            self.calls[key] += 1
        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def instrument(model: torch.nn.Module) -> Timers:
    """Hooks on the projections, norms, attention and MLP modules of ``model``."""
    from lodestar.layers.linear import DenseLinear, QuantizedLinear
    from lodestar.layers.norm import RMSNorm
    t = Timers()
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        if isinstance(mod, (QuantizedLinear, DenseLinear)):
            qtype = getattr(mod, "qtype", None)
            t.watch(mod, f"linear {_role(name)} {qtype.name if qtype is not None else 'dense'}")
        elif isinstance(mod, RMSNorm):
            t.watch(mod, "norms")
        elif kind.endswith("Attention"):
            t.watch(mod, "~attention")
        elif kind.endswith("MLP"):
            t.watch(mod, "~mlp")
    t.watch(model, "~model")
    return t


def _start(engine, rows: int, prompt_len: int, tokens: int) -> None:
    from lodestar.bench.decode import make_prompt
    from lodestar.engine.sampling import SamplingParams
    base = make_prompt(engine.tokenizer, prompt_len + rows)
    for i in range(rows):
        engine.add_request(base[i:i + prompt_len], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    while any(s.num_computed < len(s.prompt_ids) for s in engine.running + engine.waiting):
        engine.step()                      # prefill until every sequence decodes


def profile(engine, rows: int, steps: int, prompt_len: int) -> dict:
    """Per-step milliseconds by operation with ``rows`` sequences decoding."""
    model = engine.loaded.model
    _start(engine, rows, prompt_len, 3 * steps + 8)
    fused_default = getattr(model, "fused_cpu_layers", False)
    plain, graph = Stat(), Stat()
    for stat, fused in ((plain, fused_default), (graph, False)):     # unhooked steps first
        if hasattr(model, "fused_cpu_layers"):
            model.fused_cpu_layers = fused
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            stat.add((time.perf_counter() - t0) * 1e3)
    timers = instrument(model)
    hooked = 0.0
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            hooked += time.perf_counter() - t0
    finally:
        timers.remove()
        if hasattr(model, "fused_cpu_layers"):
            model.fused_cpu_layers = fused_default
        for s in list(engine.running) + list(engine.waiting):
            engine.abort(s.seq_id)
        while engine.has_unfinished():
            engine.step()
    res = {"rows": rows, "steps": steps, "step_ms": plain.as_dict(), "step_ms_graph": graph.as_dict()}
    return res | breakdown(timers, hooked, steps)


def breakdown(timers: Timers, hooked: float, steps: int) -> dict:
    """Milliseconds per step by operation from hooked ``steps`` that took ``hooked`` seconds."""
    tot = {k: v / steps * 1e3 for k, v in timers.total.items()}
    linear = {k: v for k, v in tot.items() if k.startswith("linear ")}
    inner_attn = sum(v for k, v in linear.items() if k.split()[1] in ("q|k|v", "o"))
    inner_mlp = sum(v for k, v in linear.items() if k.split()[1] in ("gate|up", "down"))
    head = sum(v for k, v in linear.items() if k.split()[1] == "head")
    norms = tot.get("norms", 0.0)
    attn = tot.get("~attention", 0.0) - inner_attn
    act = tot.get("~mlp", 0.0) - inner_mlp
    model_ms = tot.get("~model", 0.0)
    # The model's forward covers the blocks and the final norm; the head runs after it.
    rest = model_ms - (sum(linear.values()) - head) - norms - attn - act
    step_ms = hooked / steps * 1e3
    ops = dict(sorted(linear.items(), key=lambda kv: -kv[1]))
    ops.update({"attention (rope, KV store, attend)": attn, "activation (act(gate) * up)": act, "norms": norms,
                "model other (embedding, residual adds, layer loop)": rest,
                "engine outside the model (schedule, sample, detokenize)": step_ms - model_ms - head})
    return {"step_ms_hooked": step_ms, "ops_ms": ops, "calls_per_step": {k: timers.calls[k] / steps for k in timers.calls}}


def profile_prefill(engine, n: int, runs: int) -> dict:
    """Milliseconds by operation of prefilling one ``n``-token prompt (one step)."""
    from lodestar.bench.decode import make_prompt
    from lodestar.engine.sampling import SamplingParams
    model = engine.loaded.model
    ids = make_prompt(engine.tokenizer, n)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def once() -> float:
        t0 = time.perf_counter()
        engine.generate([ids], params)
        return time.perf_counter() - t0
    once()
    plain = Stat()
    for _ in range(runs):
        plain.add(once() * 1e3)
    timers = instrument(model)
    try:
        hooked = sum(once() for _ in range(runs))
    finally:
        timers.remove()
    return {"prefill": n, "steps": runs, "step_ms": plain.as_dict(), "tok_s": n / plain.median * 1e3} | breakdown(
        timers, hooked, runs)


def print_table(res: dict) -> None:
    step = res["step_ms_hooked"]
    if "prefill" in res:
        print(f"\nprefill of {res['prefill']} tokens: {res['step_ms']['median']:.1f} ms ({res['tok_s']:.0f} tok/s), "
              f"{step:.1f} ms hooked (medians of {res['steps']}):")
    else:
        print(f"\n{res['rows']} row(s) decoding: step {res['step_ms']['median']:.2f} ms as it runs, "
              f"{res['step_ms_graph']['median']:.2f} ms per-operation graph, {step:.2f} ms hooked "
              f"(medians of {res['steps']} steps); the per-operation graph, hooked:")
    print(f"  {'operation':<58}{'ms/step':>9}{'share':>8}")
    for name, ms in res["ops_ms"].items():
        print(f"  {name:<58}{ms:>9.3f}{ms / step:>8.1%}")


def main(a: argparse.Namespace) -> int:
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    from lodestar.kernels import native
    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(a.model, mode=a.dtype, progress=False, device=a.device)
    rows = sorted(set(a.rows))
    longest = max(a.prefill, default=0)
    engine = LLMEngine(lm, EngineConfig(max_num_seqs=max(rows), max_num_batched_tokens=max(512, longest),
                                        kv_tokens=max(max(rows) * (a.prompt_len + 3 * a.steps + 64), longest + 64),
                                        enable_prefix_cache=False))
    engine.warmup()
    print(f"model {lm.path.name} ({a.dtype}) on {lm.device}, {torch.get_num_threads()} threads, "
          f"CPU kernels: {native.isa() if native.available() else 'torch (extension not built or off)'}",
          file=sys.stderr)
    results = []
    with torch.inference_mode():
        for r in rows:
            results.append(profile(engine, r, a.steps, a.prompt_len))
            print_table(results[-1])
        for n in sorted(set(a.prefill)):
            results.append(profile_prefill(engine, n, max(1, a.steps // 8)))
            print_table(results[-1])
    if a.json:
        doc = {"bench": "profile", "model": lm.path.name, "dtype": a.dtype, "threads": torch.get_num_threads(),
               "native_isa": native.isa() if native.available() else None, "commit": git_commit(),
               "device": device_info(), "results": results}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
