"""The access-pattern probe (``kernel_probe pattern``) reads every word of its array exactly
once in every pattern: the xor of all words each pattern read is the same. Runs on a CUDA
device, or on the CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from triton_helpers import kernel_device  # noqa: E402


def test_every_pattern_reads_every_word_once():
    dev = kernel_device()
    from lodestar.bench import kernel_probe
    rows = 64
    got = kernel_probe.read_patterns(rows=rows, device=dev, check=True)
    assert len(got) == len([p for p in kernel_probe.PATTERNS.values() if not p[5]]) + len(kernel_probe.FLAT_STREAMS)
    gen = torch.Generator(device=dev).manual_seed(kernel_probe.SEED)
    words = torch.randint(-2**31, 2**31 - 1, (rows * 512,), dtype=torch.int32, device=dev, generator=gen)
    want = functools.reduce(lambda a, b: a ^ b, words.tolist())
    assert set(got.values()) == {want}, got


def test_pattern_is_a_probe_choice(monkeypatch):
    from lodestar.bench import kernel_probe
    monkeypatch.setattr(sys, "argv", ["kernel_probe", "nothing"])
    with pytest.raises(SystemExit):
        kernel_probe.main()
