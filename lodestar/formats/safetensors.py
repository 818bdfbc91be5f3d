"""Hugging Face checkpoints: a folder with config.json, *.safetensors (one file, or shards
listed in model.safetensors.index.json) and tokenizer.json (+ tokenizer_config.json).

``HFCheckpoint`` offers what the model builders read from a GGUF file: a ``ModelConfig``
and tensors under the GGUF names (``blk.3.attn_q.weight`` ...) with a GGML type (F32,
F16 or BF16), a shape and their raw bytes, read lazily from the memory-mapped shards.
Differences from llama.cpp's files are handled here or flagged for the model:

- q/k rows are in rotate-half order already (``config.extra["hf_layout"]``: the Llama
  builder skips the un-permute it applies to GGUF files);
- Gemma norms store ``w`` where GGUF stores ``1 + w``: the ``+ 1`` is added here (fp32);
- Llama 3.1 ``rope_scaling`` becomes the ``rope_freqs.weight`` factors llama.cpp writes.

Supported ``model_type``: llama, mistral, qwen2, qwen3, gemma3 / gemma3_text.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf.constants import GGMLQuantizationType

from lodestar.formats.config import ModelConfig

T = GGMLQuantizationType

ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
         "gemma3": "gemma3", "gemma3_text": "gemma3"}

_DTYPES = {"BF16": (T.BF16, torch.bfloat16), "F16": (T.F16, torch.float16), "F32": (T.F32, torch.float32)}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)")
_SKIP = ("vision_tower", "multi_modal_projector", "rotary_emb.inv_freq")


class HFCheckpointError(ValueError):
    """A Hugging Face folder that cannot be used; the message names the folder and the fix."""


@dataclass(eq=False)
class HFTensor:
    """One tensor of the checkpoint under its GGUF name; bytes read on ``data`` access."""

    name: str
    hf_name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    _open: Any                  # safe_open handle of its shard
    add_one: bool = False       # Gemma norm: GGUF's 1 + w, as fp32
    _value: torch.Tensor | None = None

    def _tensor(self) -> torch.Tensor:
        if self._value is not None:
            return self._value
        t = self._open.get_tensor(self.hf_name)
        return t.float() + 1.0 if self.add_one else t

    @property
    def data(self) -> torch.Tensor:
        """uint8 ``[rows, bytes_per_row]`` (1-D tensors: one row)."""
        t = self._tensor().contiguous()
        rows = t.shape[0] if t.dim() > 1 else 1
        return t.view(torch.uint8).reshape(rows, -1)

    def dequantize(self) -> torch.Tensor:
        return self._tensor().float().reshape(self.shape)


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in dict.fromkeys(weight_map.values())]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
    return files


def _gguf_name(hf_name: str, arch: str, n_layers: int) -> str | None:
    if any(s in hf_name for s in _SKIP):
        return None
    m = _LAYER.fullmatch(hf_name)
    if m:
        table = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
        rest = table.get(m.group(2))
        return f"blk.{m.group(1)}.{rest}" if rest and int(m.group(1)) < n_layers else None
    if hf_name.endswith("embed_tokens.weight"):
        return "token_embd.weight"
    if hf_name.endswith("lm_head.weight"):
        return "output.weight"
    if re.fullmatch(r"(?:.*\.)?model\.norm\.weight|norm\.weight", hf_name):
        return "output_norm.weight"
    return None


def _text_config(cfg: dict) -> dict:
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope theta, rope scaling dict or None) from either config style."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:   # per-layer-type (Gemma 3, transformers 5)
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(theta), scaling
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def llama3_rope_factors(scaling: dict, theta: float, dim: int) -> torch.Tensor:
    """llama.cpp's ``rope_freqs.weight`` for Llama 3.1-style scaling (convert_hf_to_gguf)."""
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


