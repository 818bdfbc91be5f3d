import random

import pytest

from lodestar.engine.detokenizer import IncrementalDetokenizer

EMOJI = "😀".encode()  # f0 9f 98 80
SPECIAL = 999


class Vocab:
    """Token id -> bytes, built from the pieces a test needs."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.ids = {p: i for i, p in enumerate(pieces)}

    def token_bytes(self, token_id: int) -> bytes:
        if token_id == SPECIAL:
            return b"<|special|>"
        return self.pieces[token_id]

    def encode(self, *pieces: bytes) -> list[int]:
        return [self.ids[p] for p in pieces]


def _detok(vocab: Vocab, stop=(), include=False) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(vocab.token_bytes, skip_ids={SPECIAL}, stop=stop,
                                  include_stop_str_in_output=include)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids]


def test_emoji_split_into_single_bytes_appears_whole():
    vocab = Vocab([b"hi ", *[bytes([b]) for b in EMOJI], b"!"])
    detok = _detok(vocab)
    outs = _stream(detok, vocab.encode(b"hi ", *[bytes([b]) for b in EMOJI], b"!"))
    assert outs == ["hi ", "", "", "", "😀", "!"]
    assert detok.flush() == ""
    assert detok.text == "hi 😀!"


def test_multibyte_char_split_unevenly():
    vocab = Vocab([b"caf", "é".encode()[:1], "é".encode()[1:] + EMOJI[:2], EMOJI[2:]])
    detok = _detok(vocab)
    assert _stream(detok, [0, 1, 2, 3]) == ["caf", "", "é", "😀"]


def test_invalid_bytes_become_replacement_once_they_cannot_complete():
    vocab = Vocab([EMOJI[:2], b"A", b"\xff"])
    detok = _detok(vocab)
    assert detok.push(0) == ""  # could still become an emoji
    assert detok.push(1) == "\ufffdA"  # "A" cannot continue it
    assert detok.push(2) == "\ufffd"


def test_flush_replaces_dangling_bytes():
    vocab = Vocab([b"ok", EMOJI[:3]])
    detok = _detok(vocab)
    assert _stream(detok, [0, 1]) == ["ok", ""]
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok\ufffd"
    assert detok.flush() == ""
    with pytest.raises(RuntimeError, match="after flush"):
        detok.push(0)


def test_special_tokens_are_skipped():
    vocab = Vocab([b"a", EMOJI[:2], EMOJI[2:]])
    detok = _detok(vocab)
    assert _stream(detok, [0, SPECIAL, 1, SPECIAL, 2]) == ["a", "", "", "", "😀"]


def test_stop_string_split_across_tokens_is_never_partly_emitted():
    vocab = Vocab([b"Hello", b" <", b"|", b"end", b"|>", b" world"])
    detok = _detok(vocab, stop=["<|end|>"])
    outs = _stream(detok, vocab.encode(b"Hello", b" <", b"|", b"end", b"|>", b" world"))
    assert outs == ["Hello", " ", "", "", "", ""]
    assert detok.stopped and detok.stop_str == "<|end|>"
    assert detok.flush() == ""
    assert detok.text == "Hello "


def test_held_prefix_is_released_when_stop_does_not_follow():
    vocab = Vocab([b"a <", b"|x", b"b"])
    detok = _detok(vocab, stop=["<|end|>"])
    assert _stream(detok, [0, 1, 2]) == ["a ", "<|x", "b"]
    assert not detok.stopped


def test_held_prefix_is_released_by_flush():
    vocab = Vocab([b"a <|en"])
    detok = _detok(vocab, stop=["<|end|>"])
    assert detok.push(0) == "a "
    assert detok.flush() == "<|en"
    assert detok.text == "a <|en"


def test_stop_in_the_middle_of_a_token_truncates():
    vocab = Vocab([b"one two", b" STOP three", b" four"])
    detok = _detok(vocab, stop=["STOP"])
    assert _stream(detok, [0, 1, 2]) == ["one two", " ", ""]
    assert detok.stopped
    assert detok.text == "one two "


def test_stop_string_included_when_asked():
    vocab = Vocab([b"x = 1;", b"\n\nmore"])
    detok = _detok(vocab, stop=["\n\n"], include=True)
    assert _stream(detok, [0, 1]) == ["x = 1;", "\n\n"]
    assert detok.text == "x = 1;\n\n"


def test_stop_made_of_multibyte_chars():
    vocab = Vocab([b"go ", EMOJI[:1], EMOJI[1:], b"!", b"after"])
    detok = _detok(vocab, stop=["😀!"])
    assert _stream(detok, [0, 1, 2, 3, 4]) == ["go ", "", "", "", ""]
    assert detok.stopped and detok.text == "go "


def test_stop_that_ends_first_wins():
    vocab = Vocab([b"abcd"])
    detok = _detok(vocab, stop=["abcd", "bc"])
    assert detok.push(0) == "a"
    assert detok.stop_str == "bc"
    same_end = _detok(vocab, stop=["bcd", "abcd"])
    assert same_end.push(0) == ""
    assert same_end.stop_str == "abcd"


def test_nothing_after_stop_ever_appears():
    vocab = Vocab([b"ab", b"cSTOPd", b"more", EMOJI[:2]])
    detok = _detok(vocab, stop=["STOP"])
    outs = _stream(detok, [0, 3, 1, 2, 2])
    assert outs == ["ab", "", "\ufffdc", "", ""]
    assert detok.flush() == ""
    assert detok.text == "ab\ufffdc"


def test_text_accumulates_all_emitted_pieces():
    vocab = Vocab([b"a", b"b", b"c"])
    detok = _detok(vocab)
    for t in [0, 1, 2, 0]:
        detok.push(t)
        _ = detok.text
    assert detok.text == "abca"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(lambda t: b"", stop=["ok", ""])


def _reference(pieces: list[bytes], stops: list[str], include: bool) -> tuple[str, bool]:
    """One-shot decode of all bytes, cut at the stop string that ends first."""
    text = b"".join(pieces).decode("utf-8", errors="replace")
    best = None  # (end, -len): the stop that ends first, longest on a tie
    for s in stops:
        start = text.find(s)
        if start >= 0:
            key = (start + len(s), -len(s))
            best = key if best is None or key < best else best
    if best is None:
        return text, False
    end, neg_len = best
    return (text[:end] if include else text[:end + neg_len]), True


RANDOM_PIECES = [
    b"a", b"b", b"ab", b"ba", b"<", b"|", b"<|", b"|>", b" ", b"\n",
    "é".encode(), "é".encode()[:1], "é".encode()[1:],
    EMOJI, EMOJI[:1], EMOJI[1:2], EMOJI[2:], EMOJI[:3], EMOJI[3:], EMOJI[1:],
    "€".encode()[:2], "€".encode()[2:], b"\xff", b"\x80", b"\xed\xa0", "中".encode(),
]
RANDOM_STOPS = ["ab|", "<|a", "é\n", "😀", "aa", "\ufffd<", "ba€", "b b"]


def test_random_streams_match_one_shot_decode_cut_at_stop():
    rng = random.Random(20240601)
    vocab = Vocab(RANDOM_PIECES)
    stopped_trials = 0
    for trial in range(1500):
        stops = rng.sample(RANDOM_STOPS, rng.randint(0, 3))
        include = rng.random() < 0.3
        ids = [rng.choice(range(len(RANDOM_PIECES) + 1)) for _ in range(rng.randint(0, 30))]
        ids = [SPECIAL if t == len(RANDOM_PIECES) else t for t in ids]
        detok = _detok(vocab, stop=stops, include=include)
        expected, stopped = _reference([vocab.token_bytes(t) for t in ids if t != SPECIAL], stops, include)
        streamed = ""
        for t in ids:
            streamed += detok.push(t)
            # What is out can never be taken back.
            assert expected.startswith(streamed), (trial, ids, stops)
        streamed += detok.flush()
        assert streamed == expected, (trial, ids, stops, include)
        assert detok.text == expected
        assert detok.stopped == stopped
        stopped_trials += stopped
    assert 100 < stopped_trials < 1400  # both paths well exercised


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, min(len(s), len(text) + 1))
                if text.endswith(s[:k])), default=0)


def test_overlapping_stops_hold_back_exactly_the_longest_possible_start():
    # A two-letter alphabet with stop strings that overlap themselves and each other
    # exercises every fallback of the matcher.
    rng = random.Random(7)
    vocab = Vocab([b"a", b"b", b"ab", b"ba", b"aab", b"bb"])
    stop_pool = ["aab", "abab", "ba", "bab", "aaaa", "abba", "b", "abaab"]
    for trial in range(2000):
        stops = rng.sample(stop_pool, rng.randint(1, 4))
        ids = [rng.randrange(len(vocab.pieces)) for _ in range(rng.randint(0, 20))]
        detok = _detok(vocab, stop=stops)
        expected, stopped = _reference([vocab.token_bytes(t) for t in ids], stops, False)
        streamed, seen = "", b""
        for t in ids:
            streamed += detok.push(t)
            seen += vocab.token_bytes(t)
            if not detok.stopped:
                text = seen.decode()
                assert streamed == text[:len(text) - _held_back(text, stops)], (trial, ids, stops)
        streamed += detok.flush()
        assert streamed == expected and detok.stopped == stopped, (trial, ids, stops)


def test_long_stop_strings_cost_linear_time_and_memory():
    import time
    import tracemalloc

    # 16 stop strings of 40,000 characters each, and a long output that keeps almost
    # matching them: the matcher's work and memory grow with the text, not its square.
    stops = [("ab" * 20_000)[:39_999] + chr(ord("c") + i) for i in range(16)]
    vocab = Vocab([b"ab", b"x"])
    tracemalloc.start()
    t0 = time.perf_counter()
    detok = _detok(vocab, stop=stops)
    for i in range(30_000):
        detok.push(1 if i % 25_000 == 24_999 else 0)
    detok.flush()
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert not detok.stopped and detok.text == ("ab" * 24_999 + "x" + "ab" * 5_000)
    assert peak < 60e6, f"peak {peak / 1e6:.0f} MB"
    assert seconds < 20, f"{seconds:.1f} s"
