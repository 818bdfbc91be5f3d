"""Load a model file into a ready-to-run (model, tokenizer) pair."""
from __future__ import annotations

import gc
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from lodestar.engine.collector import paused
from lodestar.formats.catalog import resolve_model_path
from lodestar.formats.config import ModelConfig
from lodestar.formats.gguf import GGUFError, GGUFFile
from lodestar.formats.registry import added_folder
from lodestar.kernels.policy import KernelPolicy, active, install
from lodestar.models import WEIGHT_MODES, CheckpointError, UnsupportedArchitectureError, build_model, validate
from lodestar.tokenizer import Tokenizer, TokenizerError

DEVICES = ("cpu", "cuda", "auto")
TENSOR_PARALLEL_ENV = "LODESTAR_TENSOR_PARALLEL"   # default of load_model's tensor_parallel


class DeviceError(ValueError):
    """A --device that this machine cannot provide."""


@dataclass
class LoadedModel:
    path: Path
    file: object            # GGUFFile, or a Hugging Face checkpoint (formats.safetensors)
    config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer
    mode: str
    load_seconds: float
    device: str = "cpu"
    tensor_parallel: int = 1    # ranks; above 1, ``model`` is rank 0's slice
    group: object | None = None # lodestar.distributed.TensorParallelGroup: the other ranks

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit)."""
        if self.group is not None:
            self.group.shutdown()


def resolve_device(device: str | None) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    device = device or "cpu"
    if device not in DEVICES and not device.startswith("cuda:"):
        raise DeviceError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    return device


def open_checkpoint(spec: str | Path | None, device: str | torch.device = "cpu") -> tuple[Path, object]:
    """(path, tensor source) of a GGUF path, Hugging Face folder, known name, None (the
    default) or ``synthetic:<geometry>[:<type>]`` (random weights made on ``device``)."""
    from lodestar.formats.synthetic import SyntheticCheckpoint, parse_spec
    if parse_spec(spec) is not None:
        return Path(str(spec)), SyntheticCheckpoint.from_spec(str(spec), device)
    folder = Path(str(spec)).expanduser() if spec is not None else None
    if folder is not None and not folder.exists():
        folder = added_folder(str(spec))
    if folder is not None and folder.is_dir():
        from lodestar.formats.safetensors import HFCheckpoint
        return folder, HFCheckpoint(folder)
    path = resolve_model_path(spec)
    return path, GGUFFile(path)


def validate_gguf(path: Path, source: GGUFFile) -> None:
    """Check a GGUF file against its architecture (metadata and shapes; no tensor data is
    read); a mismatch is a one-line ``GGUFError`` naming the file and the tensor or key."""
    try:
        validate(source.config, source.tensors)
    except (CheckpointError, UnsupportedArchitectureError) as e:
        raise GGUFError(f"{path}: {e}") from None


def gguf_tokenizer(path: Path, source: GGUFFile) -> Tokenizer:
    """The tokenizer a GGUF file describes; bad tokenizer metadata is a ``GGUFError`` naming
    the file and the key."""
    try:
        return Tokenizer.from_metadata(source.metadata)
    except TokenizerError as e:
        raise GGUFError(f"{path}: {e}") from None


def resolve_tensor_parallel(tensor_parallel: int | None) -> int:
    """``None`` -> $LODESTAR_TENSOR_PARALLEL, else 1."""
    if tensor_parallel is None:
        raw = os.environ.get(TENSOR_PARALLEL_ENV, "1")
        try:
            tensor_parallel = int(raw)
        except ValueError:
            raise ValueError(f"{TENSOR_PARALLEL_ENV}={raw!r}: expected a whole number of ranks") from None
    if tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel {tensor_parallel}: needs at least 1 rank")
    return tensor_parallel


def load_model(spec: str | Path | None = None, mode: str = "packed", progress: bool = True,
               device: str = "cpu", tensor_parallel: int | None = None,
               tp_timeout_s: float | None = None, policy: KernelPolicy | None = None) -> LoadedModel:
    """Open ``spec`` (GGUF path, Hugging Face folder, known name or None for the default) and
    build model + tokenizer on ``device`` (cpu, cuda or auto).

    ``mode``: ``packed`` keeps quantized blocks packed; ``fp32``/``bf16`` dequantize at load.
    ``tensor_parallel``: ranks to split the model over (default $LODESTAR_TENSOR_PARALLEL or 1).
    Above 1, ranks 1..N-1 start as worker processes (one GPU each on CUDA, gloo on the CPU),
    each building only its slice, and ``model`` is rank 0's slice; ``tp_timeout_s`` bounds
    how long a collective waits for another rank. ``policy``: the GPU kernels' tuning choices,
    put in force for the process; None keeps the one in force (the ``LODESTAR_*`` switches of
    ``kernels.policy.SWITCHES``, read from the environment at the first load).
    """
    if policy is not None:
        install(policy)
    else:
        active()        # a bad switch fails here, before anything is loaded
    if mode not in WEIGHT_MODES:
        raise ValueError(f"--dtype {mode!r}: choose one of {', '.join(WEIGHT_MODES)}")
    device = resolve_device(device)
    world = resolve_tensor_parallel(tensor_parallel)
    from lodestar.formats.synthetic import parse_spec
    is_synthetic = parse_spec(spec) is not None
    t0 = time.perf_counter()
    path, source = open_checkpoint(spec, device)
    if isinstance(source, GGUFFile):
        validate_gguf(path, source)     # before anything is built or allocated
        with paused():      # a 262,144-token vocabulary makes millions of objects; collections would walk them all
            tokenizer = gguf_tokenizer(path, source)
    else:
        tokenizer = source.tokenizer()
    group = None
    if world > 1:
        from lodestar.distributed import DEFAULT_TIMEOUT_S, ShardedWeightLoader, ShardSpec, TensorParallelGroup
        from lodestar.distributed.sharding import check_split
        check_split(source.config.n_heads, source.config.n_kv_heads, world)   # before starting anything
        if device.startswith("cuda") and torch.cuda.device_count() < world:
            raise DeviceError(f"--tensor-parallel {world} needs {world} CUDA devices; "
                              f"{torch.cuda.device_count()} are visible")
        gc.collect()   # a dropped tensor-parallel model may still hold the process group through a cycle
        group = TensorParallelGroup(str(spec) if is_synthetic else str(path), mode, device, world,
                                    DEFAULT_TIMEOUT_S if tp_timeout_s is None else tp_timeout_s)
    try:
        total = sum(t.n_bytes for t in source.tensors.values()) // world
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}", leave=False,
                  disable=not progress) as bar:
            on_tensor = lambda t: bar.update(t.n_bytes // world)  # noqa: E731
            loader = ShardedWeightLoader(source, ShardSpec(0, world), mode, on_tensor, device) if world > 1 else None
            model = build_model(source.config, source, mode, on_tensor=on_tensor, device=device, loader=loader)
        if device != "cpu":
            torch.cuda.synchronize()
        if group is not None:
            group.connect()
    except BaseException:
        if group is not None:
            group.shutdown()
        raise
    loaded = LoadedModel(path, source, source.config, model, tokenizer, mode, time.perf_counter() - t0, device,
                         world, group)
    if group is not None:   # a dropped model stops its workers
        weakref.finalize(loaded, group.shutdown)
    return loaded
