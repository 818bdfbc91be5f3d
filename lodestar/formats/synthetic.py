"""Random-weight checkpoints of real geometries, for speed measurements.

Decode and prefill speed do not depend on weight values, so these stand in for real
models where none can be downloaded. ``SyntheticCheckpoint`` builds the tensors a GGUF
file of that geometry and type would hold (same names, types and byte layouts: random
blocks with small finite scales) directly in memory on any device, so loading an 8B
model takes seconds instead of writing and reading 16 GB; the layers built from it run
exactly the kernels a GGUF file would. ``synthetic_tokenizer_metadata`` gives a byte-level
BPE vocabulary of any size for machines without the default model installed.

Anything that takes ``--model`` also takes ``synthetic:<geometry>[:<type>]`` (e.g.
``synthetic:llama-3.1-8b:BF16``): the checkpoint is made on the device the model loads on,
and a tensor-parallel rank makes only the tensors it slices (a 70B-geometry model needs no
disk and no host memory).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from lodestar.formats.config import ModelConfig

T = GGMLQuantizationType


@dataclass(frozen=True)
class Geometry:
    arch: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float
    tied: bool
    qk_norm: bool = False
    vocab: int = 49152
    context: int = 32768


GEOMETRIES = {
    "smollm2-135m": Geometry("llama", 576, 30, 9, 3, 64, 1536, 100000.0, tied=True, context=8192),
    "llama-3.2-1b": Geometry("llama", 2048, 16, 32, 8, 64, 8192, 500000.0, tied=True),
    "llama-3.1-8b": Geometry("llama", 4096, 32, 32, 8, 128, 14336, 500000.0, tied=False),
    "llama-70b": Geometry("llama", 8192, 80, 64, 8, 128, 28672, 500000.0, tied=False, context=131072),
    "qwen3-8b": Geometry("qwen3", 4096, 36, 32, 8, 128, 12288, 1000000.0, tied=False, qk_norm=True),
}
# Q4_K_M, Q5_K_M: llama.cpp's mixes of those names (``tensor_kind``), the types most GGUF
# downloads come in.
QTYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q4_K_M", "Q5_K_M")
K_MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}      # mix -> its main type
SPEC_PREFIX = "synthetic:"
SPEC_SEED = 1234


def parse_spec(spec) -> tuple[str, str] | None:
    """(geometry, type) of a ``synthetic:<geometry>[:<type>]`` model spec (type defaults to
    BF16), None for any other spec; ``ModelNotFoundError`` naming the choices for a bad one."""
    text = str(spec) if spec is not None else ""
    if not text.startswith(SPEC_PREFIX):
        return None
    parts = text[len(SPEC_PREFIX):].split(":")
    geometry, qtype = parts[0], (parts[1] if len(parts) > 1 else "BF16").upper()
    from lodestar.formats.catalog import ModelNotFoundError
    if len(parts) > 2 or geometry not in GEOMETRIES or qtype not in QTYPES:
        raise ModelNotFoundError(f"--model {text!r}: expected synthetic:<geometry>[:<type>] with geometry one of "
                         f"{', '.join(GEOMETRIES)} and type one of {', '.join(QTYPES)}")
    if not holds_blocks(GEOMETRIES[geometry], qtype):
        fits = [t for t in QTYPES if holds_blocks(GEOMETRIES[geometry], t)]
        raise ModelNotFoundError(f"--model {text!r}: {geometry}'s rows ({', '.join(map(str, row_widths(GEOMETRIES[geometry])))} "
                                 f"weights) do not hold whole {qtype} blocks; for this geometry use one of {', '.join(fits)}")
    return geometry, qtype


def row_widths(g: Geometry) -> list[int]:
    """The row lengths (input widths) of a geometry's projections."""
    return sorted({g.d_model, g.n_heads * g.head_dim, g.ffn_dim})


def holds_blocks(g: Geometry, qtype_name: str) -> bool:
    """Every projection row of ``g`` is a whole number of blocks of each type a ``qtype_name``
    file holds (K-quants: 256 weights a block)."""
    kinds = {tensor_kind(qtype_name, name, i, g.n_layers) for name in ("attn_v", "attn_q") for i in range(g.n_layers)}
    kinds |= set(tensor_types(qtype_name))
    blocks = [1 if k in ("F16", "BF16", "F32") else GGML_QUANT_SIZES[T[k]][0] for k in kinds]
    return all(w % b == 0 for w in row_widths(g) for b in blocks)

# fp16 scale fields per type (byte offset in the block): small, finite values.
_SCALE_OFFSETS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
                  T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q2_K: (80, 82), T.Q6_K: (208,)}


