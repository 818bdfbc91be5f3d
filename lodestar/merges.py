"""BPE merges implied by a vocabulary that stores scores instead of a merge list
(SentencePiece-style GGUF files: Gemma, Llama 2, ...), and a disk cache of them.

Rebuilding the merges walks every split of every token: about 2 s in Python for Gemma's
262,144 tokens. The result depends only on the vocabulary and its scores, so it is kept as
pairs of token ids under ``$XDG_CACHE_HOME/lodestar/merges/`` (``~/.cache`` by default),
named by a SHA-256 of everything ``generate_merges`` reads; the next load of any file with
that vocabulary reads it back in a tenth of the time. A cache that cannot be written is
skipped; one that does not read back whole (truncated, foreign ids) is rebuilt.
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from array import array
from collections.abc import Mapping
from pathlib import Path

_MAGIC = b"LSMERGE1"


def generate_merges(vocab: Mapping[str, int], vocab_scores: Mapping[str, float] | None = None) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary without a merge list: every split of a token into two
    tokens, best score first (ties: longer left piece, then longer right piece)."""
    reverse = vocab_scores is not None
    scores = dict(vocab_scores) if reverse else vocab
    merges = []
    for merge, score in scores.items():
        local = []
        for i in range(1, len(merge)):
            left, right = merge[:i], merge[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=reverse)
    return [(m[0], m[1]) for m in merges]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lodestar" / "merges"


def _key(vocab: Mapping[str, int], vocab_scores: Mapping[str, float] | None) -> str:
    h = hashlib.sha256(_MAGIC)
    for table, values in ((vocab, "q"), (vocab_scores, "d")):
        if table is None:
            h.update(b"\x00none")
            continue
        h.update(struct.pack("<q", len(table)))
        h.update(array("q", map(len, table)).tobytes())
        h.update("".join(table).encode("utf-8", "surrogatepass"))
        h.update(array(values, table.values()).tobytes())
    return h.hexdigest()


def _read(path: Path, names: list[str]) -> list[tuple[str, str]] | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < 16 or raw[:8] != _MAGIC:
        return None
    (count,) = struct.unpack("<q", raw[8:16])
    ids = array("i")
    if count < 0 or len(raw) != 16 + 8 * count:
        return None
    ids.frombytes(raw[16:])
    if ids and (min(ids) < 0 or max(ids) >= len(names)):
        return None
    it = iter(ids)
    return [(names[a], names[b]) for a, b in zip(it, it)]


def _write(path: Path, merges: list[tuple[str, str]], vocab: Mapping[str, int]) -> None:
    ids = array("i", (vocab[t] for pair in merges for t in pair))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".merges-")
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + struct.pack("<q", len(merges)) + ids.tobytes())
        os.replace(tmp, path)
    except OSError:     # a read-only or full cache: the merges are rebuilt next time
        try:
            os.unlink(tmp)
        except (OSError, UnboundLocalError):
            pass


def merges_for(vocab: Mapping[str, int], vocab_scores: Mapping[str, float] | None = None) -> list[tuple[str, str]]:
    """``generate_merges(vocab, vocab_scores)``, from the cache when it holds them."""
    path = cache_dir() / f"{_key(vocab, vocab_scores)}.bin"
    names = [""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        names[i] = token
    merges = _read(path, names)
    if merges is None:
        merges = generate_merges(vocab, vocab_scores)
        _write(path, merges, vocab)
    return merges
