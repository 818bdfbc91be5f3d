"""``python -m lodestar.bench.spec_curve`` on the CPU: a tiny synthetic model's curve has the
JSON shape the docs read, a verify step feeds the last token and its drafts and puts the
sequence back as it was."""
import json
from pathlib import Path

import pytest
import torch

from lodestar.bench import spec_curve as sc


@pytest.fixture(scope="module")
def loaded():
    from lodestar.engine.loader import LoadedModel
    from lodestar.formats.synthetic import Geometry, SyntheticCheckpoint, synthetic_tokenizer_metadata
    from lodestar.models import build_model
    from lodestar.tokenizer import Tokenizer
    g = Geometry("llama", 64, 2, 4, 2, 16, 128, 10000.0, tied=True, vocab=256, context=256)
    ck = SyntheticCheckpoint(g, "Q4_0", device="cpu", seed=3)
    model = build_model(ck.config, ck, "packed", device="cpu")
    tok = Tokenizer.from_metadata(synthetic_tokenizer_metadata(ck.config.vocab_size))
    return LoadedModel(Path("synthetic-tiny"), ck, ck.config, model, tok, "packed", 0.0, "cpu")


def test_curve_document(loaded):
    rows = sc.parse_rows([3, 2, 2])
    doc = sc.run(loaded, "packed", "Q4_0", "cpu", rows, context=40, runs=2, steps=2, warmup=1)
    doc = json.loads(json.dumps(doc))           # what --json writes
    assert doc["rows"] == [1, 2, 3] and [r["k"] for r in doc["results"]] == [1, 2, 3]
    assert doc["context"] == doc["position"] == 40
    first = doc["results"][0]
    assert first["ratio"] == {"median": 1.0, "min": 1.0, "max": 1.0} and first["path"] == "eager"
    for r in doc["results"]:
        assert r["drafts"] == r["k"] - 1 and r["rows_fed"] == r["k"] and len(r["ms"]["runs"]) == 2
        assert r["ms"]["min"] <= r["ms"]["median"] <= r["ms"]["max"]
        assert r["logit_rows"] == r["k"]                   # the head runs on every row, as verify needs
    assert [r["path"] for r in doc["results"][1:]] == ["stepwise", "stepwise"]
    assert doc["model"]["geometry"]["d_model"] == 64 and doc["model"]["synthetic_fingerprint"]
    assert doc["kernel_path"]["projections"] and set(doc["kernel_path"]["by_rows"]) == {"1", "2", "3"}
    for key in ("device", "torch", "commit", "draft_ids", "prompt_ids_sha", "runs", "steps_per_run"):
        assert key in doc, key
    assert "t(k)/t(1)" in sc.table(doc)


def test_verify_step_feeds_the_drafts_and_restores_the_sequence(loaded):
    engine = sc.build_engine(loaded, 40, 4, "cpu")
    seq, drafts = sc.prefill(engine, 40)
    state = (seq.num_computed, list(seq.block_table), engine.pool.num_free, seq.num_tokens)
    logits = sc.verify_step(engine.runner, seq, drafts, 4)
    assert (seq.num_computed, list(seq.block_table), engine.pool.num_free, seq.num_tokens) == state
    assert seq.draft_ids == []
    # row j of the run is the decode step of the token at position 40 + j, fed one per step
    seq.draft_ids = drafts[:3]
    sc.reserve(engine.pool, seq, seq.num_computed + 4)
    steps = torch.cat([engine.runner.run([seq], [1]) for _ in range(4)])
    assert logits.shape[0] == 4 and torch.equal(logits, steps)


def test_rows_are_checked():
    assert sc.parse_rows([4, 2]) == [1, 2, 4]
    for bad in ([0], [65]):
        with pytest.raises(ValueError, match="verify run has 1 to 64 rows"):
            sc.parse_rows(bad)


def test_a_geometry_needs_a_file_type_and_a_file_a_weight_mode():
    with pytest.raises(ValueError, match="--dtype names its file type"):
        sc.load("llama-3.1-8b", "packed", "cpu")
    with pytest.raises(ValueError, match="a model file takes a weight mode"):
        sc.load("default", "q4_0", "cpu")
