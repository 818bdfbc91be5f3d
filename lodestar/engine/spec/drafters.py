"""Drafters: each proposes up to ``gamma`` next tokens for a running sequence.

``NgramDrafter`` (prompt lookup): the longest suffix of the sequence's tokens (``ngram_max``
down to ``ngram_min`` tokens) that occurred before, and what followed its latest earlier
occurrence. Free to compute, and right exactly where an agent spends its time: copying
a file it was shown with a small change, repeating a context.

``DraftModelDrafter``: a smaller model with the target's vocabulary, in the same process
on the same device, with its own paged KV. Each sequence has a shadow ``Sequence`` over
the same prompt and output lists; a round feeds the tokens the draft has not seen (one
chunk) and then drafts one token per step, greedily for greedy requests and sampled from
its own softmax at the request's temperature otherwise (that distribution ``q`` goes to
the verifier). Learned heads (MTP, EAGLE) fit the same ``propose`` interface.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lodestar.engine.kv_cache import BlockPool
from lodestar.engine.sequence import Sequence


class DraftModelError(ValueError):
    """A draft model that cannot draft for this target (another vocabulary)."""


@dataclass
class Draft:
    """Tokens proposed for one sequence, and the distributions they were drawn from."""

    tokens: list[int]
    q: torch.Tensor | None = None       # fp32 [len(tokens), V] on the CPU; None: point masses (greedy, n-gram)


@dataclass
class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended (``NgramDrafter``'s per-sequence state)."""

    tokens: list[int] = field(default_factory=list)
    last: dict[tuple[int, ...], int] = field(default_factory=dict)   # n-gram -> index of the token after it
    indexed: int = 0                    # n-grams ending before this index are in ``last``


