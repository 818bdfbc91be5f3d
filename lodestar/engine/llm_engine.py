"""The engine: requests in, tokens out, one batched model step at a time.

``add_request`` queues a prompt; each ``step`` asks the ``Scheduler`` for decode rows plus
prefill chunks under a token budget, runs them as one flattened batch, samples,
detokenizes and checks stop conditions. Finished requests free their KV blocks at once.

Overlapped decode (``EngineConfig.overlap_decode``, on by default with CUDA graphs): while
every running request decodes greedily with nothing to apply to its logits, each step
queues the next one on the device, fed by the device's own greedy tokens, before reading
its tokens; the host's detokenizing and stop checks then run while the GPU computes. A
request that stops on a token leaves one step of extra device work, which is dropped; its
outputs, the KV blocks it frees and the blocks the prefix cache registers are those of the
step-by-step loop. Any other step (a prefill, a sampled or penalized row, a waiting request
that could be admitted, too few free blocks: ``Scheduler.can_continue``) first finishes the
queued step.

Structured output: a request with ``SamplingParams.grammar`` gets a ``GrammarMatcher``
(``engine.grammar``) on its sampler state. Each step fills the bitmasks of the sampled
rows that have one on the host -- on a GPU while the device computes the step's logits --
and the sampler applies them. The matcher advances only on accepted tokens; when the
grammar is complete the request stops at once. Jump-forward: after a token, the tokens
the grammar then forces are appended without sampling, and the next step feeds them
with the row's last token as one chunk (one forward pass for the whole run).

Speculative decoding (``EngineConfig.spec``, ``engine.spec``): before each step the drafter
proposes up to gamma tokens for every running request that speculates (its own adaptive
gamma; a grammar cuts drafts to the prefix it allows). The scheduler feeds the last token
and the drafts as one run whose rows all return logits, beside ordinary decode rows and
prefill chunks; ``_verify`` keeps the accepted drafts and one token of the target's, and
the rows of rejected drafts leave the KV (blocks past the accepted tokens are freed at
once). Speculating requests do not overlap steps while they draft.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from lodestar.engine.detokenizer import IncrementalDetokenizer
from lodestar.engine.faults import ModelFaultError, NonFiniteLogitsError, model_fault
from lodestar.engine.grammar import GrammarCompiler, GrammarMatcher, GrammarSpec
from lodestar.engine.kv_cache import BlockPool
from lodestar.engine.loader import LoadedModel
from lodestar.engine.grammar import apply_masks
from lodestar.engine.model_runner import GRAPH_BATCH_SIZES, STEPWISE_MAX, ModelRunner, PendingDecode
from lodestar.engine.sampling import (SampleResult, Sampler, SamplerState, SamplingParams, argmax_only, mask_rows,
                                     plain_greedy)
from lodestar.engine.scheduler import ScheduledBatch, Scheduler
from lodestar.engine.sequence import Sequence
from lodestar.engine.spec import SpecConfig, SpecStats
from lodestar.engine.spec.drafters import DraftModelDrafter, DraftModelError, NgramDrafter, check_vocabularies
from lodestar.engine.spec.verify import SpecState, argmax_rows, expected_tokens, verify_greedy, verify_sampled


def _slots(blocks: list[int], block_size: int) -> torch.Tensor:
    b = torch.tensor(blocks, dtype=torch.int64)
    return (b[:, None] * block_size + torch.arange(block_size)).reshape(-1)


class ContextLengthError(ValueError):
    """A prompt (plus at least one new token) does not fit the context."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context: int) -> None:
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context
        super().__init__(f"prompt has {prompt_tokens} tokens; with at least one new token it exceeds "
                         f"the context of {context} tokens")


