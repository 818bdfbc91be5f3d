"""The added-models registry, checkpoint descriptions, manifests and `lodestar models add|verify|rm`."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file

from lodestar.cli import main
from lodestar.engine.loader import open_checkpoint
from lodestar.formats.safetensors import HFCheckpoint
from lodestar.formats.catalog import ModelNotFoundError, cached_file_sha256, file_sha256, resolve_model_path
from lodestar.formats.registry import (FileDigest, ManifestError, ModelRegistry, RegistryConflictError, RegistryError,
                                       build_manifest, describe, locate, manifest_digest, parse_manifest,
                                       registry_path, verify)


@pytest.fixture(autouse=True)
def private_dirs(tmp_path, monkeypatch):
    """A registry and a hash cache of the test's own (never the user's)."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("LODESTAR_MODELS_DIR", str(tmp_path / "models"))


def tiny_gguf(path: Path, context: int = 256) -> Path:
    """A small llama-style GGUF: 2 layers, d_model 64, 4 heads (2 KV heads), one Q8_0 matrix."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_uint32("llama.embedding_length", 64)
    w.add_uint32("llama.attention.head_count", 4)
    w.add_uint32("llama.attention.head_count_kv", 2)
    w.add_uint32("llama.feed_forward_length", 128)
    w.add_uint32("llama.context_length", context)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b", "ab"])
    emb = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_hf(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 8, "max_position_embeddings": 512}))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 64, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "lock").write_text("hub bookkeeping")
    return folder


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the registry -----------------------------------------------------------------------------
def test_add_records_the_file_with_its_hash_and_survives_a_restart(tmp_path):
    model = tiny_gguf(tmp_path / "My Model.gguf")
    entry = ModelRegistry().add(model)
    assert entry.name == "My-Model" and entry.kind == "gguf" and entry.path == model.resolve()
    assert entry.manifest == {"My Model.gguf": FileDigest(sha(model), model.stat().st_size)}
    assert registry_path() == tmp_path / "data" / "lodestar" / "models.json"
    again = ModelRegistry().get("My-Model")              # a fresh reader: what was written
    assert again == entry
    assert json.loads(registry_path().read_text())["version"] == 1


def test_names_are_unique_and_never_a_built_in(tmp_path):
    a, b = tiny_gguf(tmp_path / "a.gguf"), tiny_gguf(tmp_path / "b.gguf", context=512)
    reg = ModelRegistry()
    reg.add(a, "mine")
    with pytest.raises(RegistryConflictError, match=r"taken by .*a\.gguf.*--name"):
        reg.add(b, "mine")
    reg.add(a, "mine")                                   # the same file again: refreshed, not refused
    reg.add(b, "other")                                  # and a second name for another file
    assert [m.name for m in reg.entries()] == ["mine", "other"]
    with pytest.raises(RegistryError, match="built-in"):
        reg.add(b, "gemma3")
    with pytest.raises(RegistryError, match="letters, digits"):
        reg.add(b, "../escape")


def test_only_models_are_added(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    reg = ModelRegistry()
    with pytest.raises(RegistryError, match="not a GGUF file"):
        reg.add(text)
    (tmp_path / "folder").mkdir()
    with pytest.raises(RegistryError, match="no config.json"):
        reg.add(tmp_path / "folder")
    with pytest.raises(ModelNotFoundError, match="no such file"):
        reg.add(tmp_path / "missing.gguf")

    def refuse(path):
        raise ValueError("architecture 'llama' is not supported")
    with pytest.raises(ValueError, match="not supported"):
        reg.add(tiny_gguf(tmp_path / "ok.gguf"), check=refuse)
    assert reg.entries() == []                            # nothing was recorded


def test_remove_forgets_the_name_but_keeps_the_file(tmp_path):
    model = tiny_gguf(tmp_path / "m.gguf")
    reg = ModelRegistry()
    reg.add(model, "m")
    assert reg.remove("m").path == model.resolve()
    assert model.is_file() and reg.get("m") is None
    with pytest.raises(ModelNotFoundError, match="no added model is named 'm'"):
        reg.remove("m")


def test_a_corrupt_registry_says_which_file_and_what_to_do(tmp_path):
    registry_path().parent.mkdir(parents=True)
    registry_path().write_text("{ not json")
    with pytest.raises(RegistryError, match=r"models\.json: not valid JSON.*delete that file"):
        ModelRegistry().entries()
    with pytest.raises(ModelNotFoundError, match="not valid JSON"):   # as --model resolution reports it
        resolve_model_path("some-name")


def test_an_unwritable_registry_says_how_to_move_it(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "file"))    # a file where a folder must go
    with pytest.raises(RegistryError, match="cannot write the model registry.*XDG_DATA_HOME"):
        ModelRegistry().add(tiny_gguf(tmp_path / "m.gguf"))


def test_added_names_resolve_as_models(tmp_path):
    model = tiny_gguf(tmp_path / "m.gguf")
    folder = tiny_hf(tmp_path / "hf")
    reg = ModelRegistry()
    reg.add(model, "mine")
    reg.add(folder, "mine-hf")
    assert resolve_model_path("mine") == model.resolve()
    with pytest.raises(ModelNotFoundError, match="pass the folder's path"):
        resolve_model_path("mine-hf")
    assert locate("mine-hf").path == folder.resolve() and locate("mine-hf").source == "added"
    path, source = open_checkpoint("mine-hf")            # what `--model mine-hf` opens
    assert path == folder.resolve() and isinstance(source, HFCheckpoint)
    model.unlink()
    with pytest.raises(ModelNotFoundError, match="no longer exists.*models rm mine"):
        locate("mine")
    with pytest.raises(ModelNotFoundError, match="lodestar models add"):
        locate("nothing-like-it")


# -- what a checkpoint holds --------------------------------------------------------------------
def test_describe_reads_geometry_and_sizes_without_weights(tmp_path):
    info = describe(tiny_gguf(tmp_path / "m.gguf"))
    assert (info.kind, info.family, info.quant, info.context) == ("gguf", "llama", "Q8_0", 256)
    assert (info.n_layers, info.n_kv_heads, info.head_dim) == (2, 2, 16)
    assert info.size_bytes == (tmp_path / "m.gguf").stat().st_size
    assert info.weights_bytes("packed") == 4 * 68 + 64 * 4           # Q8_0 rows of 64: 2 blocks of 34 bytes
    assert info.weights_bytes("fp32") == (4 * 64 + 64) * 4
    assert info.kv_bytes(100, 4) == 100 * 2 * 2 * (16 + 16) * 4
    hf = describe(tiny_hf(tmp_path / "hf"))
    assert (hf.kind, hf.family, hf.quant, hf.context) == ("hf", "llama", "BF16", 512)


# -- manifests ------------------------------------------------------------------------------
def test_verify_tells_unchanged_changed_missing_and_extra_files(tmp_path):
    folder = tiny_hf(tmp_path / "hf")
    manifest = build_manifest(folder)
    assert sorted(manifest) == ["config.json", "model.safetensors", "tokenizer.json"]    # .cache left out
    result = verify(folder, manifest, "manifest")
    assert result.ok is True and result.sha256 == result.expected == manifest_digest(manifest)

    (folder / "tokenizer.json").write_text("{ }")          # one byte more
    (folder / "extra.safetensors").write_bytes(b"x")
    (folder / "config.json").unlink()
    result = verify(folder, manifest, "manifest")
    assert result.ok is False and result.sha256 != result.expected
    assert {f.path: f.status for f in result.files} == {
        "config.json": "missing", "extra.safetensors": "unexpected", "model.safetensors": "ok",
        "tokenizer.json": "changed"}

    nothing = verify(folder, None)
    assert nothing.ok is None and {f.status for f in nothing.files} == {"unchecked"}


def test_a_renamed_file_verifies_against_its_one_file_manifest(tmp_path):
    model = tiny_gguf(tmp_path / "m.gguf")
    manifest = build_manifest(model)
    renamed = model.rename(tmp_path / "renamed.gguf")
    result = verify(renamed, manifest)
    assert result.ok is True and result.sha256 == sha(renamed) == result.expected
    data = bytearray(renamed.read_bytes())
    data[-1] ^= 1                                          # same size, different bytes
    renamed.write_bytes(bytes(data))
    assert verify(renamed, manifest).ok is False


@pytest.mark.parametrize("data,needle", [
    ([], "expected"),
    ({"files": {}}, "lists no files"),
    ({"files": {"/etc/passwd": {"sha256": "0" * 64}}}, "relative"),
    ({"files": {"a/../../b": {"sha256": "0" * 64}}}, "relative"),
    ({"files": {"m.gguf": {"sha256": "abc"}}}, r"files\['m.gguf'\]\.sha256"),
    ({"files": {"m.gguf": {"sha256": "0" * 64, "size": -1}}}, r"\.size"),
    ({"files": {"m.gguf": "0" * 64}}, r"files\['m.gguf'\]"),
])
def test_malformed_manifests_name_the_entry(data, needle):
    with pytest.raises(ManifestError, match=needle):
        parse_manifest(data)


def test_hashes_are_cached_until_the_file_changes(tmp_path):
    model = tiny_gguf(tmp_path / "m.gguf")
    assert cached_file_sha256(model) is None
    assert file_sha256(model) == sha(model) == cached_file_sha256(model)
    with open(model, "ab") as f:
        f.write(b"\0")
    assert cached_file_sha256(model) is None               # size changed: the cached digest no longer holds
    assert file_sha256(model) == sha(model)
    os.utime(model, ns=(1, 1))                              # mtime changed
    assert cached_file_sha256(model) is None


# -- the command line ---------------------------------------------------------------------------
def test_cli_add_verify_rm(tmp_path, smollm_path, capsys, monkeypatch):
    monkeypatch.delenv("LODESTAR_MODELS_DIR")              # the real model folder: known models resolve
    assert main(["models", "add", str(smollm_path), "--name", "my-smol"]) == 0
    out = capsys.readouterr().out
    assert f"added my-smol: {smollm_path.resolve()}" in out and sha(smollm_path) in out

    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "my-smol\n" in listing and "smollm2-135m\n" in listing and "added 2" in listing

    manifest = tmp_path / "manifest.json"
    assert main(["models", "verify", "my-smol", "--write-manifest", str(manifest)]) == 0
    assert "ok: every file matches" in capsys.readouterr().out
    files = json.loads(manifest.read_text())["files"]
    assert files == {smollm_path.name: {"sha256": sha(smollm_path), "size": smollm_path.stat().st_size}}

    files[smollm_path.name]["sha256"] = "0" * 64
    manifest.write_text(json.dumps({"files": files}))
    assert main(["models", "verify", str(smollm_path), "--manifest", str(manifest)]) == 1
    captured = capsys.readouterr()
    assert "changed" in captured.out and "1 of 1 files do not match" in captured.err

    assert main(["models", "rm", "my-smol"]) == 0
    assert "stays where it is" in capsys.readouterr().out and smollm_path.is_file()
    assert main(["models", "rm", "my-smol"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no added model is named 'my-smol'" in err


def test_cli_refusals_are_one_line(tmp_path, capsys):
    text = tmp_path / "x.gguf"
    text.write_text("not a model")
    assert main(["models", "add", str(text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a GGUF file" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"files": {"x": {"sha256": "nope"}}}')
    assert main(["models", "verify", str(tiny_gguf(tmp_path / "m.gguf")), "--manifest", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sha256: expected 64 hexadecimal digits" in err
