"""Tensor parallelism on the CPU: 2 processes over gloo against the single-process engine.

Contract (ARCHITECTURE.md section 4): on the exact fp32 path, greedy tokens with
--tensor-parallel 2 are identical to --tensor-parallel 1 and to the oracle's goldens,
with the oracle's top log-probabilities within 1e-3. Measured: TP=2 log-probabilities
differ from TP=1 by at most 1e-5 (SmolLM2-135M, 32 tokens) and 7e-6 (Gemma-3-270M,
16 tokens): only the order of the row-parallel sums changes.

Packed mode is not bit-exact under the split, and why: the packed kernel adds a row's
block products into one fp32 sum in order; at TP=2 each rank sums its half of the blocks
of the attention output and MLP down projections and the all-reduce adds the halves (shown
layer by layer in test_sharding.py): the same terms in another rounding order, as on the
fp32 path. Where TP=1's top two tokens lie in a near tie, that can still swap them, so the
packed test asserts what the numerics promise: identical greedy tokens up to the first
difference, if any, with every chosen log-probability until then within ``PACKED_DRIFT``
of TP=1's; at the difference, a near tie: the two tokens are each other's runner-up and
their gaps add up to less than ``2 * PACKED_DRIFT`` (what two log-probabilities that each
move by less than ``PACKED_DRIFT`` can cross).

Timing never matters: every exchange between the ranks (the step message on the pipe,
each all-reduce, the logits gather) blocks and is matched in order, so a starved worker
or a late rank 0 gives bit-identical results (``test_results_do_not_depend_on_timing``).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from lodestar.distributed import WorkerDiedError, layers
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.loader import load_model
from lodestar.engine.sampling import SamplingParams
from lodestar.formats.catalog import file_sha256

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
LOGPROB_TOL = 1e-3
PACKED_DRIFT = 0.25     # nats a packed TP=2 log-probability may move (module docstring)


@pytest.fixture
def one_thread():
    """One thread per rank: two ranks share the CI machine's two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cases(name: str, path: Path) -> list[dict]:
    doc = json.loads((GOLDENS / f"generate_{name}.json").read_text())
    if file_sha256(path) != doc["model_sha256"]:
        pytest.skip(f"installed {name} differs from the goldens' file; run scripts/make_goldens.py")
    return [c for c in doc["cases"] if len(c["prompt_ids"]) < 100]


def _generate(path: Path, mode: str, tp: int, cases: list[dict], steps: int, **kw) -> list:
    loaded = load_model(str(path), mode=mode, progress=False, tensor_parallel=tp, **kw)
    try:
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=16, max_num_batched_tokens=1024, tensor_parallel=tp))
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=20)
        return engine.generate([c["prompt_ids"] for c in cases], params)
    finally:
        loaded.close()


def _check_fp32(name: str, path: Path, steps: int) -> None:
    cases = _cases(name, path)
    single = _generate(path, "fp32", 1, cases, steps)
    split = _generate(path, "fp32", 2, cases, steps)
    worst = 0.0
    for case, one, two in zip(cases, single, split):
        assert two.token_ids == one.token_ids, f"{case['name']}: TP=2 {two.token_ids} vs TP=1 {one.token_ids}"
        assert two.token_ids == case["tokens"][:steps], f"{case['name']}: TP=2 differs from the oracle"
        for step, gold in enumerate(case["top_logprobs"][:steps]):
            ours = dict(two.logprobs[step][1])
            for tok, lp in gold:
                worst = max(worst, abs(ours[tok] - lp))
    assert worst < LOGPROB_TOL, f"max |logprob - oracle| = {worst:.2e}"


def test_fp32_greedy_matches_single_process_and_oracle(smollm_path, one_thread):
    _check_fp32("smollm2-135m", smollm_path, 32)


