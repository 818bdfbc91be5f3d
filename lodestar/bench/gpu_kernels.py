"""Kernel-level GPU benchmark stages and profiles (``lodestar.bench.gpu``): matrix-vector kernel
speed and tilings, dense bf16 products, prefill attention alone, and where a decode or prefill
step's time goes (host gap, kernel chain, host profile)."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from lodestar.bench.gpu_cells import (SEED, Results, bandwidth_from, env_policy, prompts, release, stat,
                                      synthetic_engine, timed_generate)
from lodestar.kernels.policy import using

GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "head": (49152, 4096)}


def _time_gpu(fn, reps: int = 50) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls replayed from one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return statistics.median(replay_ms(g, 5)) / 1e3 / reps


def replay_ms(graph, n: int) -> list[float]:
    """Milliseconds of each of ``n`` replays of ``graph``, one at a time (CUDA events)."""
    times = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return times


# ------------------------------------------------------------------ matrix-vector kernels

def stage_gemv(r: Results, opts: argparse.Namespace) -> None:
    """Matrix-vector kernel speed on Llama-3.1-8B shapes: the tiling in force per type (M = 1,
    8, 32), then a sweep of tilings for Q4_0 / Q4_K at M = 1 (GB/s of weight bytes, fraction
    of copy bandwidth)."""
    from lodestar.formats.synthetic import random_weight
    from lodestar.kernels import triton_quant as tq
    from lodestar.kernels.gemv_tiling import T, GemvConfig, gemv_config, kquant_scales
    from lodestar.kernels.quant_layout import pack
    bw = bandwidth_from(r)
    dev = torch.device("cuda")
    weights = {}

    def weight(qtype, name):
        key = (qtype, name)
        if key not in weights:
            n, k = GEMV_SHAPES[name]
            gen = torch.Generator(device="cuda").manual_seed(SEED)
            weights[key] = pack(qtype, random_weight(qtype.name, n, k, gen, "cuda"), n, k,
                                kquant_scales(qtype, n, k, dev))
        return weights[key]

    def measure(qtype, name, m, cfg=None):
        pw = weight(qtype, name)
        x = torch.randn(m, pw.k, device="cuda", dtype=torch.bfloat16)
        t = _time_gpu(lambda: tq.quant_matmul(x, pw, config=cfg))
        out = {"us": round(t * 1e6, 2), "gb_per_s": round(pw.nbytes / t / 1e9, 1)}
        if bw:
            out["fraction_of_copy_bw"] = round(pw.nbytes / t / bw, 3)
        return out

    def defaults():
        res = {}
        for qtype in (T.Q4_0, T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_1, T.Q5_K):
            for name in GEMV_SHAPES:
                for m in (1, 8, 32):
                    res[f"{qtype.name}/{name}/m{m}"] = measure(qtype, name, m)
                    res[f"{qtype.name}/{name}/m{m}"]["config"] = dataclasses.asdict(
                        gemv_config(*GEMV_SHAPES[name], dev, qtype))
            weights.clear()
        return res

    r.cell("defaults", defaults, 30)
    for qtype in (T.Q4_0, T.Q4_K):
        def sweep(qtype=qtype):
            res, best = {}, {}
            for name in ("qkv", "o", "gate_up", "down"):
                for bn in (8, 16, 32):
                    for tg in (8, 16, 32):
                        for split in (1, 2, 4, 8):
                            for warps in ((4, 8) if tg == 32 else (4,)):
                                if r.left() < 20:
                                    return {"partial": True, "results": res, "best": best}
                                cfg = GemvConfig(bn, tg, split, warps)
                                key = f"{name}/{bn},{tg},{split},{warps}"
                                try:
                                    res[key] = measure(qtype, name, 1, cfg)
                                except Exception as e:   # e.g. out of registers
                                    res[key] = {"error": f"{type(e).__name__}: {e}"[:200]}
                                    continue
                                if name not in best or res[key]["us"] < best[name]["us"]:
                                    best[name] = {"config": [bn, tg, split, warps], **res[key]}
            weights.clear()
            return {"results": res, "best": best}
        r.cell(f"sweep_{qtype.name}", sweep, 30)


def stage_dense(r: Results, opts: argparse.Namespace) -> None:
    """Dense bf16 matrix-vector product at M = 1: cuBLAS (F.linear) against the Triton kernel
    of ``kernels.triton_dense`` over a small tiling sweep."""
    import torch.nn.functional as F

    from lodestar.kernels import triton_dense as td
    bw = bandwidth_from(r)
    shapes = {"8b/qkv": (6144, 4096), "8b/o": (4096, 4096), "8b/gate_up": (28672, 4096), "8b/down": (4096, 14336),
              "smollm2/qkv": (960, 576), "smollm2/gate_up": (3072, 576), "smollm2/down": (576, 1536)}
    for name, (n, k) in shapes.items():
        def cell(n=n, k=k):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            nbytes = w.numel() * 2
            t = _time_gpu(lambda: F.linear(x, w))
            out = {"cublas_us": round(t * 1e6, 2), "cublas_gb_per_s": round(nbytes / t / 1e9, 1)}
            best = None
            ref = F.linear(x.float(), w.float())
            for bn in (4, 8, 16):
                for bk in (256, 512):
                    for split in (1, 4):
                        if r.left() < 15:
                            out["partial"] = True
                            break
                        cfg = td.DenseGemvConfig(bn, bk, split, 4)
                        try:
                            err = (td.dense_gemv(x, w, torch.float32, cfg) - ref).abs().max().item()
                            tt = _time_gpu(lambda: td.dense_gemv(x, w, config=cfg))
                        except Exception as e:
                            out[f"{bn},{bk},{split}"] = f"{type(e).__name__}: {e}"[:160]
                            continue
                        out[f"{bn},{bk},{split}"] = round(tt * 1e6, 2)
                        if best is None or tt < best[1]:
                            best = ((bn, bk, split), tt, err)
            if best:
                out.update(best_config=best[0], best_us=round(best[1] * 1e6, 2),
                           best_gb_per_s=round(nbytes / best[1] / 1e9, 1), best_max_abs_err=best[2],
                           triton_over_cublas_time=round(best[1] / t, 3))
            if bw:
                out["cublas_fraction_of_copy_bw"] = round(nbytes / t / bw, 3)
            return out
        r.cell(name, cell, 15)


# ----------------------------------------------------------------------- prefill attention

PREFILL_ATTN_CASES = {  # name -> (context lengths, new tokens): 8B geometry, bf16
    "fresh_512": ([512], [512]),
    "fresh_4096": ([4096], [4096]),
    "prefix_3584+512": ([4096], [512]),
    "prefix_7680+512": ([8192], [512]),
    "prefix_15872+512": ([16384], [512]),
    "prefix_32256+512": ([32768], [512]),
    "batch_32x128": ([128] * 32, [128] * 32),
    "varlen_8": ([300, 1500, 128, 900, 2048, 77, 640, 1024], [300, 200, 128, 1, 512, 77, 64, 256]),
}


def prefill_attn_cases(text: str) -> tuple[str, ...]:
    """``--prefill-attn-cases``: space-separated names of ``PREFILL_ATTN_CASES`` (empty: all)."""
    names = tuple(text.split())
    unknown = [n for n in names if n not in PREFILL_ATTN_CASES]
    if unknown:
        raise ValueError(f"--prefill-attn-cases: unknown {', '.join(unknown)}; known: {', '.join(PREFILL_ATTN_CASES)}")
    return names


def stage_prefillattn(r: Results, opts: argparse.Namespace) -> None:
    """Prefill attention alone, Llama-3.1-8B geometry (32 query heads, 8 kv heads, head dim
    128, bf16, scattered 16-token blocks): the paged varlen kernel (``paged_prefill``)
    against the SDPA forms (policy ``prefill_attention="sdpa"``: one fresh sequence, torch's
    causal flash kernel; otherwise keys gathered per sequence, padded, masked), ms per call
    (CUDA events, 20 calls after 3), and the largest difference between their outputs; then
    an 8B F16 engine's time to the first token of 32 prompts of 128 tokens, both ways.
    ``--prefill-attn-cases``: only those cases, and no engine."""
    from lodestar.kernels import triton_attention as ta
    from lodestar.layers.attention import AttentionBatch, GpuAttentionMeta
    Hq, Hk, D, bs = 32, 8, 128, 16
    scale = D ** -0.5
    base = env_policy()
    modes = {mode: dataclasses.replace(base, prefill_attention=mode) for mode in ("sdpa", "paged")}

    def timed(fn) -> dict:
        for _ in range(3):
            fn()
        ms = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        return stat(ms, 4)

    only = opts.prefill_attn_cases
    for name, (lens, qlens) in PREFILL_ATTN_CASES.items():
        if only and name not in only:
            continue

        def cell(lens=lens, qlens=qlens):
            g = torch.Generator().manual_seed(SEED)
            need = [-(-n // bs) for n in lens]
            blocks = sum(need) + 1
            perm = torch.randperm(blocks, generator=g).tolist()
            tables, at = [], 0
            for n in need:
                tables.append(perm[at:at + n])
                at += n
            kc = (torch.randn(blocks * bs, Hk, D, generator=g) * 0.5).to(torch.bfloat16).cuda()
            vc = torch.randn(blocks * bs, Hk, D, generator=g).to(torch.bfloat16).cuda()
            q = torch.randn(sum(qlens), Hq, D, generator=g).to(torch.bfloat16).cuda()
            batch = AttentionBatch.build(tables, lens, qlens, bs)
            batch.gpu = GpuAttentionMeta(batch.slot_mapping.cuda(), batch.block_tables.to(torch.int32).cuda(),
                                         batch.seq_lens.to(torch.int32).cuda(), ta.num_partitions(max(lens)), 1)
            with using(modes["sdpa"]):
                sdpa = timed(lambda: ta.prefill_attention(q, kc, vc, batch, scale))
                want = ta.prefill_attention(q, kc, vc, batch, scale).float()
            g_ = batch.gpu

            def kernel():
                return ta.paged_prefill(q, kc, vc, g_.block_tables, g_.seq_lens, batch.query_start_loc,
                                        batch.query_lens_list, bs, scale, cache=batch._cache)
            paged = timed(kernel)
            diff = float((kernel().float() - want).abs().max())
            return {"new_tokens": sum(qlens), "context_tokens": sum(lens), "sdpa_ms": sdpa, "paged_kernel_ms": paged,
                    "sdpa_over_paged": round(sdpa["median"] / paged["median"], 3), "max_abs_diff": round(diff, 5)}
        r.cell(f"prefill_attention/{name}", cell, 20)
    if only:
        return
    state = {}
    state["engine"], _, _ = synthetic_engine("llama-3.1-8b", "F16", max_len=4096, policy=base)
    batch32 = prompts(32, 128, state["engine"].loaded.config.vocab_size, seed=SEED + 32)
    for mode in ("sdpa", "paged"):
        def ttft(mode=mode):
            with using(modes[mode]):
                timed_generate(state["engine"], batch32, 1)
                runs = [timed_generate(state["engine"], batch32, 1)["ttft_s"] * 1e3 for _ in range(5)]
            return {"prompts": 32, "prompt_tokens": 128, "ttft_ms": stat(runs, 2),
                    "prefill_tok_s": round(32 * 128 / (statistics.median(runs) / 1e3), 1)}
        r.cell(f"llama-3.1-8b-F16/ttft_32x128/{mode}", ttft, 40)
    state.clear()
    release()


# ------------------------------------------------------------------ where the time goes

def stage_profile(r: Results, opts: argparse.Namespace) -> None:
    """Where a decode step's time goes: wall time per engine step vs the GPU time of the
    graph replay (host gap), and per-kernel CUDA time of eager steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from lodestar.engine.sampling import SamplingParams
    for geometry, qtype in (("smollm2-135m", "F16"), ("llama-3.1-8b", "F16"), ("llama-3.1-8b", "Q4_K"),
                            ("llama-3.1-8b", "Q4_0")):
        def cell(geometry=geometry, qtype=qtype):
            engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, max_seqs=1, kv_tokens=1024)
            runner = engine.runner
            vocab = engine.loaded.config.vocab_size
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            rid = engine.add_request(prompts(1, 128, vocab)[0], params)
            for _ in range(20):                      # prefill, then decode: graph for batch 1 captured
                engine.step()
            torch.cuda.synchronize()
            steps = 100
            walls = {}
            for overlap in (False, True):      # step by step, then overlapped (the default)
                engine.overlap = overlap
                engine.step()
                engine.step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                torch.cuda.synchronize()
                walls[overlap] = (time.perf_counter() - t0) / steps
            wall = walls[True]
            g = runner.graphs[1].graph
            # GPU time of the graph replay inside the engine's steps (vs back to back below)
            inner, replay = [], g.replay

            def timed_replay():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                replay()
                b.record()
                inner.append((a, b))
            g.replay = timed_replay
            for _ in range(30):
                engine.step()
            torch.cuda.synchronize()
            g.replay = replay
            in_engine = statistics.median(a.elapsed_time(b) for a, b in inner) / 1e3 if inner else None
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(steps):
                g.replay()
            e.record()
            e.synchronize()
            gpu = s.elapsed_time(e) / 1e3 / steps
            # eager steps under the profiler: kernel names and times
            runner.cuda_graphs = False
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
            n_prof = 10
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(n_prof):
                    engine.step()
                torch.cuda.synchronize()
            runner.cuda_graphs = True
            kernels = {}
            for ev in prof.key_averages():
                dev_t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
                if dev_t and ev.key and not ev.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
                    kernels[ev.key[:90]] = (dev_t / n_prof, ev.count // n_prof)
            top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
            total_kernel_us = sum(v[0] for v in kernels.values())
            engine.abort(rid)
            out = {"wall_ms_per_step": round(wall * 1e3, 3),
                   "wall_ms_per_step_step_by_step": round(walls[False] * 1e3, 3),
                   "graph_replay_gpu_ms": round(gpu * 1e3, 3),
                   "in_engine_replay_gpu_ms": round(in_engine * 1e3, 3) if in_engine else None,
                   "host_gap_ms": round((wall - gpu) * 1e3, 3), "decode_tok_s_wall": round(1 / wall, 1),
                   "eager_kernel_ms_per_step": round(total_kernel_us / 1e3, 3),
                   "eager_kernels_per_step": sum(v[1] for v in kernels.values()),
                   "top_kernels_us_per_step": {k: {"us": round(v[0], 1), "calls": v[1]} for k, v in top}}
            del engine, runner
            release()
            return out
        r.cell(f"{geometry}-{qtype}", cell, 25)


PLACES_AFTER_LAYERS = 2     # calls of a per-layer kernel after the last layer (the head)


def chain_trace(events: list[tuple], replays: int, layers: int = 0) -> dict:
    """Where a replayed decode step's time goes, from the device kernels of ``replays`` graph
    replays as (key, start ns, end ns[, stream]) in launch order: each kernel's *advance* is
    how far it moved the end of the chain (its end minus the latest end before it, at least
    0; with dependent launch a kernel starts before the one ahead of it ends, so durations
    overlap and do not add up, advances do: their sum per step is the step's span from the
    first kernel's end). Kernels on another stream than the step's first kernel (the side
    prefetch) run beside the chain: they are counted, with their durations, but move
    nothing (``side_stream``). Per key: calls and advance per step, mean duration (start to
    end, which includes the time a dependently launched kernel's blocks sat waiting) and
    mean advance per call; sorted by advance per step. With ``layers``, a key called ``m *
    layers + r`` times a step (m >= 2, r <= ``PLACES_AFTER_LAYERS``) is told apart by its
    place in the layer: ``key #i`` is its i-th call of each layer (a layer's q|k|v, o, gate|up
    and down projections share one kernel), ``key #+`` the r calls after the last layer. A
    key called more often than that (layers of different forms: a Q4_K_M file's q|k|v is
    two kernels in half its layers) is left whole."""
    events = [(e[0], e[1], e[2], e[3] if len(e) > 3 else None) for e in events]
    per_key: dict[str, list] = {}
    spans = []
    # replays are apart by the host's synchronize and launch: cut at the replays - 1 widest gaps
    gaps, end = [], None
    for i, (_, start, stop, _) in enumerate(events):
        if end is not None:
            gaps.append((start - end, i))
        end = stop if end is None else max(end, stop)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:max(0, replays - 1)])
    bounds = [0, *cuts, len(events)]
    steps = [events[a:b] for a, b in zip(bounds, bounds[1:])]
    for step in steps:
        if layers:
            count: dict[str, int] = {}
            for key, *_ in step:
                count[key] = count.get(key, 0) + 1
            seen: dict[str, int] = {}
            labelled = []
            for key, start, end, stream in step:
                i, m = seen.get(key, 0), count[key] // layers
                seen[key] = i + 1
                if m >= 2 and count[key] - m * layers <= PLACES_AFTER_LAYERS:
                    key = f"{key} #{i % m}" if i < m * layers else f"{key} #+"
                labelled.append((key, start, end, stream))
            step = labelled
        main = step[0][3] if step else None
        last_end = None
        for key, start, end, stream in step:
            rec = per_key.setdefault(key, [0, 0, 0, False])
            rec[0] += 1
            rec[2] += end - start
            if stream != main:
                rec[3] = True
                continue
            rec[1] += 0 if last_end is None else max(0, end - last_end)
            last_end = end if last_end is None else max(last_end, end)
        if step:
            spans.append((last_end - step[0][1]) / 1e3)
    rows = {}
    for k, v in per_key.items():
        rows[k] = {"calls_per_step": v[0] / replays, "advance_us_per_step": round(v[1] / 1e3 / replays, 1),
                   "advance_us_per_call": round(v[1] / 1e3 / v[0], 2),
                   "duration_us_per_call": round(v[2] / 1e3 / v[0], 2)}
        if v[3]:
            rows[k]["side_stream"] = True
    rows = dict(sorted(rows.items(), key=lambda kv: -kv[1]["advance_us_per_step"]))
    return {"kernels_per_step": [len(st) for st in steps], "traced_span_us": stat(spans) if spans else None, "kernels": rows}


