"""``lodestar bench spec``: its workload is what it claims, its statistics are right on
fabricated timings, a token mismatch is a visible failure, and a tiny real run writes the
JSON the docs read."""
import json
import math
import re
import subprocess
import sys

import pytest

from lodestar.bench import spec
from lodestar.bench.spec import RequestRun, SideRun, summarize
from lodestar.bench.spec_workloads import SOURCES, chat_tasks, edit_tasks, task_ids
from lodestar.engine.spec import SpecStats


# -- workload -------------------------------------------------------------------------
def test_source_files_are_realistic_and_the_edits_apply():
    assert len({s.language for s in SOURCES}) == len(SOURCES) >= 2
    for s in SOURCES:
        assert 60 <= len(s.text.splitlines()) <= 200, s.name
        old, new = s.rename
        # the renamed function is defined once and called elsewhere; its new name is free
        assert len(re.findall(rf"\b{old}\b", s.text)) >= 2 and not re.search(rf"\b{new}\b", s.text), s.name
    names = [t.name for t in edit_tasks()]
    assert len(set(names)) == len(names) == 2 * len(SOURCES)
    assert names[:2] == [f"rename-{SOURCES[0].name}", f"extend-{SOURCES[0].name}"]
    assert len(chat_tasks()) == 4


def test_prompts_render_through_the_chat_template(smollm_path):
    from lodestar.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(smollm_path)
    for t, s in zip(edit_tasks(), [s for s in SOURCES for _ in range(2)]):
        ids = task_ids(tok, t)
        text = tok.decode(ids)
        assert s.text in text and "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
        assert 800 < len(ids) < 3000, (t.name, len(ids))
    for t in chat_tasks():
        assert len(task_ids(tok, t)) < 100          # nothing to copy from


def test_batch_cycles_through_the_edit_prompts():
    w = spec.workloads(["batch", "chat"], prompts=2, streams=5)
    assert list(w) == ["batch", "chat"] and len(w["chat"]) == 2
    assert [t.name for t in w["batch"]] == [edit_tasks()[i % 2].name for i in range(5)]
    with pytest.raises(Exception, match="choose from edit, chat, batch"):
        spec.parse_parts("edit,verify")


# -- statistics on fabricated timings -----------------------------------------------------
def _request(tokens: list[int], chunks: list[int], ttft: float, dt: float, stats=None, t0: float = 100.0):
    """A request that started at ``t0``, got its first chunk after ``ttft`` and the next ones
    every ``dt`` seconds."""
    assert sum(chunks) == len(tokens)
    arrivals = [(t0 + ttft + i * dt, k) for i, k in enumerate(chunks)]
    return RequestRun(list(tokens), arrivals, t0, "length", 0, stats, "x")


TOKENS = list(range(11))


def _records(on_dts=(0.04, 0.05, 0.06, 0.05), off_dts=(0.1, 0.1, 0.12, 0.08), on_tokens=TOKENS):
    """Runs of one prompt: off decodes 10 tokens after the first one per step; on in 4 verify steps."""
    off = [SideRun([_request(TOKENS, [1] * 11, 0.5, dt)], 2.0) for dt in off_dts]
    on = [SideRun([_request(on_tokens, [1, 3, 3, 2, 2], 0.5, dt, SpecStats(12, 6, 4, 10))], 1.0,
                  {"spec_drafted": 12, "spec_accepted": 6, "spec_verify_steps": 4, "spec_emitted": 10})
          for dt in on_dts]
    return {"off": off, "on": on}


def test_rates_ratios_and_speculation_stats():
    r = summarize(_records(), ["p"], together=False)
    # run 0 is the warm-up: off 10 tokens over 10 steps of 0.1/0.12/0.08 s, on over 4 steps of 0.05/0.06/0.05 s
    off, on = r["decode_tok_s"]["off"], r["decode_tok_s"]["on"]
    assert off["runs"] == pytest.approx([10.0, 10 / 1.2, 10 / 0.8])
    assert on["runs"] == pytest.approx([50.0, 10 / 0.24, 50.0])
    assert (off["min"], off["median"], off["max"]) == pytest.approx((10 / 1.2, 10.0, 12.5))
    assert r["ratio"]["runs"] == pytest.approx([5.0, 5.0, 4.0])
    assert r["ratio"]["median"] == pytest.approx(5.0)
    assert r["ratio_bounds"] == pytest.approx({"low": (10 / 0.24) / 12.5, "high": 50 / (10 / 1.2)})
    assert r["ttft_ms"]["off"]["median"] == pytest.approx(500.0)
    sp = r["speculation"]
    assert (sp["drafted"], sp["accepted"], sp["verify_steps"], sp["emitted"]) == (36, 18, 12, 30)
    assert sp["acceptance_rate"] == pytest.approx(0.5) and sp["tokens_per_verify_step"] == pytest.approx(2.5)
    assert sp["decode_steps"] == {"off": 30, "on": 12} and sp["step_ratio"] == pytest.approx(0.4)
    assert sp["engine"]["spec_drafted"] == 36 and r["off_side_drafted"] == 0
    assert r["identical"] and r["same"] == r["total"] == 1 and spec.failures({"edit": r}) == []
    (p,) = r["per_prompt"]
    assert p["ratio_median"] == pytest.approx(50.0 / 10.0) and p["same_tokens"]
    assert p["speculation"]["drafted"] == 36


