"""A/B GPU benchmark stages (``lodestar.bench.gpu``): two settings of the engine or its kernel
policy, the same model, whether greedy tokens agree and decode / prefill speed of each.

A side that is a kernel policy builds its engine inside ``using(policy)`` and runs it inside
``using(policy)`` again (the engine reads the policy in force while it runs; a model load may
install the environment's)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from pathlib import Path

from lodestar.bench.gpu_cells import (RUNS, SEED, Results, bandwidth_from, decode_cell, env_policy, file_weight_bytes,
                                      prompts, read_bytes_per_token, release, stat, synthetic_engine, timed_generate)
from lodestar.kernels.policy import SWITCHES, KernelPolicy, using

# --ab names that are not environment variables: tool-only fields of KernelPolicy
POLICY_FIELDS = ("gemv", "dense_gemv", "prefill_attention")
# Switches the kernels no longer read, and what replaced them
RETIRED = {
    "LODESTAR_GEMV": "gemv=TILING",
    "LODESTAR_DENSE_GEMV": "dense_gemv=0|1",
    "LODESTAR_PREFILL_ATTN": "prefill_attention=paged|sdpa",
    "LODESTAR_GEMV_VARIANT": "gemv=TILING (block_n,tile_groups,split_k,num_warps[,prefetch,unroll,words,maxnreg])",
    "LODESTAR_KQUANT_SCALES": "LODESTAR_GEMV_TABLE=FILE with SCALES:TYPE:n,k entries",
    "LODESTAR_GLU_GEMV": "LODESTAR_GEMV_TABLE=FILE with GLU:TYPE:n,k entries",
    "LODESTAR_DENSE_CONFIG": "LODESTAR_GEMV_TABLE=FILE with BF16:n,k entries",
}


def fusion_text(text: str) -> str:
    """``--fuse-on`` / ``--fuse-off``: a ``LODESTAR_FUSE`` value (1, 0, default or a comma list)."""
    KernelPolicy.from_env({"LODESTAR_FUSE": text})
    return text


def gemv_tilings(text: str) -> str:
    """``--gemv-ab``: ``off`` (the tiling rule alone), a tiling table file, or one tiling
    (``parse_gemv_config`` text) for every packed shape."""
    from lodestar.kernels.gemv_tiling import parse_gemv_config
    if text != "off" and not Path(text).is_file():
        try:
            parse_gemv_config(text)
        except ValueError:
            raise ValueError(f"--gemv-ab {text!r}: give off, a tiling table file, or one tiling "
                             f"block_n,tile_groups,split_k,num_warps[,prefetch,unroll,words,maxnreg]") from None
    return text


def gemv_policy(base: KernelPolicy, tilings: str) -> KernelPolicy:
    """``base`` with the matrix-vector tilings of ``gemv_tilings`` text."""
    if tilings == "off" or Path(tilings).is_file():
        return dataclasses.replace(base, gemv_table=tilings, gemv="")
    return dataclasses.replace(base, gemv=tilings)


def parse_sides(text: str) -> list[dict[str, str]]:
    """``--ab``: ``A|B|...``, each side a space-separated list of NAME=value (one side without
    ``|``; an empty text is one side that changes nothing)."""
    sides = []
    for side in text.split("|"):
        items = {}
        for item in side.split():
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise ValueError(f"--ab item {item!r}: give NAME=value")
            if name in RETIRED:
                raise ValueError(f"--ab: {name} is no longer read; write {RETIRED[name]}")
            items[name] = value
        sides.append(items)
    for side in sides:
        side_setting(side, sides, {})       # bad values fail here, before any model is built
    return sides


def side_setting(side: dict[str, str], sides: list[dict[str, str]],
                 environ) -> tuple[KernelPolicy, dict[str, str]]:
    """(kernel policy, other environment variables) of one ``--ab`` side. A NAME is a policy
    switch (``policy.SWITCHES``: ``LODESTAR_PDL=0``), a tool-only policy field
    (``POLICY_FIELDS``: ``gemv=8,32,1,1,0,0,1``, ``dense_gemv=0``, ``prefill_attention=sdpa``) or
    any other environment variable (set while the side's engine is built and run). A switch
    that some side names and this one does not takes its default, not ``environ``'s; the
    other switches come from ``environ``."""
    switches = {s.env for s in SWITCHES}
    named = {k for s in sides for k in s}
    env = {k: v for k, v in environ.items() if k not in named}
    env.update({k: v for k, v in side.items() if k in switches})
    policy = KernelPolicy.from_env(env)
    fields: dict[str, object] = {}
    for name in POLICY_FIELDS:
        if name not in side:
            continue
        value = side[name]
        if name == "dense_gemv":
            if value not in ("0", "1"):
                raise ValueError(f"--ab dense_gemv={value!r}; use 0 or 1")
            fields[name] = value == "1"
        else:
            if name == "gemv" and value:
                from lodestar.kernels.gemv_tiling import parse_gemv_config
                parse_gemv_config(value)
            fields[name] = value
    other = {k: v for k, v in side.items() if k not in switches and k not in POLICY_FIELDS}
    return dataclasses.replace(policy, **fields), other


def first_divergence(tokens_a: list[int], logprobs_a: list, tokens_b: list[int], logprobs_b: list) -> dict:
    """Where greedy sequence b leaves sequence a (same prompt): the first differing step
    (None: none), the logit margin there (top-1 minus top-2 logprob) on each side, and the
    largest difference of the chosen tokens' logprobs before it."""
    step = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None)
    upto = len(tokens_a) if step is None else step
    out = {"step": step, "max_abs_dlogprob_before": round(max(
        (abs(logprobs_a[i][0] - logprobs_b[i][0]) for i in range(upto)), default=0.0), 6)}
    if step is not None:
        for key, lp in (("margin_a", logprobs_a), ("margin_b", logprobs_b)):
            top = lp[step][1]
            out[key] = round(top[0][1] - top[1][1], 6) if top and len(top) > 1 else None
    return out


