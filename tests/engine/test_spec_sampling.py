"""Rejection sampling keeps the target's distribution exactly (chi-square over seeded draws).

A small vocabulary, two verify rows. For point-mass drafts (n-gram, greedy drafters) and
for drafts drawn from another distribution q (a draft model), the first emitted token
must follow the distribution plain decoding samples from (``Sampler.distribution``:
temperature, top-k/p, min-p, bias, penalties, grammar mask), and the second one, after an
accepted draft, the distribution plain decoding would use after that token (penalties
counting it). Seeds are fixed, so the test is deterministic; the thresholds are the
chi-square 0.999 quantiles.
"""
import math

import pytest
import torch

from lodestar.engine.sampling import Sampler, SamplerState, SamplingParams
from lodestar.engine.spec.verify import verify_sampled

V = 8
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
TRIALS = 6000
LOGITS = torch.tensor([[1.2, 0.3, 2.0, -0.5, 0.9, 1.6, -1.0, 0.1],
                       [0.4, 1.8, -0.2, 1.1, 0.0, 0.7, 1.5, -0.8]])

SETTINGS = {
    "plain": dict(temperature=1.0),
    "filters": dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.05),
    "penalties": dict(temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={3: 1.0, 6: -2.0}),
}


def _chi2(counts: list[int], probs: torch.Tensor) -> tuple[float, int]:
    n = sum(counts)
    stat, df = 0.0, -1
    for c, p in zip(counts, probs.tolist()):
        if p == 0:
            assert c == 0, "a token of probability 0 was emitted"
            continue
        stat += (c - n * p) ** 2 / (n * p)
        df += 1
    return stat, df


def _expected(params: SamplingParams, row: int, after: list[int] = ()) -> torch.Tensor:
    st = SamplerState(params, [1, 2])
    for t in after:
        st.append(t)
    return Sampler().distribution(LOGITS[row:row + 1], [st])[0]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("drafter", ["point", "model"])
def test_emitted_tokens_follow_the_target_distribution(setting, drafter):
    sampler = Sampler()
    draft_tok = 5
    q = torch.tensor([0.05, 0.1, 0.05, 0.3, 0.1, 0.2, 0.1, 0.1]).repeat(1, 1)
    gen = torch.Generator().manual_seed(1234)
    first, second = [0] * V, [0] * V
    for seed in range(TRIALS):
        params = SamplingParams(seed=(seed * 0x9E3779B97F4A7C15) % 2**63, **SETTINGS[setting])  # spread seeds
        st = SamplerState(params, [1, 2])
        if drafter == "point":
            d, qd = draft_tok, None
        else:
            d, qd = int(torch.multinomial(q[0], 1, generator=gen)), q
        out = verify_sampled(sampler, LOGITS, st, [d], qd, lambda: None)
        assert 1 <= len(out) <= 2 and not st.output_counts      # the state is left as it was
        first[out[0].token_id] += 1
        if len(out) == 2:
            assert out[0].token_id == d
            if d == draft_tok:
                second[out[1].token_id] += 1
    stat, df = _chi2(first, _expected(SamplingParams(**SETTINGS[setting]), 0))
    assert stat < CHI2_999[df], f"first token: chi2 {stat:.1f} with {df} df, counts {first}"
    stat, df = _chi2(second, _expected(SamplingParams(**SETTINGS[setting]), 1, [draft_tok]))
    assert sum(second) > 300
    assert stat < CHI2_999[df], f"second token: chi2 {stat:.1f} with {df} df, counts {second}"


def test_greedy_rows_with_penalties_accept_only_the_argmax():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    p = _expected(params, 0)
    best = int(p.argmax())
    assert math.isclose(float(p.sum()), 1.0) and float(p[best]) == 1.0
    st = SamplerState(params, [1, 2])
    out = verify_sampled(Sampler(), LOGITS, st, [best], None, lambda: None)
    assert [r.token_id for r in out] == [best, int(_expected(params, 1, [best]).argmax())]
    wrong = (best + 1) % V
    out = verify_sampled(Sampler(), LOGITS, SamplerState(params, [1, 2]), [wrong], None, lambda: None)
    assert [r.token_id for r in out] == [best]


def test_grammar_mask_acts_on_the_verify_distribution():
    """A mask that allows tokens {0, 2, 4} only: no other token is ever emitted, and a draft
    outside it (which the engine cuts before verification) would be rejected."""
    mask = torch.tensor([[0b10101]], dtype=torch.int32)

    class _Grammar:
        def accept(self, t):
            return True

        def rollback(self, n):
            pass

    counts = [0] * V
    for seed in range(400):
        st = SamplerState(SamplingParams(seed=seed), [])
        st.grammar = _Grammar()
        out = verify_sampled(Sampler(), LOGITS, st, [2], None, lambda: mask)
        for r in out:
            counts[r.token_id] += 1
    assert all(counts[t] == 0 for t in (1, 3, 5, 6, 7)) and counts[2] > 0
