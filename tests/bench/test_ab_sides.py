"""What each side of the A/B stages sets: kernel policy or environment (no GPU needed)."""
from __future__ import annotations

import pytest

from lodestar.bench.gpu_ab import gemv_policy, gemv_tilings, parse_sides, side_setting
from lodestar.kernels.policy import FUSIONS, MIB, KernelPolicy


def test_switches_fields_and_other_variables_go_where_they_are_read():
    sides = parse_sides("LODESTAR_PDL=0 dense_gemv=0|LODESTAR_FUSE=quant prefill_attention=sdpa "
                        "LODESTAR_STAGE_COPIES=sync")
    environ = {"LODESTAR_FUSE": "0", "LODESTAR_WEIGHT_PREFETCH": "2", "HOME": "/root"}
    a, a_env = side_setting(sides[0], sides, environ)
    b, b_env = side_setting(sides[1], sides, environ)
    # LODESTAR_FUSE is named by side 1, so side 0 takes its default, not the environment's
    assert a == KernelPolicy(pdl=False, dense_gemv=False, weight_prefetch_bytes=2 * MIB)
    assert a.fusions == frozenset(FUSIONS) and a_env == {}
    assert b == KernelPolicy(fusions=frozenset({"quant"}), prefill_attention="sdpa", weight_prefetch_bytes=2 * MIB)
    assert b_env == {"LODESTAR_STAGE_COPIES": "sync"}


def test_one_empty_side_is_the_environment_alone():
    sides = parse_sides("")
    assert sides == [{}]
    assert side_setting(sides[0], sides, {"LODESTAR_PDL": "0"}) == (KernelPolicy(pdl=False), {})


@pytest.mark.parametrize("text, says", [
    ("LODESTAR_PDL", "NAME=value"),
    ("gemv=8,32", "GEMV config"),
    ("dense_gemv=yes", "dense_gemv"),
    ("prefill_attention=flash", "prefill_attention"),
    ("LODESTAR_FUSE=quant,bogus", "bogus"),
    ("LODESTAR_GEMV_VARIANT=words", "gemv=TILING"),
    ("LODESTAR_PREFILL_ATTN=sdpa", "prefill_attention=paged|sdpa"),
])
def test_bad_sides_are_refused_before_any_model_is_built(text, says):
    with pytest.raises(ValueError, match=says.replace("|", r"\|")):
        parse_sides(f"LODESTAR_PDL=1|{text}")


def test_gemv_tilings_name_a_rule_a_table_or_one_tiling(tmp_path):
    table = tmp_path / "table.json"
    table.write_text('{"table": {"Q4_0:4096,4096": "8,32,1,1,0,0,1"}}')
    base = KernelPolicy(gemv="16,16,1,4")
    assert gemv_policy(base, gemv_tilings("off")) == KernelPolicy(gemv_table="off")
    assert gemv_policy(base, gemv_tilings(str(table))) == KernelPolicy(gemv_table=str(table))
    assert gemv_policy(KernelPolicy(), gemv_tilings("8,32,1,1,0,0,1")) == KernelPolicy(gemv="8,32,1,1,0,0,1")
    for bad in ("words", "8,32", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match="--gemv-ab"):
            gemv_tilings(bad)
