"""The access-pattern probe (``kernel_probe pattern``) reads every word of its array exactly
once in every pattern: the xor of all words each pattern read is the same. Runs on a CUDA
device, or on the CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from triton_helpers import kernel_device  # noqa: E402


def test_every_pattern_reads_every_word_once():
    dev = kernel_device()
    from lodestar.bench import kernel_probe
    rows = {"gate_up": 64, "down": 64}
    got = kernel_probe.read_patterns(rows=rows, device=dev, check=True)
    checked = [name for name, p in kernel_probe.PATTERNS.items() if not p[7]]
    assert set(got) == set(checked) | {n for n in got if n.startswith("flat_")}
    assert len(got) == len(checked) + len(kernel_probe.FLAT_STREAMS)
    for array in kernel_probe.ARRAYS:
        words, _ = kernel_probe.pattern_words(array, rows[array], dev)
        want = functools.reduce(lambda a, b: a ^ b, words.tolist())
        mine = {v for n, v in got.items() if n.startswith(array) or (array == "gate_up" and n.startswith("flat_"))}
        assert mine == {want}, (array, got)


def test_pattern_is_a_probe_choice(monkeypatch):
    from lodestar.bench import kernel_probe
    monkeypatch.setattr(sys, "argv", ["kernel_probe", "nothing"])
    with pytest.raises(SystemExit):
        kernel_probe.main()