def stream_rates(kernels: dict, layer_bytes: list[int], head_bytes: int) -> None:
    """Add ``stream_tb_s`` (weight bytes / advance per call) to ``chain_trace``'s rows of the
    matrix-vector kernels: ``#i`` is a layer's i-th projection (``layer_bytes[i]``), ``#+``
    the head."""
    for key, row in kernels.items():
        if "gemv" not in key or row["advance_us_per_call"] <= 0:
            continue
        slot = key.rsplit(" #", 1)[-1] if " #" in key else None
        nbytes = head_bytes if slot == "+" else layer_bytes[int(slot)] if slot and slot.isdigit() \
            and int(slot) < len(layer_bytes) else None
        if nbytes:
            row["stream_tb_s"] = round(nbytes / (row["advance_us_per_call"] * 1e-6) / 1e12, 2)


def _projection_bytes(model) -> tuple[list[int], int] | None:
    """Weight bytes of the first block's q|k|v, o, gate|up and down, and of the head (a
    Llama-form model), in the order a decode step runs them; None for another form."""
    try:
        blk = model.layers[0]
        mods = (blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down)
        size = lambda m: sum(x.nbytes for x in m) if isinstance(m, (list, torch.nn.ModuleList)) else m.nbytes  # noqa: E731
        return [size(m) for m in mods], size(model.head)
    except (AttributeError, IndexError, TypeError):
        return None