@dataclass
class EngineConfig:
    max_num_seqs: int = 16              # rows decoded together
    max_num_batched_tokens: int = 512   # token budget of one step (prefill chunk size)
    block_size: int = 16
    max_model_len: int | None = None    # default: the model's context, capped at kv_tokens
    kv_tokens: int = 16384              # KV pool capacity in tokens (memory is touched lazily)
    enable_prefix_cache: bool = True
    kv_dir: str | None = None           # disk tier folder (None: no disk tier)
    disk_min_tokens: int = 256          # checkpoint prefixes of at least this many tokens
    disk_max_bytes: int = 4 << 30
    device: str | None = None           # None: where the model was loaded; KV lives there too
    cuda_graphs: bool = True            # replay captured graphs for decode steps (CUDA only)
    prefill_graphs: bool = True         # also for one whole prompt's prefill, per token-count bucket
                                        # (CUDA, one rank; needs cuda_graphs)
    tensor_parallel: int = 1            # ranks; must match load_model(..., tensor_parallel=N) (1: as loaded)
    spec: SpecConfig | None = None      # speculative decoding (None: off)
    overlap_decode: bool | None = None  # queue the next greedy decode step before reading this one's
                                        # tokens (None: on where it gains, CUDA graphs on one rank)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose KV came from the cache (memory or disk)
    cache_read_disk_tokens: int = 0 # ... of which were read from the disk tier
    cache_write_tokens: int = 0     # tokens of this request checkpointed to the disk tier
    forced_tokens: int = 0          # output tokens a grammar forced (jump-forward), so far
    speculation: SpecStats | None = None   # drafts scored and accepted, so far (None: not speculating)


