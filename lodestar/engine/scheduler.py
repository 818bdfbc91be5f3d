"""Continuous batching: which sequences run in a step, and how many tokens each feeds.

``schedule`` takes the running sequences first, oldest request first, one decode token
each (or the run of tokens a grammar forced, fed as one chunk; or the last token and the
request's speculative drafts, whose rows all return logits for verification; drafts
that do not fit the budget or the free blocks are dropped first); then it admits waiting
prompts in arrival order while the token budget and ``max_num_seqs`` allow. A prompt longer than what is left of the budget is fed in chunks
over several steps (nothing is admitted behind it until it completes). A row whose next
tokens need KV blocks when none is free preempts the newest request that holds blocks
(newer than itself and not yet in this step): that request frees its KV, waits again in
arrival order and is recomputed later, mostly from the prefix cache. With no such request
a decode row steps back itself, and a prefill chunk shrinks to the blocks left. A prompt
admitted for the first time (or again after preemption) first takes the longest run of
cached full blocks of its tokens.

No model here: the scheduler works on ``Sequence``s and the ``BlockPool``. The engine's
disk tier plugs in through the ``extend_prefix`` and ``on_cached`` hooks.
"""
from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from lodestar.engine.kv_cache import BlockPool, block_hash, prefix_hashes
from lodestar.engine.sequence import Sequence, SequenceStatus

# extend_prefix(seq, hashes, limit): called after the memory hit of ``seq``'s prompt; may
# extend its cached prefix (block table, block hashes, num_computed) up to ``limit`` blocks
# of the full-block hash chain ``hashes``.
PrefixHook = Callable[[Sequence, list[bytes], int], None]
# on_cached(hash, parent hash, tokens): a full block just became the prefix cache's copy.
CachedHook = Callable[[bytes, bytes | None, list[int]], None]