def _kernel_key(ev) -> str:
    """A device kernel's name, shortened (``void f<...>(args)`` -> ``f<...>``)."""
    import re
    return re.sub(r"^void |\(.*$", "", ev.name())[:60]


def stage_chain(r: Results, opts: argparse.Namespace) -> None:
    """The decode step's kernel chain as the GPU runs it: graph replays of one stream
    (prompt 128) under torch.profiler (CUPTI records each kernel of a replayed graph),
    summarised by ``chain_trace``; with the untraced replay time of the same graph, to show
    how much tracing perturbs it. ``--chain-cells``: geometry/type cells."""
    from torch.profiler import ProfilerActivity, profile

    from lodestar.engine.sampling import SamplingParams
    for geometry, qtype in opts.chain_cells:
        def cell(geometry=geometry, qtype=qtype):
            engine, _, _ = synthetic_engine(geometry, qtype, max_len=1024, max_seqs=1, kv_tokens=1024)
            runner = engine.runner
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            rid = engine.add_request(prompts(1, 128, engine.loaded.config.vocab_size)[0], params)
            for _ in range(40):                      # prefill, then decode: graph for batch 1 captured
                engine.step()
            torch.cuda.synchronize()
            g = runner.graphs[1].graph
            layers = engine.loaded.config.n_layers
            untraced = [ms * 1e3 for ms in replay_ms(g, 30)]
            replays = 10
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    g.replay()
                    torch.cuda.synchronize()
            evs = [ev for ev in prof.profiler.kineto_results.events()
                   if ev.device_type() == torch.autograd.DeviceType.CUDA
                   and not ev.name().startswith(("Memcpy", "Memset")) and ev.duration_ns() > 0]
            evs.sort(key=lambda ev: ev.start_ns())
            events = [(_kernel_key(ev), ev.start_ns(), ev.end_ns(), ev.device_resource_id()) for ev in evs]
            sizes = _projection_bytes(engine.loaded.model)
            engine.abort(rid)
            del engine, runner, g
            release()
            out = chain_trace(events, replays, layers)
            if sizes:
                stream_rates(out["kernels"], *sizes)
            out["untraced_replay_us"] = stat(untraced)
            out["traced_kernels"] = len(events)
            return out
        r.cell(f"{geometry}-{qtype}", cell, 40)