def tensor_types(qtype_name: str) -> tuple[str, str, str]:
    """(layer weights, token embedding, output head) types of a file of ``qtype_name``,
    as llama.cpp's quantizer picks them (Q4_K_M, Q5_K_M: the layers' main type; some of
    their layers hold more bits, ``tensor_kind``)."""
    if qtype_name in ("F16", "BF16"):
        return qtype_name, qtype_name, qtype_name
    if qtype_name in K_MIXES:
        return K_MIXES[qtype_name], K_MIXES[qtype_name], "Q6_K"
    return qtype_name, "Q8_0", "Q6_K" if qtype_name == "Q4_K" else "Q8_0"


def more_bits(layer: int, n_layers: int) -> bool:
    """Layers to which llama.cpp's Q4_K_M / Q5_K_M mixes give attn_v and ffn_down more bits:
    the first and last eighth, and every third layer between them."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_kind(qtype_name: str, name: str, layer: int, n_layers: int) -> str:
    """Type of layer ``layer``'s tensor ``name`` (``attn_q``, ``ffn_down``, ...) in a file of
    ``qtype_name``: Q4_K_M (Q5_K_M) holds attn_v and ffn_down in Q6_K on ``more_bits`` layers
    (for a 32-layer model, 16 of them), everything else in Q4_K (Q5_K), as llama.cpp's
    quantizer does."""
    if qtype_name in K_MIXES:
        return "Q6_K" if name in ("attn_v", "ffn_down") and more_bits(layer, n_layers) else K_MIXES[qtype_name]
    return tensor_types(qtype_name)[0]


def random_weight(kind: str, rows: int, cols: int, generator: torch.Generator,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """Random bytes ``[rows, bytes_per_row]`` of a ``kind`` weight (F16/BF16: N(0, 0.02))."""
    if kind in ("F16", "BF16"):
        w = torch.randn(rows, cols, generator=generator, device=device) * 0.02
        return w.to(torch.float16 if kind == "F16" else torch.bfloat16).view(torch.uint8)
    qt = T[kind]
    block, size = GGML_QUANT_SIZES[qt]
    data = torch.randint(0, 256, (rows, cols // block, size), generator=generator, device=device, dtype=torch.uint8)
    d = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8).to(device)
    m = torch.tensor([0.001], dtype=torch.float16).view(torch.uint8).to(device)
    for i, off in enumerate(_SCALE_OFFSETS.get(qt, ())):
        data[..., off:off + 2] = d if i == 0 else m
    return data.reshape(rows, -1)


@dataclass(eq=False)
class SyntheticTensor:
    """A tensor whose random bytes are made on each ``data`` access (nothing is held)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    seed: int
    device: torch.device

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        n = 1
        for s in self.shape:
            n *= s
        return n // block * size

    @property
    def data(self) -> torch.Tensor:
        if self.qtype == T.F32:     # norm weights: ones
            return torch.ones(self.shape[-1]).view(torch.uint8).reshape(1, -1)
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        rows, cols = self.shape
        return random_weight(self.qtype.name, rows, cols, gen, self.device)

    def dequantize(self) -> torch.Tensor:
        from lodestar.kernels.dequant import dequantize
        return dequantize(self.data.cpu(), self.qtype, self.shape)


