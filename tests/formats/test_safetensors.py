"""Hugging Face folders load into the same models as GGUF files.

A tiny random Llama (two shards + index, Llama 3.1 rope scaling, byte-level tokenizer)
is written with safetensors; its logits through the engine's runner must equal a direct
torch computation of the Hugging Face model's forward with those weights.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from lodestar.engine.kv_cache import BlockPool
from lodestar.engine.loader import load_model
from lodestar.engine.model_runner import ModelRunner
from lodestar.engine.sequence import Sequence
from lodestar.formats.safetensors import HFCheckpoint, HFCheckpointError, llama3_rope_factors
from lodestar.formats.synthetic import hf_tokenizer_files, synthetic_tokenizer_metadata

D, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 4, 2, 16, 96, 400
THETA = 500000.0
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(torch.bfloat16)  # noqa: E731
    w = {"model.embed_tokens.weight": r(VOCAB, D), "model.norm.weight": (1 + r(D).float() * 0.1).to(torch.bfloat16),
         "lm_head.weight": r(VOCAB, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": (1 + r(D).float()).to(torch.bfloat16),
              p + "post_attention_layernorm.weight": (1 + r(D).float()).to(torch.bfloat16),
              p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, D), p + "self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, D),
              p + "self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, D), p + "self_attn.o_proj.weight": r(D, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": r(FFN, D), p + "mlp.up_proj.weight": r(FFN, D),
              p + "mlp.down_proj.weight": r(D, FFN)}
    return w


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-llama")
    w = _weights()
    names = sorted(w)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    index = {"metadata": {}, "weight_map": {}}
    for fname, keys in shards.items():
        save_file({k: w[k] for k in keys}, str(d / fname))
        index["weight_map"] |= {k: fname for k in keys}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": D, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": FFN, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": THETA, "rope_scaling": SCALING,
        "tie_word_embeddings": False, "eos_token_id": [2, 1]}))
    for name, text in hf_tokenizer_files(synthetic_tokenizer_metadata(VOCAB)).items():
        (d / name).write_text(text)
    return d, w


def _reference_logits(w: dict[str, torch.Tensor], ids: list[int], divisor=None) -> torch.Tensor:
    """The Hugging Face Llama forward in fp32, written out (``divisor`` of the rope frequencies:
    the Llama 3.1 factors by default)."""
    f = {k: v.float() for k, v in w.items()}
    x = f["model.embed_tokens.weight"][ids]
    T = len(ids)

    def norm(h, weight):
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))

    inv = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    inv = inv / (llama3_rope_factors(SCALING, THETA, HEAD_DIM) if divisor is None else divisor)
    ang = torch.arange(T).float()[:, None] * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]

    def rope(t):
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat((-t2, t1), -1) * sin

    mask = torch.ones(T, T).tril().bool()
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = norm(x, f[p + "input_layernorm.weight"])
        q = rope((h @ f[p + "self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM))
        k = rope((h @ f[p + "self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM))
        v = (h @ f[p + "self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
        k = k.repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.repeat_interleave(HEADS // KV_HEADS, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        a = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v).reshape(T, -1)
        x = x + a @ f[p + "self_attn.o_proj.weight"].T
        h = norm(x, f[p + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(h @ f[p + "mlp.gate_proj.weight"].T) * (h @ f[p + "mlp.up_proj.weight"].T)
                 ) @ f[p + "mlp.down_proj.weight"].T
    return norm(x, f["model.norm.weight"]) @ f["lm_head.weight"].T


def test_config_names_and_tokenizer(hf_folder):
    d, w = hf_folder
    ck = HFCheckpoint(d)
    c = ck.config
    assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == ("llama", 2, 4, 2, 16, 96)
    assert c.extra["hf_layout"] and not c.tie_embeddings and c.rope_theta == THETA
    assert "blk.1.attn_q.weight" in ck.tensors and "output.weight" in ck.tensors and "rope_freqs.weight" in ck.tensors
    t = ck.tensors["blk.0.ffn_down.weight"]
    assert t.qtype.name == "BF16" and t.shape == (D, FFN) and t.data.shape == (D, FFN * 2)
    tok = ck.tokenizer()
    assert tok.vocab_size == VOCAB and tok.bos_id == 1 and {1, 2} <= tok.eos_ids
    assert tok.decode(tok.encode("hi <|im_end|>")) == "hi <|im_end|>"
    assert tok.has_chat_template


def test_forward_matches_direct_computation(hf_folder):
    d, w = hf_folder
    loaded = load_model(str(d), mode="fp32", progress=False)
    ids = [5, 77, 300, 12, 9, 250, 41]
    pool = BlockPool(8, 4)
    runner = ModelRunner(loaded.model, pool)
    seq = Sequence(0, ids, None)
    got = runner.run([seq], [len(ids)])[0]
    want = _reference_logits(w, ids)[-1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_linear_rope_scaling_matches_direct_computation(hf_folder, tmp_path):
    """``rope_scaling: {"rope_type": "linear", "factor": 4}``: every frequency divided by 4."""
    d, w = hf_folder
    folder = tmp_path / "linear"
    folder.mkdir()
    for f in d.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(folder), mode="fp32", progress=False)
    assert loaded.config.rope_scale == 4.0 and "rope_freqs.weight" not in HFCheckpoint(folder).tensors
    ids = [5, 77, 300, 12, 9, 250, 41, 3, 99, 180]
    seq = Sequence(0, ids, None)
    got = ModelRunner(loaded.model, BlockPool(8, 4)).run([seq], [len(ids)])[0]
    torch.testing.assert_close(got, _reference_logits(w, ids, divisor=4.0)[-1], rtol=1e-4, atol=1e-4)
    unscaled = _reference_logits(w, ids, divisor=1.0)[-1]
    assert not torch.allclose(got, unscaled, rtol=1e-4, atol=1e-4)      # the scaling is not a no-op here


def test_gemma_norms_gain_one(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = {"model.embed_tokens.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
         "model.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
         "model.layers.0.pre_feedforward_layernorm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
         "model.layers.0.self_attn.q_norm.weight": torch.randn(8, generator=g).to(torch.bfloat16)}
    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3_text", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32, "vocab_size": 32,
        "sliding_window": 512, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "query_pre_attn_scalar": 8}))
    ck = HFCheckpoint(tmp_path)
    assert ck.config.arch == "gemma3" and ck.config.tie_embeddings
    assert ck.config.extra["sliding_window_pattern"] == 6 and ck.config.sliding_window == 512
    for hf, name in (("model.norm.weight", "output_norm.weight"),
                     ("model.layers.0.pre_feedforward_layernorm.weight", "blk.0.ffn_norm.weight"),
                     ("model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight")):
        assert torch.equal(ck.tensors[name].dequantize(), w[hf].float() + 1.0)


def test_unsupported_model_type_names_the_fix(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HFCheckpointError, match="model_type 'gpt2' is not supported; supported: gemma3"):
        HFCheckpoint(tmp_path)