def stage_fuse(r: Results, opts: argparse.Namespace) -> None:
    """Decode fusions off (``--fuse-off``, default 0: none; a comma list keeps just those) vs on
    (``--fuse-on``, default ``default``: the shipped set), one engine each: identical greedy
    tokens and log-probabilities, and decode tok/s. ``--fuse-cells``: geometry/type cells."""
    from lodestar.engine.sampling import SamplingParams
    policies = {"0": env_policy(LODESTAR_FUSE=opts.fuse_off), "1": env_policy(LODESTAR_FUSE=opts.fuse_on)}
    for geometry, qtype in opts.fuse_cells:
        def cell(geometry=geometry, qtype=qtype):
            res = {}
            for fuse, policy in policies.items():
                engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, kv_tokens=4096, policy=policy)
                with using(policy):
                    ps = prompts(3, 40, engine.loaded.config.vocab_size)
                    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
                    comp = engine.generate(ps, sp)
                    timed_generate(engine, [ps[0]], 16)
                    one = [timed_generate(engine, [ps[0]], 128)["decode_tok_s"] for _ in range(RUNS)]
                res[fuse] = {"tokens": [c.token_ids for c in comp],
                             "logprobs": [[lp[0] for lp in c.logprobs] for c in comp],
                             "decode_tok_s": stat(one)}
                del engine, comp
                release()
            off, on = res["0"], res["1"]
            return {"off_means": opts.fuse_off, "on_means": opts.fuse_on, "same_tokens": off["tokens"] == on["tokens"],
                    "same_logprobs": off["logprobs"] == on["logprobs"],
                    "decode_tok_s_off": off["decode_tok_s"], "decode_tok_s_on": on["decode_tok_s"],
                    "on_over_off": round(on["decode_tok_s"]["median"] / off["decode_tok_s"]["median"], 3)}
        r.cell(f"{geometry}-{qtype}", cell, 30)


def stage_gemvform(r: Results, opts: argparse.Namespace) -> None:
    """8B Q4_0 / Q4_K decode with the matrix-vector tilings in force (the shipped table) vs
    those ``--gemv-ab`` names (default ``off``: the tiling rule alone), one engine each:
    decode tok/s (roofline fraction) and whether the greedy tokens agree."""
    from lodestar.engine.sampling import SamplingParams
    bw = bandwidth_from(r)
    other = opts.gemv_ab
    policies = {"shipped": env_policy(), other: gemv_policy(env_policy(), other)}
    for qtype in ("Q4_0", "Q4_K"):
        def cell(qtype=qtype):
            res = {}
            for name, policy in policies.items():
                engine, _, _ = synthetic_engine("llama-3.1-8b", qtype, max_len=1024, kv_tokens=4096, policy=policy)
                with using(policy):
                    ps = prompts(2, 40, engine.loaded.config.vocab_size)
                    toks = [c.token_ids for c in engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=32,
                                                                                     ignore_eos=True))]
                    res[name] = {"tokens": toks, **decode_cell(engine, read_bytes_per_token(engine.loaded.model), bw)}
                del engine
                release()
            a, b = res["shipped"], res[other]
            return {"tilings": other, "same_tokens": a.pop("tokens") == b.pop("tokens"), "shipped": a, other: b,
                    "ratio": round(b["decode_tok_s"]["median"] / a["decode_tok_s"]["median"], 3)}
        r.cell(f"llama-3.1-8b-{qtype}", cell, 40)