class SyntheticCheckpoint:
    """The tensors of a GGUF file of ``geometry`` and ``qtype_name``, random, made on ``device``
    when the loader reads them.

    Every layer has its own random weights (so memory use and bytes read per token are
    those of the real model). ``seed`` fixes them.
    """

    def __init__(self, geometry: str | Geometry, qtype_name: str, device: str | torch.device = "cpu",
                 seed: int = 0, n_layers: int | None = None) -> None:
        g = GEOMETRIES[geometry] if isinstance(geometry, str) else geometry
        self.geometry, self.qtype_name = g, qtype_name
        name = geometry if isinstance(geometry, str) else g.arch
        device = torch.device(device)
        _, emb_kind, out_kind = tensor_types(qtype_name)
        self.tensors: dict[str, SyntheticTensor] = {}
        layers = g.n_layers if n_layers is None else n_layers

        def add(tname: str, kind: str, rows: int, cols: int) -> None:
            self.tensors[tname] = SyntheticTensor(tname, T[kind], (rows, cols), seed * 100003 + len(self.tensors),
                                                  device)

        def ones(tname: str, n: int) -> None:
            self.tensors[tname] = SyntheticTensor(tname, T.F32, (n,), 0, torch.device("cpu"))

        q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
        add("token_embd.weight", emb_kind, g.vocab, g.d_model)
        for i in range(layers):
            p = f"blk.{i}."
            ones(p + "attn_norm.weight", g.d_model)
            kind = {t: tensor_kind(qtype_name, t, i, g.n_layers) for t in
                    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
            add(p + "attn_q.weight", kind["attn_q"], q, g.d_model)
            add(p + "attn_k.weight", kind["attn_k"], kv, g.d_model)
            add(p + "attn_v.weight", kind["attn_v"], kv, g.d_model)
            add(p + "attn_output.weight", kind["attn_output"], g.d_model, q)
            if g.qk_norm:
                ones(p + "attn_q_norm.weight", g.head_dim)
                ones(p + "attn_k_norm.weight", g.head_dim)
            ones(p + "ffn_norm.weight", g.d_model)
            add(p + "ffn_gate.weight", kind["ffn_gate"], g.ffn_dim, g.d_model)
            add(p + "ffn_up.weight", kind["ffn_up"], g.ffn_dim, g.d_model)
            add(p + "ffn_down.weight", kind["ffn_down"], g.d_model, g.ffn_dim)
        ones("output_norm.weight", g.d_model)
        if not g.tied:
            add("output.weight", out_kind, g.vocab, g.d_model)
        self.config = ModelConfig(
            arch=g.arch, name=f"synthetic {name} {qtype_name}", n_layers=layers, d_model=g.d_model,
            n_heads=g.n_heads, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim, v_head_dim=g.head_dim,
            ffn_dim=g.ffn_dim, vocab_size=g.vocab, context_length=g.context, rms_eps=1e-5,
            rope_theta=g.rope_theta, rope_dim=g.head_dim, sliding_window=None, tie_embeddings=g.tied,
            extra={"hf_layout": True})
        self.metadata: dict = {}
        # stands in for the file SHA-256 that keys disk KV checkpoints: same weights, same id
        desc = f"{SPEC_PREFIX}{name}:{qtype_name}:seed={seed}:layers={layers}"
        self.fingerprint = hashlib.sha256(desc.encode()).hexdigest()

    @classmethod
    def from_spec(cls, spec: str, device: str | torch.device = "cpu") -> "SyntheticCheckpoint":
        """The checkpoint a ``synthetic:...`` spec names (fixed seed: every rank and every
        process makes the same weights)."""
        parsed = parse_spec(spec)
        if parsed is None:
            raise ValueError(f"{spec!r} is not a synthetic:<geometry>[:<type>] spec")
        return cls(parsed[0], parsed[1], device=device, seed=SPEC_SEED)

    def tokenizer(self):
        """The default model's tokenizer when installed and of this vocabulary size, else a
        synthetic byte-level one."""
        from lodestar.tokenizer import Tokenizer
        meta, _ = tokenizer_metadata_or_synthetic(self.config.vocab_size)
        return Tokenizer.from_metadata(meta)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the checkpoint's tensors (what a file of it would hold)."""
        return sum(t.n_bytes for t in self.tensors.values())


# ----------------------------------------------------------------------------- tokenizer

SYNTHETIC_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def synthetic_tokenizer_metadata(vocab_size: int = 49152) -> dict:
    """GGUF-style tokenizer metadata of a byte-level BPE vocabulary of ``vocab_size`` tokens:
    three control tokens, the 256 byte symbols, then merges of byte pairs in order."""
    from lodestar.tokenizer import bytes_to_unicode
    alphabet = list(bytes_to_unicode().values())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + alphabet
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(tokens) >= vocab_size:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    if len(tokens) < vocab_size:
        raise ValueError(f"synthetic vocabulary holds at most {len(tokens)} tokens")
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": SYNTHETIC_CHAT_TEMPLATE,
    }


def tokenizer_metadata_or_synthetic(vocab_size: int = 49152) -> tuple[dict, str]:
    """The default model's tokenizer metadata when it is installed (its vocabulary has
    49,152 tokens), else a synthetic one; second item says which."""
    from lodestar.formats.catalog import ModelNotFoundError, known_model_path
    try:
        path = known_model_path("default")
    except ModelNotFoundError:
        return synthetic_tokenizer_metadata(vocab_size), "synthetic"
    from lodestar.tokenizer import read_tokenizer_metadata
    meta = read_tokenizer_metadata(path)
    if len(meta.get("tokenizer.ggml.tokens", ())) != vocab_size:
        return synthetic_tokenizer_metadata(vocab_size), "synthetic"
    return meta, "default model"


def hf_tokenizer_files(meta: dict) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json contents for a Hugging Face folder."""
    from lodestar.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    config = {"chat_template": tok.chat_template, "add_bos_token": tok.add_bos,
              "bos_token": tokens[tok.bos_id] if tok.bos_id is not None else None,
              "eos_token": tokens[tok.eos_id] if tok.eos_id is not None else None}
    return {"tokenizer.json": tok.backend.to_str(), "tokenizer_config.json": json.dumps(config, indent=1)}
