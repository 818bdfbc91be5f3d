"""``synthetic:<geometry>[:<type>]`` model specs: parsing, errors, and what loads."""
from __future__ import annotations

import pytest

from lodestar.engine.loader import open_checkpoint
from lodestar.formats.catalog import ModelNotFoundError
from lodestar.formats.synthetic import GEOMETRIES, SyntheticCheckpoint, parse_spec


def test_parse_spec():
    assert parse_spec("synthetic:llama-3.1-8b") == ("llama-3.1-8b", "BF16")
    assert parse_spec("synthetic:llama-70b:bf16") == ("llama-70b", "BF16")
    assert parse_spec("synthetic:llama-3.1-8b:Q4_K") == ("llama-3.1-8b", "Q4_K")
    assert parse_spec("model.gguf") is None and parse_spec(None) is None
    for bad in ("synthetic:llama-9b", "synthetic:llama-3.1-8b:Q3_K", "synthetic:llama-3.1-8b:BF16:x"):
        with pytest.raises(ModelNotFoundError, match="expected synthetic:<geometry>"):
            parse_spec(bad)


def test_open_checkpoint_makes_the_geometry_with_a_tokenizer():
    path, ck = open_checkpoint("synthetic:llama-70b:BF16")
    g = GEOMETRIES["llama-70b"]
    assert str(path) == "synthetic:llama-70b:BF16"
    assert (ck.config.d_model, ck.config.n_layers, ck.config.n_heads, ck.config.n_kv_heads) == (8192, 80, 64, 8)
    assert ck.tensors["blk.79.ffn_down.weight"].shape == (g.d_model, g.ffn_dim)
    assert 138e9 < ck.weight_bytes < 139e9          # nothing was made: tensors are made when read
    tok = ck.tokenizer()
    assert tok.decode(tok.encode("hello world")) == "hello world"
    # the same spec names the same weights (the disk KV tier keys on this)
    again = SyntheticCheckpoint.from_spec("synthetic:llama-70b:BF16")
    assert again.fingerprint == ck.fingerprint and len(ck.fingerprint) == 64
    assert SyntheticCheckpoint.from_spec("synthetic:llama-70b:Q4_0").fingerprint != ck.fingerprint


def test_q4_k_m_mixes_types_as_llama_cpp_does():
    """Q4_K_M: attn_v and ffn_down in Q6_K on the first and last eighth of the layers and every
    third between them, the head in Q6_K, everything else (embedding too) in Q4_K; an 8B file
    then holds llama.cpp's Q4_K_M size for this vocabulary (4.47 GB)."""
    from lodestar.formats.synthetic import more_bits
    assert parse_spec("synthetic:llama-3.1-8b:q4_k_m") == ("llama-3.1-8b", "Q4_K_M")
    assert [i for i in range(32) if more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    ck = SyntheticCheckpoint("llama-3.1-8b", "Q4_K_M")
    types = {name: t.qtype.name for name, t in ck.tensors.items() if t.qtype.name != "F32"}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    for i in range(32):
        more = "Q6_K" if more_bits(i, 32) else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == more
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{name}.weight"] == "Q4_K"
    assert 4.45e9 < ck.weight_bytes < 4.48e9
    assert SyntheticCheckpoint("llama-3.1-8b", "Q4_K").weight_bytes < 4.31e9


def test_q5_k_m_is_the_same_mix_around_q5_k():
    from lodestar.formats.synthetic import more_bits
    ck = SyntheticCheckpoint("llama-3.1-8b", "Q5_K_M")
    types = {name: t.qtype.name for name, t in ck.tensors.items()}
    assert types["token_embd.weight"] == "Q5_K" and types["output.weight"] == "Q6_K"
    for i in range(32):
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if more_bits(i, 32) else "Q5_K")
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == "Q5_K"


def test_a_geometry_whose_rows_do_not_hold_the_type_s_blocks_is_refused_with_the_types_that_fit():
    with pytest.raises(ModelNotFoundError, match=r"576.*Q4_K blocks.*F16, BF16, Q8_0, Q4_0$"):
        parse_spec("synthetic:smollm2-135m:Q4_K")
    with pytest.raises(ModelNotFoundError, match="Q5_K_M blocks"):
        parse_spec("synthetic:smollm2-135m:Q5_K_M")
    assert parse_spec("synthetic:smollm2-135m:Q4_0") == ("smollm2-135m", "Q4_0")
    assert parse_spec("synthetic:llama-3.2-1b:Q4_K_M") == ("llama-3.2-1b", "Q4_K_M")
