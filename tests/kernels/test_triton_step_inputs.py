"""A decode graph's inputs taken from a host stage (``triton_step_inputs.take_inputs``) against
its torch reference, and the greedy kernel's host result slot."""
from __future__ import annotations

import pytest
import torch
from triton_helpers import kernel_device

from lodestar.kernels import triton_sampling as ts
from lodestar.kernels import triton_step_inputs as si


def _host(size: int, input_bytes: int, dev: str) -> torch.Tensor:
    t = torch.zeros(2, si.stage_bytes(size, input_bytes), dtype=torch.uint8)
    return t.pin_memory() if dev == "cuda" else t


def _fill(host: torch.Tensor, size: int, max_blocks: int, t0: int, input_bytes: int, seed: int,
          host_ids: int, width: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in range(2):
        st = si.stage_views(host[p], size, input_bytes)
        st["header"].copy_(torch.tensor([host_ids, width, 0, 0], dtype=torch.int32))
        st["ids"].copy_(torch.randint(0, 1 << 40, (size,), generator=g))
        st["raw"].copy_(torch.randint(0, 256, (input_bytes,), generator=g, dtype=torch.uint8))


@pytest.mark.parametrize("size,max_blocks,width,first_trip", [
    (1, 5, 5, si.FIRST_TRIP_ELEMENTS),       # one trip: the whole (narrow) table
    (3, 64, 9, 4),                           # a chunk of 1 column a trip: 8 more trips for 9 columns
    (8, 40, 17, 64),                         # 8 columns a trip: 3 trips
    (64, 512, 3, si.FIRST_TRIP_ELEMENTS),    # 64 columns in the first trip, 3 used
])
@pytest.mark.parametrize("host_ids", [0, 1])
def test_take_inputs_matches_reference(size, max_blocks, width, first_trip, host_ids, monkeypatch):
    dev = kernel_device()
    monkeypatch.setattr(si, "FIRST_TRIP_ELEMENTS", first_trip)
    t0 = (20 * size + 15) // 16 * 16
    nbytes = t0 + 4 * size * max_blocks
    host = _host(size, nbytes, dev)
    _fill(host, size, max_blocks, t0, nbytes, seed=size * 7 + host_ids, host_ids=host_ids, width=width)
    for step in (0, 1, 2, 5):       # both stages, counters past the first two
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(step))
        ids = torch.randint(0, 1 << 40, (size + 2,), generator=torch.Generator().manual_seed(step + 100))
        ctl = torch.tensor([step, 9], dtype=torch.int32)
        want = [raw.clone(), ids.clone(), ctl.clone()]
        si.take_inputs_ref(host, want[2], want[0], want[1], size, max_blocks, t0)
        got = [raw.to(dev), ids.to(dev), ctl.to(dev)]
        si.take_inputs(host, got[2], got[0], got[1], size, max_blocks, t0)
        raw_got, ids_got, ctl_got = (t.cpu() for t in got)
        assert ctl_got.tolist() == [step + 1, step % 2]
        assert torch.equal(ids_got, want[1])
        assert torch.equal(raw_got[:t0], want[0][:t0])
        tab = lambda b: b[t0:].view(torch.int32).view(size, max_blocks)  # noqa: E731
        assert torch.equal(tab(raw_got)[:, :width], tab(want[0])[:, :width])
        # the columns past the first trip and the header's count are left as they were
        cols = max(si.table_chunk(size, max_blocks), width)
        if cols < max_blocks:
            assert torch.equal(tab(raw_got)[:, cols:], tab(raw)[:, cols:])
        assert torch.equal(tab(raw_got), tab(want[0]))
        if host_ids:
            assert torch.equal(ids_got[:size], si.stage_views(host[step % 2], size, nbytes)["ids"])
        assert torch.equal(ids_got[size:], ids[size:])


def test_take_inputs_checks_its_buffers():
    raw = torch.zeros(48 + 4 * 2 * 3, dtype=torch.uint8)
    ctl = torch.zeros(2, dtype=torch.int32)
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="host must be uint8"):
        si.take_inputs_ref(torch.zeros(2, 8, dtype=torch.uint8), ctl, raw, ids, 2, 3, 48)
    host = torch.zeros(2, si.stage_bytes(2, raw.numel()), dtype=torch.uint8)
    with pytest.raises(ValueError, match="raw"):
        si.take_inputs_ref(host, ctl, raw, ids, 2, 4, 48)
    with pytest.raises(ValueError, match="raw"):
        si.take_inputs_ref(host, ctl, raw, ids, 2, 3, 32)    # tables over the lengths
    with pytest.raises(ValueError, match="ids must be int64"):
        si.take_inputs_ref(host, ctl, raw, ids.int(), 2, 3, 48)
    with pytest.raises(ValueError, match="multiple of 4"):
        si.stage_bytes(2, 30)


@pytest.mark.parametrize("rows,vocab,chunk", [(1, 5000, None), (3, 3 * ts.BLOCK + 5, ts.BLOCK)])
def test_greedy_writes_the_host_slot(rows, vocab, chunk):
    dev = kernel_device()
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dev)
    x[-1, 17] = float("nan")
    buf = torch.full((2, 2, rows + 1), -5, dtype=torch.int64)
    if dev == "cuda":
        buf = buf.pin_memory()
    for slot in (1, 0):
        ctl = torch.tensor([4, slot], dtype=torch.int32, device=dev)
        out = torch.zeros(2, rows, dtype=torch.int64, device=dev)
        ts.greedy_rows(x, out, chunk, host=(buf, ctl))
        if dev == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(buf[slot, :, :rows], out.cpu())
        assert (buf[slot, :, rows:] == -5).all()
    assert torch.equal(buf[0], buf[1])
    with pytest.raises(ValueError, match="host buffer"):
        ts.greedy_rows(x, out, host=(buf[0], ctl))
