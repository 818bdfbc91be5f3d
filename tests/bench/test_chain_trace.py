"""``gpu_kernels.chain_trace``: how far each kernel moved the end of a replayed decode chain."""
from lodestar.bench.gpu_kernels import chain_trace


def test_advances_add_up_to_the_span_and_overlap_is_not_counted_twice():
    # two replays of: a (0-10), b starts early (5) and ends at 14, c (20-30), d inside c (22-25)
    step = [("a", 0, 10_000), ("b", 5_000, 14_000), ("c", 20_000, 30_000), ("d", 22_000, 25_000)]
    shifted = [(k, s + 100_000, e + 100_000) for k, s, e in step]
    out = chain_trace(step + shifted, replays=2)
    k = out["kernels"]
    assert out["kernels_per_step"] == [4, 4]
    assert k["a"]["advance_us_per_step"] == 0.0           # the first kernel only starts the chain
    assert k["b"]["advance_us_per_step"] == 4.0           # 14 - 10
    assert k["c"]["advance_us_per_step"] == 16.0          # 30 - 14, the gap before it included
    assert k["d"]["advance_us_per_step"] == 0.0           # ends inside c
    assert k["b"]["duration_us_per_call"] == 9.0
    assert out["traced_span_us"]["median"] == 30.0
    assert list(k)[0] == "c"                              # sorted by advance
    total = sum(v["advance_us_per_step"] for v in k.values())
    assert total == 30.0 - 10.0                           # span from the first kernel's end


def test_kernels_on_another_stream_move_nothing():
    # main stream 7: a (0-10), c (12-20); stream 9: s (5-30), after both
    step = [("a", 0, 10_000, 7), ("s", 5_000, 30_000, 9), ("c", 12_000, 20_000, 7)]
    out = chain_trace(step, replays=1)
    k = out["kernels"]
    assert k["c"]["advance_us_per_step"] == 10.0
    assert k["s"]["advance_us_per_step"] == 0.0 and k["s"]["side_stream"] and k["s"]["duration_us_per_call"] == 25.0
    assert "side_stream" not in k["c"]
    assert out["traced_span_us"]["median"] == 20.0        # the main stream's span


def test_repeated_keys_are_summed_per_step():
    step = [("g", 0, 1_000), ("g", 1_000, 3_000), ("h", 2_000, 6_000)]
    out = chain_trace(step, replays=1)
    assert out["kernels"]["g"]["calls_per_step"] == 2
    assert out["kernels"]["g"]["advance_us_per_step"] == 2.0
    assert out["kernels"]["g"]["advance_us_per_call"] == 1.0
    assert out["kernels"]["h"]["advance_us_per_step"] == 3.0


def test_a_kernel_called_several_times_a_layer_is_told_apart_by_its_place():
    # two layers of (p, n, p) and a final p: p is called 2 * 2 + 1 times, n once a layer
    step, t = [], 0
    for _ in range(2):
        for key, dur in (("p", 3_000), ("n", 1_000), ("p", 5_000)):
            step.append((key, t, t + dur))
            t += dur
    step.append(("p", t, t + 2_000))
    out = chain_trace(step, replays=1, layers=2)["kernels"]
    assert set(out) == {"p #0", "p #1", "p #+", "n"}
    assert out["p #0"]["calls_per_step"] == 2 and out["p #0"]["advance_us_per_step"] == 3.0   # first is 0
    assert out["p #1"]["advance_us_per_step"] == 10.0
    assert out["p #+"]["advance_us_per_step"] == 2.0
    assert out["n"]["advance_us_per_step"] == 2.0


def test_stream_rates_of_the_projections_and_the_head():
    from lodestar.bench.gpu_kernels import stream_rates
    kernels = {"_gemv_words_kernel #0": {"advance_us_per_call": 2.0},
               "_gemv_words_kernel #3": {"advance_us_per_call": 4.0},
               "_gemv_words_kernel #+": {"advance_us_per_call": 10.0},
               "_rms_norm_kernel #0": {"advance_us_per_call": 2.0},
               "_dense_gemv_kernel": {"advance_us_per_call": 0.0}}
    stream_rates(kernels, [4_000_000, 1, 1, 12_000_000], 40_000_000)
    assert kernels["_gemv_words_kernel #0"]["stream_tb_s"] == 2.0        # 4 MB in 2 us
    assert kernels["_gemv_words_kernel #3"]["stream_tb_s"] == 3.0
    assert kernels["_gemv_words_kernel #+"]["stream_tb_s"] == 4.0
    assert "stream_tb_s" not in kernels["_rms_norm_kernel #0"] and "stream_tb_s" not in kernels["_dense_gemv_kernel"]


def test_a_kernel_called_unevenly_across_layers_is_left_whole():
    # four layers of (p, n, p), two of them with an extra p, and a final p: places would mix
    step, t = [], 0
    for layer in range(4):
        for key in ("p", "n", "p") + (("p",) if layer in (1, 2) else ()):
            step.append((key, t, t + 1_000))
            t += 1_000
    step.append(("p", t, t + 1_000))
    out = chain_trace(step, replays=1, layers=4)["kernels"]
    assert set(out) == {"p", "n"} and out["p"]["calls_per_step"] == 11