def test_fp32_gemma3_with_replicated_kv_head(gemma_path, one_thread):
    # 4 query heads, 1 KV head: each rank keeps a copy of the KV head and computes 2 query heads.
    _check_fp32("gemma3-270m", gemma_path, 16)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_packed_greedy_matches_single_process(smollm_path, one_thread):
    cases = _cases("smollm2-135m", smollm_path)
    assert len(cases) == 10
    single = _generate(smollm_path, "packed", 1, cases, 32)
    split = _generate(smollm_path, "packed", 2, cases, 32)
    for case, one, two in zip(cases, single, split):
        name, step = case["name"], _first_difference(one.token_ids, two.token_ids)
        for i in range(32 if step is None else step):
            drift = abs(two.logprobs[i][0] - one.logprobs[i][0])
            assert drift < PACKED_DRIFT, f"{name} step {i}: token {one.token_ids[i]}'s log-probability " \
                                         f"{one.logprobs[i][0]:.4f} at TP=1, {two.logprobs[i][0]:.4f} at TP=2"
        if step is None:
            continue
        a, b = one.token_ids[step], two.token_ids[step]
        top1, top2 = one.logprobs[step][1], two.logprobs[step][1]
        seen = f"{name}: TP=2 {two.token_ids} vs TP=1 {one.token_ids}, first difference at step {step}"
        assert top1[1][0] == b and top2[1][0] == a, f"{seen}, not a swap of the top two: TP=1 {top1[:3]}, " \
                                                    f"TP=2 {top2[:3]}"
        gap = (top1[0][1] - top1[1][1]) + (top2[0][1] - top2[1][1])
        assert gap < 2 * PACKED_DRIFT, f"{seen}, not a near tie: the gaps add up to {gap:.3f} nats"


def _disturb(worker: int, stop: threading.Event, stops: list, seed: int) -> None:
    """Stop ``worker`` for 0-20 ms at random moments (mid-collective, mid-read) until ``stop``."""
    rng = random.Random(seed)
    try:
        while not stop.wait(rng.uniform(0.0, 0.02)):
            os.kill(worker, signal.SIGSTOP)
            stops.append(rng.uniform(0.0, 0.02))
            time.sleep(stops[-1])
            os.kill(worker, signal.SIGCONT)
    except ProcessLookupError:      # the worker is gone: the test fails on its own
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)


def _late(fn, rng: random.Random, pauses: list):
    """``fn`` called after a random 0-3 ms pause one time in four."""
    def call(*args, **kwargs):
        if rng.random() < 0.25:
            pauses.append(rng.uniform(0.0, 0.003))
            time.sleep(pauses[-1])
        return fn(*args, **kwargs)
    return call


def test_results_do_not_depend_on_timing(smollm_path, one_thread, monkeypatch):
    # A busy machine, a worker stopped at random moments and a rank 0 late at random
    # collectives and step messages give bit-identical tokens and log-probabilities.
    # Chunked prefill and staggered lengths make steps of every shape: prefill chunks
    # that want no logits (no gather), mixed prefill and decode rows, shrinking batches.
    by_name = {c["name"]: c for c in _cases("smollm2-135m", smollm_path)}
    cases = [by_name[n] for n in ("chat_hello", "raw_code", "chat_system", "raw_count")]   # 36, 7, 31, 14 tokens
    prompts = [c["prompt_ids"] for c in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5) for n in (9, 12, 7, 5)]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, tensor_parallel=2)
    loaded = load_model(str(smollm_path), mode="packed", progress=False, tensor_parallel=2)
    busy, stop, stops, pauses = [], threading.Event(), [], []
    disturber = threading.Thread(target=_disturb, args=(loaded.group.pids[0], stop, stops, 8), daemon=True)
    try:
        quiet = LLMEngine(loaded, config).generate(prompts, params)
        for _ in range(2):      # each ends by itself within 90 s should this process be killed
            busy.append(subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic() + 90\n"
                                          "while time.monotonic() < t: pass"]))
        rng = random.Random(32)
        monkeypatch.setattr(layers, "all_reduce", _late(layers.all_reduce, rng, pauses))
        monkeypatch.setattr(dist, "gather", _late(dist.gather, rng, pauses))
        monkeypatch.setattr(loaded.group, "send", _late(loaded.group.send, rng, pauses))
        disturber.start()
        noisy = LLMEngine(loaded, config).generate(prompts, params)
    finally:
        stop.set()
        if disturber.is_alive():
            disturber.join()
        for p in busy:
            p.kill()
            p.wait()
        loaded.close()
    assert len(stops) >= 20 and len(pauses) >= 100, (len(stops), len(pauses))   # the disturbance happened
    for case, a, b in zip(cases, quiet, noisy):
        assert b.token_ids == a.token_ids, f"{case['name']}: disturbed {b.token_ids} vs undisturbed {a.token_ids}"
        assert b.logprobs == a.logprobs, f"{case['name']}: the log-probabilities changed under disturbance"


def test_engine_config_must_match_the_loaded_split(smollm_path):
    loaded = load_model(str(smollm_path), progress=False)
    with pytest.raises(ValueError, match=r"load_model\(\.\.\., tensor_parallel=2\)"):
        LLMEngine(loaded, EngineConfig(tensor_parallel=2))


