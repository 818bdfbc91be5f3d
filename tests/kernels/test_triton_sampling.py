"""The greedy-token kernel against ``model_runner.greedy_into``'s torch path (``torch.max``)."""
from __future__ import annotations

import math

import pytest
import torch
from triton_helpers import kernel_device

from lodestar.engine.model_runner import greedy_into
from lodestar.kernels import triton_sampling as ts

B = ts.BLOCK


def _reference(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(2, x.shape[0], dtype=torch.int64)
    greedy_into(x.cpu(), out)
    return out


def _greedy(x: torch.Tensor, chunk: int | None = None, extra: int = 0) -> torch.Tensor:
    out = torch.full((2, x.shape[0] + extra), -7, dtype=torch.int64, device=x.device)
    ts.greedy_rows(x, out, chunk)
    got = out.cpu()
    assert (got[:, x.shape[0]:] == -7).all()        # columns past R untouched
    assert (ts.workspace(x.device).counters == 0).all()
    return got[:, :x.shape[0]]


def _check(x: torch.Tensor, chunk: int | None = None) -> None:
    got, ref = _greedy(x, chunk, extra=3), _reference(x)
    assert torch.equal(got[1], ref[1])
    ok = ref[1] == 1
    assert torch.equal(got[0][ok], ref[0][ok])
    assert ((got[0] >= 0) & (got[0] < x.shape[1])).all()


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("vocab", [1000, 49152, 151936])
def test_random_rows_match_torch_max(rows, vocab):
    dev = kernel_device()
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab)).to(dev)
    _check(x)
    if vocab > B:
        _check(x, B)                       # one step per chunk, the most chunks
        _check(x, 2 * B)


@pytest.mark.parametrize("chunk", [None, B, 2 * B, 4 * B])
def test_ties_take_the_first_index(chunk):
    dev = kernel_device()
    v = 4 * B + 5
    # each row: equal maxima at these columns (across lanes, steps of one lane, chunk edges)
    spots = [[B + 7, 2 * B + 7, 4 * B + 1], [3, B + 3, 2 * B + 3], [B - 1, B], [2 * B - 1, 2 * B, 3 * B],
             [4 * B + 4, 4 * B + 2], [0, v - 1], [17, 18, 19], [2 * B + 9, 9 + B]]
    x = torch.randn(len(spots), v, generator=torch.Generator().manual_seed(1))
    for r, cols in enumerate(spots):
        x[r, cols] = 10.0
    x = x.to(dev)
    _check(x, chunk)
    assert _greedy(x, chunk)[0].tolist() == [min(c) for c in spots]

    z = torch.zeros(3, v)                  # every column ties; -0.0 ties with 0.0
    z[1, 0] = -0.0
    z[2] = -math.inf
    z[2, [B + 2, 3 * B]] = -0.0
    z[2, [B + 1, 2 * B]] = 0.0
    z = z.to(dev)
    assert _greedy(z, chunk).tolist() == [[0, 0, B + 1], [1, 1, 1]]
    _check(z, chunk)


@pytest.mark.parametrize("vocab, chunk", [(1000, None), (3 * B + 11, None), (3 * B + 11, B)])
def test_inf_and_nan_rows(vocab, chunk):
    dev = kernel_device()
    x = torch.randn(8, vocab, generator=torch.Generator().manual_seed(2))
    last = vocab - 1
    x[0] = -math.inf                       # all -inf: flag 0
    x[1] = -math.inf
    x[1, last] = -1e30                     # one finite value among -inf
    x[2, [5, last]] = math.inf             # +inf is a valid maximum: the first one
    x[3, last] = math.nan                  # NaN after the maximum
    x[4, 0] = math.nan                     # NaN before it
    x[4, 3] = 1e9
    x[5] = -math.inf
    x[5, vocab // 2] = math.nan            # NaN among -inf
    x[6, [7, last]] = math.inf
    x[6, vocab // 3] = math.nan            # NaN with +inf present
    x = x.to(dev)
    got = _greedy(x, chunk)
    assert got[1].tolist() == [0, 1, 1, 0, 0, 0, 0, 1]
    assert got[0, 1] == last and got[0, 2] == 5
    _check(x, chunk)


@pytest.mark.parametrize("chunk", [None, B])
def test_bf16_rows(chunk):
    dev = kernel_device()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3 * B + 100, generator=g) * 4).round().to(torch.bfloat16)   # many ties
    x[3] = -math.inf
    x[4, 77] = math.nan
    x = x.to(dev)
    got = _greedy(x, chunk)
    _check(x, chunk)
    assert torch.equal(got[0][:3], x[:3].float().cpu().eq(x[:3].float().cpu().amax(-1, keepdim=True))
                       .int().argmax(-1))


def test_row_stride_of_a_wider_tensor():
    dev = kernel_device()
    wide = torch.randn(4, 2 * B + 40, generator=torch.Generator().manual_seed(4)).to(dev)
    x = wide[:, 3: 3 + 2 * B + 20]
    _check(x, B)
    _check(x)


def test_split_sizes(monkeypatch):
    monkeypatch.setattr(ts, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert ts.split(1, 49152, cpu) == (B, 12)
    for rows in (1, 2, 3, 8, 64, 200):
        for vocab in (1, 1000, B, B + 1, 32000, 49152, 128256, 151936, 262144):
            chunk, chunks = ts.split(rows, vocab, cpu)
            assert chunk % B == 0 and 1 <= chunks <= ts.MAX_CHUNKS
            assert (chunks - 1) * chunk < vocab <= chunks * chunk


def test_bad_arguments():
    dev = kernel_device()
    x = torch.randn(2, 10, device=dev)
    with pytest.raises(ValueError):
        ts.greedy_rows(x, torch.zeros(2, 1, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError):
        ts.greedy_rows(x, torch.zeros(2, 2, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError):
        ts.greedy_rows(x.half(), torch.zeros(2, 2, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError):
        ts.greedy_rows(torch.randn(2, 65 * B, device=dev), torch.zeros(2, 2, dtype=torch.int64, device=dev), B)
