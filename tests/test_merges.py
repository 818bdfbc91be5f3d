"""Merges rebuilt from a scored vocabulary, and their disk cache."""
from __future__ import annotations

import pytest

from lodestar import merges as M

TOKENS = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "bca", "▁", "▁a", "▁ab"]


def scored(order: list[str]) -> tuple[dict[str, int], dict[str, float]]:
    return {t: i for i, t in enumerate(order)}, {t: -i for i, t in enumerate(order)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "lodestar" / "merges"


def test_merges_are_every_two_token_split_best_score_first():
    vocab, scores = scored(TOKENS)
    got = M.generate_merges(vocab, scores)
    assert got[:3] == [("a", "b"), ("b", "c"), ("ab", "c")]      # "ab", "bc", then "abc": longer left first
    assert ("a", "bc") in got and got.index(("ab", "c")) < got.index(("a", "bc"))
    assert len(got) == len(set(got)) == 12


def test_the_second_build_reads_the_cache(cache, monkeypatch):
    vocab, scores = scored(TOKENS)
    want = M.generate_merges(vocab, scores)
    assert M.merges_for(vocab, scores) == want
    assert len(list(cache.glob("*.bin"))) == 1

    def no_rebuild(*_):
        raise AssertionError("rebuilt although cached")
    monkeypatch.setattr(M, "generate_merges", no_rebuild)
    assert M.merges_for(vocab, scores) == want


def test_another_order_or_vocabulary_is_another_entry(cache):
    vocab, scores = scored(TOKENS)
    other_vocab, other_scores = scored(TOKENS[::-1])
    first, second = M.merges_for(vocab, scores), M.merges_for(other_vocab, other_scores)
    assert second == M.generate_merges(other_vocab, other_scores) != first
    assert M.merges_for(vocab) == M.generate_merges(vocab)          # unscored: by id
    assert len(list(cache.glob("*.bin"))) == 3


@pytest.mark.parametrize("damage", ["truncate", "magic", "foreign ids", "empty"])
def test_a_damaged_cache_file_is_rebuilt(cache, damage):
    vocab, scores = scored(TOKENS)
    want = M.merges_for(vocab, scores)
    (path,) = cache.glob("*.bin")
    raw = path.read_bytes()
    path.write_bytes({"truncate": raw[:-3], "magic": b"X" + raw[1:], "empty": b"",
                      "foreign ids": raw[:16] + b"\xff\x00\x00\x00" * ((len(raw) - 16) // 4)}[damage])
    assert M.merges_for(vocab, scores) == want
    assert path.read_bytes() == raw                                 # and written again


def test_an_unwritable_cache_still_gives_the_merges(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    vocab, scores = scored(TOKENS)
    assert M.merges_for(vocab, scores) == M.generate_merges(vocab, scores)
    assert list(tmp_path.iterdir()) == [blocker]


def test_gemma_merges_from_the_cache_equal_a_fresh_build(gemma_path, cache):
    from lodestar.formats.gguf import GGUFFile
    tokens = GGUFFile(gemma_path).metadata["tokenizer.ggml.tokens"]
    vocab, scores = scored(tokens)
    fresh = M.merges_for(vocab, scores)
    assert len(fresh) > 500_000 and M.merges_for(vocab, scores) == fresh
