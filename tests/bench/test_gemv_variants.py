"""The matrix-vector tiling sweep imports without a GPU and plans well-formed configs."""
import pytest
import torch

from lodestar.bench import gemv_variants as gv
from lodestar.kernels.gemv_tiling import GemvConfig, T, config_text, default_gemv_config, parse_gemv_config


def test_every_shape_gets_the_rule_first_then_distinct_valid_configs():
    dev = torch.device("cpu")
    for shape, (n, k) in gv.SHAPES.items():
        plan = gv.configs(n, k, dev)
        assert plan[0] == ("default", "default", default_gemv_config(n, k, dev)), shape
        names = [name for _, name, _ in plan]
        cfgs = [cfg for _, _, cfg in plan]
        assert len(set(names)) == len(names) and len(set(cfgs)) == len(cfgs), shape
        assert {rnd for rnd, _, _ in plan} == {"default", "tiling"}
        # word tiles in each loop form: plain, next tile prefetched, unrolled
        assert {"words", "words_prefetch", "words_unroll"} <= set(names), shape
        assert any(c.words and c.prefetch for c in cfgs) and any(c.words and c.unroll for c in cfgs)
        for cfg in cfgs:
            assert cfg.tile_groups & (cfg.tile_groups - 1) == 0 and cfg.split_k >= 1 and cfg.block_n >= 1
            assert cfg.tile_groups <= k // 32
            assert parse_gemv_config(config_text(cfg)) == cfg


def test_a_typed_plan_adds_the_type_rule_and_only_filters_tilings():
    dev = torch.device("cpu")
    n, k = gv.SHAPES["o"]
    plan = gv.configs(n, k, dev, T.Q4_0, only=("words_prefetch", "bn8"))
    assert [name for _, name, _ in plan] == ["default", "rule", "bn8", "words_prefetch"]
    assert plan[1][2] == default_gemv_config(n, k, dev, T.Q4_0) and plan[1][2].words


def test_summary_picks_the_fastest_per_shape_and_sums_a_token():
    res = {shape: {"default": {"config": "16,16,1,4,0,0", "us": {"median": 10.0}},
                   "words_prefetch": {"config": "16,32,1,4,1,0,1", "us": {"median": 8.0}},
                   "bn8": {"config": "8,16,1,4,0,0", "error": "out of resources"}} for shape in gv.SHAPES}
    s = gv._summary("Q4_0", res)
    assert all(b["name"] == "words_prefetch" and b["speedup"] == 1.25 for b in s["best"].values())
    assert s["table"]["Q4_0:6144,4096"] == "16,32,1,4,1,0,1"     # a LODESTAR_GEMV_TABLE key
    assert s["token_us"] == {"default": 10.0 * 129, "best_per_shape": 8.0 * 129}


def test_named_configs_replace_the_built_in_tilings_and_bad_items_are_refused():
    dev = torch.device("cpu")
    explicit = gv.parse_explicit("down:8,32,7,1,0,0,1; down:16,32,2,4,0,0,1,128 gate_up:4,32,1,1,0,0,1")
    assert explicit == {"down": ("8,32,7,1,0,0,1", "16,32,2,4,0,0,1,128"), "gate_up": ("4,32,1,1,0,0,1",)}
    plan = gv.configs(*gv.SHAPES["down"], dev, T.Q4_K, explicit=explicit["down"])
    assert [rnd for rnd, _, _ in plan if rnd not in ("default", "config")] == []
    named = {name: cfg for rnd, name, cfg in plan if rnd == "config"}
    assert named["16,32,2,4,0,0,1,128"] == GemvConfig(16, 32, 2, 4, words=True, maxnreg=128)
    assert gv.parse_explicit("v:16,32,4,4,0,0,1") == {"v": ("16,32,4,4,0,0,1",)}    # a shape --configs adds
    res = {"v": {"default": {"config": "16,16,4,4,0,0", "us": {"median": 3.0}}}}
    assert gv._summary("Q6_K", res)["table"] == {"Q6_K:1024,4096": "16,16,4,4,0,0"}
    # prefetch on a group tile (words=0) is no config at all
    for bad in ("attn:8,32,1,1", "down", "down:8,32", "down:8,32,7,1,1,0,0"):
        with pytest.raises(ValueError):
            gv.parse_explicit(bad)
