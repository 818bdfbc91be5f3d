import math

import pytest
import torch

from lodestar.engine.faults import NonFiniteLogitsError
from lodestar.engine.sampling import MAX_LOGPROBS, SampleResult, Sampler, SamplerState, SamplingParams

VOCAB = 64


def _logits(rows: int, seed: int, vocab: int = VOCAB, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _state(prompt=(), output=(), **params) -> SamplerState:
    state = SamplerState(SamplingParams(**params), prompt)
    for t in output:
        state.append(t)
    return state


def _tokens(results: list[SampleResult]) -> list[int]:
    return [r.token_id for r in results]


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().to(torch.float32)


# --- greedy ----------------------------------------------------------------------

def test_greedy_equals_argmax():
    logits = _logits(5, seed=0)
    states = [_state(temperature=0.0) for _ in range(5)]
    assert _tokens(Sampler().sample(logits, states)) == logits.argmax(-1).tolist()


def test_plain_greedy_fast_path_matches_the_general_path(monkeypatch):
    # Greedy rows with nothing to apply take one max-reduction; it must pick exactly the
    # token the general path (processed copy, argmax) picks, ties included (first index).
    import lodestar.engine.sampling as sampling
    logits = _logits(6, seed=3)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1.0          # an exact tie: first wins
    logits[2] = torch.full((VOCAB,), -math.inf)
    logits[2, 7] = 0.0                                             # a single finite logit
    logits = logits.to(torch.bfloat16).to(torch.float32)           # many near-ties after rounding
    states = [_state(temperature=0.0) for _ in range(6)]
    fast = _tokens(Sampler().sample(logits, states))
    monkeypatch.setattr(sampling, "plain_greedy", lambda p: False)
    assert fast == _tokens(Sampler().sample(logits, states)) == logits.argmax(-1).tolist()
    assert fast[1] == 10 and fast[2] == 7


def test_plain_greedy_rows_without_a_finite_maximum_are_a_model_fault():
    dead = _logits(2, seed=4)
    dead[1] = -math.inf
    with pytest.raises(NonFiniteLogitsError, match=r"-inf logits \(batch row 1\)"):
        Sampler().sample(dead, [_state(temperature=0.0) for _ in range(2)])
    nan = _logits(1, seed=5)
    nan[0, 3] = math.nan          # one NaN logit: no token of the row can be trusted
    with pytest.raises(NonFiniteLogitsError, match=r"NaN logits \(batch row 0\)"):
        Sampler().sample(nan, [_state(temperature=0.0)])


def test_greedy_takes_no_random_draw():
    state = _state(temperature=0.0, seed=7)
    before = state.generator.get_state()
    Sampler().sample(_logits(1, seed=1), [state])
    assert torch.equal(state.generator.get_state(), before)


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = _logits(4, seed=2)
    states = [_state(temperature=0.0), _state(seed=1), _state(temperature=0.0), _state(seed=2, top_k=1)]
    tokens = _tokens(Sampler().sample(logits, states))
    argmax = logits.argmax(-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2] and tokens[3] == argmax[3]


# --- seeds -----------------------------------------------------------------------

def _run_seeded(seed: int, steps: int, companions: int, position: int, companion_seed: int) -> list[int]:
    """Tokens of one seeded request, decoded inside a batch of other requests."""
    sampler = Sampler()
    target = _state(seed=seed, temperature=0.9, top_p=0.95, top_k=40)
    others = [_state(seed=companion_seed + j, temperature=1.3) for j in range(companions)]
    out = []
    for step in range(steps):
        row = _logits(1, seed=1000 + step)
        batch_states = others[:position] + [target] + others[position:]
        filler = _logits(companions, seed=companion_seed * 100 + step) if companions else row[:0]
        logits = torch.cat([filler[:position], row, filler[position:]])
        token = sampler.sample(logits, batch_states)[position].token_id
        target.append(token)
        out.append(token)
    return out


def test_same_seed_same_tokens_regardless_of_batch():
    alone = _run_seeded(seed=1234, steps=20, companions=0, position=0, companion_seed=0)
    assert alone == _run_seeded(seed=1234, steps=20, companions=0, position=0, companion_seed=0)
    assert alone == _run_seeded(seed=1234, steps=20, companions=3, position=2, companion_seed=5)
    assert alone == _run_seeded(seed=1234, steps=20, companions=5, position=0, companion_seed=9)
    assert alone == _run_seeded(seed=1234, steps=20, companions=2, position=2, companion_seed=1)


def test_different_seeds_give_different_tokens():
    a = _run_seeded(seed=1, steps=20, companions=0, position=0, companion_seed=0)
    b = _run_seeded(seed=2, steps=20, companions=0, position=0, companion_seed=0)
    assert a != b


def test_unseeded_requests_get_distinct_replayable_seeds():
    first, second = SamplerState(SamplingParams()), SamplerState(SamplingParams())
    assert first.seed != second.seed
    logits = _logits(1, seed=3, scale=0.1)  # near-uniform: streams show up in the tokens
    replay = SamplerState(SamplingParams(seed=first.seed))
    sampler = Sampler()
    assert ([sampler.sample(logits, [first])[0].token_id for _ in range(10)]
            == [sampler.sample(logits, [replay])[0].token_id for _ in range(10)])


# --- filters ---------------------------------------------------------------------

@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_one_token_equal_greedy(params):
    logits = _logits(8, seed=4)
    states = [_state(seed=i, temperature=1.5, **params) for i in range(8)]
    assert _tokens(Sampler().sample(logits, states)) == logits.argmax(-1).tolist()


def _frequencies(probs: list[float], n: int = 4000, **params) -> list[float]:
    logits = _probs_logits(probs).expand(n, -1)
    states = [_state(seed=i, **params) for i in range(n)]
    counts = torch.bincount(torch.tensor(_tokens(Sampler().sample(logits, states))), minlength=len(probs))
    return (counts.double() / n).tolist()


PROBS = [0.5, 0.3, 0.15, 0.05]


def _assert_close(freqs: list[float], expected: list[float]) -> None:
    # 4000 draws: one standard deviation of a frequency is at most 0.008.
    for f, e in zip(freqs, expected):
        if e == 0:
            assert f == 0
        else:
            assert abs(f - e) < 0.04, (freqs, expected)


def test_sampling_follows_the_distribution():
    _assert_close(_frequencies(PROBS), PROBS)


def test_temperature_sharpens_and_flattens():
    sharp = _frequencies(PROBS, temperature=0.5)
    flat = _frequencies(PROBS, temperature=2.0)
    p = torch.tensor(PROBS, dtype=torch.float64)
    _assert_close(sharp, (p**2 / (p**2).sum()).tolist())
    _assert_close(flat, (p**0.5 / (p**0.5).sum()).tolist())


def test_top_k_keeps_k_most_likely():
    _assert_close(_frequencies(PROBS, top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0, 0])


def test_top_p_keeps_smallest_set_reaching_p():
    # mass before token 2 is 0.8 >= 0.75: tokens 0 and 1 stay.
    _assert_close(_frequencies(PROBS, top_p=0.75), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    _assert_close(_frequencies(PROBS, top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_top_p_is_measured_after_top_k():
    # After top_k=3 the renormalized masses are 0.526, 0.316, 0.158: top_p=0.8 keeps two.
    _assert_close(_frequencies(PROBS, top_k=3, top_p=0.8), [0.5 / 0.8, 0.3 / 0.8, 0, 0])


def test_min_p_drops_tokens_below_fraction_of_max():
    # threshold 0.2 * 0.5 = 0.1: token 3 (0.05) goes.
    _assert_close(_frequencies(PROBS, min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    _assert_close(_frequencies(PROBS, min_p=0.5), [0.5 / 0.8, 0.3 / 0.8, 0, 0])


# --- penalties -------------------------------------------------------------------

def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    state = _state(prompt=[0, 1], output=[2, 2, 1], repetition_penalty=2.0)
    processed = Sampler().process(logits, [state])
    assert processed.tolist() == [[1.0, -2.0, 0.25, 3.0, -4.0]]


def test_frequency_and_presence_penalties_count_output_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    state = _state(prompt=[4, 4, 4], output=[3, 3, 0], frequency_penalty=0.5, presence_penalty=0.25)
    processed = Sampler().process(logits, [state])
    # token 3: 3 - 0.5*2 - 0.25; token 0: 2 - 0.5*1 - 0.25; prompt token 4 untouched
    assert processed.tolist() == [[1.25, -1.0, 0.5, 1.75, -4.0]]


def test_penalties_compose_repetition_first():
    logits = torch.tensor([[4.0, -1.0, 1.0]])
    state = _state(output=[0, 0, 1], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    processed = Sampler().process(logits, [state])
    assert processed.tolist() == [[4.0 / 2 - 0.5 * 2 - 1.0, -1.0 * 2 - 0.5 - 1.0, 1.0]]


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    sampler = Sampler()
    assert sampler.sample(logits, [_state(temperature=0.0, output=[3])])[0].token_id == 3
    assert sampler.sample(logits, [_state(temperature=0.0, output=[3], repetition_penalty=2.0)])[0].token_id == 0
    assert sampler.sample(logits, [_state(temperature=0.0, output=[3, 3], frequency_penalty=1.0)])[0].token_id == 0
    # A negative presence penalty encourages repeats.
    assert sampler.sample(logits, [_state(temperature=0.0, output=[0], presence_penalty=-2.0)])[0].token_id == 0


def test_penalties_apply_per_row():
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0]])
    states = [_state(temperature=0.0, output=[0], repetition_penalty=4.0), _state(temperature=0.0, output=[0])]
    assert _tokens(Sampler().sample(logits, states)) == [1, 0]


# --- logit bias ------------------------------------------------------------------

def test_logit_bias_minus_inf_bans_token():
    logits = _logits(1, seed=5)
    best = int(logits.argmax())
    result = Sampler().sample(logits, [_state(temperature=0.0, logit_bias={best: -math.inf})])
    assert result[0].token_id == int(logits[0].topk(2).indices[1])
    states = [_state(seed=i, temperature=5.0, logit_bias={best: -math.inf}) for i in range(200)]
    assert best not in _tokens(Sampler().sample(logits.expand(200, -1), states))


def test_logit_bias_plus_100_forces_token():
    logits = _logits(1, seed=6)
    forced = int(logits.argmin())
    states = [_state(seed=i, temperature=1.0, logit_bias={forced: 100.0}) for i in range(50)]
    assert set(_tokens(Sampler().sample(logits.expand(50, -1), states))) == {forced}


def test_logit_bias_outside_vocab_is_an_error():
    with pytest.raises(ValueError, match="vocabulary has 64"):
        Sampler().sample(_logits(1, seed=0), [_state(logit_bias={64: 1.0})])


def test_banning_every_token_is_an_error():
    bias = {t: -math.inf for t in range(VOCAB)}
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        Sampler().sample(_logits(2, seed=0), [_state(), _state(logit_bias=bias)])


# --- logprobs --------------------------------------------------------------------

def test_logprobs_are_raw_model_log_softmax():
    logits = _logits(3, seed=8)
    states = [
        _state(seed=1, logprobs=5, temperature=0.7, repetition_penalty=1.5, output=[1, 2]),
        _state(temperature=0.0, logprobs=0, logit_bias={0: 5.0}),
        _state(seed=2),
    ]
    results = Sampler().sample(logits, states)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row in (0, 1):
        r = results[row]
        assert r.logprob == pytest.approx(reference[row, r.token_id].item(), abs=1e-5)
    top = results[0].top_logprobs
    assert [t for t, _ in top] == reference[0].topk(5).indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(reference[0].topk(5).values.tolist(), abs=1e-5)
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert results[1].top_logprobs == []
    assert results[2].logprob is None and results[2].top_logprobs is None


def test_logprobs_count_per_row():
    logits = _logits(2, seed=9)
    results = Sampler().sample(logits, [_state(logprobs=MAX_LOGPROBS), _state(logprobs=2)])
    assert len(results[0].top_logprobs) == MAX_LOGPROBS
    assert len(results[1].top_logprobs) == 2


def test_low_precision_logits_are_accepted():
    logits = _logits(2, seed=10).to(torch.bfloat16)
    results = Sampler().sample(logits, [_state(temperature=0.0), _state(seed=3)])
    assert results[0].token_id == int(logits[0].float().argmax())


def test_batch_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 rows but 2"):
        Sampler().sample(_logits(3, seed=0), [_state(), _state()])


# --- validation ------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("max_tokens", 0),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", -1),
    ("seed", "42"),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("logit_bias", {"50256": 1.0}),
    ("logit_bias", {5: math.inf}),
    ("logit_bias", {5: math.nan}),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_defaults_and_normalization():
    params = SamplingParams(stop="###", temperature=0)
    assert params.stop == ["###"]
    assert params.is_greedy
    assert not SamplingParams().is_greedy
    assert SamplingParams(logit_bias={3: -math.inf}).logit_bias == {3: -math.inf}
