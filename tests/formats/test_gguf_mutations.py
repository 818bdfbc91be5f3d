"""Mutated copies of the real models either load and run or fail with one line naming the
file and the tensor or key at fault: never a traceback, never a hang.

Most cases use a two-block cut of the default model (``fuzz_gguf.shrink``: the same
vocabulary, embedding, tensor types and metadata), which loads and runs in a fraction of
the full model's time.
"""
from __future__ import annotations

import math
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGUFValueType as V

from lodestar.bench.fuzz_gguf import KINDS, KV, Mutant, Source, classify, run, shrink
from lodestar.cli import main
from lodestar.engine.faults import SCALE_OFFSETS

CASE_SECONDS = 30


@pytest.fixture(scope="module")
def mini(tmp_path_factory, smollm_path) -> Source:
    return Source(shrink(smollm_path, tmp_path_factory.mktemp("mini") / "smollm2-2blocks.gguf", 2))


@pytest.fixture(scope="module")
def gemma(gemma_path) -> Source:
    return Source(gemma_path)


@pytest.fixture(autouse=True)
def one_thread():
    # Loads and two-token runs of a small model: one thread is faster than two on a shared machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write(src: Source, path: Path, layout=None, **edits) -> Path:
    src.write(Mutant("test", "", layout or src.layout, **edits), path)
    return path


def set_key(src: Source, key: str, value, types=None):
    old = src.layout.kv(key)
    types = types or (old.types if old is not None else (V.UINT32,))
    return src.layout.set_kv(key, KV(key, types, value))


def tensor_index(src: Source, name: str) -> int:
    return next(i for i, t in enumerate(src.layout.tensors) if t.name == name)


def expect_error(path: Path, *needles: str) -> str:
    out = classify(path, CASE_SECONDS)
    assert out.result == "error", out
    assert str(path) in out.message, out.message
    for needle in needles:
        assert needle in out.message, out.message
    return out.message


# ------------------------------------------------------------- a sample of every kind

def test_a_sample_of_mutations_loads_or_fails_with_one_line(mini, tmp_path):
    report = run(mini, 4 * len(KINDS), seed=2024, workdir=tmp_path, timeout_s=CASE_SECONDS)
    bad = [f"#{c.index} {c.kind} ({c.description}): {c.outcome.result}: {c.outcome.message}"
           for c in report.cases if c.outcome.result in ("crash", "hang")]
    assert not bad, "\n".join(bad)
    assert {c.kind for c in report.cases} == set(KINDS)
    counts = report.counts
    assert counts["error"] >= 36 and counts["ok"] >= 4, counts   # the mutations reach every stage
    for c in report.cases:
        if c.outcome.result == "error" and c.outcome.error_type != "ContextLengthError":
            assert f"mutant-2024-{c.index}.gguf" in c.outcome.message, (c.description, c.outcome.message)


def test_same_seed_same_mutants(mini):
    from lodestar.bench.fuzz_gguf import mutate
    a = [mutate(mini, 5, i) for i in range(len(KINDS))]
    b = [mutate(mini, 5, i) for i in range(len(KINDS))]
    assert [m.description for m in a] == [m.description for m in b]
    assert mini.header(a[0].layout) == mini.header(b[0].layout)


def test_the_unmutated_copy_loads_and_runs(mini, tmp_path):
    assert classify(write(mini, tmp_path / "same.gguf"), CASE_SECONDS).result == "ok"


# ------------------------------------------------------------- tensors

def test_renamed_tensor_is_missing_with_the_near_name(mini, tmp_path):
    i = tensor_index(mini, "blk.1.attn_q.weight")
    layout = mini.layout.set_tensor(i, replace(mini.layout.tensors[i], name="blk.1.attn_qq.weight"))
    expect_error(write(mini, tmp_path / "m.gguf", layout), "missing tensor blk.1.attn_q.weight",
                 "expected shape (576, 576)", "similar: blk.1.attn_qq.weight")


def test_renamed_to_an_existing_name(mini, tmp_path):
    i = tensor_index(mini, "blk.1.ffn_up.weight")
    layout = mini.layout.set_tensor(i, replace(mini.layout.tensors[i], name="blk.0.ffn_up.weight"))
    expect_error(write(mini, tmp_path / "m.gguf", layout), "tensor name blk.0.ffn_up.weight appears twice")


def test_removed_tensor(mini, tmp_path):
    layout = mini.layout.set_tensor(tensor_index(mini, "blk.0.ffn_norm.weight"), None)
    expect_error(write(mini, tmp_path / "m.gguf", layout), "missing tensor blk.0.ffn_norm.weight",
                 "from llama.embedding_length=576")