@dataclass
class ScheduledBatch:
    """One step's work: row i feeds ``num_new[i]`` uncomputed tokens of ``seqs[i]``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)        # 1: a decode row; more: a prefill chunk
    # logits wanted at the row's last tokens: 1 when it reaches its last known token, 1 + drafts
    # for a verify run, 0 for a prefill chunk that stops short
    want_logits: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def is_decode(self) -> bool:
        """Every row feeds one token (what a decode graph runs)."""
        return all(n == 1 for n in self.num_new)

    @property
    def sampled(self) -> list[Sequence]:
        """The rows that get a new token this step, in batch order (their logits' order)."""
        return [s for s, w in zip(self.seqs, self.want_logits) if w]


class Scheduler:
    """Owns the waiting and running queues and each step's choice of rows."""

    def __init__(self, pool: BlockPool, fingerprint: str, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, stats: Counter | None = None, extend_prefix: PrefixHook | None = None,
                 on_cached: CachedHook | None = None) -> None:
        self.pool = pool
        self.fingerprint = fingerprint      # block hashes depend on the weights and mode too
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.stats = stats if stats is not None else Counter()
        self.extend_prefix = extend_prefix
        self.on_cached = on_cached
        self.waiting: list[Sequence] = []   # by seq_id: arrival order, a preempted one back in its place
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` is done ("stop", "length" or "abort"): it leaves the queues and frees its KV."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []

    # -- one step ------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """This step's rows: decode rows first, then prefill chunks, under the token budget."""
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch()
        scheduled: set[int] = set()
        for seq in sorted(self.running, key=lambda s: s.seq_id):   # oldest first
            if budget <= 0:
                break
            if seq not in self.running:                             # preempted by an older one
                continue
            # one token, or more when a grammar forced some after the last sampled one, + drafts
            base = min(max(seq.num_tokens - seq.num_computed, 1), budget)
            if seq.draft_ids:
                del seq.draft_ids[max(budget - base, 0):]
            n = base + len(seq.draft_ids)
            if not self._reserve(seq, seq.num_computed + n, scheduled):
                seq.draft_ids.clear()
                n = base
                if not self._reserve(seq, seq.num_computed + n, scheduled):
                    self._preempt(seq)
                    continue
            batch.seqs.append(seq)
            batch.num_new.append(n)
            scheduled.add(seq.seq_id)
            budget -= n
        while budget > 0 and self._can_admit():
            seq = self.waiting[0]
            if seq.num_computed == 0 and not seq.block_table:
                self._attach_prefix(seq)
            todo = seq.num_tokens - seq.num_computed
            chunk = min(todo, budget)
            if not self._reserve(seq, seq.num_computed + chunk, scheduled):
                fit = (len(seq.block_table) + self.pool.num_free) * self.pool.block_size - seq.num_computed
                chunk = min(chunk, fit)
                if chunk <= 0 or not self._reserve(seq, seq.num_computed + chunk, scheduled):
                    break
            batch.seqs.append(seq)
            batch.num_new.append(chunk)
            scheduled.add(seq.seq_id)
            budget -= chunk
            if chunk == todo:                         # prompt complete after this step
                self.waiting.pop(0)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            else:
                break                                 # chunked: the rest next step
        for seq in self.running:                      # drafts only ride along in this step
            if seq.draft_ids and seq.seq_id not in scheduled:
                seq.draft_ids.clear()
        batch.want_logits = [max(s.num_computed + n - s.num_tokens + 1, 0) for s, n in zip(batch.seqs, batch.num_new)]
        return batch

    def can_continue(self, seqs: list[Sequence]) -> bool:
        """Whether the next ``schedule`` would decode exactly ``seqs`` (the running batch, in
        flight) again: all still running, nobody waiting who could be admitted, some row not
        stopping on the token in flight, and blocks for every row's next token. If so, those
        blocks are reserved now (preempting no one), since the caller launches that step at
        once without calling ``schedule``."""
        if len(seqs) != len(self.running) or any(s.is_finished for s in seqs):
            return False
        if self._can_admit() or len(seqs) > self.max_num_batched_tokens:
            return False
        # rows that stop on the token in flight (max_tokens, context) need no next step
        if all(len(s.output_ids) + 1 >= s.params.max_tokens or s.num_computed + 1 >= self.max_model_len
               for s in seqs):
            return False
        needs = [self.pool.blocks_needed(s.num_computed + 1) - len(s.block_table) for s in seqs]
        if sum(n for n in needs if n > 0) > self.pool.num_free:
            return False
        for s, need in zip(seqs, needs):
            if need > 0:
                self._grow(s, need)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: hash ``seq``'s newly full blocks and offer them to the prefix cache."""
        bs = self.pool.block_size
        # with a step in flight, num_computed may run one past the tokens the host knows
        full = min(seq.num_computed, seq.num_tokens) // bs
        for j in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.token_slice(j * bs, (j + 1) * bs)
            h = block_hash(parent, tokens, self.fingerprint)
            seq.block_hashes.append(h)
            if self.pool.register(seq.block_table[j], h) and self.on_cached is not None:
                self.on_cached(h, parent, tokens)

    def admitting(self) -> bool:
        """The next ``schedule`` may take (part of) a waiting prompt."""
        return self._can_admit()

    # -- helpers -------------------------------------------------------------------
    def _can_admit(self) -> bool:
        """A waiting request could start (or continue its prefill) this step."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def _attach_prefix(self, seq: Sequence) -> None:
        """Reuse cached blocks for the longest cached prefix (always leaving one token to run)."""
        bs = self.pool.block_size
        hashes = prefix_hashes(seq.token_slice(0, seq.num_tokens), bs, self.fingerprint)
        limit = (seq.num_tokens - 1) // bs
        hit = self.pool.lookup(hashes[:limit])
        seq.block_table = list(hit)
        seq.block_hashes = hashes[: len(hit)]
        seq.num_computed = len(hit) * bs
        if self.extend_prefix is not None:
            self.extend_prefix(seq, hashes, limit)
        if not seq.output_ids:          # a first admission, not a recompute after preemption
            seq.cached_tokens = seq.num_computed
            self.stats["prompt_tokens"] += len(seq.prompt_ids)
            self.stats["cached_tokens"] += seq.num_computed

    def _reserve(self, seq: Sequence, num_tokens: int, protected: set[int]) -> bool:
        """Blocks for ``num_tokens`` tokens of ``seq``, preempting newer requests (not those
        in ``protected``, already in this step) if needed."""
        need = self.pool.blocks_needed(num_tokens) - len(seq.block_table)
        while need > self.pool.num_free:
            holders = [s for s in self.running + self.waiting
                       if s.block_table and s.seq_id > seq.seq_id and s.seq_id not in protected]
            if not holders:
                return False
            self._preempt(max(holders, key=lambda s: s.seq_id))
        if need > 0:
            self._grow(seq, need)
        return True

    def _grow(self, seq: Sequence, need: int) -> None:
        tail = seq.block_table[-1] if seq.block_table else None    # grow in place where free
        seq.block_table.extend(self.pool.allocate(need, after=tail))

    def _preempt(self, seq: Sequence) -> None:
        """Free a request's KV; it waits again and recomputes (cheaply, from cached blocks)."""
        self.pool.free(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
        seq.draft_ids.clear()
        if seq in self.running:
            self.running.remove(seq)
        if seq not in self.waiting:
            bisect.insort(self.waiting, seq, key=lambda s: s.seq_id)
        seq.status = SequenceStatus.WAITING
        self.stats["preemptions"] += 1