def stage_ab(r: Results, opts: argparse.Namespace) -> None:
    """Two or more settings (``--ab``, ``parse_sides``; default: programmatic dependent launch
    off | on; one side is measured alone), one engine each, runs interleaved: decode tok/s of
    one stream (prompt 128, 256 new) and whether greedy tokens agree. ``--ab-cells``:
    geometry/type cells. Greedy tokens are compared with side 0's, side by side
    (``same_tokens_as_side_0``; where they differ, ``first_divergence`` gives the step and
    the logit margins there)."""
    from lodestar.engine.sampling import SamplingParams
    bw = bandwidth_from(r)
    sides = opts.ab
    settings = [side_setting(side, sides, os.environ) for side in sides]
    env_names = {k for _, other in settings for k in other}

    def setenv(other: dict[str, str]) -> None:
        for k in env_names:
            os.environ.pop(k, None)
        os.environ.update(other)

    for geometry, qtype in opts.ab_cells:
        def cell(geometry=geometry, qtype=qtype):
            engines, toks, lps, runs = [], [], [], [[] for _ in sides]
            for policy, other in settings:
                setenv(other)
                engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, kv_tokens=4096, policy=policy)
                with using(policy):
                    ps = prompts(2, 40, engine.loaded.config.vocab_size)
                    comp = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                              logprobs=2))
                    toks.append([c.token_ids for c in comp])
                    lps.append([c.logprobs for c in comp])
                    timed_generate(engine, prompts(1, 128, engine.loaded.config.vocab_size), 16)
                engines.append(engine)
            p = prompts(1, 128, engines[0].loaded.config.vocab_size)
            for _ in range(RUNS):
                for i, ((policy, other), engine) in enumerate(zip(settings, engines)):
                    setenv(other)
                    with using(policy):
                        runs[i].append(timed_generate(engine, p, 256)["decode_tok_s"])
            setenv({})
            read = read_bytes_per_token(engines[0].loaded.model)
            stored = file_weight_bytes(engines[0].loaded)
            out = {"sides": [" ".join(f"{k}={v}" for k, v in s.items()) for s in sides],
                   "same_tokens": all(t == toks[0] for t in toks),
                   "same_tokens_as_side_0": [t == toks[0] for t in toks],
                   "divergence_from_side_0": [[first_divergence(toks[0][j], lps[0][j], toks[i][j], lps[i][j])
                                               for j in range(len(toks[0]))] for i in range(len(sides))]}
            for i in range(len(sides)):
                out[f"side_{i}"] = {"decode_tok_s": stat(runs[i])}
                if bw:
                    out[f"side_{i}"]["fraction_of_weight_roofline"] = round(statistics.median(runs[i]) * read / bw, 3)
                    out[f"side_{i}"]["fraction_of_file_roofline"] = round(statistics.median(runs[i]) * stored / bw, 3)
            if len(sides) > 1:      # one side: that setting measured alone
                out["ratio_1_over_0"] = round(statistics.median(runs[1]) / statistics.median(runs[0]), 3)
            del engines
            release()
            return out
        r.cell(f"{geometry}-{qtype}", cell, 40)