@pytest.mark.parametrize("delta, needle", [(-1, "the header's tensor count is wrong"),
                                           (-5, "the header's tensor count is wrong"),
                                           (1, "truncated")])
def test_wrong_tensor_count_in_the_header(mini, tmp_path, delta, needle):
    layout = replace(mini.layout, n_tensors=len(mini.layout.tensors) + delta)
    expect_error(write(mini, tmp_path / "m.gguf", layout), needle)


def test_shape_that_does_not_match_the_config(mini, tmp_path):
    # Same bytes, other shape: k as a 96 x 1152 matrix would reach the int4 matmul with the
    # wrong inner dimension.
    i = tensor_index(mini, "blk.1.attn_k.weight")
    layout = mini.layout.set_tensor(i, replace(mini.layout.tensors[i], dims=(1152, 96)))
    expect_error(write(mini, tmp_path / "m.gguf", layout), "tensor blk.1.attn_k.weight has shape (96, 1152)",
                 "expected (192, 576) from llama.attention.head_count_kv=3 x head dimension 64")


def test_config_that_does_not_match_the_shapes(mini, tmp_path):
    layout = set_key(mini, "llama.attention.head_count_kv", 1)
    expect_error(write(mini, tmp_path / "m.gguf", layout), "tensor blk.0.attn_k.weight has shape (192, 576)",
                 "expected (64, 576)")
    layout = set_key(mini, "llama.feed_forward_length", 1024)
    expect_error(write(mini, tmp_path / "m2.gguf", layout), "blk.0.ffn_gate.weight", "llama.feed_forward_length=1024")


def test_type_changed_so_data_overlaps(mini, tmp_path):
    i = tensor_index(mini, "blk.0.attn_q.weight")
    layout = mini.layout.set_tensor(i, replace(mini.layout.tensors[i], qtype=8))    # Q4_1 -> Q8_0: larger
    expect_error(write(mini, tmp_path / "m.gguf", layout), "overlaps", "blk.0.attn_q.weight")


def test_unsupported_type(mini, tmp_path):
    i = tensor_index(mini, "blk.0.attn_q.weight")
    layout = mini.layout.set_tensor(i, replace(mini.layout.tensors[i], qtype=20))   # IQ4_NL
    expect_error(write(mini, tmp_path / "m.gguf", layout), "blk.0.attn_q.weight has type IQ4_NL; supported:")


# ------------------------------------------------------------- metadata

def test_rope_dimension_count_one(mini, tmp_path):
    expect_error(write(mini, tmp_path / "m.gguf", set_key(mini, "llama.rope.dimension_count", 1)),
                 "llama.rope.dimension_count is 1; expected an even number from 2 to the head dimension 64")


@pytest.mark.parametrize("value, needle", [
    (10 ** 9, "llama.block_count has value 1000000000, expected at most 4096"),
    (3, "llama.block_count is 3 but the file has tensors for blocks up to blk.1 and none for blk.2"),
    (1, "unexpected tensor blk.1."),
    (0, "llama.block_count has value 0, expected a positive number"),
])
def test_absurd_block_count(mini, tmp_path, value, needle):
    expect_error(write(mini, tmp_path / "m.gguf", set_key(mini, "llama.block_count", value)), needle)


@pytest.mark.parametrize("key, value, types, needle", [
    ("llama.attention.layer_norm_rms_epsilon", math.nan, None, "expected a positive number"),
    ("llama.attention.layer_norm_rms_epsilon", 5.0, None, "expected a small positive number"),
    ("llama.rope.freq_base", math.inf, None, "expected a finite number"),
    ("llama.context_length", (1 << 32) - 1, (V.UINT32,), "expected at most 16777216"),
    ("llama.attention.head_count_kv", 5, None, "llama.attention.head_count=9 is not a multiple of"),
    ("llama.attention.head_count", 7, None, "llama.embedding_length 576 is not divisible by"),
    ("llama.attention.head_count", "nine", (V.STRING,), "has value 'nine', expected int"),
    ("llama.attention.head_count_kv", ["3", "x"], (V.ARRAY, V.STRING), "per-layer values"),
    ("llama.attention.head_count_kv", [3, 1], (V.ARRAY, V.INT32), "differs between layers"),
    ("llama.attention.key_length", 63, None, "head dimension 63 (llama.attention.key_length) is odd"),
    ("llama.attention.value_length", 32, None, "llama.attention.value_length=32 differs from the key length 64"),
    ("llama.vocab_size", 49153, None, "tokenizer.ggml.tokens has 49152 entries but llama.vocab_size is 49153"),
    ("general.architecture", "mamba", (V.STRING,), "missing metadata key mamba.block_count"),
])
def test_bad_hyperparameters_name_the_key(mini, tmp_path, key, value, types, needle):
    expect_error(write(mini, tmp_path / "m.gguf", set_key(mini, key, value, types)), needle)


