"""`lodestar bench profile`: a decode step's time by operation, at 1 and 2 rows."""
import json

from lodestar.cli import main


def test_profile_accounts_for_the_hooked_step(smollm_path, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--threads", "1", "--steps", "3", "--rows", "1", "2",
                 "--prompt-len", "16", "--prefill", "40", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r.get("rows") for r in doc["results"]] == [1, 2, None]
    pre = doc["results"][2]
    assert pre["prefill"] == 40 and pre["tok_s"] > 0
    assert pre["calls_per_step"]["linear q|k|v Q4_1"] == 30 and pre["calls_per_step"]["linear head Q8_0"] == 1
    assert abs(sum(pre["ops_ms"].values()) - pre["step_ms_hooked"]) < 1e-6 * max(1.0, pre["step_ms_hooked"])
    for r in doc["results"][:2]:
        ops = r["ops_ms"]
        assert {"linear q|k|v Q4_1", "linear head Q8_0", "attention (rope, KV store, attend)", "norms"} <= set(ops)
        assert abs(sum(ops.values()) - r["step_ms_hooked"]) < 1e-6 * max(1.0, r["step_ms_hooked"])
        assert r["calls_per_step"]["linear q|k|v Q4_1"] == 30           # one fused projection per layer
        assert r["step_ms"]["median"] > 0 and r["step_ms_graph"]["median"] > 0
    printed = capsys.readouterr().out
    assert "1 row(s) decoding" in printed and "prefill of 40 tokens" in printed
