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


def _rewrite_header(path: Path, change) -> None:
    """Replace a checkpoint's JSON header with ``change(header)`` (any JSON value), keeping
    the marker and the payload as they were."""
    import struct
    data = path.read_bytes()
    (hlen,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12:12 + hlen])
    new = json.dumps(change(header)).encode()
    path.write_bytes(data[:8] + struct.pack("<I", len(new)) + new + data[12 + hlen:])


HEADER_DAMAGE = {
    "a list": lambda h: [h],
    "a number": lambda h: 7,
    "a string": lambda h: "header",
    "null": lambda h: None,
    "shapes as ints": lambda h: {**h, "shapes": [s[0] for s in h["shapes"]]},
    "shapes as a string": lambda h: {**h, "shapes": "9x64"},
    "tokens as a string": lambda h: {**h, "tokens": "1 2 3"},
    "version as a string": lambda h: {**h, "version": "1"},
    "payload_bytes as a list": lambda h: {**h, "payload_bytes": [h["payload_bytes"]]},
    "a key missing": lambda h: {k: v for k, v in h.items() if k != "checksum"},
    "dtype unknown": lambda h: {**h, "dtype": "float128"},
    "block_size a float": lambda h: {**h, "block_size": 16.5},
}


def test_a_header_of_the_wrong_shape_is_deleted_not_fatal(loaded, tmp_path):
    """Each damaged header once raised TypeError on the engine thread, killing the server."""
    import shutil
    short = dict(case="chat_multiturn", disk_min_tokens=32)
    _, _, e = run_once(loaded, tmp_path / "good", **short)
    good = sorted((tmp_path / "good").glob("*.kv"))
    assert good
    meta = e.disk.layout
    from lodestar.engine.disk_cache import DiskKVCache
    for name, change in HEADER_DAMAGE.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        for f in good:
            shutil.copy(f, folder / f.name)
            _rewrite_header(folder / f.name, change)
        cache = DiskKVCache(folder, meta)
        for f in good:
            chain = bytes.fromhex(f.stem.rsplit("-", 1)[1])
            assert cache.load(chain, list(range(32))) is None, name
            assert not (folder / f.name).exists(), name
        assert cache.stats["rejected"] == len(good), name
    # End to end, the engine recomputes and checkpoints again (the first case of the report).
    for f in good:
        _rewrite_header(f, HEADER_DAMAGE["a list"])
    toks, last, e = run_once(loaded, tmp_path / "good", **short)
    assert toks == CASES["chat_multiturn"]["tokens"][:8]
    assert last.cache_read_disk_tokens == 0 and e.disk.stats["rejected"] >= 1
    toks, last, e = run_once(loaded, tmp_path / "good", **short)
    assert toks == CASES["chat_multiturn"]["tokens"][:8] and last.cache_read_disk_tokens > 0