def test_batch_rate_counts_only_while_every_stream_decodes():
    # stream a decodes from t=1 to t=3, stream b from t=2 to t=4: window (2, 3]
    a = RequestRun([0] * 5, [(1.0, 1), (1.5, 1), (2.0, 1), (2.5, 1), (3.0, 1)], 0.0)
    b = RequestRun([0] * 5, [(2.0, 1), (2.5, 2), (3.0, 1), (4.0, 1)], 0.0)
    run = SideRun([a, b], 4.0)
    r = summarize({"off": [run, run], "on": [run, run]}, ["a", "b"], together=True)
    assert r["decode_tok_s"]["off"]["median"] == pytest.approx((2 + 3) / 1.0)    # a: 2.5, 3.0; b: 2.5 (2), 3.0
    assert r["end_to_end_tok_s"]["on"]["median"] == pytest.approx(10 / 4.0)
    assert r["ttft_ms"]["on"]["runs"] == pytest.approx([1000.0, 2000.0])


def test_a_token_mismatch_is_a_visible_failure(capsys):
    changed = TOKENS[:5] + [99] + TOKENS[6:]
    r = summarize(_records(on_tokens=changed), ["rename-x"], together=False, decode=lambda t: f"<{t[0]}>")
    assert not r["identical"] and r["same"] == 0
    (m,) = r["mismatches"]
    assert m["first_difference"] == 5 and m["between"] == "off and on"
    assert m["off_text"] == ["<1>", "<2>", "<3>", "<4>", "<5>", "<6>", "<7>"] and m["on_text"][4] == "<99>"
    assert spec.failures({"edit": r}) == ["edit rename-x: tokens differ (off and on) at 5"]
    spec.print_report({"edit": r}, "title")
    out = capsys.readouterr().out
    assert "MISMATCH edit rename-x: off and on part at token 5" in out and "0/1" in out


def test_nondeterminism_between_runs_of_one_side_is_caught():
    rec = _records()
    rec["off"][1].requests[0].token_ids = TOKENS[:8] + [42, 9, 10]      # one timed off run differs
    r = summarize(rec, ["p"], together=False)
    (m,) = r["mismatches"]
    assert m["between"] == "two off runs" and m["first_difference"] == 8 and not m["off_deterministic"]


def test_drafting_on_the_off_side_fails_and_crashes_are_reported(capsys):
    rec = _records()
    rec["off"][2].engine_spec = {"spec_drafted": 3}
    r = summarize(rec, ["p"], together=False)
    assert r["off_side_drafted"] == 3 and "speculate=False requests drafted 3" in spec.failures({"chat": r})[0]
    crashed = {"batch": {"error": "RuntimeError: boom", "part_seconds": 1.0}}
    assert spec.failures(crashed) == ["batch: crashed (RuntimeError: boom)"]
    spec.print_report({"chat": r, **crashed}, "title")
    out = capsys.readouterr().out
    assert "batch   CRASHED: RuntimeError: boom" in out and "WARNING: requests with speculate=False" in out


def test_report_marks_the_chat_target_and_the_json_is_strict(capsys):
    slow = summarize(_records(on_dts=(0.3, 0.3, 0.3, 0.3)), ["haiku"], together=False)
    fast = summarize(_records(), ["haiku"], together=False)
    spec.print_report({"chat": slow}, "t")
    assert ">=0.97 BELOW" in capsys.readouterr().out
    spec.print_report({"chat": fast}, "t")
    assert ">=0.97 ok" in capsys.readouterr().out
    one = _records()
    one["on"][1].requests[0] = _request([0], [1], 0.5, 0.1)          # a one-token answer: no decode rate
    doc = spec._strip({"edit": summarize(one, ["p"], together=False)})
    text = json.dumps(doc, allow_nan=False)
    part = json.loads(text)["edit"]
    assert set(part) >= {"decode_tok_s", "ratio", "ratio_bounds", "ttft_ms", "speculation", "identical",
                         "mismatches", "per_prompt"}
    assert part["decode_tok_s"]["on"]["runs"][0] is None and math.isfinite(part["decode_tok_s"]["off"]["median"])


# -- a tiny real run ---------------------------------------------------------------------
def test_bench_spec_end_to_end(smollm_path, tmp_path):
    out = tmp_path / "spec.json"
    cmd = [sys.executable, "-m", "lodestar.cli", "bench", "spec", "--threads", "1", "--runs", "1", "--prompts", "1",
           "--max-tokens", "8", "--streams", "2", "--strict", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["bench"] == "spec" and len(doc["model_sha256"]) == 64 and doc["spec"]["method"] == "ngram"
    assert doc["lodestar_device"] == "cpu" and doc["threads"] == 1 and doc["failures"] == []
    assert [p["name"] for p in doc["prompts"]["batch"]] == [edit_tasks()[0].name] * 2
    assert doc["prompts"]["edit"][0]["tokens"] > 800
    for part in ("edit", "chat", "batch"):
        p = doc["parts"][part]
        assert p["identical"] and p["off_side_drafted"] == 0, p
        assert p["decode_tok_s"]["off"]["median"] > 0 and p["decode_tok_s"]["on"]["median"] > 0
        assert part in r.stdout
