"""The serve-load decode window counts only tokens produced while every stream decodes."""
import math

from lodestar.bench.serve_load import decode_rate, percentile


def test_decode_rate_uses_the_window_where_all_streams_decode():
    # stream A: first token at t=1, then one token per 0.1 s until t=3
    a = [(1.0 + 0.1 * i, 1) for i in range(21)]
    # stream B starts later (t=2) and ends later (t=4)
    b = [(2.0 + 0.1 * i, 1) for i in range(21)]
    # window (2, 3]: A contributes 10 tokens (2.1..3.0), B 10 tokens (2.1..3.0)
    assert math.isclose(decode_rate([a, b]), 20 / 1.0, rel_tol=1e-9)


def test_decode_rate_single_stream_is_its_decode_speed_and_counts_chunks():
    a = [(0.5, 1)] + [(0.5 + 0.02 * i, 2) for i in range(1, 51)]   # 2 tokens per 20 ms
    assert math.isclose(decode_rate([a]), 100.0, rel_tol=1e-9)


def test_decode_rate_without_overlap_is_nan():
    assert math.isnan(decode_rate([[(0.0, 1), (1.0, 1)], [(2.0, 1), (3.0, 1)]]))


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert math.isnan(percentile([], 0.5))
