"""Verification of drafted tokens, and each request's adaptive draft length.

A verify step feeds a sequence's last token and its drafts d_1..d_g as g+1 rows; row i's
logits are the target's next-token distribution after d_1..d_i. ``verify_greedy`` keeps
the drafts that equal the target's argmax (of the grammar-masked logits where there is a
grammar), then the target's own token: the output is token-identical to plain decoding.
``verify_sampled`` walks the rows in order: row i's distribution p is the one plain
decoding would sample from after accepting d_1..d_i (bias, penalties counting those
drafts, grammar mask in the state after them, temperature, top-k/p, min-p), d_{i+1} is
accepted with probability min(1, p(d)/q(d)) (q: the draft model's distribution; a point
mass for n-gram and greedy drafts, so min(1, p(d))), and a rejection samples the
row's token from max(p - q, 0) renormalized (for a point mass: p with d removed). The
emitted tokens then follow p exactly (Leviathan et al. 2023, Chen et al. 2023).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lodestar.engine.faults import NonFiniteLogitsError
from lodestar.engine.sampling import SampleResult, Sampler, SamplerState
from lodestar.engine.spec import SpecConfig, SpecStats

MISS_LIMIT = 4          # steps in a row with no draft before a request stops asking for a while
COOLDOWN_MIN, COOLDOWN_MAX = 32, 512


@dataclass
class SpecState:
    """A speculating request's draft length and record (``Sequence.spec``)."""

    config: SpecConfig
    gamma: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    hits: float = 1.2                  # decayed accepted drafts ...
    trials: float = 2.0                # ... over decayed draft trials (an optimistic 0.6 prior)
    misses: int = 0                    # steps in a row with no draft offered
    cooldown: int = 0                  # steps left without drafting
    backoff: int = COOLDOWN_MIN
    q: torch.Tensor | None = None      # this step's draft distributions (a draft model's sampled drafts)

    def __post_init__(self) -> None:
        self.gamma = self.config.num_spec_tokens

    @property
    def alpha(self) -> float:
        """Estimated probability that a draft is accepted, given the ones before it were."""
        return min(self.hits / self.trials, 0.98)

    @property
    def active(self) -> bool:
        """The request asks its drafter for tokens this step."""
        return self.cooldown == 0

    def next_gamma(self, limit: int) -> int:
        return max(0, min(self.gamma, limit)) if self.active else 0

    def tick(self) -> None:
        """One step passed without drafting (cooling down)."""
        if self.cooldown:
            self.cooldown -= 1

    def no_draft(self) -> None:
        """The drafter had nothing for this request this step."""
        self.misses += 1
        if self.misses >= MISS_LIMIT:
            self._cool()

    def record(self, drafted: int, accepted: int, cost: Callable[[int], float]) -> None:
        """A verify step scored ``drafted`` drafts and kept ``accepted``; pick the next length,
        ``cost(g)`` being the time of a step with g drafts of this request relative to none."""
        st = self.stats
        st.drafted += drafted
        st.accepted += accepted
        st.verify_steps += 1
        st.emitted += accepted + 1
        self.misses = 0
        decay = 0.8
        self.hits = self.hits * decay + accepted
        self.trials = self.trials * decay + accepted + (1 if accepted < drafted else 0)
        if not self.config.adaptive:
            return
        best = best_gamma(self.alpha, cost, self.config.num_spec_tokens)
        if best == 0:
            self._cool()
        else:
            self.gamma = best
            self.backoff = COOLDOWN_MIN

    def _cool(self) -> None:
        if not self.config.adaptive:
            return
        self.cooldown = self.backoff
        self.backoff = min(self.backoff * 2, COOLDOWN_MAX)
        self.misses = 0
        self.gamma = max(1, self.gamma // 2)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens a verify run of ``gamma`` drafts emits when each draft is accepted with
    probability ``alpha`` given the ones before it were (the target adds one of its own)."""
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def best_gamma(alpha: float, cost: Callable[[int], float], ceiling: int) -> int:
    """The draft length that maximizes expected tokens per unit of step time (``cost(g)``:
    a step's time with g drafts relative to none)."""
    best, best_rate = 0, 1.0
    for g in range(1, ceiling + 1):
        rate = expected_tokens(alpha, g) / cost(g)
        if rate > best_rate * 1.001:
            best, best_rate = g, rate
    return best


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """First maximal index of each row (one reduction, one copy); NonFiniteLogitsError for rows
    whose maximum is not a finite number."""
    values, ids = logits.max(dim=-1)
    both = torch.stack((values.to(torch.float64), ids.to(torch.float64))).tolist()
    bad = [i for i, v in enumerate(both[0]) if not math.isfinite(v)]
    if bad:
        raise NonFiniteLogitsError(bad, [both[0][i] for i in bad])
    return [int(t) for t in both[1]]


def verify_greedy(picks: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Argmax verification of several sequences' runs at once. ``picks``: the target's argmax
    token of every run's rows, in order (run j has len(drafts[j]) + 1 rows). Returns each
    run's emitted tokens: the drafts that match, then the target's own token."""
    out, r = [], 0
    for d in drafts:
        target = picks[r:r + len(d) + 1]
        n = 0
        while n < len(d) and d[n] == target[n]:
            n += 1
        out.append(target[:n + 1])
        r += len(d) + 1
    return out


def verify_sampled(sampler: Sampler, logits: torch.Tensor, state: SamplerState, draft: list[int],
                   q: torch.Tensor | None, fill_mask) -> list[SampleResult]:
    """Rejection sampling over one run's rows (``logits``: len(draft) + 1 rows). ``fill_mask()``
    returns the [1, words] bitmask of the request's grammar in its current state (None
    without one). Returns the emitted tokens with their raw logprobs when requested. The
    request's grammar and penalty counts are left as they were."""
    grammar = state.grammar
    seen: list[int] = []
    out: list[SampleResult] = []
    try:
        for i in range(len(draft) + 1):
            row = logits[i:i + 1]
            p = sampler.distribution(row, [state], fill_mask())[0]
            if i < len(draft):
                d = draft[i]
                qd = 1.0 if q is None else float(q[i, d])
                pd = float(p[d])
                u = float(state.draw())
                if qd > 0 and u < min(1.0, pd / qd):
                    out.append(_result(row, d, state))
                    state.append(d)
                    seen.append(d)
                    if grammar is not None and not grammar.accept(d):
                        raise RuntimeError(f"accepted draft token {d} is outside the request's grammar")
                    continue
                if q is None:
                    residual = p.clone()
                    residual[d] = 0.0
                else:
                    residual = torch.clamp(p - q[i].to(p.device, p.dtype), min=0.0)
                if float(residual.sum()) <= 0.0:
                    residual = p
                tok = _draw(residual, state)
            else:
                tok = _draw(p, state)
            out.append(_result(row, tok, state))
            return out
        return out
    finally:
        for t in seen:                           # the engine appends the emitted tokens itself
            c = state.output_counts[t] - 1
            if c:
                state.output_counts[t] = c
            else:
                del state.output_counts[t]
        if grammar is not None and seen:
            grammar.rollback(len(seen))


def _draw(p: torch.Tensor, state: SamplerState) -> int:
    """One token from the (unnormalized) distribution ``p``, one uniform from the request's stream."""
    cdf = p.to(torch.float64).cumsum(0)
    u = state.draw().to(cdf.device)
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=p.numel() - 1))
    if float(p[i]) <= 0.0:                      # rounding at the top end: the last kept token
        i = int(torch.nonzero(p > 0)[-1])
    return i


def _result(row: torch.Tensor, token: int, state: SamplerState) -> SampleResult:
    n = state.params.logprobs
    if n is None:
        return SampleResult(token)
    raw = torch.log_softmax(row[0].to(torch.float32), dim=-1)
    top = []
    if n:
        v, ix = raw.topk(min(n, raw.numel()))
        top = list(zip(ix.tolist(), v.tolist()))
    return SampleResult(token, float(raw[token]), top)
