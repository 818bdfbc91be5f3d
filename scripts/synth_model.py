#!/usr/bin/env python3
"""Write random-weight models of real geometries, for speed measurements.

Decode speed does not depend on weight values, so these files stand in for real models
where none can be downloaded. Weights are random (quantized types: random blocks with
small, finite scales); every layer reuses the same random bytes to keep generation fast.
The tokenizer (49,152-token BPE vocabulary and chat template) is copied from the default
model when it is installed, else a synthetic byte-level vocabulary of the same size is
written. Run with EOS ignored: random weights may emit it at any step.

    python scripts/synth_model.py --geometry llama-3.1-8b --qtype Q4_K --out /tmp/models
    python scripts/synth_model.py --geometry smollm2-135m --qtype F16 --format safetensors --out /tmp/models
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from lodestar.formats.synthetic import GEOMETRIES, QTYPES, Geometry, holds_blocks, row_widths  # noqa: E402


def _random_blocks(rng: np.random.Generator, qtype, rows: int, cols: int) -> np.ndarray:
    """Random GGUF bytes for a [rows, cols] weight with finite, small scales."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
    blk, size = GGML_QUANT_SIZES[qtype]
    n_blocks = cols // blk
    data = rng.integers(0, 256, size=(rows, n_blocks, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    m = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        data[..., 0:2] = d
        if qtype in (T.Q4_1, T.Q5_1):
            data[..., 2:4] = m
    elif qtype in (T.Q4_K, T.Q5_K, T.Q2_K):
        off = 0 if qtype != T.Q2_K else 16
        data[..., off:off + 2] = d
        data[..., off + 2:off + 4] = m
    elif qtype == T.Q6_K:
        data[..., 208:210] = d
    return data.reshape(rows, n_blocks * size)


def _float_weight(rng, qtype_name: str, rows: int, cols: int) -> np.ndarray:
    w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
    if qtype_name == "BF16":
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    return w.astype(np.float16)


def tensors(g: Geometry, qtype_name: str, seed: int = 0):
    """(name, array, raw qtype) for every tensor of ``formats.synthetic.SyntheticCheckpoint``'s
    list (the same names, order, types and shapes); arrays are shared between tensors of one
    shape and type, to keep writing fast."""
    from gguf.constants import GGMLQuantizationType as T
    from lodestar.formats.synthetic import SyntheticCheckpoint
    rng = np.random.default_rng(seed)
    cache: dict = {}
    for name, t in SyntheticCheckpoint(g, qtype_name).tensors.items():
        if t.qtype == T.F32:      # norm weights
            yield name, np.ones(t.shape[-1], dtype=np.float32), T.F32
            continue
        rows, cols = t.shape
        key = (rows, cols, t.qtype)
        if key not in cache:
            kind = t.qtype.name
            cache[key] = (_float_weight(rng, kind, rows, cols) if kind in ("F16", "BF16")
                          else _random_blocks(rng, t.qtype, rows, cols), t.qtype)
        yield (name, *cache[key])


def write_gguf(g: Geometry, name: str, qtype_name: str, out: Path) -> Path:
    import gguf
    from lodestar.formats.synthetic import tokenizer_metadata_or_synthetic
    md, _ = tokenizer_metadata_or_synthetic(g.vocab)
    path = out / f"synth-{name}-{qtype_name}.gguf"
    w = gguf.GGUFWriter(str(path), g.arch)
    a = g.arch
    w.add_name(f"synthetic {name} {qtype_name}")
    w.add_uint32(f"{a}.block_count", g.n_layers)
    w.add_uint32(f"{a}.context_length", g.context)
    w.add_uint32(f"{a}.embedding_length", g.d_model)
    w.add_uint32(f"{a}.feed_forward_length", g.ffn_dim)
    w.add_uint32(f"{a}.attention.head_count", g.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", g.n_kv_heads)
    w.add_uint32(f"{a}.attention.key_length", g.head_dim)
    w.add_uint32(f"{a}.attention.value_length", g.head_dim)
    w.add_float32(f"{a}.rope.freq_base", g.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.vocab_size", g.vocab)
    w.add_string("tokenizer.ggml.model", md["tokenizer.ggml.model"])
    w.add_string("tokenizer.ggml.pre", md["tokenizer.ggml.pre"])
    w.add_array("tokenizer.ggml.tokens", md["tokenizer.ggml.tokens"])
    w.add_array("tokenizer.ggml.token_type", md["tokenizer.ggml.token_type"])
    w.add_array("tokenizer.ggml.merges", md["tokenizer.ggml.merges"])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in md:
            w.add_uint32(f"tokenizer.ggml.{key}", md[f"tokenizer.ggml.{key}"])
    w.add_bool("tokenizer.ggml.add_bos_token", bool(md.get("tokenizer.ggml.add_bos_token", False)))
    if md.get("tokenizer.chat_template"):
        w.add_chat_template(md["tokenizer.chat_template"])
    for tname, arr, qt in tensors(g, qtype_name):
        if qt.name in ("F32",):
            w.add_tensor(tname, arr)
        elif qt.name in ("F16",):
            w.add_tensor(tname, arr, raw_dtype=qt)
        else:   # BF16 bits as uint16, or quantized blocks as [rows, row_bytes]
            w.add_tensor(tname, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    return path


def write_safetensors(g: Geometry, name: str, dtype: str, out: Path, shard_bytes: int = 4 << 30) -> Path:
    """A Hugging Face style folder: config.json, tokenizer files, sharded safetensors + index."""
    import torch
    from safetensors.torch import save_file
    from lodestar.formats.synthetic import hf_tokenizer_files, tokenizer_metadata_or_synthetic
    d = out / f"synth-{name}-{dtype.lower()}-hf"
    d.mkdir(parents=True, exist_ok=True)
    tdt = torch.bfloat16 if dtype.upper() == "BF16" else torch.float16
    gen = torch.Generator().manual_seed(0)
    cache: dict = {}

    def w(rows, cols):
        if (rows, cols) not in cache:
            cache[(rows, cols)] = (torch.randn(rows, cols, generator=gen) * 0.02).to(tdt)
        return cache[(rows, cols)]

    q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    names: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(g.vocab, g.d_model),
                                      "model.norm.weight": torch.ones(g.d_model, dtype=tdt)}
    for i in range(g.n_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight": torch.ones(g.d_model, dtype=tdt),
                  p + "post_attention_layernorm.weight": torch.ones(g.d_model, dtype=tdt),
                  p + "self_attn.q_proj.weight": w(q, g.d_model), p + "self_attn.k_proj.weight": w(kv, g.d_model),
                  p + "self_attn.v_proj.weight": w(kv, g.d_model), p + "self_attn.o_proj.weight": w(g.d_model, q),
                  p + "mlp.gate_proj.weight": w(g.ffn_dim, g.d_model), p + "mlp.up_proj.weight": w(g.ffn_dim, g.d_model),
                  p + "mlp.down_proj.weight": w(g.d_model, g.ffn_dim)}
        if g.qk_norm:
            names |= {p + "self_attn.q_norm.weight": torch.ones(g.head_dim, dtype=tdt),
                      p + "self_attn.k_norm.weight": torch.ones(g.head_dim, dtype=tdt)}
    if not g.tied:
        names["lm_head.weight"] = w(g.vocab, g.d_model)
    shards, cur, size = [], {}, 0
    for k, t in names.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = t
        size += nbytes
    shards.append(cur)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in names.values())},
             "weight_map": {}}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # tensors shared between layers must be written as separate storages
        save_file({k: v.clone() if id(v) in {id(x) for x in cache.values()} else v for k, v in shard.items()},
                  str(d / fname), metadata={"format": "pt"})
        for k in shard:
            index["weight_map"][k] = fname
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[g.arch]
    cfg = {"architectures": [arch], "model_type": g.arch, "hidden_size": g.d_model, "num_hidden_layers": g.n_layers,
           "num_attention_heads": g.n_heads, "num_key_value_heads": g.n_kv_heads, "head_dim": g.head_dim,
           "intermediate_size": g.ffn_dim, "vocab_size": g.vocab, "max_position_embeddings": g.context,
           "rms_norm_eps": 1e-5, "rope_theta": g.rope_theta, "tie_word_embeddings": g.tied,
           "torch_dtype": "bfloat16" if tdt == torch.bfloat16 else "float16", "bos_token_id": 1, "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    md, _ = tokenizer_metadata_or_synthetic(g.vocab)
    for fname, text in hf_tokenizer_files(md).items():
        (d / fname).write_text(text)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), required=True)
    ap.add_argument("--qtype", choices=QTYPES, default="F16")
    ap.add_argument("--format", choices=["gguf", "safetensors"], default="gguf")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    g = GEOMETRIES[a.geometry]
    if not holds_blocks(g, a.qtype):
        ap.error(f"{a.geometry}'s rows ({', '.join(map(str, row_widths(g)))} weights) do not hold whole {a.qtype} "
                 f"blocks; for this geometry use one of {', '.join(t for t in QTYPES if holds_blocks(g, t))}")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.format == "gguf":
        print(write_gguf(g, a.geometry, a.qtype, a.out))
    else:
        print(write_safetensors(g, a.geometry, a.qtype, a.out))


if __name__ == "__main__":
    main()