def test_unsupported_architecture(mini, tmp_path):
    layout = set_key(mini, "general.architecture", "mamba", (V.STRING,))
    layout = replace(layout, kvs=tuple(replace(kv, key="mamba" + kv.key[5:]) if kv.key.startswith("llama.") else kv
                                       for kv in layout.kvs))
    expect_error(write(mini, tmp_path / "m.gguf", layout), "architecture 'mamba' is not supported; supported:")


def test_missing_key(mini, tmp_path):
    layout = mini.layout.set_kv("llama.embedding_length", None)
    expect_error(write(mini, tmp_path / "m.gguf", layout), "missing metadata key llama.embedding_length")


# ------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("entry, needle", [
    ("a b c", "tokenizer.ggml.merges[7] is 'a b c'; expected two tokens separated by one space"),
    ("", "tokenizer.ggml.merges[7] is ''"),
    ("\u0120zzqx \u0120qqzx", "tokenizer.ggml.merges does not fit tokenizer.ggml.tokens"),
])
def test_corrupt_merges(mini, tmp_path, entry, needle):
    merges = list(mini.layout.kv("tokenizer.ggml.merges").value)
    merges[7] = entry
    expect_error(write(mini, tmp_path / "m.gguf", set_key(mini, "tokenizer.ggml.merges", merges)), needle)


def test_merges_of_the_wrong_type(mini, tmp_path):
    layout = set_key(mini, "tokenizer.ggml.merges", [1, 2, 3], (V.ARRAY, V.UINT32))
    expect_error(write(mini, tmp_path / "m.gguf", layout), "tokenizer.ggml.merges[0] is 1")


def test_truncated_token_array(mini, tmp_path):
    tokens = mini.layout.kv("tokenizer.ggml.tokens").value
    layout = set_key(mini, "tokenizer.ggml.tokens", tokens[:-1])
    expect_error(write(mini, tmp_path / "m.gguf", layout), "tokenizer.ggml.tokens has 49151 entries",
                 "llama.vocab_size is 49152")
    # without the vocab_size key the embedding's shape says what the vocabulary should be
    layout = layout.set_kv("llama.vocab_size", None)
    expect_error(write(mini, tmp_path / "m2.gguf", layout), "tensor token_embd.weight has shape (49152, 576)",
                 "expected (49151, 576) from the vocabulary size 49151")


@pytest.mark.parametrize("key, value, types, needle", [
    ("tokenizer.ggml.token_type", [1] * 10, (V.ARRAY, V.INT32), "token_type must hold one type per token"),
    ("tokenizer.ggml.token_type", None, (V.ARRAY, V.INT32), "tokenizer.ggml.token_type holds 99"),
    ("tokenizer.ggml.bos_token_id", 49152, (V.UINT32,), "tokenizer.ggml.bos_token_id is 49152, outside the vocabulary"),
    ("tokenizer.ggml.eos_token_id", -1, (V.INT32,), "tokenizer.ggml.eos_token_id is -1, outside the vocabulary"),
    ("tokenizer.ggml.eos_token_id", "2", (V.STRING,), "tokenizer.ggml.eos_token_id must be a token id"),
    ("tokenizer.ggml.model", 2, (V.UINT32,), "tokenizer.ggml.model must be a string"),
    ("tokenizer.ggml.pre", ["smollm"], (V.ARRAY, V.STRING), "tokenizer.ggml.pre must be a string"),
    ("tokenizer.ggml.tokens", "abc", (V.STRING,), "tokenizer.ggml.tokens must be a non-empty array of strings"),
    ("tokenizer.chat_template", "{% for m in messages %}", (V.STRING,), "tokenizer.chat_template does not compile"),
])
def test_bad_tokenizer_metadata_names_the_key(mini, tmp_path, key, value, types, needle):
    if value is None:   # one token type out of range
        value = list(mini.layout.kv(key).value)
        value[100] = 99
    expect_error(write(mini, tmp_path / "m.gguf", set_key(mini, key, value, types)), needle)


# ------------------------------------------------------------- Gemma 3

