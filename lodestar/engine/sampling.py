"""Sampling: per-request parameters, per-request random streams, and a batched sampler.

One `Sampler.sample` call turns a [B, V] logits tensor into B tokens. Each row is
processed in this order (llama.cpp / vLLM):

    grammar mask -> logit bias -> repetition, frequency and presence penalties
    -> argmax for greedy rows
    -> temperature -> top-k -> top-p -> min-p -> one random draw

Every request owns a `SamplerState`: its parameters, its token counts for the
penalties, and a CPU `torch.Generator` seeded from `SamplingParams.seed`. A sampled
row takes exactly one uniform number from its own generator, so a seed gives the same
tokens whatever else is in the batch, at any row position and on any device.

Logprobs are taken from the log_softmax of the raw model logits, before the grammar
mask, bias, penalties and temperature: they describe the model, not the sampler settings, which
makes them comparable with the reference goldens and across requests (vLLM's default
`raw_logprobs` behaves the same way).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from lodestar.engine.faults import NonFiniteLogitsError
from lodestar.engine.grammar import GrammarSpec, apply_masks

MAX_LOGPROBS = 20
# Stop strings are matched in time linear in the output, but each one is held back
# from a stream until it cannot match, so both their number and length are bounded.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
# Dividing by a smaller temperature can overflow float32; such rows are argmax (as vLLM).
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy; top_k 0 and top_p 1 and min_p 0 mean "off".
    repetition_penalty follows HF/llama.cpp: over tokens seen in prompt and output,
    positive logits are divided by it and negative ones multiplied.
    presence_penalty and frequency_penalty follow OpenAI, over output tokens only:
    logit -= frequency_penalty * count + presence_penalty * (count > 0).
    logit_bias is added to the logits first; -inf bans a token.
    logprobs: None = none, 0 = the chosen token's logprob, n = also the top n.
    grammar: constrain the output to a JSON schema, regex, grammar or choice list
    (``engine.grammar.GrammarSpec``); end-of-sequence is allowed only where it is complete.
    jump_forward: append the tokens a grammar forces without a forward pass each (off
    while logprobs are requested: forced tokens have none).
    speculate: let the engine's drafter propose tokens for this request (when the engine
    has speculation on, ``EngineConfig.spec``); False decodes it one token per step.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    grammar: GrammarSpec | None = None
    jump_forward: bool = True
    speculate: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        if not _is_number(self.temperature) or not self.temperature >= 0 or math.isinf(self.temperature):
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an int >= 0 (0 = off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1] (1 = off)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1] (0 = off)")
        if (not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0
                or math.isinf(self.repetition_penalty)):
            raise bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2] (0 = off)")
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must be a dict of token id -> bias")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(
                    f"SamplingParams.logit_bias keys must be token ids (ints >= 0), got {token_id!r}; "
                    "convert JSON string keys with int()")
            if not _is_number(bias) or math.isnan(bias) or bias == math.inf:
                raise ValueError(
                    f"SamplingParams.logit_bias[{token_id}] must be a finite number or -inf, got {bias!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an int or None")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"SamplingParams.stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} "
                             "are allowed")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(f"SamplingParams.stop has a string of {len(longest)} characters; at most "
                             f"{MAX_STOP_CHARS} are allowed")
        self.stop_token_ids = list(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids (ints >= 0)")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.speculate, bool):
            raise bad("speculate", "must be true or false")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise bad("grammar", "must be an engine.grammar.GrammarSpec or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None  # chosen token, raw model distribution
    top_logprobs: list[tuple[int, float]] | None = None  # best first


class SamplerState:
    """What the sampler keeps for one request between steps.

    The sampler reads it and advances the generator; it never records tokens.
    The engine calls `append` for each token it accepts, so a speculative draft
    that is rejected leaves the penalties untouched.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Iterable[int] = ()) -> None:
        self.params = params
        # Unseeded requests still get a concrete seed, kept so a run can be replayed.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        # On the CPU whatever the logits' device: the same seed gives the same stream everywhere.
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed % 2**64)
        self.prompt_token_ids = torch.tensor(sorted(set(prompt_token_ids)), dtype=torch.long)
        self.output_counts: dict[int, int] = {}
        self.grammar = None            # engine.grammar.GrammarMatcher of a constrained request

    def append(self, token_id: int) -> None:
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def draw(self) -> torch.Tensor:
        """The row's one uniform number in [0, 1) for this step, float64 shape [1]."""
        return torch.rand(1, generator=self.generator, dtype=torch.float64)


