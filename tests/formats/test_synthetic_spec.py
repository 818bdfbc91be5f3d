"""``synthetic:<geometry>[:<type>]`` model specs: parsing, errors, and what loads."""
from __future__ import annotations

import pytest

from lodestar.engine.loader import open_checkpoint
from lodestar.formats.catalog import ModelNotFoundError
from lodestar.formats.synthetic import GEOMETRIES, SyntheticCheckpoint, parse_spec


def test_parse_spec():
    assert parse_spec("synthetic:llama-3.1-8b") == ("llama-3.1-8b", "BF16")
    assert parse_spec("synthetic:llama-70b:bf16") == ("llama-70b", "BF16")
    assert parse_spec("synthetic:smollm2-135m:Q4_K") == ("smollm2-135m", "Q4_K")
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
