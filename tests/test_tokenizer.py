"""The GGUF tokenizer against the oracle's goldens (tests/goldens/tokenizer_*.json).

Regenerate the goldens with ``python scripts/make_tokenizer_goldens.py``.
"""
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from lodestar.formats.catalog import file_sha256
from lodestar.tokenizer import Tokenizer, TokenizerError

GOLDEN_DIR = Path(__file__).parent / "goldens"
MODELS = {"smollm2-135m": "smollm_path", "gemma3-270m": "gemma_path"}


def _load_golden(name: str) -> dict:
    return json.loads((GOLDEN_DIR / f"tokenizer_{name}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def loaded(request):
    """(name, path, golden, tokenizer) per model, built once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = request.getfixturevalue(MODELS[name])
            cache[name] = (path, _load_golden(name), Tokenizer.from_gguf(path))
        return cache[name]

    return get


@pytest.fixture(params=list(MODELS))
def model(request, loaded):
    """A model whose installed file is the one the goldens were made from."""
    path, golden, tok = loaded(request.param)
    if file_sha256(path) != golden["model_sha256"]:
        pytest.skip(
            f"{path.name} has SHA-256 {file_sha256(path)}, the goldens were made from {golden['model_sha256']}: "
            "run `python scripts/make_tokenizer_goldens.py` with the oracle extra installed to regenerate them"
        )
    return request.param, golden, tok


def _mismatches(pairs):
    return [(key, want, got) for key, want, got in pairs if want != got]


def _report(bad, what):
    lines = [f"{len(bad)} {what} differ from the oracle; first ones:"]
    for key, want, got in bad[:5]:
        lines.append(f"  {key!r}\n    oracle: {want!r}\n    ours:   {got!r}")
    return "\n".join(lines)


def test_goldens_record_their_provenance(model):
    _, golden, _ = model
    assert set(golden["tools"]) >= {"transformers", "tokenizers", "gguf"}
    assert len(golden["model_sha256"]) == 64 and int(golden["model_sha256"], 16) >= 0


def test_vocabulary_facts_match_oracle(model):
    _, golden, tok = model
    assert tok.vocab_size == golden["vocab_size"]
    assert tok.bos_id == golden["bos_token_id"]
    assert tok.eos_id == golden["eos_token_id"]
    assert tok.add_bos == golden["add_bos_token"]
    assert tok.special_tokens_map == golden["special_tokens_map"]
    assert tok.has_chat_template == golden["has_chat_template"]


def test_golden_set_is_broad(model):
    _, golden, _ = model
    texts = [case["text"] for case in golden["encode"]]
    assert len(texts) >= 200
    needles = ["", "\u200d", "🇺🇸", "\u0301", "你好", "مرحبا", "def ", "://", "\t", "  ", "<|im_start|>"]
    for needle in needles:
        assert any(needle in t for t in texts), needle


def test_encode_matches_oracle(model):
    _, golden, tok = model
    cases = golden["encode"]
    bad = _mismatches((c["text"], c["ids"], tok.encode(c["text"])) for c in cases)
    bad += _mismatches((c["text"], c["ids_no_special"], tok.encode(c["text"], add_special_tokens=False)) for c in cases)
    assert not bad, _report(bad, "encodings")


def test_encode_batch_matches_encode(model):
    _, golden, tok = model
    texts = [c["text"] for c in golden["encode"][:50]]
    assert tok.encode_batch(texts) == [c["ids"] for c in golden["encode"][:50]]


def test_decode_matches_oracle(model):
    _, golden, tok = model
    cases = golden["encode"]
    bad = _mismatches((c["text"], c["decode"], tok.decode(c["ids"])) for c in cases)
    bad += _mismatches(
        (c["text"], c["decode_skip_special"], tok.decode(c["ids"], skip_special_tokens=True)) for c in cases
    )
    assert not bad, _report(bad, "decodes")


def test_token_bytes_join_to_decoded_text(model):
    """Concatenated token bytes decode to what decode() returns, while single tokens may hold
    only part of a UTF-8 character (so an incremental detokenizer has to hold them back)."""
    _, golden, tok = model
    partial = 0
    for case in golden["encode"]:
        pieces = [tok.token_bytes(i) for i in case["ids"]]
        assert b"".join(pieces).decode("utf-8", errors="replace") == tok.decode(case["ids"]), case["text"]
        for piece in pieces:
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                partial += 1
    assert partial > 0, "no golden token holds a partial UTF-8 character; the check above proves too little"


def test_special_tokens_encode_whole(model):
    name, _, tok = model
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] if name == "smollm2-135m" else \
        ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"]
    for text in specials:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1 and tok.id_to_piece(ids[0]) == text
        assert tok.is_special(ids[0])
        assert tok.decode(ids, skip_special_tokens=True) == ""


def test_eos_ids_hold_end_of_turn(model):
    name, _, tok = model
    if name == "smollm2-135m":
        im_end = tok.piece_to_id("<|im_end|>")
        assert tok.eos_id == im_end and im_end in tok.eos_ids
    else:
        # A base model without a template stops on <eos> only.
        assert tok.eos_ids == {tok.piece_to_id("<eos>")}


def test_chat_templates_match_oracle(model):
    name, golden, tok = model
    if golden["chat"] is None:
        assert not tok.has_chat_template and tok.chat_template is None
        pytest.skip(golden["chat_note"])
    assert tok.chat_template == golden["chat_template"]
    assert len(golden["chat"]) >= 20
    for case in golden["chat"]:
        kwargs = dict(case.get("kwargs", {}))
        if case.get("continue_final_message"):
            kwargs["continue_final_message"] = True
        common = dict(tools=case.get("tools"), add_generation_prompt=case["add_generation_prompt"], **kwargs)
        if "error" in case:
            with pytest.raises(Exception):
                tok.apply_chat_template(case["messages"], **common)
            continue
        assert tok.apply_chat_template(case["messages"], tokenize=False, **common) == case["text"], case["messages"]
        assert tok.apply_chat_template(case["messages"], tokenize=True, **common) == case["ids"], case["messages"]


def test_template_environment_matches_oracle(model):
    _, golden, tok = model
    if golden["chat"] is None:
        pytest.skip(golden["chat_note"])
    features = golden["template_features"]
    for case in features["cases"]:
        template = features["templates"][case["template"]]
        common = dict(tools=case.get("tools"), add_generation_prompt=case["add_generation_prompt"],
                      chat_template=template)
        if "error" in case:
            with pytest.raises(Exception, match="roles must alternate"):
                tok.apply_chat_template(case["messages"], **common)
            continue
        assert tok.apply_chat_template(case["messages"], **common) == case["text"], case["template"]
        assert tok.apply_chat_template(case["messages"], tokenize=True, **common) == case["ids"], case["template"]


def test_model_without_template_raises_clear_error(loaded):
    _, golden, tok = loaded("gemma3-270m")
    assert golden["chat"] is None
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # An explicit template still works.
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ bos_token }}x")
    assert text == "<bos>x"


def test_strftime_now_and_bad_input(loaded):
    _, _, tok = loaded("smollm2-135m")
    year = tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ strftime_now('%Y') }}")
    assert year in {str(datetime.now().year), str(datetime.now().year - 1)}
    with pytest.raises(TokenizerError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(Exception, match="underscore"):
        tok.apply_chat_template([{"role": "user", "content": "x"}],
                                chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}")


def _tiny_gpt2(pre: str) -> Tokenizer:
    from lodestar.tokenizer import bytes_to_unicode

    alphabet = sorted(set(bytes_to_unicode().values()))
    tokens = ["<|end|>"] + alphabet + ["12", "123", "45"]
    meta = {
        "general.architecture": "qwen2",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": ["1 2", "12 3", "4 5"],
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}<|end|>{% endfor %}",
    }
    return Tokenizer.from_metadata(meta)


@pytest.mark.parametrize("pre, pieces", [
    ("llama-bpe", ["123", "45"]),            # digits in groups of up to three
    ("qwen2", ["1", "2", "3", "4", "5"]),     # one digit per piece
    ("smollm", ["12345"]),                    # GPT-2's regex keeps the run together
])
def test_split_regex_follows_pre_tokenizer_type(pre, pieces):
    tok = _tiny_gpt2(pre)
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("12345")] == pieces
    assert tok.eos_ids == {0}
    assert tok.encode("<|end|>") == [0]


def test_runtime_does_not_import_transformers():
    code = "import sys, lodestar.tokenizer; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _tiny_spm(arch: str) -> Tokenizer:
    tokens = ["<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", "▁", "h", "i", "▁h", "hi", "▁hi", "<|turn_end|>"]
    types = [2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1, 3]
    meta = {
        "general.architecture": arch,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -3.0, -4.0, -5.0, 0.0],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return Tokenizer.from_metadata(meta)


def test_sentencepiece_vocabulary_without_flags():
    tok = _tiny_spm("llama")
    assert tok.add_bos  # a SentencePiece vocabulary that does not say otherwise gets BOS
    ids = tok.encode("hi hi")
    assert ids == [1, 10, 10]  # "▁hi ▁hi": prefix space on the first word only
    assert tok.decode(ids, skip_special_tokens=True) == "hi hi"  # and decoding takes it off again
    ids = tok.encode("é", add_special_tokens=False)
    assert ids == [5, 3, 4]  # "▁" then byte fallback for the character the vocabulary lacks
    assert [tok.token_bytes(i) for i in ids] == [b" ", b"\xc3", b"\xa9"]
    assert tok.encode("<|turn_end|>", add_special_tokens=False) == [11]
    assert tok.eos_ids == {2}
    assert not tok.has_chat_template