class NgramDrafter:
    """Prompt lookup decoding over a sequence's own prompt and output."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 5) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._index: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], gammas: list[int]) -> list[Draft]:
        return [self._one(s, g) for s, g in zip(seqs, gammas)]

    def _one(self, seq: Sequence, gamma: int) -> Draft:
        idx = self._index.get(seq.seq_id)
        if idx is None:
            idx = self._index[seq.seq_id] = NgramIndex(list(seq.prompt_ids))
        toks = idx.tokens
        have = len(toks) - len(seq.prompt_ids)
        if have < len(seq.output_ids):
            toks.extend(seq.output_ids[have:])
        end = len(toks)
        # index every n-gram that ends before the last token (the suffix itself must not match itself)
        lo, hi, last = self.ngram_min, self.ngram_max, idx.last
        for e in range(max(idx.indexed, lo - 1), end - 1):
            for n in range(lo, min(hi, e + 1) + 1):
                last[tuple(toks[e - n + 1:e + 1])] = e + 1
        idx.indexed = max(idx.indexed, end - 1)
        if gamma <= 0:
            return Draft([])
        for n in range(min(hi, end), lo - 1, -1):
            at = last.get(tuple(toks[end - n:]))
            if at is not None:
                return Draft(toks[at:at + gamma])
        return Draft([])

    def release(self, seq: Sequence) -> None:
        self._index.pop(seq.seq_id, None)


def check_vocabularies(target_tok, draft_tok, target_path, draft_path) -> None:
    """DraftModelError unless both tokenizers map every id to the same bytes."""
    if target_tok.vocab_size != draft_tok.vocab_size:
        raise DraftModelError(f"draft model {draft_path} has a vocabulary of {draft_tok.vocab_size} tokens, the "
                              f"target {target_path} one of {target_tok.vocab_size}: drafts would be other tokens; "
                              "pick a draft model of the same family and tokenizer")
    for i in range(target_tok.vocab_size):
        if target_tok.token_bytes(i) != draft_tok.token_bytes(i):
            raise DraftModelError(f"draft model {draft_path} and target {target_path} differ at token {i} "
                                  f"({draft_tok.token_bytes(i)!r} vs {target_tok.token_bytes(i)!r}): another "
                                  "tokenizer; pick a draft model of the same family")


class DraftModelDrafter:
    """Drafts with a second, smaller model (``LoadedModel``) on the target's device."""

    def __init__(self, draft, target_vocab: int, kv_tokens: int, block_size: int, max_model_len: int,
                 cuda_graphs: bool = True) -> None:
        from lodestar.engine.model_runner import ModelRunner

        self.loaded = draft
        self.vocab = target_vocab
        device = torch.device(getattr(draft, "device", "cpu"))
        kv_dtype = torch.float32 if device.type == "cpu" or draft.mode == "fp32" else torch.bfloat16
        self.pool = BlockPool(-(-kv_tokens // block_size), block_size, enable_prefix_cache=False)
        self.runner = ModelRunner(draft.model, self.pool, kv_dtype, device, max_model_len, cuda_graphs,
                                  prefill_graphs=False)
        self._shadows: dict[int, Sequence] = {}
        self._gens: dict[int, torch.Generator] = {}

    def _shadow(self, seq: Sequence) -> Sequence:
        sh = self._shadows.get(seq.seq_id)
        if sh is None:
            sh = self._shadows[seq.seq_id] = Sequence(seq.seq_id, seq.prompt_ids, seq.params)
            sh.output_ids = seq.output_ids          # the same list: the shadow sees every accepted token
            g = torch.Generator(device="cpu")
            g.manual_seed((seq.sampler_state.seed + 0x5DEECE66D) % 2**64)
            self._gens[seq.seq_id] = g
        # what the draft computed past the target's accepted tokens was a rejected draft
        sh.num_computed = min(sh.num_computed, seq.num_computed, seq.num_tokens - 1)
        sh.draft_ids = []
        return sh

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], gammas: list[int]) -> list[Draft]:
        rows = [(s, g) for s, g in zip(seqs, gammas) if g > 0]
        out = {s.seq_id: Draft([]) for s in seqs}
        if not rows:
            return [out[s.seq_id] for s in seqs]
        shadows = [self._shadow(s) for s, _ in rows]
        need = [max(sh.num_tokens - sh.num_computed, 1) for sh in shadows]
        # blocks for the catch-up and every draft; a shadow that cannot get them does not draft
        live, live_need = [], []
        for (s, g), sh, n in zip(rows, shadows, need):
            blocks = self.pool.blocks_needed(sh.num_computed + n + g) - len(sh.block_table)
            if blocks > self.pool.num_free:
                self._drop(s.seq_id)
                continue
            if blocks > 0:
                sh.block_table.extend(self.pool.allocate(blocks))
            live.append((s, g, sh))
            live_need.append(n)
        if not live:
            return [out[s.seq_id] for s in seqs]
        qs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s, _, _ in live}
        feed = [sh for _, _, sh in live]
        counts = live_need
        for step in range(max(g for _, g, _ in live)):
            logits = self.runner.run(feed, counts)
            nxt = []
            for (s, g, sh), row in zip([x for x in live if len(x[2].draft_ids) < x[1]], logits):
                tok, q = self._pick(s, row[:self.vocab])
                sh.draft_ids.append(tok)
                out[s.seq_id].tokens.append(tok)
                if q is not None:
                    qs[s.seq_id].append(q)
                if len(sh.draft_ids) < g:
                    nxt.append(sh)
            # the last draft of each row is not fed: the target scores it
            feed = nxt
            counts = [1] * len(feed)
            if not feed:
                break
        for s, _, sh in live:
            d = out[s.seq_id]
            if qs[s.seq_id]:
                d.q = torch.stack(qs[s.seq_id])
            sh.draft_ids = []
        return [out[s.seq_id] for s in seqs]

    def _pick(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        p = seq.params
        if p.is_greedy:
            return int(logits.argmax()), None
        q = torch.softmax(logits.float() / p.temperature, dim=-1).cpu()
        return int(torch.multinomial(q, 1, generator=self._gens[seq.seq_id])), q

    def _drop(self, seq_id: int) -> None:
        sh = self._shadows.pop(seq_id, None)
        if sh is not None:
            self.pool.free(sh.block_table)
            sh.block_table = []
        self._gens.pop(seq_id, None)

    def release(self, seq: Sequence) -> None:
        self._drop(seq.seq_id)
