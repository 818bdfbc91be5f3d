"""How a model is cut into tensor-parallel slices (no processes: pure bookkeeping and bytes)."""
import pytest
import torch

from lodestar.distributed import ShardedWeightLoader, ShardingError, ShardSpec, split_heads
from lodestar.distributed.layers import RowParallelLinear
from lodestar.distributed.sharding import even_range, vocab_range
from lodestar.formats.gguf import GGUFFile
from lodestar.layers.linear import DenseLinear


def test_heads_follow_their_kv_group():
    # SmolLM2-135M: 9 query heads in 3 GQA groups of 3; two ranks get 2 and 1 groups.
    assert [(s.q0, s.q1, s.kv0, s.kv1) for s in (split_heads(9, 3, ShardSpec(r, 2)) for r in range(2))] == \
        [(0, 6, 0, 2), (6, 9, 2, 3)]
    # Llama-3-8B over 4: 32 query heads, 8 KV heads, 2 groups each.
    assert [(s.q0, s.q1, s.kv0, s.kv1) for s in (split_heads(32, 8, ShardSpec(r, 4)) for r in range(4))] == \
        [(0, 8, 0, 2), (8, 16, 2, 4), (16, 24, 4, 6), (24, 32, 6, 8)]


def test_fewer_kv_heads_than_ranks_replicates_them():
    # Gemma-3-270M: 4 query heads share 1 KV head; both ranks keep a copy of it.
    assert [(s.q0, s.q1, s.kv0, s.kv1) for s in (split_heads(4, 1, ShardSpec(r, 2)) for r in range(2))] == \
        [(0, 2, 0, 1), (2, 4, 0, 1)]
    # 8 query heads, 2 KV heads over 4 ranks: each KV head on 2 ranks.
    assert [(s.q0, s.q1, s.kv0, s.kv1) for s in (split_heads(8, 2, ShardSpec(r, 4)) for r in range(4))] == \
        [(0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]


def test_unsplittable_heads_are_refused_with_the_fix():
    with pytest.raises(ShardingError, match="divides 2 or is a multiple"):
        split_heads(8, 2, ShardSpec(0, 3))
    with pytest.raises(ShardingError, match="--tensor-parallel 4 or less"):
        split_heads(4, 1, ShardSpec(0, 8))


def test_ranges_cover_everything_once():
    for n, parts in [(48, 2), (49, 4), (7, 7), (262144, 3)]:
        got = [even_range(n, parts, i) for i in range(parts)]
        assert got[0][0] == 0 and got[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert max(b - a for a, b in got) - min(b - a for a, b in got) <= 1
    assert [vocab_range(49155, ShardSpec(r, 2)) for r in range(2)] == [(0, 24578, 24578), (24578, 49155, 24578)]


def _loader(path, rank, world, mode):
    return ShardedWeightLoader(GGUFFile(path), ShardSpec(rank, world), mode)


def test_row_parallel_slices_sum_to_the_whole_projection(smollm_path):
    """Each rank's column slice, cut from the GGUF bytes at block boundaries, times its slice
    of the input adds up to the full projection (down: Q4_1, 1536 -> 576, cut at 768)."""
    name = "blk.0.ffn_down.weight"
    full = GGUFFile(smollm_path).tensors[name].dequantize()
    x = torch.randn(3, 1536)
    total = torch.zeros(3, 576, dtype=torch.float64)
    for r in range(2):
        w = _loader(smollm_path, r, 2, "fp32")
        f0, f1 = w.ffn_split(1536, name)
        layer = w.row_parallel_linear(name, (f0, f1))
        assert isinstance(layer, RowParallelLinear) and layer.inner.in_features == f1 - f0
        torch.testing.assert_close(layer.inner.weight, full[:, f0:f1], rtol=0, atol=0)
        total += layer.inner(x[:, f0:f1]).double()
    assert (f0, f1) == (768, 1536)
    # fp32 dot products of length 768, summed: within K * eps * sum|x*w| of the exact value
    exact = x.double() @ full.double().T
    bound = 1536 * 2.0 ** -24 * (x.abs().double() @ full.abs().double().T)
    assert bool(((total - exact).abs() <= bound).all())
    packed = _loader(smollm_path, 1, 2, "packed").row_parallel_linear(name, (768, 1536))
    assert packed.inner.qtype.name == "Q4_1" and packed.inner.in_features == 768 and packed.inner.path in ("native", "int")


def test_cut_inside_a_block_is_an_error_when_packed_and_exact_when_dense(gemma_path):
    # Gemma-3's attention output is Q4_K (256 weights per block): a cut at column 128 splits a block.
    name = "blk.0.attn_output.weight"
    with pytest.raises(ShardingError, match=r"Q4_K, 256 weights per block.*--dtype bf16"):
        _loader(gemma_path, 0, 8, "packed").row_parallel_linear(name, (128, 256))
    layer = _loader(gemma_path, 0, 8, "fp32").row_parallel_linear(name, (128, 256))
    full = GGUFFile(gemma_path).tensors[name].dequantize()
    assert isinstance(layer.inner, DenseLinear)
    torch.testing.assert_close(layer.inner.weight, full[:, 128:256], rtol=0, atol=0)


def test_column_parallel_rows_and_vocab_rows(smollm_path):
    g = GGUFFile(smollm_path)
    w = _loader(smollm_path, 1, 2, "fp32")
    emb = w.embedding("token_embd.weight")
    assert (emb.v0, emb.v1, emb.vocab_size) == (24576, 49152, 49152)
    table = g.tensors["token_embd.weight"].dequantize()
    rows = emb.inner(torch.tensor([24576, 49151]) - emb.v0)
    torch.testing.assert_close(rows, table[[24576, 49151]], rtol=0, atol=0)
    # rank 1's MLP rows: gate/up rows 768..1535
    gate = g.tensors["blk.2.ffn_gate.weight"].dequantize()
    f0, f1 = w.ffn_split(1536, "blk.2.ffn_down.weight")
    gu = w.linears(["blk.2.ffn_gate.weight", "blk.2.ffn_up.weight"], [torch.arange(f0, f1)] * 2)
    torch.testing.assert_close(gu[0].weight, gate[f0:f1], rtol=0, atol=0)


def test_packed_split_differs_only_by_the_order_of_its_fp32_sums(smollm_path):
    """Why packed TP=2 is not bit-identical to TP=1 (see test_tensor_parallel.py): the kernel adds
    a row's k/32 block products into one fp32 sum, in order; TP=2 sums each half of the blocks
    and then adds the two halves. Same terms (x is quantized per 32 values either way), another
    rounding order."""
    from lodestar.models.weights import WeightLoader
    g = GGUFFile(smollm_path)
    name = "blk.5.ffn_down.weight"
    torch.manual_seed(0)
    x = torch.randn(4, 1536)
    whole = WeightLoader(g, "packed").linear(name)(x)
    parts = [_loader(smollm_path, r, 2, "packed").row_parallel_linear(name, (768 * r, 768 * (r + 1))).inner
             for r in range(2)]
    split = parts[0](x[:, :768]) + parts[1](x[:, 768:])
    w = g.tensors[name].dequantize().double()
    exact = x.double() @ w.T
    amax = x.view(4, 48, 32).abs().amax(-1).repeat_interleave(32, 1).double()
    # x's quantization error (amax/64768 per element), then 2 * 48 + 1 fp32 roundings at most
    bound = (amax / 64768) @ w.abs().T + 100 * 2.0 ** -24 * ((x.abs().double() + amax) @ w.abs().T)
    assert bool(((whole.double() - exact).abs() <= bound).all())
    assert bool(((split.double() - exact).abs() <= bound).all())
    assert not torch.equal(whole, split)                       # so the split is not exact


def test_cli_refuses_a_split_the_model_cannot_take(smollm_path, capsys):
    from lodestar.cli import main
    # SmolLM2-135M has 3 KV heads: 4 ranks can neither share them out nor replicate them evenly.
    assert main(["generate", "-p", "hi", "--model", str(smollm_path), "--device", "cpu",
                 "--tensor-parallel", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3 KV heads" in err and "--tensor-parallel" in err
    assert main(["generate", "-p", "hi", "--tensor-parallel", "0"]) == 2
    assert main(["generate", "-p", "hi", "--tensor-parallel", "2", "--kv-dir", "/tmp/unused"]) == 2