class Sampler:
    """Samples one token per row of a [B, V] logits tensor."""

    def process(self, logits: torch.Tensor, states: Sequence[SamplerState],
                masks: torch.Tensor | None = None) -> torch.Tensor:
        """float32 copy of `logits` with the grammar masks, logit bias and penalties applied, per row.

        ``masks``: int32 [B, words] bitmasks on the CPU; row i applies where states[i] has a grammar."""
        _check_batch(logits, states)
        out = logits.to(torch.float32, copy=True)
        rows = [i for i, s in enumerate(states) if s.grammar is not None]
        if rows:
            apply_masks(out, rows, mask_rows(masks, rows))
        _apply_logit_bias(out, states)
        _apply_repetition_penalty(out, states)
        _apply_frequency_presence(out, states)
        return out

    def sample(self, logits: torch.Tensor, states: Sequence[SamplerState],
               masks: torch.Tensor | None = None) -> list[SampleResult]:
        """One token per row; row i follows states[i] (and masks[i] where it has a grammar).
        Advances the generators of sampled rows.

        Raises ``NonFiniteLogitsError`` when a row of ``logits`` itself (before bias and
        penalties) has a NaN or infinite maximum: a fault of the model, not of the request.
        """
        if all(argmax_only(s.params) for s in states):
            rows = [i for i, s in enumerate(states) if s.grammar is not None]
            if rows:          # greedy under a grammar: the best allowed token (the logits are
                apply_masks(logits, rows, mask_rows(masks, rows))   # this step's scratch)
            return _plain_argmax(logits, states)
        processed = self.process(logits, states, masks)
        # One reduction, which every row needs anyway: a row whose best logit is not a finite
        # number is examined further (the model's fault, or bans over the whole vocabulary).
        best = processed.max(dim=-1).values
        if not bool(torch.isfinite(best).all()):
            _check_finite(logits)
            dead = ~(best > -math.inf)
            if bool(dead.any()):
                rows = dead.nonzero().flatten().tolist()
                raise ValueError(
                    f"no token can be sampled in batch rows {rows}: logit_bias (with the grammar, if any) bans "
                    "every token the model left possible; check logit_bias for bans that cover the whole "
                    "vocabulary")

        batch = len(states)
        token_ids = torch.empty(batch, dtype=torch.long, device=logits.device)
        greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
        sampled = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            token_ids[rows] = processed[rows].argmax(dim=-1)
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            token_ids[rows] = _sample_rows(processed[rows], [states[i] for i in sampled])

        ids = token_ids.tolist()
        logprobs: list[float | None] = [None] * batch
        top: list[list[tuple[int, float]] | None] = [None] * batch
        wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            raw = torch.log_softmax(logits[rows].to(torch.float32), dim=-1)
            chosen = raw.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
            n_top = min(max(states[i].params.logprobs for i in wanted), raw.shape[-1])
            top_vals: list[list[float]] = [[] for _ in wanted]
            top_ids: list[list[int]] = [[] for _ in wanted]
            if n_top:
                values, indices = raw.topk(n_top, dim=-1)
                top_vals, top_ids = values.tolist(), indices.tolist()
            for j, i in enumerate(wanted):
                logprobs[i] = chosen[j]
                n = states[i].params.logprobs
                top[i] = list(zip(top_ids[j][:n], top_vals[j][:n]))
        return [SampleResult(ids[i], logprobs[i], top[i]) for i in range(batch)]


    def distribution(self, logits: torch.Tensor, states: Sequence[SamplerState],
                     masks: torch.Tensor | None = None) -> torch.Tensor:
        """float64 [B, V]: the distribution ``sample`` draws row i's token from (in token-id
        order, summing to 1): a point mass at the processed argmax for greedy rows. What
        speculative verification accepts drafts against. Draws nothing."""
        processed = self.process(logits, states, masks)
        best = processed.max(dim=-1).values
        if not bool(torch.isfinite(best).all()):
            _check_finite(logits)
            rows = (~(best > -math.inf)).nonzero().flatten().tolist()
            raise ValueError(f"no token can be sampled in batch rows {rows}: logit_bias (with the grammar, if "
                             "any) bans every token the model left possible")
        out = torch.zeros(processed.shape, dtype=torch.float64, device=processed.device)
        greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
        sampled = [i for i, s in enumerate(states) if not s.params.is_greedy]
        for i in greedy:
            out[i, processed[i].argmax()] = 1.0
        if sampled:
            rows = torch.tensor(sampled, device=processed.device)
            probs, order = _filtered_probs(processed[rows], [states[i] for i in sampled])
            dist = torch.zeros_like(probs, dtype=torch.float64).scatter_(1, order, probs.to(torch.float64))
            out[rows] = dist / dist.sum(dim=-1, keepdim=True)
        return out


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing to apply to the logits and no logprobs to report."""
    return p.grammar is None and argmax_only(p)


def argmax_only(p: SamplingParams) -> bool:
    """Greedy with no logprobs, bias or penalties: the best token, of those a grammar allows."""
    return (p.is_greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)


def mask_rows(masks: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
    """The listed rows of a step's bitmask buffer (a pinned view when they are the first rows)."""
    if masks is None:
        raise ValueError(f"batch rows {rows} have a grammar but no token mask was given")
    if rows == list(range(len(rows))):
        return masks[:len(rows)]         # a view: stays pinned, so the copy to a GPU is asynchronous
    return masks[rows]