def stage_hostprof(r: Results, opts: argparse.Namespace) -> None:
    """Where the host's time goes in one 8B F16 prefill step of 512 tokens and in one eager
    decode step (no CUDA graph): cProfile's top functions by own time and by cumulative
    time, with the step's wall time and the GPU's kernel time for comparison."""
    import cProfile
    import io
    import pstats

    from lodestar.engine.sampling import SamplingParams
    state = {}
    state["engine"], _, _ = synthetic_engine("llama-3.1-8b", "F16", max_len=2048, kv_tokens=4096)
    vocab = state["engine"].loaded.config.vocab_size

    def profiled(fn) -> dict:
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        out = {"host_ms": round(host * 1e3, 3), "wall_ms": round(wall * 1e3, 3)}
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(35)
            out[f"top_by_{key}"] = buf.getvalue().splitlines()[-45:]
        return out

    def prefill():
        engine = state["engine"]
        p = prompts(1, 512, vocab, seed=SEED + 512)[0]
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for _ in range(3):
            engine.add_request(p, sp)
            while engine.has_unfinished():
                engine.step()

        def one():
            engine.add_request(p, sp)
            while engine.has_unfinished():
                engine.step()
        return profiled(one)

    def eager_decode():
        engine = state["engine"]
        runner = engine.runner
        runner.cuda_graphs = False
        engine.overlap = False
        rid = engine.add_request(prompts(1, 64, vocab)[0], SamplingParams(temperature=0.0, max_tokens=64,
                                                                        ignore_eos=True))
        for _ in range(5):
            engine.step()
        out = profiled(lambda: [engine.step() for _ in range(5)])
        engine.abort(rid)
        runner.cuda_graphs = True
        return out

    r.cell("llama-3.1-8b-F16/prefill_512", prefill, 10)
    r.cell("llama-3.1-8b-F16/eager_decode_x5", eager_decode, 10)
    state.clear()
    release()


