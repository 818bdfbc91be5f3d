"""The matrix-vector variant sweep imports without a GPU and plans well-formed configs."""
import torch

from lodestar.bench import gemv_variants as gv
from lodestar.kernels import triton_quant as tq


def test_every_shape_gets_the_rule_first_then_distinct_valid_configs():
    dev = torch.device("cpu")
    for shape, (n, k) in gv.SHAPES.items():
        plan = gv.configs(n, k, dev)
        assert plan[0] == ("default", "default", tq.default_gemv_config(n, k, dev)), shape
        names = [name for _, name, _ in plan]
        cfgs = [cfg for _, _, cfg in plan]
        assert len(set(names)) == len(names) and len(set(cfgs)) == len(cfgs), shape
        assert {name for rnd, name, _ in plan if rnd == "variant"} <= set(tq.GEMV_VARIANTS)
        assert "prefetch" in names, shape
        for cfg in cfgs:
            assert cfg.tile_groups & (cfg.tile_groups - 1) == 0 and cfg.split_k >= 1 and cfg.block_n >= 1
            assert tq.parse_gemv_config(tq.config_text(cfg)) == cfg


def test_summary_picks_the_fastest_per_shape_and_sums_a_token():
    res = {shape: {"default": {"config": "16,16,1,4,0,0,0", "us": {"median": 10.0}},
                   "prefetch": {"config": "16,16,1,4,1,0,0", "us": {"median": 8.0}},
                   "bn8": {"config": "8,16,1,4,0,0,0", "error": "out of resources"}} for shape in gv.SHAPES}
    s = gv._summary("Q4_0", res)
    assert all(b["name"] == "prefetch" and b["speedup"] == 1.25 for b in s["best"].values())
    assert s["table"]["Q4_0:6144,4096"] == "16,16,1,4,1,0,0"     # a LODESTAR_GEMV_TABLE key
    assert s["token_us"] == {"default": 10.0 * 129, "best_per_shape": 8.0 * 129}


def test_named_configs_replace_the_built_in_variants_and_bad_items_are_refused():
    dev = torch.device("cpu")
    explicit = gv.parse_explicit("down:8,32,7,1,0,0,0,1; down:16,32,2,4,0,0,0,1,128 gate_up:4,32,1,1,0,0,0,1")
    assert explicit == {"down": ("8,32,7,1,0,0,0,1", "16,32,2,4,0,0,0,1,128"), "gate_up": ("4,32,1,1,0,0,0,1",)}
    plan = gv.configs(*gv.SHAPES["down"], dev, tq.T.Q4_K, explicit=explicit["down"])
    assert [rnd for rnd, _, _ in plan if rnd not in ("default", "config")] == []
    named = {name: cfg for rnd, name, cfg in plan if rnd == "config"}
    assert named["16,32,2,4,0,0,0,1,128"] == tq.GemvConfig(16, 32, 2, 4, words=True, maxnreg=128)
    assert gv.parse_explicit("v:16,32,4,4,0,0,0,1") == {"v": ("16,32,4,4,0,0,0,1",)}    # a shape --configs adds
    res = {"v": {"default": {"config": "16,16,4,4,0,0,0", "us": {"median": 3.0}}}}
    assert gv._summary("Q6_K", res)["table"] == {"Q6_K:1024,4096": "16,16,4,4,0,0,0"}
    for bad in ("attn:8,32,1,1", "down", "down:8,32"):
        try:
            gv.parse_explicit(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
