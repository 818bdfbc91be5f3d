"""``python -m lodestar.bench.gpu``'s options: defaults, refusals, and agreement with
scripts/device_bench.sh (no GPU needed)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lodestar.bench import gpu

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_bench.sh"


def _args(*argv: str):
    return gpu.parser().parse_args([*argv, "--json", "bench.json"])


def test_defaults_are_parsed_into_what_the_stages_read():
    a = _args("sweep")
    assert a.contexts == (1024, 2048, 4096, 8192, 16384, 32768) and a.qtypes == ["Q4_K", "F16"]
    assert a.chain_cells == [("llama-3.1-8b", "Q4_0"), ("llama-3.1-8b", "F16")]
    assert a.fuse_cells[0] == ("smollm2-135m", "F16") and len(a.fuse_cells) == 4
    assert (a.fuse_off, a.fuse_on, a.gemv_ab) == ("0", "default", "off")
    assert a.ab == [{"LODESTAR_PDL": "0"}, {"LODESTAR_PDL": "1"}]
    assert a.ab_cells == [("llama-3.1-8b", "F16"), ("llama-3.1-8b", "Q4_0"), ("smollm2-135m", "F16")]
    assert a.prefill_attn_cases == () and a.seconds == 120.0


def test_options_are_parsed():
    a = _args("ab", "--ab", "", "--ab-cells", "llama-3.1-8b/Q5_K_M", "--contexts", "384,896",
              "--prefill-attn-cases", "fresh_512 varlen_8", "--gemv-ab", "8,32,1,1,0,0,1")
    assert a.ab == [{}]                           # one side that changes nothing: the settings in force alone
    assert a.ab_cells == [("llama-3.1-8b", "Q5_K_M")] and a.contexts == (384, 896)
    assert a.prefill_attn_cases == ("fresh_512", "varlen_8") and a.gemv_ab == "8,32,1,1,0,0,1"


@pytest.mark.parametrize("argv, says", [
    (("--contexts", "1024,512"), "ascending"),
    (("--chain-cells", "llama-3.1-8b"), "geometry/type"),
    (("--fuse-on", "quant,bogus"), "bogus"),
    (("--gemv-ab", "words"), "--gemv-ab"),
    (("--ab", "LODESTAR_DENSE_GEMV=0|LODESTAR_DENSE_GEMV=1"), "dense_gemv=0|1"),
    (("--ab", "LODESTAR_PDL=2"), "LODESTAR_PDL"),
    (("--prefill-attn-cases", "fresh_9"), "fresh_9"),
])
def test_bad_values_are_refused_with_the_fix(argv, says, capsys):
    with pytest.raises(SystemExit):
        _args("ab", *argv)
    assert says in capsys.readouterr().err


def test_every_stage_and_option_the_device_script_uses_exists():
    text = SCRIPT.read_text().replace("\\\n", " ")       # continued lines joined
    stages = re.findall(r"^bench (\S+) \d+(.*)$", text, re.M)
    assert len(stages) > 15
    options = {o for action in gpu.parser()._actions for o in action.option_strings}
    passed = set()
    for name, rest in stages:
        assert name in gpu.STAGES, name
        for opt in re.findall(r"(--[a-z][a-z-]*)", rest):
            assert opt in options, (name, opt)
            passed.add(opt)
    # the script's own variables reach every option that steers a stage
    assert {"--contexts", "--qtypes", "--chain-cells", "--fuse-cells", "--fuse-on", "--fuse-off", "--gemv-ab",
            "--ab", "--ab-cells", "--prefill-attn-cases"} <= passed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_without_a_gpu_it_says_so(tmp_path, capsys):
    assert gpu.main(["env", "--json", str(tmp_path / "b.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "b.json").exists()