def stage_densegemv(r: Results, opts: argparse.Namespace) -> None:
    """Decode with bf16 weights, the layers' Triton matrix-vector kernel off vs on (policy
    ``dense_gemv``; off: cuBLAS), one engine each: decode tok/s, and whether greedy tokens
    agree (the two sum in different orders)."""
    from lodestar.engine.sampling import SamplingParams
    base = env_policy()
    for geometry in ("smollm2-135m", "llama-3.1-8b"):
        def cell(geometry=geometry):
            res = {}
            for flag in (False, True):
                policy = dataclasses.replace(base, dense_gemv=flag)
                engine, _, _ = synthetic_engine(geometry, "F16", max_len=1024, kv_tokens=4096, policy=policy)
                with using(policy):
                    ps = prompts(2, 40, engine.loaded.config.vocab_size)
                    comp = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                    timed_generate(engine, [ps[0]], 16)
                    runs = [timed_generate(engine, [ps[0]], 256)["decode_tok_s"] for _ in range(RUNS)]
                res[flag] = {"tokens": [c.token_ids for c in comp], "decode_tok_s": stat(runs)}
                del engine, comp
                release()
            cublas, triton = res[False], res[True]
            return {"same_tokens": cublas["tokens"] == triton["tokens"],
                    "decode_tok_s_cublas": cublas["decode_tok_s"], "decode_tok_s_triton": triton["decode_tok_s"],
                    "triton_over_cublas": round(triton["decode_tok_s"]["median"] / cublas["decode_tok_s"]["median"], 3)}
        r.cell(geometry, cell, 30)


def stage_overlap(r: Results, opts: argparse.Namespace) -> None:
    """Overlapped decode off vs on in one engine (runs interleaved): greedy tokens must be
    identical; decode tok/s of one stream and of 8."""
    from lodestar.engine.sampling import SamplingParams
    for geometry, qtype in (("smollm2-135m", "F16"), ("llama-3.1-8b", "F16"), ("llama-3.1-8b", "Q4_0")):
        def cell(geometry=geometry, qtype=qtype):
            engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, kv_tokens=8192)
            ps = prompts(8, 64, engine.loaded.config.vocab_size)
            sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            toks, runs = {}, {(o, b): [] for o in (False, True) for b in (1, 8)}
            for overlap in (False, True):
                engine.overlap = overlap
                toks[overlap] = [c.token_ids for c in engine.generate(ps[:3], sp)]
                timed_generate(engine, ps[:1], 16)
            for _ in range(RUNS):
                for overlap in (False, True):
                    engine.overlap = overlap
                    for b in (1, 8):
                        runs[(overlap, b)].append(timed_generate(engine, ps[:b], 128)["decode_tok_s"])
            engine.overlap = True
            out = {"same_tokens": toks[False] == toks[True]}
            for b in (1, 8):
                off, on = stat(runs[(False, b)]), stat(runs[(True, b)])
                out[f"batch_{b}"] = {"step_by_step_tok_s": off, "overlapped_tok_s": on,
                                     "overlapped_over_step_by_step": round(on["median"] / off["median"], 3)}
            del engine
            release()
            return out
        r.cell(f"{geometry}-{qtype}", cell, 40)


def stage_prefillgraph(r: Results, opts: argparse.Namespace) -> None:
    """Prefill of one prompt eagerly vs from a token-count bucket's CUDA graph
    (``EngineConfig.prefill_graphs``), one engine, runs interleaved: wall tok/s at 512 and
    4096 prompt tokens (8B F16, 8B Q4_0, SmolLM2 F16), and greedy tokens of 32 steps after
    the first, both ways."""
    from lodestar.engine.sampling import SamplingParams
    for geometry, qtype in (("llama-3.1-8b", "F16"), ("llama-3.1-8b", "Q4_0"), ("smollm2-135m", "F16")):
        def cell(geometry=geometry, qtype=qtype):
            engine, _, _ = synthetic_engine(geometry, qtype, max_len=8192, kv_tokens=16384)
            engine.runner.prefill_graphs = False
            vocab = engine.loaded.config.vocab_size
            out = {}
            for length in (512, 4096):
                p = prompts(1, length, vocab, seed=SEED + length)[0]
                runs = {False: [], True: []}
                toks = {}
                for on in (False, True):           # warm-up (and capture)
                    engine.runner.prefill_graphs = on
                    toks[on] = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=32,
                                                                   ignore_eos=True))[0].token_ids
                for _ in range(RUNS + 2):
                    for on in (False, True):
                        engine.runner.prefill_graphs = on
                        runs[on].append(length / timed_generate(engine, [p], 1)["ttft_s"])
                out[f"prefill_{length}"] = {"eager_tok_s": stat(runs[False], 1), "graph_tok_s": stat(runs[True], 1),
                                            "ratio": round(statistics.median(runs[True]) /
                                                           statistics.median(runs[False]), 3),
                                            "same_tokens_32": toks[False] == toks[True]}
            out["prefill_graph_replays"] = engine.runner.prefill_replays
            del engine
            release()
            return out
        r.cell(f"{geometry}-{qtype}", cell, 40)
