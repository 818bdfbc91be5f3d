"""The context sweep's plot, file types and contexts (no GPU needed)."""
from __future__ import annotations

import pytest

from lodestar.bench.gpu_models import svg_plot, sweep_contexts, sweep_qtypes


def _rows(qtype, first):
    return [{"qtype": qtype, "context": c, "decode_tok_s": {"median": first * f}, "roofline_tok_s": first * f * 1.2}
            for c, f in ((1024, 1.0), (8192, 0.9), (32768, 0.6))]


def test_one_line_and_roofline_per_file_type():
    svg = svg_plot(_rows("Q4_K", 470.0) + _rows("F16", 255.0))
    assert svg.count("<polyline") == 4 and svg.count('stroke-dasharray="5,4"') == 2
    assert ">Q4_K</text>" in svg and ">F16</text>" in svg and ">32k</text>" in svg


def test_sweep_types_default_and_setting():
    assert sweep_qtypes() == ["Q4_K", "F16"]
    assert sweep_qtypes(" F16 ,") == ["F16"]
    with pytest.raises(ValueError, match="--qtypes"):
        sweep_qtypes(" , ")


def test_sweep_contexts_default_and_setting():
    assert sweep_contexts() == (1024, 2048, 4096, 8192, 16384, 32768)
    assert sweep_contexts("384,896,1024") == (384, 896, 1024)
    for bad in ("1024,512", "0,8", "x", "8,8", ""):
        with pytest.raises(ValueError, match="--contexts"):
            sweep_contexts(bad)
