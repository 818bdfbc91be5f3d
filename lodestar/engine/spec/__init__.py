"""Speculative decoding: drafters propose tokens, one target forward verifies them.

A running sequence that speculates gets up to ``gamma`` draft tokens per step from the
engine's drafter (``drafters``): n-gram lookup over its prompt and output, or a smaller
draft model. The step feeds its last token and the drafts as one run of rows (a decode
graph on a GPU, row by row attention on the CPU, so each row gives the bits of a plain
decode step), and ``verify`` keeps the longest accepted prefix plus one token of the
target's own: greedy rows keep the drafts that match the target's argmax, sampled rows
use rejection sampling, so the output follows the target's distribution exactly. Rejected
drafts never enter the output, the penalties, the grammar or the prefix cache, and their
KV blocks are released at once.
"""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")
MAX_SPEC_TOKENS = 16


@dataclass
class SpecConfig:
    """Speculation settings of an engine (``EngineConfig.spec``).

    method: "ngram" (prompt lookup over the sequence's own tokens) or "draft" (a draft
    model passed to ``LLMEngine(..., draft=loaded)``).
    num_spec_tokens: the most drafts one verify step scores (the adaptive gamma's ceiling).
    ngram_min / ngram_max: the n-gram lengths the lookup matches, longest first.
    adaptive: shrink gamma when recent acceptance is low (to 0 = plain decode for a while).
    """

    method: str = "ngram"
    num_spec_tokens: int = 16
    ngram_min: int = 2
    ngram_max: int = 5
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculation method {self.method!r} is not one of {', '.join(METHODS)}")
        if not isinstance(self.num_spec_tokens, int) or not 1 <= self.num_spec_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_spec_tokens must be an int in [1, {MAX_SPEC_TOKENS}], got {self.num_spec_tokens!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)
                and 1 <= self.ngram_min <= self.ngram_max <= 64):
            raise ValueError(f"n-gram lengths must satisfy 1 <= ngram_min <= ngram_max <= 64, got "
                             f"{self.ngram_min}..{self.ngram_max}")


@dataclass
class SpecStats:
    """One request's speculation so far (``RequestOutput.speculation``; cumulative)."""

    drafted: int = 0            # draft tokens scored by the target
    accepted: int = 0           # ... of which entered the output
    verify_steps: int = 0       # target steps that scored at least one draft
    emitted: int = 0            # tokens those steps put in the output (accepted + the target's own)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean output tokens per verify step (1.0 would be plain decode)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict:
        return {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 4), "verify_steps": self.verify_steps,
                "mean_tokens_per_step": round(self.tokens_per_step, 4)}