def _stream_until_failure(loaded, timeout_s: float, kill) -> tuple[WorkerDiedError, float]:
    engine = LLMEngine(loaded, EngineConfig())
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stream = engine.stream([1, 504, 3458, 282, 4649, 314], params)
    first = next(stream)                      # the group works ...
    assert first.token_ids
    kill(loaded.group.pids[0])                # ... until a worker is gone
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as err:
        for _ in stream:
            assert time.monotonic() - t0 < timeout_s + 10, "the engine kept running without its worker"
    elapsed = time.monotonic() - t0
    # The engine stays failed: a new request gets the same error, not a hang.
    engine.add_request([1, 2, 3], params)
    with pytest.raises(WorkerDiedError) as again:
        engine.step()
    assert str(again.value) == str(err.value)
    return err.value, elapsed


def test_killed_worker_fails_the_request_with_a_clear_error(smollm_path, one_thread):
    loaded = load_model(str(smollm_path), progress=False, tensor_parallel=2, tp_timeout_s=30)
    try:
        pid = loaded.group.pids[0]
        err, elapsed = _stream_until_failure(loaded, 30, lambda p: os.kill(p, signal.SIGKILL))
        assert re.search(rf"worker rank 1 \(pid {pid}\) was killed by SIGKILL", str(err)), str(err)
        assert "must be restarted" in str(err)
        assert elapsed < 10          # a dead peer's socket closes at once: no waiting for the timeout
    finally:
        loaded.close()
    assert all(p.exitcode is not None for p in loaded.group.procs)


def test_hung_worker_fails_after_the_collective_timeout(smollm_path, one_thread):
    loaded = load_model(str(smollm_path), progress=False, tensor_parallel=2, tp_timeout_s=3)
    try:
        err, elapsed = _stream_until_failure(loaded, 3, lambda p: os.kill(p, signal.SIGSTOP))
        assert "no worker exited" in str(err) and "3s collective timeout" in str(err), str(err)
        assert 2.5 < elapsed < 15
    finally:
        loaded.close()               # kills the stopped worker
    assert all(p.exitcode is not None for p in loaded.group.procs)


def _spawned_children(pid: int) -> list[int]:
    """Worker processes (multiprocessing spawn children) of ``pid``."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")]


def test_server_exits_when_a_worker_dies(smollm_path):
    proc = subprocess.Popen([sys.executable, "-m", "lodestar.cli", "serve", "--port", "0", "--model", str(smollm_path),
                             "--served-model-name", "local", "--tensor-parallel", "2", "--threads", "1",
                             "--tp-timeout", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert url, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert "tensor-parallel 2" in line
        workers = _spawned_children(proc.pid)
        assert len(workers) == 1
        body = {"model": "local", "stream": True, "max_tokens": 500, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}
        with httpx.stream("POST", url.group(1) + "/v1/chat/completions", json=body, timeout=40) as r:
            assert r.status_code == 200
            events = r.iter_lines()
            for ev in events:
                if ev.startswith("data:") and '"content"' in ev:
                    break                     # tokens are flowing
            os.kill(workers[0], signal.SIGKILL)
            rest = "\n".join(events)          # the stream must end, with the reason
        assert "engine" in rest and "worker rank 1" in rest and "SIGKILL" in rest, rest[-2000:]
        assert proc.wait(timeout=40) == 1
        err = proc.stderr.read()
        assert re.search(r"lodestar: error: engine stopped: tensor-parallel worker rank 1 .*SIGKILL", err), err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_synthetic_spec_loads_shard_wise_in_every_rank(one_thread):
    # Each worker makes its own slice of the random weights from the spec (no file at all).
    spec, prompt = "synthetic:smollm2-135m:Q8_0", [[40, 41, 42, 43, 44, 45]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = []
    for tp in (1, 2):
        loaded = load_model(spec, mode="fp32", progress=False, tensor_parallel=tp)
        try:
            assert loaded.config.name == "synthetic smollm2-135m Q8_0" and loaded.tensor_parallel == tp
            engine = LLMEngine(loaded, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, tensor_parallel=tp))
            outs.append(engine.generate(prompt, params)[0])
        finally:
            loaded.close()
    assert outs[1].token_ids == outs[0].token_ids
    for (lp1, _), (lp2, _) in zip(outs[0].logprobs, outs[1].logprobs):
        assert abs(lp1 - lp2) < 1e-4