def _plain_argmax(logits: torch.Tensor, states: Sequence[SamplerState]) -> list[SampleResult]:
    """Greedy rows with no processing: one reduction and one copy to the host (on a GPU the
    general path costs about ten small kernels and two waits for the device per step).

    ``max`` gives the first maximal index, as ``argmax`` does. With nothing applied to the
    logits, a row whose maximum is not a finite number (NaN anywhere in the row, +inf, or
    every logit -inf) is the model's fault.
    """
    _check_batch(logits, states)
    values, indices = logits.max(dim=-1)
    both = torch.stack((values.to(torch.float64), indices.to(torch.float64))).tolist()
    bad = [i for i, v in enumerate(both[0]) if not math.isfinite(v)]
    if bad:
        raise NonFiniteLogitsError(bad, [both[0][i] for i in bad])
    return [SampleResult(int(i)) for i in both[1]]


def _check_finite(logits: torch.Tensor) -> None:
    """NonFiniteLogitsError for rows whose maximum is NaN (NaN anywhere), +inf or -inf (no
    finite logit): the model computed them so; no bias or penalty is applied yet."""
    top = logits.max(dim=-1).values.to(torch.float64).tolist()
    bad = [i for i, v in enumerate(top) if not math.isfinite(v)]
    if bad:
        raise NonFiniteLogitsError(bad, [top[i] for i in bad])


def _check_batch(logits: torch.Tensor, states: Sequence[SamplerState]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(states):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(states)} sampler states were given")


def _apply_logit_bias(logits: torch.Tensor, states: Sequence[SamplerState]) -> None:
    vocab = logits.shape[-1]
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for i, state in enumerate(states):
        for token_id, bias in state.params.logit_bias.items():
            if token_id >= vocab:
                raise ValueError(f"logit_bias names token {token_id}, but the vocabulary has {vocab} tokens")
            rows.append(i)
            tokens.append(token_id)
            biases.append(bias)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def _apply_repetition_penalty(logits: torch.Tensor, states: Sequence[SamplerState]) -> None:
    penalized = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if not penalized:
        return
    device = logits.device
    rows, tokens = [], []
    for i in penalized:
        state = states[i]
        seen = torch.cat([state.prompt_token_ids,
                          torch.tensor(list(state.output_counts), dtype=torch.long)])
        rows.append(torch.full_like(seen, i))
        tokens.append(seen)
    # A boolean mask, so a token seen in both prompt and output is penalized once.
    seen_mask = torch.zeros(logits.shape, dtype=torch.bool, device=device)
    seen_mask[torch.cat(rows).to(device), torch.cat(tokens).to(device)] = True
    penalty = torch.tensor([s.params.repetition_penalty for s in states],
                           dtype=logits.dtype, device=device).unsqueeze(1)
    penalized_logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen_mask, penalized_logits, logits))


def _apply_frequency_presence(logits: torch.Tensor, states: Sequence[SamplerState]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    deltas: list[float] = []
    for i, state in enumerate(states):
        freq, presence = state.params.frequency_penalty, state.params.presence_penalty
        if freq == 0 and presence == 0:
            continue
        for token_id, count in state.output_counts.items():
            rows.append(i)
            tokens.append(token_id)
            deltas.append(-(freq * count + presence))
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        logits.index_put_(index, torch.tensor(deltas, dtype=logits.dtype, device=device), accumulate=True)


def _filtered_probs(logits: torch.Tensor, states: Sequence[SamplerState]) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-greedy rows' distributions after temperature, top-k, top-p and min-p, sorted
    descending (stable: equal probabilities keep token-id order, as argmax does): (probs,
    the token id of each sorted column). Filtered tokens have probability 0; rows are not
    renormalized."""
    device = logits.device
    rows, vocab = logits.shape
    params = [s.params for s in states]

    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    probs, order = probs.sort(dim=-1, descending=True, stable=True)
    position = torch.arange(vocab, device=device)

    if any(0 < p.top_k < vocab for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        probs = probs.masked_fill(position >= top_k.unsqueeze(1), 0.0)

    if any(p.top_p < 1.0 for p in params):
        # Keep the smallest prefix whose mass reaches top_p, measured after top-k.
        # Rows with top_p == 1 get a threshold above any rounding of the running sum.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params],
                             dtype=probs.dtype, device=device)
        renormalized = probs / probs.sum(dim=-1, keepdim=True)
        mass_before = torch.zeros_like(renormalized)
        mass_before[:, 1:] = renormalized[:, :-1].cumsum(dim=-1)
        probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)

    if any(p.min_p > 0.0 for p in params):
        # Relative to the most likely token, which no earlier filter removes.
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
        probs = probs.masked_fill(probs < probs[:, :1] * min_p.unsqueeze(1), 0.0)
    return probs, order


def _sample_rows(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """Token ids [S] for non-greedy rows: temperature, top-k, top-p, min-p, one draw each."""
    device = logits.device
    probs, order = _filtered_probs(logits, states)
    # Inverse CDF over the kept tokens: one uniform per row from that row's generator.
    uniform = torch.cat([s.draw() for s in states]).to(device)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniform.unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True)
    kept = (probs > 0).sum(dim=-1, keepdim=True)
    picked = torch.minimum(picked, kept - 1).clamp_(min=0)
    return order.gather(1, picked).squeeze(1)