def stage_prefill(r: Results, opts: argparse.Namespace) -> None:
    """8B F16 prefill of 512 and 4096 tokens: wall time to the first token vs the time
    between CUDA events recorded around the engine's steps (which also counts GPU idle
    while the host works), 8 runs each, decode fusions off and on (one engine, runs under
    the policy of each); then ``prefill_profile`` of each length."""
    from lodestar.engine.sampling import SamplingParams
    state = {}
    state["engine"], _, _ = synthetic_engine("llama-3.1-8b", "F16", max_len=8192)
    vocab = state["engine"].loaded.config.vocab_size
    for fuse in ("0", "1"):
        for length in (512, 4096):
            def cell(fuse=fuse, length=length):
                engine = state["engine"]
                p = prompts(1, length, vocab, seed=SEED + length)[0]
                walls, gpus = [], []
                with using(env_policy(LODESTAR_FUSE=fuse)):
                    for i in range(9):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                        a.record()
                        while engine.has_unfinished():
                            engine.step()
                        b.record()
                        b.synchronize()
                        if i:
                            walls.append(length / (time.perf_counter() - t0))
                            gpus.append(length / (a.elapsed_time(b) / 1e3))
                return {"wall_tok_s": stat(walls, 1), "gpu_tok_s": stat(gpus, 1)}
            r.cell(f"llama-3.1-8b-F16/prefill_{length}/fuse_{fuse}", cell, 8)
    for length in (512, 4096):
        r.cell(f"llama-3.1-8b-F16/prefill_{length}/profile",
               lambda length=length: prefill_profile(state["engine"], length), 10)
    state.clear()
    release()