def test_gemma3_needs_its_extra_norms(gemma, tmp_path):
    layout = gemma.layout.set_tensor(tensor_index(gemma, "blk.4.post_ffw_norm.weight"), None)
    expect_error(write(gemma, tmp_path / "g.gguf", layout), "missing tensor blk.4.post_ffw_norm.weight",
                 "gemma3.embedding_length=640")
    layout = gemma.layout.set_tensor(tensor_index(gemma, "blk.2.attn_q_norm.weight"), None)
    expect_error(write(gemma, tmp_path / "g2.gguf", layout), "missing tensor blk.2.attn_q_norm.weight",
                 "expected shape (256,)")


def test_gemma3_head_dimension_from_key_length(gemma, tmp_path):
    layout = set_key(gemma, "gemma3.attention.key_length", 128)
    expect_error(write(gemma, tmp_path / "g.gguf", layout),
                 "differs from the key length 128")
    layout = set_key(gemma, "gemma3.attention.key_length", 128).set_kv(
        "gemma3.attention.value_length", KV("gemma3.attention.value_length", (V.UINT32,), 128))
    expect_error(write(gemma, tmp_path / "g2.gguf", layout), "blk.0.attn_q.weight has shape (1024, 640)",
                 "expected (512, 640) from gemma3.attention.head_count=4 x head dimension 128")


# ------------------------------------------------------------- NaN weights

def nan_scale(src: Source, name: str, block: int = 0, value: float = math.nan) -> tuple[tuple[int, bytes], ...]:
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES
    t = src.layout.tensors[tensor_index(src, name)]
    size = GGML_QUANT_SIZES[Q(t.qtype)][1]
    return ((t.offset + block * size + SCALE_OFFSETS[Q(t.qtype)][0], struct.pack("<e", value)),)


@pytest.mark.parametrize("name, edits", [
    ("output_norm.weight", lambda src, t: ((t.offset + 4 * 10, struct.pack("<f", math.nan)),)),     # F32
    ("blk.1.ffn_down.weight", lambda src, t: nan_scale(src, t.name, 3, math.inf)),                 # Q4_1 scale
    ("token_embd.weight", lambda src, t: nan_scale(src, t.name, 18 * 100 + 2)),                    # Q8_0 scale
])
def test_nan_weights_are_a_model_fault_naming_the_tensor(mini, tmp_path, name, edits):
    t = mini.layout.tensors[tensor_index(mini, name)]
    path = write(mini, tmp_path / "nan.gguf", data_edits=edits(mini, t))
    expect_error(path, "model fault: the model computed", f"tensor {name} holds NaN or infinite values")


def test_generate_with_nan_weights_exits_2_naming_the_tensor(mini, tmp_path, capsys):
    t = mini.layout.tensors[tensor_index(mini, "blk.0.attn_norm.weight")]
    path = write(mini, tmp_path / "nan.gguf", data_edits=((t.offset, struct.pack("<f", math.nan)),))
    assert main(["generate", "-p", "Hello", "--model", str(path), "--device", "cpu", "-n", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lodestar: error: "), err
    assert str(path) in err and "tensor blk.0.attn_norm.weight holds NaN" in err
    assert "logit_bias" not in err.replace(str(path), "")


def test_serve_warmup_with_nan_weights_exits_2(mini, tmp_path, capsys):
    t = mini.layout.tensors[tensor_index(mini, "output_norm.weight")]
    path = write(mini, tmp_path / "nan.gguf", data_edits=((t.offset, struct.pack("<f", math.inf)),))
    assert main(["serve", "--port", "0", "--model", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model fault" in err and "output_norm.weight" in err, err


def test_a_fault_under_logit_bias_is_not_blamed_on_it(mini, tmp_path):
    from lodestar.engine.faults import ModelFaultError
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.engine.loader import load_model
    from lodestar.engine.sampling import SamplingParams
    t = mini.layout.tensors[tensor_index(mini, "blk.1.ffn_norm.weight")]
    path = write(mini, tmp_path / "nan.gguf", data_edits=((t.offset + 8, struct.pack("<f", -math.inf)),))
    loaded = load_model(str(path), progress=False, device="cpu")
    for params in (SamplingParams(temperature=0.0, max_tokens=2, logit_bias={5: -math.inf}),
                   SamplingParams(temperature=0.7, seed=1, max_tokens=2, logit_bias={5: 3.0}, logprobs=2)):
        with pytest.raises(ModelFaultError) as e:   # a fault stops the engine: a fresh one each time
            LLMEngine(loaded, EngineConfig(kv_tokens=256)).generate([[28, 29]], params)
        message = str(e.value)
        assert message.startswith(f"{path}: model fault: ")
        assert "blk.1.ffn_norm.weight" in message and "logit_bias" not in message.removeprefix(str(path))
