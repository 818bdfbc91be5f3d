"""Non-finite logits are the model's fault: the error names the file and the broken tensor,
never logit_bias; the scan that finds the tensor reads float values and block scales."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from lodestar.engine.faults import (SCALE_OFFSETS, ModelFaultError, NonFiniteLogitsError, first_nonfinite_tensor,
                                    tensor_is_finite)
from lodestar.engine.sampling import Sampler, SamplerState, SamplingParams
from lodestar.kernels import dequant


class Tensor:
    """The parts of a checkpoint tensor the scan reads."""

    def __init__(self, qtype: T, raw: bytes, shape: tuple[int, ...]) -> None:
        self.qtype, self.shape = qtype, shape
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(shape[0] if len(shape) > 1 else 1, -1)

    def dequantize(self) -> torch.Tensor:
        return dequant.dequantize(self.data, self.qtype, self.shape)


def blocks(qtype: T, rows: int = 4, n_blocks: int = 2, seed: int = 0) -> bytearray:
    """Random blocks whose fp16 scales are small finite numbers."""
    size = GGML_QUANT_SIZES[qtype][1]
    raw = bytearray(np.random.default_rng(seed).integers(0, 256, rows * n_blocks * size, dtype=np.uint8).tobytes())
    for b in range(rows * n_blocks):
        for off in SCALE_OFFSETS[qtype]:
            raw[b * size + off: b * size + off + 2] = struct.pack("<e", 0.01)
    return raw


@pytest.mark.parametrize("qtype", list(SCALE_OFFSETS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_block_scale_that_is_not_finite_is_found(qtype, bad):
    block = GGML_QUANT_SIZES[qtype][0]
    raw = blocks(qtype)
    shape = (4, 2 * block)
    assert tensor_is_finite(Tensor(qtype, bytes(raw), shape))
    assert torch.isfinite(Tensor(qtype, bytes(raw), shape).dequantize()).all()
    size = GGML_QUANT_SIZES[qtype][1]
    off = 5 * size + SCALE_OFFSETS[qtype][-1]
    raw[off:off + 2] = struct.pack("<e", bad)
    t = Tensor(qtype, bytes(raw), shape)
    assert not tensor_is_finite(t)
    assert not torch.isfinite(t.dequantize()).all()   # the field read is a scale the values depend on


@pytest.mark.parametrize("qtype, dtype", [(T.F32, np.float32), (T.F16, np.float16)])
def test_float_tensors_are_scanned_value_by_value(qtype, dtype):
    values = np.ones(64, dtype=dtype)
    assert tensor_is_finite(Tensor(qtype, values.tobytes(), (64,)))
    values[37] = np.nan
    assert not tensor_is_finite(Tensor(qtype, values.tobytes(), (64,)))


def test_bf16_infinity_is_found():
    values = torch.ones(2, 32, dtype=torch.bfloat16)
    values[1, 3] = math.inf
    raw = values.view(torch.uint8).numpy().tobytes()
    assert not tensor_is_finite(Tensor(T.BF16, raw, (2, 32)))


def test_first_nonfinite_tensor_in_file_order():
    good = Tensor(T.F32, np.ones(32, dtype=np.float32).tobytes(), (32,))
    nan = np.ones(32, dtype=np.float32)
    nan[0] = np.nan
    bad = Tensor(T.F32, nan.tobytes(), (32,))
    assert first_nonfinite_tensor({"a": good, "b": bad, "c": bad}) == "b"
    assert first_nonfinite_tensor({"a": good}) is None


def _states(n: int, **params) -> list[SamplerState]:
    return [SamplerState(SamplingParams(**params)) for _ in range(n)]


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.0, logit_bias={1: -math.inf}),
                                    dict(temperature=0.8, seed=1), dict(temperature=0.0, logprobs=2)])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_logits_are_a_model_fault_whatever_the_sampler(params, bad):
    logits = torch.randn(3, 16)
    logits[1, 5] = bad
    with pytest.raises(NonFiniteLogitsError, match=r"the model computed (NaN|\+inf) logits \(batch row 1\)") as e:
        Sampler().sample(logits, _states(3, **params))
    assert "logit_bias" not in str(e.value)


def test_logits_all_minus_inf_from_the_model_are_a_fault_but_bans_are_the_request():
    logits = torch.randn(2, 16)
    logits[0] = -math.inf
    with pytest.raises(NonFiniteLogitsError, match=r"-inf logits \(batch row 0\)"):
        Sampler().sample(logits, _states(2, temperature=0.0))
    bans = {t: -math.inf for t in range(16)}
    with pytest.raises(ValueError, match="check logit_bias") as e:
        Sampler().sample(torch.randn(2, 16), _states(2, temperature=0.0, logit_bias=bans))
    assert not isinstance(e.value, NonFiniteLogitsError)


def test_model_fault_error_is_a_value_error():
    assert issubclass(ModelFaultError, ValueError)