class HFCheckpoint:
    """A Hugging Face model folder read as GGUF-named tensors plus a ``ModelConfig``."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open
        self.path = Path(folder)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise HFCheckpointError(f"{self.path}: no config.json (not a Hugging Face model folder)")
        self.hf_config = json.loads(cfg_path.read_text())
        cfg = _text_config(self.hf_config)
        model_type = cfg.get("model_type")
        arch = ARCHS.get(model_type)
        if arch is None:
            raise HFCheckpointError(f"{self.path}: model_type {model_type!r} is not supported; supported: "
                                    f"{', '.join(sorted(ARCHS))}")
        n_layers = int(cfg["num_hidden_layers"])
        self.tensors: dict[str, HFTensor] = {}
        self._handles = []
        for shard in _shards(self.path):
            h = safe_open(str(shard), framework="pt")
            self._handles.append(h)
            for hf_name in h.keys():
                name = _gguf_name(hf_name, arch, n_layers)
                if name is None:
                    continue
                sl = h.get_slice(hf_name)
                dtype = sl.get_dtype()
                if dtype not in _DTYPES:
                    raise HFCheckpointError(f"{shard}: tensor {hf_name} has dtype {dtype}; supported: "
                                            f"{', '.join(_DTYPES)}")
                shape = tuple(int(s) for s in sl.get_shape())
                qtype, tdt = _DTYPES[dtype]
                add_one = arch == "gemma3" and name.endswith("norm.weight")
                if add_one:
                    qtype, tdt = T.F32, torch.float32
                n = math.prod(shape) * torch.tensor([], dtype=tdt).element_size()
                self.tensors[name] = HFTensor(name, hf_name, qtype, shape, n, h, add_one)
        self.config = self._config(cfg, arch, n_layers)
        self.metadata: dict = {}

    def _config(self, cfg: dict, arch: str, n_layers: int) -> ModelConfig:
        d_model = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or d_model // n_heads)
        theta, scaling = _rope(cfg)
        extra: dict[str, Any] = {"hf_layout": True}
        rope_scale = 1.0
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "linear":
            rope_scale = float(scaling.get("factor", 1.0))
        elif scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3" or arch not in ("llama", "mistral"):
                raise HFCheckpointError(f"{self.path}: rope scaling {kind!r} is not supported for {arch}")
            factors = llama3_rope_factors(scaling, theta, head_dim)
            self.tensors["rope_freqs.weight"] = HFTensor("rope_freqs.weight", "", T.F32, tuple(factors.shape),
                                                         factors.numel() * 4, None, _value=factors)
        if "token_embd.weight" not in self.tensors:
            raise HFCheckpointError(f"{self.path}: no embed_tokens.weight tensor")
        sliding = cfg.get("sliding_window")
        if arch == "gemma3":
            pattern = cfg.get("sliding_window_pattern")
            if pattern is None and isinstance(cfg.get("layer_types"), list):
                types = cfg["layer_types"]
                pattern = types.index("full_attention") + 1 if "full_attention" in types else n_layers + 1
            local = cfg.get("rope_local_base_freq")
            params = cfg.get("rope_parameters")
            if local is None and isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
                local = params["sliding_attention"].get("rope_theta")
            extra.update(sliding_window_pattern=int(pattern or 6), rope_local_theta=float(local or 10000.0),
                         query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", head_dim)))
        return ModelConfig(
            arch=arch, name=self.path.name, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=head_dim, v_head_dim=head_dim,
            ffn_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            context_length=int(cfg.get("max_position_embeddings", 4096)), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_dim=head_dim, sliding_window=int(sliding) if sliding else None,
            tie_embeddings="output.weight" not in self.tensors, file_type=None, rope_scale=rope_scale, extra=extra)

    def tokenizer(self):
        return load_hf_tokenizer(self.path, self.config.arch, self.hf_config)


# ----------------------------------------------------------------------------- tokenizer

def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, tok_cfg: dict) -> str | None:
    tpl = tok_cfg.get("chat_template")
    if isinstance(tpl, list):   # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if tpl:
        return tpl
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = folder / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text()).get("chat_template")
    return None


def _adds_bos(spec: dict) -> bool:
    """Whether tokenizer.json's post-processor puts a special token before the text."""
    post = spec.get("post_processor") or {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single") or []
            return bool(single) and "SpecialToken" in single[0]
    return False


def _is_byte_level(spec: dict) -> bool:
    def has(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False
    return has(spec.get("decoder")) or has(spec.get("pre_tokenizer"))


def load_hf_tokenizer(folder: str | Path, arch: str = "llama", hf_config: dict | None = None):
    """A ``lodestar.tokenizer.Tokenizer`` from tokenizer.json (+ tokenizer_config.json)."""
    from tokenizers import Tokenizer as Backend

    from lodestar.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, Tokenizer
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise HFCheckpointError(f"{folder}: no tokenizer.json")
    spec = json.loads(path.read_text())
    backend = Backend.from_str(json.dumps(spec))
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    types = [TOKEN_NORMAL] * len(tokens)
    for i, added in backend.get_added_tokens_decoder().items():
        types[i] = TOKEN_CONTROL if added.special else TOKEN_USER_DEFINED
    meta: dict[str, Any] = {
        "general.architecture": arch,
        "tokenizer.ggml.model": "gpt2" if _is_byte_level(spec) else "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_bos_token": bool(tok_cfg.get("add_bos_token", _adds_bos(spec))),
        "tokenizer.ggml.add_eos_token": bool(tok_cfg.get("add_eos_token", False)),
    }
    hf_config = hf_config or {}
    for key, field in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")):
        text = _token_text(tok_cfg.get(field))
        tid = backend.token_to_id(text) if text else None
        if tid is None and isinstance(hf_config.get(f"{field}_id"), int):
            tid = hf_config[f"{field}_id"]
        if tid is not None:
            meta[f"tokenizer.ggml.{key}_token_id"] = tid
    template = _chat_template(folder, tok_cfg)
    if template:
        meta["tokenizer.chat_template"] = template
    tok = Tokenizer(backend, meta)
    # config.json may name further end-of-generation ids (Llama 3: <|eot_id|>, <|eom_id|>).
    eos = hf_config.get("eos_token_id")
    extra = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and 0 <= e < len(tokens)]
    if extra:
        tok.eos_ids = frozenset(tok.eos_ids | set(extra))
    return tok
