"""Disk KV tier: restore after a restart gives the same tokens; bad files are never trusted."""
import json
from pathlib import Path

import pytest

from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.loader import load_model
from lodestar.engine.sampling import SamplingParams

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
CASES = {c["name"]: c for c in json.loads((GOLDENS / "generate_smollm2-135m.json").read_text())["cases"]}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(smollm_path):
    return load_model("default", mode="fp32", progress=False)


def run_once(loaded, kv_dir, case="chat_long", **cfg):
    """A fresh engine (as after a restart) on the same weights; returns tokens and last output."""
    e = LLMEngine(loaded, EngineConfig(kv_dir=str(kv_dir), max_num_batched_tokens=512, **cfg))
    outs = list(e.stream(CASES[case]["prompt_ids"], PARAMS))
    e.close()
    return [t for o in outs for t in o.token_ids], outs[-1], e


def test_restore_after_restart_is_exact(loaded, tmp_path):
    want = CASES["chat_long"]["tokens"][:8]
    toks, last, e = run_once(loaded, tmp_path)
    assert toks == want and last.cached_tokens == 0 and last.cache_write_tokens >= 1024
    assert list(tmp_path.glob("*.kv"))
    toks, last, e = run_once(loaded, tmp_path)
    assert toks == want
    assert last.cache_read_disk_tokens >= 1024 and last.cached_tokens == last.cache_read_disk_tokens


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "other_model", "empty"])
def test_damaged_checkpoint_is_rejected_deleted_and_recomputed(loaded, tmp_path, damage):
    short = dict(case="chat_multiturn", disk_min_tokens=32)
    run_once(loaded, tmp_path, **short)
    files = sorted(tmp_path.glob("*.kv"))
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip_payload":
            data[-100] ^= 0xFF
        elif damage == "flip_header":
            data[20] ^= 0x01
        elif damage == "other_model":
            data = data.replace(b'"model_sha256": "', b'"model_sha256": "0', 1)
        else:
            data = b""
        f.write_bytes(bytes(data))
    toks, last, e = run_once(loaded, tmp_path, **short)
    assert toks == CASES["chat_multiturn"]["tokens"][:8]
    assert last.cache_read_disk_tokens == 0
    assert e.disk.stats["rejected"] >= 1
    for f in files:             # rejected files are gone or replaced by a fresh valid write
        if f.exists():
            assert f.read_bytes()[:8] == b"LDSTRKV\n"


def test_size_cap_deletes_least_recently_used(loaded, tmp_path):
    # each checkpoint of this prompt is ~2.3 MB: a 3 MB cap keeps only the newest one
    run_once(loaded, tmp_path, case="chat_multiturn", disk_min_tokens=32, disk_max_bytes=3 << 20)
    files = list(tmp_path.glob("*.kv"))
    assert len(files) == 1 and files[0].stat().st_size <= 3 << 20
