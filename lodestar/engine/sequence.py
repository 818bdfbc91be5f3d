"""A request's token state as the engine sees it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # prompt (or part of it) not yet in the KV cache
    RUNNING = "running"      # decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: Any                            # engine.sampling.SamplingParams
    output_ids: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)     # speculative tokens this step feeds after them
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0                  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None       # "stop" | "length" | "abort"
    sampler_state: Any = None
    spec: Any = None                       # engine.spec.verify.SpecState of a speculating request
    detokenizer: Any = None
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of its full blocks
    cached_tokens: int = 0                 # prompt tokens reused from the prefix cache
    disk_read_tokens: int = 0              # ... of which came from the disk tier
    cache_write_tokens: int = 0            # tokens checkpointed to the disk tier
    arrival: float = 0.0
    prefill_started: float = 0.0           # monotonic time of its first prefill chunk (0: not yet)
    prefill_logged: float = 0.0            # ... and of its last progress line (0: none yet)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (+ drafts past them) without building the whole list."""
        n = self.num_tokens
        if end > n:
            return self.token_slice(start, n) + self.draft_ids[max(start - n, 0):end - n]
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