def prefill_profile(engine, length: int) -> dict:
    """One prompt's prefill, three ways: wall time; host time until ``step`` returns (the GPU
    may still be working); and under torch.profiler, the sum of kernel times (GPU busy) and
    the top kernels. Kernel sum well below wall time means the GPU waits for the host."""
    from torch.profiler import ProfilerActivity, profile

    from lodestar.engine.sampling import SamplingParams
    vocab = engine.loaded.config.vocab_size
    p = prompts(1, length, vocab, seed=SEED + length)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    walls, hosts = [], []
    for i in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add_request(p, sp)
        host = 0.0
        while engine.has_unfinished():
            h0 = time.perf_counter()
            engine.step()
            host += time.perf_counter() - h0
        torch.cuda.synchronize()
        if i:
            walls.append((time.perf_counter() - t0) * 1e3)
            hosts.append(host * 1e3)
    mem0 = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.add_request(p, sp)
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
    mem1 = torch.cuda.memory_stats()
    kernels = {}
    for ev in prof.key_averages():
        dev_t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if dev_t and ev.key and not ev.key.startswith(("aten::", "cuda")):
            kernels[ev.key[:90]] = (dev_t, ev.count)
    busy = sum(v[0] for v in kernels.values()) / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    return {"wall_ms": stat(walls, 3), "host_ms_in_step_calls": stat(hosts, 3),
            "profiled_kernel_ms": round(busy, 3), "kernel_launches": sum(v[1] for v in kernels.values()),
            "allocator": {k: mem1.get(k, 0) - mem0.get(k, 0) for k in
                          ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")},
            "top_kernels_ms": {k: {"ms": round(v[0] / 1e3, 3), "calls": v[1]} for k, v in top}}
