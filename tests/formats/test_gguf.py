"""GGUFFile: metadata, config and tensors of the real models, and clear errors for bad files."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from lodestar.formats.gguf import GGUFError, GGUFFile


# --------------------------------------------------------------- small files

def write_gguf(path: Path, *, arch: str = "llama", kv: dict | None = None, drop: tuple[str, ...] = (),
               tensors: dict[str, tuple[np.ndarray, T | None]] | None = None) -> Path:
    """A small llama-style GGUF: 2 layers, d_model 64, 4 heads. ``kv`` overrides/extends
    the metadata (key without the arch prefix when it starts with '.'), ``drop`` removes keys."""
    meta: dict[str, object] = {
        ".block_count": 2, ".embedding_length": 64, ".attention.head_count": 4,
        ".feed_forward_length": 128, ".context_length": 256,
        ".attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"],
    }
    meta.update(kv or {})
    w = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        full = arch + key if key.startswith(".") else key
        if key in drop or full in drop:
            continue
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        else:
            w.add_array(full, value)
    rng = np.random.default_rng(0)
    if tensors is None:
        emb = rng.standard_normal((4, 64)).astype(np.float32)
        tensors = {
            "token_embd.weight": (gguf.quants.quantize(emb, T.Q8_0), T.Q8_0),
            "output_norm.weight": (np.ones(64, dtype=np.float32), None),
        }
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def part_offset(path: Path, pick) -> int:
    """Byte offset of a header field part chosen by ``pick(reader)`` (a numpy view)."""
    reader = gguf.GGUFReader(path)
    return pick(reader).ctypes.data - reader.data.ctypes.data


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def tensor_part(name: str, index: int):
    """Part ``index`` of a tensor-info entry: 2 n_dims, 3 dims, 4 type, 5 offset."""
    return lambda r: next(t for t in r.tensors if t.name == name).field.parts[index]


def expect_error(path: Path, match: str) -> GGUFError:
    """Opening ``path`` fails with "<path>: <message>" and the message matches ``match``."""
    with pytest.raises(GGUFError) as info:
        GGUFFile(path)
    prefix = f"{path}: "
    assert str(info.value).startswith(prefix)
    assert re.search(match, str(info.value)[len(prefix):]), str(info.value)
    return info.value


# ------------------------------------------------------------- real models

def test_smollm_metadata_and_config(smollm_path):
    with GGUFFile(smollm_path) as f:
        assert f.version == 3
        m = f.metadata
        assert m["general.architecture"] == "llama"
        assert m["llama.block_count"] == 30
        assert m["tokenizer.ggml.add_bos_token"] is False
        tokens = m["tokenizer.ggml.tokens"]
        assert type(tokens) is list and len(tokens) == 49152
        assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        assert m["tokenizer.ggml.merges"][0] == "Ġ t"
        assert m["tokenizer.ggml.token_type"][:3] == [3, 3, 3]
        assert "<|im_start|>" in m["tokenizer.chat_template"]
        assert not any(k.startswith("GGUF.") for k in m)

        c = f.config
        assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads) == ("llama", 30, 576, 9, 3)
        assert (c.head_dim, c.v_head_dim, c.ffn_dim, c.vocab_size) == (64, 64, 1536, 49152)
        assert (c.context_length, c.rope_theta, c.rope_dim, c.sliding_window) == (8192, 100000.0, 64, None)
        assert c.rms_eps == float(np.float32(1e-5))
        assert c.tie_embeddings is True
        assert c.file_type == 3
        assert c.extra["rope.dimension_count"] == 64


def test_smollm_tensors_are_views_of_the_mapping(smollm_path):
    with GGUFFile(smollm_path) as f:
        assert len(f.tensors) == 272
        emb = f.tensor("token_embd.weight")
        assert (emb.qtype, emb.shape, tuple(emb.data.shape)) == (T.Q8_0, (49152, 576), (49152, 612))
        assert emb.n_bytes == 49152 * 612 and emb.data.dtype == torch.uint8
        down = f.tensor("blk.0.ffn_down.weight")
        assert (down.qtype, down.shape, tuple(down.data.shape)) == (T.Q4_1, (576, 1536), (576, 960))
        norm = f.tensor("blk.29.attn_norm.weight")
        assert (norm.qtype, norm.shape, tuple(norm.data.shape)) == (T.F32, (576,), (1, 2304))
        # Zero copy: the bytes live in the mapped file, at the tensor's offset.
        assert emb.data.untyped_storage().nbytes() == smollm_path.stat().st_size
        with open(smollm_path, "rb") as fh:
            fh.seek(down.offset)
            assert fh.read(64) == down.data.reshape(-1)[:64].numpy().tobytes()
        assert norm.dequantize().shape == (576,)


def test_gemma_metadata_and_config(gemma_path):
    with GGUFFile(gemma_path) as f:
        m = f.metadata
        assert m["general.architecture"] == "gemma3"
        assert len(m["tokenizer.ggml.tokens"]) == 262144
        scores = m["tokenizer.ggml.scores"]
        assert len(scores) == 262144 and isinstance(scores[0], float)
        assert m["tokenizer.ggml.add_bos_token"] is True

        c = f.config
        assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads) == ("gemma3", 18, 640, 4, 1)
        assert (c.head_dim, c.v_head_dim, c.rope_dim, c.ffn_dim) == (256, 256, 256, 2048)
        assert (c.vocab_size, c.context_length, c.sliding_window) == (262144, 32768, 512)
        assert c.rope_theta == 1e6 and c.tie_embeddings is True
        assert c.extra["attention.key_length"] == 256


def test_gemma_tensor_types_and_shapes(gemma_path):
    with GGUFFile(gemma_path) as f:
        assert len(f.tensors) == 236
        expect = {
            "token_embd.weight": (T.Q8_0, (262144, 640)),
            "blk.0.attn_q.weight": (T.Q5_0, (1024, 640)),
            "blk.0.attn_k.weight": (T.Q5_0, (256, 640)),
            "blk.0.attn_output.weight": (T.Q4_K, (640, 1024)),
            "blk.0.ffn_down.weight": (T.Q6_K, (640, 2048)),
            "blk.0.attn_q_norm.weight": (T.F32, (256,)),
        }
        for name, (qtype, shape) in expect.items():
            t = f.tensor(name)
            assert (t.qtype, t.shape) == (qtype, shape), name


def test_missing_tensor_error_suggests_near_names(smollm_path):
    with GGUFFile(smollm_path) as f:
        near = r"no tensor named blk\.0\.attn_qq\.weight; similar: blk\.0\.attn_q\.weight"
        with pytest.raises(GGUFError, match=near):
            f.tensor("blk.0.attn_qq.weight")


# ------------------------------------------------------------- small files

def test_small_file_config_defaults(tmp_path):
    with GGUFFile(write_gguf(tmp_path / "m.gguf")) as f:
        c = f.config
        assert (c.n_kv_heads, c.head_dim, c.v_head_dim, c.rope_dim) == (4, 16, 16, 16)
        assert (c.rope_theta, c.sliding_window, c.vocab_size, c.file_type) == (10000.0, None, 4, None)
        assert c.name == "m" and c.tie_embeddings is True
        assert f.tensor("output_norm.weight").dequantize().tolist() == [1.0] * 64


@pytest.mark.parametrize("kv, scale", [
    ({}, 1.0),
    ({".rope.scaling.type": "none"}, 1.0),
    ({".rope.scaling.type": "linear", ".rope.scaling.factor": 8.0}, 8.0),
    ({".rope.scale_linear": 4.0}, 4.0),                               # the older key
    ({".rope.scaling.type": "yarn", ".rope.scaling.factor": 1.0}, 1.0),  # a factor of 1 changes nothing
])
def test_linear_rope_scaling_is_read(tmp_path, kv, scale):
    with GGUFFile(write_gguf(tmp_path / "m.gguf", kv=kv)) as f:
        assert f.config.rope_scale == scale


def test_rope_scaling_it_cannot_compute_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", kv={".rope.scaling.type": "yarn", ".rope.scaling.factor": 4.0})
    with pytest.raises(GGUFError, match=r"llama.rope.scaling.type is 'yarn' \(factor 4.0\): only linear"):
        GGUFFile(path)


def test_output_weight_unties_embeddings(tmp_path):
    tensors = {"output.weight": (np.zeros((4, 64), dtype=np.float16), None)}
    with GGUFFile(write_gguf(tmp_path / "m.gguf", tensors=tensors)) as f:
        assert f.config.tie_embeddings is False
        assert f.config.vocab_size == 4
        assert f.tensor("output.weight").qtype == T.F16


def test_writes_to_tensor_data_never_reach_the_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    before = path.read_bytes()
    with GGUFFile(path) as f:
        w = f.tensor("output_norm.weight").dequantize()
        w.add_(1.0)
    assert path.read_bytes() == before
    assert GGUFFile(path).tensor("output_norm.weight").dequantize().tolist() == [1.0] * 64


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")
    expect_error(tmp_path, "not a regular file")


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04 zip bytes", b"hello world\n" * 10])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    expect_error(path, "not a GGUF file")


def test_header_only_file_is_truncated(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    expect_error(path, "truncated")


@pytest.mark.parametrize("version, hint", [(1, ""), (4, ""), (3 << 24, "big-endian")])
def test_unsupported_version(tmp_path, version, hint):
    path = write_gguf(tmp_path / "m.gguf")
    patch(path, 4, struct.pack("<I", version))
    err = expect_error(path, f"unsupported GGUF version {version}")
    assert hint in str(err) and "supported versions: 2, 3" in str(err)


@pytest.mark.parametrize("cut", [300_000, 1_000_000, 5_000_000])
def test_truncated_real_file(tmp_path, smollm_path, cut):
    # 300 kB and 1 MB end inside the token lists, 5 MB inside the tensor data.
    path = tmp_path / "smollm-cut.gguf"
    with open(smollm_path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(cut))
    expect_error(path, "truncated")


def test_tensor_data_past_end_of_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    patch(path, part_offset(path, tensor_part("output_norm.weight", 5)), struct.pack("<Q", 1 << 20))
    expect_error(path, r"truncated: tensor output_norm\.weight needs bytes")


def test_inflated_counts_are_rejected(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    patch(path, 8, struct.pack("<Q", 1 << 62))
    expect_error(path, "corrupt header: claims 4611686018427387904 tensors")
    path = write_gguf(tmp_path / "m2.gguf")
    tokens = part_offset(path, lambda r: r.fields["tokenizer.ggml.tokens"].parts[4])  # array length
    patch(path, tokens, struct.pack("<Q", 1 << 60))
    expect_error(path, "truncated or corrupt: metadata array at offset .* claims 1152921504606846976 elements")


def test_unsupported_tensor_type_names_tensor_and_supported_types(tmp_path):
    iq = np.zeros((2, 56), dtype=np.uint8)  # two IQ1_M blocks of 256 weights
    path = write_gguf(tmp_path / "m.gguf", tensors={"blk.3.ffn_up.weight": (iq, T.IQ1_M)})
    err = expect_error(path, r"tensor blk\.3\.ffn_up\.weight has type IQ1_M; supported: F32, F16, BF16, Q4_0")
    assert "Q6_K" in str(err)


def test_unknown_tensor_type_id(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    patch(path, part_offset(path, tensor_part("token_embd.weight", 4)), struct.pack("<I", 200))
    expect_error(path, r"tensor token_embd\.weight has unknown type id 200")


def test_row_not_multiple_of_block_size(tmp_path):
    # Same 136 bytes, dims rewritten from 64 x 4 to 16 x 16: rows of 16 cannot hold Q8_0 blocks.
    path = write_gguf(tmp_path / "m.gguf")
    patch(path, part_offset(path, tensor_part("token_embd.weight", 3)), struct.pack("<QQ", 16, 16))
    expect_error(path, r"token_embd\.weight of type Q8_0 has row length 16, not a multiple of the block size 32")


def test_missing_required_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", drop=(".block_count",))
    expect_error(path, r"missing metadata key llama\.block_count, required for llama models")
    path = write_gguf(tmp_path / "m2.gguf", drop=(".attention.layer_norm_rms_epsilon",))
    expect_error(path, r"missing metadata key llama\.attention\.layer_norm_rms_epsilon")


def test_bad_metadata_values(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", kv={".block_count": "thirty"})
    expect_error(path, r"llama\.block_count has value 'thirty', expected int")
    path = write_gguf(tmp_path / "m2.gguf", kv={".attention.head_count": 0})
    expect_error(path, r"llama\.attention\.head_count has value 0, expected a positive number")


def test_per_layer_head_counts(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", kv={".attention.head_count_kv": [2, 4]})
    with GGUFFile(path) as f:
        assert f.config.n_kv_heads == 4
        assert f.config.extra["attention.head_count_kv_per_layer"] == [2, 4]


def test_invalid_utf8_in_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", kv={"general.name": "abcdef"})
    data = path.read_bytes()
    patch(path, data.index(b"abcdef"), b"\xff\xfe")
    expect_error(path, "invalid UTF-8")



def test_read_metadata_gives_the_fields_and_names_a_bad_file(tmp_path):
    from lodestar.formats.gguf import read_metadata
    from lodestar.tokenizer import read_tokenizer_metadata
    path = write_gguf(tmp_path / "m.gguf", arch="mamba9", kv={"tokenizer.ggml.model": "gpt2"})
    meta = read_tokenizer_metadata(path)
    assert meta == {"general.architecture": "mamba9", "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"],
                    "tokenizer.ggml.model": "gpt2"}
    assert read_metadata(path)["mamba9.block_count"] == 2
    for bad, match in ((tmp_path / "nope.gguf", "no such file"), (tmp_path, "not a regular file")):
        with pytest.raises(GGUFError, match=match):
            read_metadata(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:60])
    with pytest.raises(GGUFError, match="cut.gguf"):
        read_metadata(cut)
