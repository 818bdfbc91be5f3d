"""The file weight bytes of the CUDA issue's roofline (``bench.gpu_cells.file_weight_bytes``)."""
from __future__ import annotations

from types import SimpleNamespace

from lodestar.bench.gpu_cells import file_weight_bytes
from lodestar.formats.synthetic import SyntheticCheckpoint


def test_file_weight_bytes_of_the_8b_q4_k_file():
    """Every tensor as stored: Q4_K layers (144 bytes a block of 256), the Q8_0 token
    embedding (34 bytes a block of 32, in the file though a step reads one row), the Q6_K
    head (210 a block of 256) and the fp32 norms; 8B F16 is the 14.77 GB the issue names."""
    d, f, vocab, layers = 4096, 14336, 49152, 32
    per_layer = d * (d + 2 * 1024) + d * d + 3 * d * f
    want = (layers * per_layer // 256 * 144 + vocab * d // 32 * 34 + vocab * d // 256 * 210
            + (2 * layers + 1) * d * 4)
    ck = SyntheticCheckpoint("llama-3.1-8b", "Q4_K")
    assert file_weight_bytes(SimpleNamespace(file=ck)) == want
    f16 = file_weight_bytes(SimpleNamespace(file=SyntheticCheckpoint("llama-3.1-8b", "F16")))
    assert round(f16 / 1e9, 2) == 14.77