@dataclass
class Completion:
    """A finished request, as returned by ``LLMEngine.generate``."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


log = logging.getLogger("lodestar.engine")

PREFILL_LOG_S = 10.0    # a prompt still prefilling after this long is logged, and again at this interval


def _check_spec(spec: SpecConfig | None, draft: LoadedModel | None, world: int) -> None:
    """Speculation settings that cannot work, refused before anything is allocated."""
    if spec is None:
        if draft is not None:
            raise ValueError("a draft model needs EngineConfig.spec = SpecConfig('draft')")
        return
    if world > 1:
        raise ValueError("speculative decoding does not work with tensor parallelism yet")
    if spec.method == "ngram" and draft is not None:
        raise ValueError("SpecConfig('ngram') drafts from the request's own tokens; use SpecConfig('draft') "
                         "with a draft model")
    if spec.method == "draft" and draft is None:
        raise DraftModelError("speculation method 'draft' needs a draft model: LLMEngine(..., draft=load_model(...))")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 draft: LoadedModel | None = None) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = cfg = config or EngineConfig()
        _check_spec(cfg.spec, draft, getattr(loaded, "tensor_parallel", 1))
        num_blocks = -(-cfg.kv_tokens // cfg.block_size)
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        # Block hashes are per process and weights: the mode changes the KV values.
        self.fingerprint = f"{loaded.path.name}:{loaded.mode}"
        self.stats: Counter = Counter()
        # hash -> (parent hash, tokens) of each block the prefix cache holds, to checkpoint a
        # cached chain when it is evicted; an entry leaves with its block.
        self._block_meta: dict[bytes, tuple[bytes | None, list[int]]] = {}
        ctx = loaded.config.context_length
        self.max_model_len = min(cfg.max_model_len or ctx, ctx, num_blocks * cfg.block_size)
        self.device = torch.device(cfg.device or getattr(loaded, "device", "cpu"))
        kv_dtype = torch.float32
        if self.device.type == "cuda":
            self.fingerprint += ":cuda"
            kv_dtype = torch.float32 if loaded.mode == "fp32" else torch.bfloat16
        world = getattr(loaded, "tensor_parallel", 1)
        if cfg.tensor_parallel not in (1, world):
            raise ValueError(f"EngineConfig.tensor_parallel={cfg.tensor_parallel}, but the model was loaded for "
                             f"{world} rank(s); load it with load_model(..., tensor_parallel={cfg.tensor_parallel})")
        if world > 1:
            if cfg.kv_dir:
                raise ValueError("the disk KV tier (--kv-dir) does not work with tensor parallelism yet: "
                                 "each rank holds only its heads' slice of the KV cache")
            from lodestar.distributed.runner import TPModelRunner
            self.fingerprint += f":tp{world}"
            self.runner = TPModelRunner(loaded.group, loaded.model, self.pool, kv_dtype, self.device,
                                        self.max_model_len, cfg.cuda_graphs)
        else:
            self.runner = ModelRunner(loaded.model, self.pool, kv_dtype, self.device, self.max_model_len,
                                      cfg.cuda_graphs, cfg.prefill_graphs)
        self.disk = None
        if cfg.kv_dir:
            from lodestar.engine.disk_cache import DiskKVCache, KVLayout
            from lodestar.formats.catalog import file_sha256
            layers = loaded.model.attention_layers
            weights_id = getattr(loaded.file, "fingerprint", None) or file_sha256(loaded.path)
            layout = KVLayout(weights_id, loaded.mode,
                              str(layers[0].k_cache.dtype).removeprefix("torch."), cfg.block_size,
                              tuple((l.n_kv_heads, l.head_dim) for l in layers))
            self.disk = DiskKVCache(cfg.kv_dir, layout, cfg.disk_max_bytes, cfg.disk_min_tokens)
        self.pool.on_evict = self._on_evict
        self.scheduler = Scheduler(self.pool, self.fingerprint, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.max_model_len, self.stats, on_cached=self._remember_block,
                                   extend_prefix=self._attach_from_disk if self.disk is not None else None)
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(self.tokenizer, loaded.config.vocab_size)
        self._masks: torch.Tensor | None = None    # host bitmask buffer, [rows, words] int32
        self._masks_np: np.ndarray | None = None    # ... and a numpy view of it
        self._ids = itertools.count()
        self.requests: dict[int, Sequence] = {}
        self._skip_ids = frozenset(self.tokenizer.special_ids)
        self._inflight: PendingDecode | None = None
        self.drafter = self._drafter(cfg.spec, draft, world)
        overlap = cfg.overlap_decode
        if overlap is None:
            overlap = self.device.type == "cuda" and cfg.cuda_graphs
        self.overlap = bool(overlap) and world == 1 and self.runner.can_overlap

    def _drafter(self, spec: SpecConfig | None, draft: LoadedModel | None, world: int):
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramDrafter(spec.ngram_min, spec.ngram_max)
        if torch.device(getattr(draft, "device", "cpu")) != self.device:
            raise DraftModelError(f"the draft model is on {getattr(draft, 'device', 'cpu')}, the target on "
                                  f"{self.device}: load both on the same device")
        check_vocabularies(self.tokenizer, draft.tokenizer, self.loaded.path, draft.path)
        return DraftModelDrafter(draft, self.loaded.config.vocab_size, self.config.kv_tokens, self.config.block_size,
                                 self.max_model_len, self.config.cuda_graphs)

    # -- requests ----------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        bad = [t for t in list(params.logit_bias) + list(params.stop_token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias / stop_token_ids name token ids outside [0, {vocab}): {bad[:5]}")
        if len(prompt_ids) + 1 > self.max_model_len:
            raise ContextLengthError(len(prompt_ids), params.max_tokens, self.max_model_len)
        matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        seq = Sequence(next(self._ids), list(prompt_ids), params)
        seq.sampler_state = SamplerState(params, prompt_ids)
        seq.sampler_state.grammar = matcher
        if self.drafter is not None and params.speculate:
            seq.spec = SpecState(self.config.spec)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer.token_bytes, self._skip_ids, params.stop,
                                                 params.include_stop_str_in_output)
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile (and cache) a request's grammar ahead of ``add_request``; raises GrammarError.
        Thread-safe, so a server can compile on a worker thread rather than the engine's."""
        self.grammars.compile(spec)

    def abort(self, request_id: int) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def waiting(self) -> list[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    # -- prefix cache: records and the disk tier -------------------------------------
    def _remember_block(self, h: bytes, parent: bytes | None, tokens: list[int]) -> None:
        """The scheduler cached a full block: keep its parent and tokens (``_on_evict`` needs them)."""
        self._block_meta[h] = (parent, tokens)

    def _attach_from_disk(self, seq: Sequence, hashes: list[bytes], limit: int) -> None:
        """Extend the memory hit from the longest checkpoint on disk (it may cover more)."""
        bs, have = self.pool.block_size, len(seq.block_table)
        found = self.disk.find(hashes)
        use = min(found, limit)
        if use <= have or use - have > self.pool.num_free:
            return
        kv = self.disk.load(hashes[found - 1], seq.token_slice(0, found * bs))
        if kv is None:
            return
        blocks = self.pool.allocate(use - have)
        slots = _slots(blocks, bs).to(self.device)
        for layer, (k, v) in zip(self.loaded.model.attention_layers, kv):
            layer.k_cache[slots] = k[have * bs:use * bs].to(self.device, layer.k_cache.dtype)
            layer.v_cache[slots] = v[have * bs:use * bs].to(self.device, layer.v_cache.dtype)
        for j, b in enumerate(blocks, start=have):
            if self.pool.register(b, hashes[j]):
                self._remember_block(hashes[j], hashes[j - 1] if j else None, seq.token_slice(j * bs, (j + 1) * bs))
        seq.block_table += blocks
        seq.block_hashes = hashes[:use]
        seq.num_computed = use * bs
        seq.disk_read_tokens = (use - have) * bs
        self.stats["disk_read_tokens"] += (use - have) * bs

    def _save_to_disk(self, hashes: list[bytes], blocks: list[int], tokens: list[int] | None = None) -> int:
        """Checkpoint a chain of full blocks (copied now, written in the background); ``tokens``
        are the chain's tokens, read from the prefix cache's records when not given."""
        bs = self.pool.block_size
        if self.disk is None or not hashes or len(hashes) * bs < self.disk.min_tokens or self.disk.has(hashes[-1]):
            return 0
        if tokens is None:
            tokens = [t for h in hashes for t in self._block_meta[h][1]]
        slots = _slots(blocks, bs).to(self.device)
        kv = [(l.k_cache[slots].cpu(), l.v_cache[slots].cpu()) for l in self.loaded.model.attention_layers]
        self.disk.save(hashes[-1], tokens, kv)
        self.stats["disk_write_tokens"] += len(tokens)
        return len(tokens)

    def _on_evict(self, block: int, evicted: bytes) -> None:
        """A cached chain is about to lose its tail: keep it on disk if it is long enough."""
        chain, h = [], evicted
        while self.disk is not None and h is not None:
            b = self.pool.cached.get(h)
            if b is None:
                chain = []           # an ancestor is gone already: nothing whole to save
                break
            chain.append((h, b))
            h = self._block_meta.get(h, (None, None))[0]
        if chain:
            chain.reverse()
            self._save_to_disk([c[0] for c in chain], [c[1] for c in chain])
        self._block_meta.pop(evicted, None)

    def close(self) -> None:
        """Checkpoint running conversations and wait for the disk tier to finish writing."""
        if self.disk is None:
            return
        for seq in self.scheduler.running:
            self._save_to_disk(*self._chain(seq))
        self.disk.flush()

    def _chain(self, seq: Sequence) -> tuple[list[bytes], list[int], list[int]]:
        """A sequence's hashed full blocks: (hashes, blocks, tokens), for ``_save_to_disk``."""
        n = len(seq.block_hashes)
        return seq.block_hashes, seq.block_table[:n], seq.token_slice(0, n * self.pool.block_size)

    # -- one step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> sample -> postprocess; an overlapped decode step in flight is
        collected first (and the next one queued when the scheduler says the batch continues)."""
        if self._inflight is not None:
            outs = self._collect()
            if outs or self._inflight is not None:
                return outs
        if self.drafter is not None:
            self._draft()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        if self._overlappable(batch):
            self._inflight = self.runner.launch(batch.seqs)
            self._pick(self._inflight)
            self.stats["overlapped_steps"] += 1
            return self._collect()
        logits = self._run(batch)
        seqs = batch.sampled
        if not any(s.draft_ids for s in seqs):
            return [self._accept(seq, [res]) for seq, res in zip(seqs, self._sample(seqs, logits))]
        return self._verify(seqs, logits)

    def _run(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The model on one batch; then its new full blocks go to the prefix cache and a cold
        prefill's prompt to the disk tier. Logits of the rows in ``batch.sampled``."""
        now = time.monotonic()
        for s in batch.seqs:
            if not s.prefill_started:
                s.prefill_started = now
        logits = self.runner.run(batch.seqs, batch.num_new, batch.want_logits)
        for s, w in zip(batch.seqs, batch.want_logits):
            self.scheduler.register_full_blocks(s)
            if not s.output_ids:
                self._log_prefill(s, w)
            if w and not s.output_ids and self.disk is not None and \
                    s.num_computed - s.cached_tokens >= self.disk.min_tokens:
                # a cold prefill: checkpoint its prompt
                s.cache_write_tokens = self._save_to_disk(*self._chain(s))
        return logits

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor | None) -> list[SampleResult]:
        if not seqs:
            return []
        states = [s.sampler_state for s in seqs]
        try:
            return self.sampler.sample(logits, states, self._grammar_masks([s.grammar for s in states]))
        except NonFiniteLogitsError as e:
            raise self._model_fault(str(e)) from None

    def _grammar_masks(self, matchers: list[GrammarMatcher | None]) -> torch.Tensor | None:
        """Row i: the next-token bitmask of ``matchers[i]`` (None when no row has one).

        Called after the step was launched, so on a GPU the host fills them while the device
        computes the logits. A row whose grammar allows no token at all (a dead end the
        compiler could not see) is allowed end-of-sequence, so it ends instead of failing
        the batch."""
        if all(m is None for m in matchers):
            return None
        g = self.grammars
        if self._masks is None or self._masks.shape[0] < len(matchers):
            rows = max(len(matchers), self.config.max_num_seqs)
            self._masks = torch.zeros((rows, g.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._masks_np = self._masks.numpy()
        t0 = time.perf_counter()
        g.fill_masks(matchers, self._masks)
        rows = [i for i, m in enumerate(matchers) if m is not None]
        for i in rows:
            if not self._masks_np[i].any():      # (numpy: a torch op per row costs ~10x more here)
                log.warning("grammar of %s allows no token; ending its output", matchers[i].spec.field)
                for e in self.tokenizer.eos_ids:
                    self._masks_np[i, e // 32] |= np.int32(np.uint32(1 << (e % 32)).view(np.int32))
        self.stats["grammar_mask_rows"] += len(rows)
        self.stats["grammar_mask_ns"] += int((time.perf_counter() - t0) * 1e9)
        return self._masks

    def _log_prefill(self, seq: Sequence, done: bool) -> None:
        """A long prefill's progress in the log: every ``PREFILL_LOG_S`` seconds, and when it ends."""
        now = time.monotonic()
        if now - (seq.prefill_logged or seq.prefill_started) < PREFILL_LOG_S and not (done and seq.prefill_logged):
            return
        seq.prefill_logged = now
        total, computed = len(seq.prompt_ids), min(seq.num_computed, len(seq.prompt_ids))
        rate = (computed - seq.cached_tokens) / max(now - seq.prefill_started, 1e-9)
        if done:
            log.info("request %d: prefill done, %d prompt tokens (%d from the prefix cache) in %.1f s, %.0f tokens/s",
                     seq.seq_id, total, seq.cached_tokens, now - seq.prefill_started, rate)
        else:
            log.info("request %d: prefill %d/%d prompt tokens, %.0f tokens/s, about %.0f s left", seq.seq_id,
                     computed, total, rate, (total - computed) / max(rate, 1e-9))

    def _model_fault(self, detail: str) -> ModelFaultError:
        """The error for logits the model computed as NaN or infinite, naming the file and the
        first tensor with a non-finite value (one scan of the weights, now that it failed)."""
        return model_fault(self.loaded.path, detail, getattr(self.loaded.file, "tensors", None))

    # -- overlapped decode ------------------------------------------------------------
    def _overlappable(self, batch: ScheduledBatch) -> bool:
        # greedy rows under a grammar too, on a GPU: their masks are applied after the graph (``_pick``)
        masked = self.device.type == "cuda"
        return (self.overlap and batch.is_decode and self.runner.launchable(batch.seqs)
                and not any(s.spec is not None and s.spec.active for s in batch.seqs)
                and all(plain_greedy(s.params) or (masked and argmax_only(s.params)) for s in batch.seqs))

    def _pick(self, pending) -> None:
        """Grammar rows of a launched decode step: fill their masks on the host while the device
        computes the step, then queue the masked greedy pick behind it (the next step, queued
        later, reads the picked tokens). Rows that finished, or have forced tokens still to feed
        (their pick is dropped), get none."""
        matchers = [s.sampler_state.grammar if not s.is_finished and s.num_tokens == s.num_computed else None
                    for s in pending.seqs]
        masks = self._grammar_masks(matchers)
        if masks is not None:
            rows = [i for i, m in enumerate(matchers) if m is not None]
            self.runner.pick_masked(pending, rows, mask_rows(masks, rows))

    def _collect(self) -> list[RequestOutput]:
        """Queue the next step of the in-flight rows when the scheduler would pick exactly them
        again, then read and accept the in-flight step's tokens."""
        cur, self._inflight = self._inflight, None
        # (a row with tokens a grammar forced after its last one feeds them as a chunk: no next step)
        if (self.overlap and all(s.num_tokens <= s.num_computed for s in cur.seqs)
                and not any(s.spec is not None and s.spec.active for s in cur.seqs)
                and self.scheduler.can_continue(cur.seqs) and self.runner.launchable(cur.seqs)):
            self._inflight = self.runner.launch(cur.seqs, cur)
            self.stats["overlapped_steps"] += 1
        tokens, ok = cur.tokens()
        outs = []
        for seq, tok, good in zip(cur.seqs, tokens, ok):
            if seq.is_finished:          # aborted, or stopped, while this step was queued
                continue
            if seq.num_tokens > seq.num_computed:    # a grammar forced tokens after its last one:
                continue                             # they come next, not this step's pick
            if not good:   # greedy with nothing applied: the logits are as the model computed them
                raise self._model_fault(f"the model computed NaN or -inf logits (request {seq.seq_id})")
            self.scheduler.register_full_blocks(seq)
            outs.append(self._accept(seq, [SampleResult(tok)]))
        if self._inflight is not None:
            self._pick(self._inflight)
        return outs

    def _accept(self, seq: Sequence, results: list[SampleResult], drafted: int | None = None) -> RequestOutput:
        """A step's tokens for ``seq`` (one; or a verify run's accepted drafts and the target's
        token, ``drafted`` drafts having been scored): append them up to the first that ends
        the request, then what a grammar forces."""
        p = seq.params
        lp = [] if p.logprobs is not None else None
        grammar = seq.sampler_state.grammar
        tokens: list[int] = []
        text, reason = "", None
        for res in results:
            piece, reason = self._append(seq, res.token_id)
            text += piece
            tokens.append(res.token_id)
            if lp is not None:
                lp.append((res.logprob, res.top_logprobs))
            if grammar is not None and reason is None:
                reason = self._grammar_accept(seq, grammar, res.token_id)
            if reason:
                break
        if grammar is not None and reason is None:
            text, reason = self._jump_forward(seq, grammar, text, tokens)
        st = seq.spec
        if drafted is not None:
            self._settle(seq, drafted, len(results) - 1)
        elif st is not None and not st.active:
            st.tick()
        if reason:
            text += seq.detokenizer.flush()
            self._finish(seq, reason)
        return RequestOutput(seq.seq_id, tokens, text, reason is not None, reason, lp,
                             len(seq.prompt_ids), len(seq.output_ids), seq.cached_tokens,
                             seq.disk_read_tokens, seq.cache_write_tokens,
                             grammar.forced_total if grammar is not None else 0,
                             st.stats if st is not None and st.stats.verify_steps else None)

    def _append(self, seq: Sequence, tok: int) -> tuple[str, str | None]:
        """One new output token: (its text, finish reason or None)."""
        p = seq.params
        seq.output_ids.append(tok)
        seq.sampler_state.append(tok)
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tokenizer.eos_ids):
            return "", "stop"
        text = seq.detokenizer.push(tok)
        if seq.detokenizer.stopped:
            return text, "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return text, "length"
        return text, None

    def _grammar_accept(self, seq: Sequence, grammar, tok: int) -> str | None:
        """Move the grammar over ``tok``: "stop" when it is complete, "error" if it refuses it."""
        if not grammar.accept(tok):
            log.error("request %d: token %d is outside its grammar (%s); ending it", seq.seq_id, tok,
                      grammar.error() or "not allowed")
            return "error"
        return "stop" if grammar.is_stopped() else None

    def _jump_forward(self, seq: Sequence, grammar, text: str, tokens: list[int]) -> tuple[str, str | None]:
        """Append the tokens the grammar forces now (jump-forward)."""
        if not seq.params.jump_forward or seq.params.logprobs is not None:
            return text, None
        for forced in grammar.forced():
            if not grammar.accept(forced):
                log.error("request %d: forced token %d refused by its grammar (%s)", seq.seq_id, forced,
                          grammar.error())
                return text, "error"
            grammar.forced_total += 1
            self.stats["forced_tokens"] += 1
            piece, reason = self._append(seq, forced)
            text += piece
            tokens.append(forced)
            if reason is None and grammar.is_stopped():
                reason = "stop"
            if reason:
                return text, reason
        return text, None

    # -- speculative decoding --------------------------------------------------------
    def _draft(self) -> None:
        """Drafts for the running requests that speculate and decode one token next step. On a
        GPU none while a prompt is being admitted: a step with a prefill chunk runs eagerly,
        where a verify run would not get the bits of decode steps (the decode graph's)."""
        if self.device.type == "cuda" and self.scheduler.admitting():
            for s in self.scheduler.running:
                s.draft_ids.clear()
            return
        seqs, gammas = [], []
        for s in self.scheduler.running:
            s.draft_ids.clear()
            st = s.spec
            if st is None or not st.active or s.num_tokens - s.num_computed != 1:
                continue
            # no draft past max_tokens or the context (the target adds a token of its own)
            limit = min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.num_tokens,
                        STEPWISE_MAX) - 1
            g = st.next_gamma(limit)
            if g > 0:
                seqs.append(s)
                gammas.append(g)
        if not seqs:
            return
        gammas = self._cap_drafts(seqs, gammas)
        if not any(gammas):
            return
        for s, g, d in zip(seqs, gammas, self.drafter.propose(seqs, gammas)):
            toks = d.tokens[:g]
            grammar = s.sampler_state.grammar
            if grammar is not None and toks:
                toks = toks[:grammar.valid_prefix(toks)]
            if not toks:
                s.spec.no_draft()
                continue
            s.draft_ids.extend(toks)
            s.spec.q = d.q

    def _cap_drafts(self, seqs: list[Sequence], gammas: list[int]) -> list[int]:
        """One cap on this step's draft lengths that maximizes the step's expected tokens per
        unit of time (``ModelRunner.step_cost``: several requests' drafts share one step, and
        on a GPU a step costs what its graph bucket costs); verify runs stay within the largest
        decode graph."""
        rows = len(self.scheduler.running)
        if self.device.type == "cuda":
            spare = GRAPH_BATCH_SIZES[-1] - rows
            while sum(gammas) > spare and max(gammas) > 0:
                j = gammas.index(max(gammas))
                gammas[j] -= 1
        if not self.config.spec.adaptive:
            return gammas
        alphas = [s.spec.alpha for s in seqs]
        cost = self.runner.step_cost
        best, best_rate = 0, rows / cost(rows)
        for cap in range(1, max(gammas) + 1):
            gs = [min(g, cap) for g in gammas]
            tokens = rows - len(seqs) + sum(expected_tokens(a, g) for a, g in zip(alphas, gs))
            rate = tokens / cost(rows + sum(gs))
            if rate > best_rate * 1.001:
                best, best_rate = cap, rate
        return [min(g, best) for g in gammas]

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        """Outputs of a step with verify runs: plain rows sample as usual, greedy runs keep the
        drafts that match the argmax, sampled runs use rejection sampling (``spec.verify``)."""
        offs, r = [], 0
        for s in seqs:
            offs.append(r)
            r += 1 + len(s.draft_ids)
        results: dict[int, list[SampleResult]] = {}
        plain = [i for i, s in enumerate(seqs) if not s.draft_ids]
        if plain:
            res = self._sample([seqs[i] for i in plain], logits[[offs[i] for i in plain]])
            results.update((i, [x]) for i, x in zip(plain, res))
        runs = [i for i, s in enumerate(seqs) if s.draft_ids]
        greedy = [i for i in runs if argmax_only(seqs[i].params)]
        try:
            if greedy:
                idx = [offs[i] + j for i in greedy for j in range(1 + len(seqs[i].draft_ids))]
                masked = [(off, seqs[i]) for off, i in self._sub_offsets(greedy, seqs)
                          if seqs[i].sampler_state.grammar is not None]
                picks = None if masked else self.runner.greedy_picks()
                if picks is not None:        # the decode graph's own argmax of every row
                    tokens, ok = picks
                    bad = [j for j in idx if not ok[j]]
                    if bad:
                        raise NonFiniteLogitsError(bad, [float("nan")] * len(bad))
                    targets = [tokens[j] for j in idx]
                else:
                    sub = logits[idx]
                    if masked:
                        self._run_masks(sub, masked)
                    targets = argmax_rows(sub)
                for i, toks in zip(greedy, verify_greedy(targets, [seqs[i].draft_ids for i in greedy])):
                    results[i] = [SampleResult(t) for t in toks]
            for i in runs:
                if i in results:
                    continue
                s = seqs[i]
                k = len(s.draft_ids)
                q = s.spec.q[:k] if s.spec.q is not None else None
                results[i] = verify_sampled(self.sampler, logits[offs[i]:offs[i] + k + 1], s.sampler_state,
                                            list(s.draft_ids), q, lambda s=s: self._one_mask(s))
        except NonFiniteLogitsError as e:
            raise self._model_fault(str(e)) from None
        outs = []
        for i, s in enumerate(seqs):
            drafted = len(s.draft_ids) if s.draft_ids else None
            outs.append(self._accept(s, results[i], drafted))
        return outs

    @staticmethod
    def _sub_offsets(greedy: list[int], seqs: list[Sequence]) -> list[tuple[int, int]]:
        out, r = [], 0
        for i in greedy:
            out.append((r, i))
            r += 1 + len(seqs[i].draft_ids)
        return out

    def _run_masks(self, logits: torch.Tensor, runs: list[tuple[int, Sequence]]) -> None:
        """Apply grammar masks to verify rows: row j of a run is masked with the grammar in the
        state after the run's first j drafts (the grammar is stepped over them and back)."""
        rows = [off + j for off, s in runs for j in range(len(s.draft_ids) + 1)]
        masks = torch.zeros((len(rows), self.grammars.words), dtype=torch.int32)
        t0 = time.perf_counter()
        r = 0
        for off, s in runs:
            g = s.sampler_state.grammar
            drafts = s.draft_ids
            for j in range(len(drafts) + 1):
                self.grammars.fill_masks([g], masks[r:r + 1])
                r += 1
                if j < len(drafts) and not g.accept(drafts[j]):
                    raise RuntimeError(f"draft token {drafts[j]} passed the grammar check but was refused")
            g.rollback(len(drafts))
        self.stats["grammar_mask_rows"] += len(rows)
        self.stats["grammar_mask_ns"] += int((time.perf_counter() - t0) * 1e9)
        apply_masks(logits, rows, masks.pin_memory() if logits.is_cuda else masks)

    def _one_mask(self, seq: Sequence) -> torch.Tensor | None:
        g = seq.sampler_state.grammar
        if g is None:
            return None
        return self._grammar_masks([g])

    def _settle(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """After a verify run: only the last token and the accepted drafts stay in the KV (the
        last emitted token stays uncomputed, as after a plain step), the blocks past them are
        freed, and the request's gamma adapts."""
        seq.num_computed = min(seq.num_computed - drafted + accepted, seq.num_tokens - 1)
        keep = self.pool.blocks_needed(seq.num_tokens)
        if len(seq.block_table) > keep and not seq.is_finished:
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]
        seq.draft_ids.clear()
        self.scheduler.register_full_blocks(seq)
        rows = len(self.scheduler.running)
        base = self.runner.step_cost(rows)
        seq.spec.record(drafted, accepted, lambda g: self.runner.step_cost(rows + g) / base)
        seq.spec.q = None
        self.stats["spec_drafted"] += drafted
        self.stats["spec_accepted"] += accepted
        self.stats["spec_verify_steps"] += 1
        self.stats["spec_emitted"] += accepted + 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.draft_ids.clear()
        if self.drafter is not None:
            self.drafter.release(seq)
        if reason != "abort":    # the whole conversation so far, for the next turn after a restart
            self._save_to_disk(*self._chain(seq))
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.seq_id, None)

    # -- conveniences ------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Run prompts together to completion; results in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        acc = {i: Completion(i, p, [], "", "") for i, p in zip(ids, prompts)}
        while self.has_unfinished():
            for out in self.step():
                c = acc[out.request_id]
                c.token_ids += out.token_ids
                c.text += out.text
                if out.logprobs:
                    c.logprobs += out.logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason
        return [acc[i] for i in ids]

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate one request, yielding each step's output; closing the iterator aborts it."""
        rid = self.add_request(prompt_ids, params)
        done = False
        try:
            while not done:
                for out in self.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.abort(rid)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny request so first-token latency excludes one-time setup."""
        self.generate([[self.tokenizer.bos_id if self.tokenizer.bos_id is not None else 0]],
                      SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
