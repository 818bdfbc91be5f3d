"""Dense matrix-vector kernel against an fp32 reference, and its batch invariance."""
from __future__ import annotations

import pytest
import torch
from triton_helpers import kernel_device

from lodestar.kernels import triton_dense as td
from lodestar.kernels.policy import KernelPolicy, using


@pytest.mark.parametrize("n,k", [(40, 576), (576, 1536), (100, 1000)])
@pytest.mark.parametrize("cfg", [td.DenseGemvConfig(8, 64, 1, 4), td.DenseGemvConfig(16, 128, 2, 4),
                                 td.DenseGemvConfig(4, 64, 3, 2)], ids=["one", "split2", "split3"])
def test_matches_reference(n, k, cfg):
    dev = kernel_device()
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).to(dev)
    x = torch.randn(3, k, generator=g).to(torch.bfloat16).to(dev)
    y = td.dense_gemv(x, w, torch.float32, cfg)
    torch.testing.assert_close(y, td.dense_gemv_ref(x, w), rtol=1e-5, atol=1e-4)
    assert td.dense_gemv(x, w, config=cfg).dtype == torch.bfloat16


def test_rows_do_not_depend_on_the_batch():
    dev = kernel_device()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 512, generator=g).to(torch.bfloat16).to(dev)
    x = torch.randn(5, 512, generator=g).to(torch.bfloat16).to(dev)
    cfg = td.DenseGemvConfig(8, 128, 2, 4)
    whole = td.dense_gemv(x, w, torch.float32, cfg)
    for i in range(5):
        assert torch.equal(td.dense_gemv(x[i:i + 1], w, torch.float32, cfg)[0], whole[i])


def test_the_layer_uses_it_for_few_rows_and_cublas_beyond():
    dev = kernel_device()
    if dev != "cuda":
        pytest.skip("CudaDenseLinear runs the kernel on CUDA tensors only")
    from lodestar.layers.cuda_linear import CudaDenseLinear
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(300, 576, generator=g) * 0.05).to(torch.bfloat16).to(dev)
    layer = CudaDenseLinear(w)
    x = torch.randn(6, 576, generator=g).to(torch.bfloat16).to(dev)
    one = x[:td.MAX_ROWS]
    assert torch.equal(layer(one), td.dense_gemv(one, w, config=layer.gemv_config))
    rows = x[:td.MAX_ROWS + 1]
    assert torch.equal(layer(rows), torch.nn.functional.linear(rows, w))     # cuBLAS beyond MAX_ROWS
    torch.testing.assert_close(layer(x).float(), td.dense_gemv_ref(x, w), rtol=2e-2, atol=2e-2)
    with using(KernelPolicy(dense_gemv=False)):                                # policy: cuBLAS only
        assert torch.equal(layer(one), torch.nn.functional.linear(one, w))
