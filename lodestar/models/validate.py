"""Check a checkpoint against its architecture before anything is built or allocated.

Each family lists the tensors it reads with the shape its hyper-parameters imply
(``TensorSpec``) and checks the hyper-parameters it depends on (``check_config``). This
module compares those lists with the checkpoint: every required tensor present, every
tensor of the list with its expected shape, optional groups (q/k/v biases, q/k norms)
complete or absent, and no block past ``block_count``. Metadata and shapes only: no
tensor data is read.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

_BLOCK = re.compile(r"blk\.(\d+)\.")


class CheckpointError(ValueError):
    """Tensors or hyper-parameters that do not fit the architecture; the message names the
    tensor or key, what was expected and what was found."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]      # torch order: rows first
    why: str                    # where the shape comes from, for messages
    required: bool = True
    group: str | None = None    # optional tensors that come all together or not at all


def key(arch: str, suffix: str) -> str:
    return f"{arch}.{suffix}"


def check_blocks(arch: str, n_layers: int, names: list[str]) -> None:
    """Block indices of the tensor names against ``{arch}.block_count``."""
    indices = {int(m.group(1)) for n in names if (m := _BLOCK.match(n))}
    beyond = sorted(i for i in indices if i >= n_layers)
    if beyond:
        extra = next(n for n in names if n.startswith(f"blk.{beyond[0]}."))
        raise CheckpointError(f"unexpected tensor {extra}: {arch}.block_count is {n_layers}, "
                              f"so blocks run 0..{n_layers - 1}")
    if len(indices) < n_layers:
        have = f"tensors for blocks up to blk.{max(indices)}" if indices else "no blk.N tensors"
        first = next(i for i in range(n_layers) if i not in indices)
        raise CheckpointError(f"{arch}.block_count is {n_layers} but the file has {have} "
                              f"and none for blk.{first}")


def check_tensors(specs: Iterable[TensorSpec], tensors: Mapping[str, Any]) -> None:
    """Every spec against ``tensors`` (objects with a ``shape``); the first mismatch raises."""
    specs = list(specs)
    groups: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        if spec.group is not None:
            groups.setdefault(spec.group, []).append(spec)
    for spec in specs:
        t = tensors.get(spec.name)
        if t is None:
            if spec.required:
                raise CheckpointError(f"missing tensor {spec.name}, expected shape {_shape(spec.shape)} "
                                      f"from {spec.why}{_near(spec.name, tensors)}")
            continue
        if tuple(t.shape) != tuple(spec.shape):
            raise CheckpointError(f"tensor {spec.name} has shape {_shape(t.shape)}, expected "
                                  f"{_shape(spec.shape)} from {spec.why}")
    for members in groups.values():
        present = [s.name for s in members if s.name in tensors]
        if present and len(present) != len(members):
            absent = next(s.name for s in members if s.name not in tensors)
            raise CheckpointError(f"tensor {present[0]} is present but {absent} is missing: "
                                  f"{', '.join(s.name for s in members)} come together")


def _shape(shape: Iterable[int]) -> str:
    dims = tuple(int(d) for d in shape)
    return f"({dims[0]},)" if len(dims) == 1 else str(dims)


def _near(name: str, tensors: Mapping[str, Any]) -> str:
    near = difflib.get_close_matches(name, list(tensors), n=2, cutoff=0.85)
    if near:
        return f"; similar: {', '.join(near)} (renamed?)"
    return f"; the file has {len(tensors)} tensors"
