"""Builds one flattened batch per step and runs the model on it.

On a CUDA device, steps where every row decodes one token replay a CUDA graph captured
for the smallest batch-size bucket (``GRAPH_BATCH_SIZES``) that holds them: static input
buffers (token ids, positions, KV slots, block tables as wide as ``max_model_len``
needs, lengths) are filled on the host and copied in, padded rows write to a spare KV
block that no sequence owns, and the graph runs the trunk and the head. Other steps
(prefill, mixed, or more rows than the largest bucket) run eagerly. Logits stay on the
device; the sampler reads them there.

Prefill graphs (``prefill_graphs``, on by default with CUDA graphs): a step that
prefills one whole prompt from position 0 (no cached prefix) replays a graph captured for
the smallest token-count bucket (``PREFILL_GRAPH_TOKENS``) that holds it, because a
prefill's eager launches cost the host more time than the GPU needs at a few hundred
tokens. Padding tokens follow the prompt (causal attention: no real token sees them),
write their K/V to the spare block, and only the last real token's logits come back.
Real rows go through matrix products of the bucket's row count, so their last bits may
differ from an eager prefill of exactly the prompt's length; a prompt always lands in the
same bucket, so results stay deterministic. The graphs share one memory pool.

Overlapped decode (``launch``): a graph also leaves each row's greedy token (the first
maximal logit, as the sampler's plain greedy path picks it) in its own token-id input, and
in pinned host memory behind an event. So the engine can queue the next step, fed from the
device, before it has read this step's tokens: the GPU runs step N+1 while the host
detokenizes step N. Host staging and result buffers alternate between two sets, so
filling one step's inputs never waits for the step still queued. A step's positions, KV
slots, lengths and block tables sit in one device buffer laid out as its staging buffer.
The graph's first kernel reads the staging buffer itself from pinned host memory and its
greedy kernel writes the tokens back there (``triton_step_inputs``), so nothing but the
replays runs on the stream.
On the CPU ``launch`` runs the step at once (same results; only the device path gains
speed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from lodestar.engine.collector import paused
from lodestar.engine.grammar import apply_masks
from lodestar.engine.kv_cache import BlockPool, allocate_kv_tensors
from lodestar.engine.sequence import Sequence
from lodestar.kernels.triton_attention import grid_splits, num_partitions
from lodestar.kernels.triton_sampling import greedy_rows
from lodestar.kernels.triton_step_inputs import stage_bytes, stage_views, take_inputs
from lodestar.layers.attention import AttentionBatch, GpuAttentionMeta

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# A CPU step's time grows by about this fraction of a one-row step per extra decode row
# (attention runs row by row, the head runs on every row): 2 rows 1.18x, 4 rows 1.71x,
# 8 rows 2.78x for the default model at context 512 on 2 cores
# (bench/results/spec-curve-cpu-smollm2.json, ``python -m lodestar.bench.spec_curve --device cpu``)
CPU_ROW_COST = 0.25
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass(eq=False)
class StepInputs:
    """A decode step's inputs as views of one byte buffer (``ModelRunner._input_views``)."""

    positions: torch.Tensor             # int64 [size]
    slots: torch.Tensor                 # int64 [size]: KV slot of each row's new token
    lens: torch.Tensor                  # int32 [size]
    tables: torch.Tensor                # int32 [size, max_blocks], 16-byte aligned


@dataclass(eq=False)
class StepStage:
    """Pinned host buffers for one decode step's inputs (``ModelRunner._staging``)."""

    inputs: StepInputs                  # views of ``raw``
    ids: torch.Tensor                   # int64 [size]: the rows' token ids
    raw: torch.Tensor                   # uint8: laid out as the graph's device input buffer
    copied: torch.cuda.Event            # recorded once the device has read this stage
    header: torch.Tensor                # int32 [4]: take the ids?, table columns in use


@dataclass(eq=False)
class DecodeGraph:
    """A decode graph captured for ``size`` rows (``ModelRunner._capture``) and its buffers."""

    size: int
    res: torch.Tensor                   # int64 [2, size] device: token-id input / greedy tokens, valid flags
    ids: torch.Tensor                   # ``res[0]``: the graph's token-id input
    stages: list[StepStage]             # two host stages, filled by alternate steps
    raw: torch.Tensor                   # device uint8 input buffer, laid out as a stage's ``raw``
    inputs: StepInputs                  # views of ``raw``
    batch: AttentionBatch
    host: torch.Tensor                  # pinned uint8 [2, stage_bytes] holding both stages
    outs_host: torch.Tensor             # pinned int64 [2, 2, size], the greedy kernel's result slots
    ctl: torch.Tensor                   # int32 [2] device (step counter, stage taken)
    stage: int = 0                      # the stage the next step fills
    logits: torch.Tensor = field(init=False)        # the captured graph's output
    graph: torch.cuda.CUDAGraph = field(init=False)


@dataclass(eq=False)
class PrefillGraph:
    """A prefill graph captured for a ``size``-token bucket (``ModelRunner._prefill_capture``)."""

    size: int
    ids: torch.Tensor                   # int64 [size] device
    positions: torch.Tensor             # int64 [size] device
    slots: torch.Tensor                 # int64 [size] device
    last: torch.Tensor                  # int64 [1] device: the row whose logits come back
    host: torch.Tensor                  # pinned int64 [4, size]: ids, positions, slots, last
    copied: torch.cuda.Event            # recorded once the device has read ``host``
    batch: AttentionBatch
    logits: torch.Tensor = field(init=False)
    graph: torch.cuda.CUDAGraph = field(init=False)


@dataclass
class PendingDecode:
    """A launched decode step whose greedy tokens the host has not read yet."""

    seqs: list[Sequence]
    result: torch.Tensor                # int64 [2, >= rows] on the host: tokens, then 1 if the row's max is > -inf
    done: torch.cuda.Event | None       # recorded after the copy to ``result`` (None: ready)
    graph: DecodeGraph | None = None    # the captured graph it replayed (CUDA)

    def tokens(self) -> tuple[list[int], list[bool]]:
        """(token per row, whether the row had a finite-or-+inf maximum); waits for the device."""
        if self.done is not None:
            self.done.synchronize()
        n = len(self.seqs)
        ids, ok = self.result[:, :n].tolist()
        return ids, [bool(v) for v in ok]


def greedy_into(logits: torch.Tensor, out: torch.Tensor, host: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> None:
    """``out[0, :R]`` = first index of each row's maximum, ``out[1, :R]`` = 1 where that
    maximum is a number above -inf (0 for a row of -inf or with a NaN maximum). One Triton
    kernel on CUDA (``triton_sampling.greedy_rows``, which also writes ``host``'s slot when
    given); the torch reduction elsewhere (the same result)."""
    if logits.is_cuda:
        greedy_rows(logits, out, host=host)
        return
    if host is not None:
        raise ValueError("greedy_into(host=...) needs the CUDA greedy kernel")
    values, ids = logits.max(dim=-1)
    r = logits.shape[0]
    out[0, :r].copy_(ids)
    out[1, :r].copy_(torch.gt(values, -math.inf))


STEPWISE_MAX = 64     # longest run of output tokens fed at once as one decode row per token


def _decoded_run(seq: Sequence, n: int) -> bool:
    """Several new tokens that all lie in ``seq``'s output (a grammar's forced run). They give the
    bits of decoding them one per step: on the CPU they attend one row at a time, on a GPU they
    replay through the decode graph as one row per token."""
    return 1 < n <= STEPWISE_MAX and seq.num_computed >= seq.prompt_len


def _logit_rows(num_new: list[int], want_logits: list[int] | None) -> list[int]:
    """Flat row indices of the last ``want_logits[i]`` new tokens of each sequence (default: 1)."""
    rows, end = [], 0
    for i, n in enumerate(num_new):
        end += n
        w = 1 if want_logits is None else int(want_logits[i])
        rows.extend(range(end - w, end))
    return rows


class ModelRunner:
    """Owns the model and its KV tensors; turns (sequence, new-token count) rows into logits."""

    def __init__(self, model: nn.Module, pool: BlockPool, kv_dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", max_model_len: int | None = None,
                 cuda_graphs: bool = True, prefill_graphs: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.device = torch.device(device)
        self._picks = None
        if self.device.type == "cpu":
            self.kv_bytes = allocate_kv_tensors(model.attention_layers, pool.num_blocks, pool.block_size, kv_dtype)
            return
        layers = model.attention_layers
        # One block past the pool: padded graph rows write and read there.
        self.kv_bytes = allocate_kv_tensors(layers, pool.num_blocks + 1, pool.block_size, kv_dtype, self.device)
        for layer in layers:   # defined contents, so a read past what was written is never NaN
            layer.k_cache.zero_()
            layer.v_cache.zero_()
        self.spare_block = pool.num_blocks
        self.max_model_len = max_model_len or pool.num_blocks * pool.block_size
        self.max_blocks = -(-self.max_model_len // pool.block_size)
        self.n_kv_heads = layers[0].n_kv_heads
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[int, DecodeGraph] = {}
        self._bucket_ms: dict[int, float] = {}        # replay time per graph bucket (``step_cost``)
        self.graph_replays = 0
        self.prefill_graphs = prefill_graphs
        self.prefill_buckets: dict[int, PrefillGraph] = {}
        self.prefill_replays = 0
        self._prefill_pool = None
        windows = [l.sliding_window for l in layers if getattr(l, "sliding_window", None)]
        # the largest bucket a graph may have: its padded positions stay within the context and,
        # for sliding-window models, the window (0: none fits)
        limit = min([self.max_model_len] + windows)
        self.max_prefill_graph = max([b for b in PREFILL_GRAPH_TOKENS if b <= limit], default=0)
        for m in model.modules():
            if hasattr(m, "ensure_positions"):
                m.ensure_positions(self.max_model_len + 1)

    def step_cost(self, rows: int) -> float:
        """Time of a decode step of ``rows`` rows relative to one row: on a GPU the replay time
        of the graph bucket that holds them (each bucket timed once, at first use, with padded
        rows), on the CPU a linear model. Speculation sizes its drafts by it."""
        if self.device.type == "cpu" or not self.cuda_graphs:
            return 1.0 + CPU_ROW_COST * (rows - 1)
        if rows > GRAPH_BATCH_SIZES[-1]:
            return self.step_cost(GRAPH_BATCH_SIZES[-1]) * rows / GRAPH_BATCH_SIZES[-1]
        size = next(b for b in GRAPH_BATCH_SIZES if b >= rows)
        for b in (1, size):
            if b not in self._bucket_ms:
                self._bucket_ms[b] = self._time_bucket(b)
        return self._bucket_ms[size] / self._bucket_ms[1]

    @torch.inference_mode()
    def _time_bucket(self, size: int, reps: int = 10) -> float:
        """Median ms of a replay of the ``size``-row decode graph on padded rows."""
        g = self._graph_for(size)
        times = []
        for i in range(reps + 2):
            st = self._stage(g, [], host_ids=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.graph.replay()
            end.record()
            st.copied.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens (may raise OutOfBlocksError)."""
        need = self.pool.blocks_needed(num_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new: list[int], want_logits: list[int] | None = None
            ) -> torch.Tensor | None:
        """Feed ``num_new[i]`` uncomputed tokens of each sequence; advance ``num_computed``.

        Returns fp32 logits (on the model's device) at the last ``want_logits[i]`` new tokens
        of each sequence (0: none; a speculative verify run wants all of its rows; default:
        the last one of each), in batch order, or None when none is wanted.
        """
        if self.device.type != "cpu":
            return self._run_device(seqs, num_new, want_logits)
        ids: list[int] = []
        for s, n in zip(seqs, num_new):
            self.ensure_blocks(s, s.num_computed + n)
            ids.extend(s.token_slice(s.num_computed, s.num_computed + n))
        batch = AttentionBatch.build([s.block_table for s in seqs],
                                     [s.num_computed + n for s, n in zip(seqs, num_new)],
                                     num_new, self.pool.block_size,
                                     stepwise=[_decoded_run(s, n) for s, n in zip(seqs, num_new)])
        hidden = self.model(torch.tensor(ids, dtype=torch.int64), batch.positions(), batch)
        return self._advance(seqs, num_new, batch, hidden, want_logits)

    # -- CUDA ------------------------------------------------------------------------
    def _run_device(self, seqs: list[Sequence], num_new: list[int], want_logits: list[int] | None
                    ) -> torch.Tensor | None:
        self._picks = None
        for s, n in zip(seqs, num_new):
            self.ensure_blocks(s, s.num_computed + n)
        # decode rows, and runs of decoded tokens (a grammar's forced run) as one row per token:
        # each row attends up to its own position, so the graph gives the bits of one step each
        rows = sum(num_new)
        if (self.cuda_graphs and rows <= GRAPH_BATCH_SIZES[-1]
                and all(n == 1 or _decoded_run(s, n) for s, n in zip(seqs, num_new))
                and max(len(s.block_table) for s in seqs) <= self.max_blocks):
            flat = [s for s, n in zip(seqs, num_new) for _ in range(n)]
            positions = None if rows == len(seqs) else [s.num_computed + j for s, n in zip(seqs, num_new)
                                                        for j in range(n)]
            logits = self._replay(flat, positions)
            for s, n in zip(seqs, num_new):
                s.num_computed += n
            keep = _logit_rows(num_new, want_logits)
            if not keep:
                return None
            self._picks = (self._last_replay, keep)
            return logits if keep == list(range(len(logits))) else logits[keep]
        if self._prefill_graphable(seqs, num_new, want_logits):
            return self._prefill_replay(seqs[0], num_new[0])
        return self._eager(seqs, num_new, want_logits)

    # -- prefill graphs ------------------------------------------------------------------
    def _prefill_graphable(self, seqs: list[Sequence], num_new: list[int], want_logits: list[bool] | None) -> bool:
        """One sequence prefilling from position 0, its logits wanted, in a bucket's reach."""
        return (self.prefill_graphs and self.cuda_graphs and len(seqs) == 1 and seqs[0].num_computed == 0
                and 1 < num_new[0] <= self.max_prefill_graph and (want_logits is None or want_logits[0] == 1))

    def _prefill_capture(self, size: int) -> PrefillGraph:
        dev, bs = self.device, self.pool.block_size
        spare = self.spare_block * bs + torch.arange(size, device=dev) % bs
        ids = torch.zeros(size, dtype=torch.int64, device=dev)
        positions = torch.arange(size, dtype=torch.int64, device=dev)
        slots = spare.clone()
        last = torch.zeros(1, dtype=torch.int64, device=dev)
        host = torch.zeros(4, size, dtype=torch.int64, pin_memory=True)
        copied = torch.cuda.Event()
        copied.record()
        dummy = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        meta = GpuAttentionMeta(slots, dummy, dummy[0], 1, 1)
        # one sequence of ``size`` new tokens, no cached prefix: plain causal attention over
        # the tokens' own slots (the device plan is the slot buffer itself)
        batch = AttentionBatch(slots, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([size]),
                               torch.tensor([0, size]), bs, [size], [size], gpu=meta)
        plan = batch._cache["device_plan"] = {"context_slots": slots.view(1, size)}
        for window in {None} | {getattr(l, "sliding_window", None) for l in self.model.attention_layers}:
            plan[("mask", window)] = None     # the causal path takes no mask (size <= every window)
        g = PrefillGraph(size, ids, positions, slots, last, host, copied, batch)

        def forward():
            hidden = self.model(g.ids, g.positions, g.batch)
            return self.model.compute_logits(hidden.index_select(0, g.last))

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):   # compile kernels and set up cuBLAS outside the capture
            for _ in range(2):
                forward()
        torch.cuda.current_stream(dev).wait_stream(stream)
        if self._prefill_pool is None:
            self._prefill_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with paused(), torch.cuda.graph(graph, pool=self._prefill_pool):
            g.logits = forward()
        g.graph = graph
        self.prefill_buckets[size] = g
        return g

    def _prefill_replay(self, seq: Sequence, n: int) -> torch.Tensor:
        """Prefill ``seq``'s first ``n`` tokens with the bucket's graph; logits at token n-1."""
        size = next(b for b in PREFILL_GRAPH_TOKENS if b >= n)
        g = self.prefill_buckets.get(size) or self._prefill_capture(size)
        bs = self.pool.block_size
        g.copied.synchronize()                  # the last replay's copies have read the buffer
        h = g.host.numpy()
        h[0, :n] = seq.token_slice(0, n)
        h[0, n:] = 0
        h[1, :] = range(size)                   # padding continues the positions (within the context)
        pos = h[1, :n]
        table = seq.block_table
        h[2, :n] = [table[p // bs] * bs + p % bs for p in pos.tolist()]
        h[2, n:] = self.spare_block * bs + torch.arange(size - n).numpy() % bs
        h[3, 0] = n - 1
        g.ids.copy_(g.host[0], non_blocking=True)
        g.positions.copy_(g.host[1], non_blocking=True)
        g.slots.copy_(g.host[2], non_blocking=True)
        g.last.copy_(g.host[3, :1], non_blocking=True)
        g.copied.record()
        g.graph.replay()
        self.prefill_replays += 1
        seq.num_computed += n
        return g.logits.clone()

    def _gpu_meta(self, batch: AttentionBatch) -> GpuAttentionMeta:
        dev = self.device
        return GpuAttentionMeta(batch.slot_mapping.to(dev, non_blocking=True),
                                batch.block_tables.to(torch.int32).to(dev, non_blocking=True),
                                batch.seq_lens.to(torch.int32).to(dev, non_blocking=True),
                                num_partitions(max(batch.seq_lens_list)),
                                grid_splits(batch.num_seqs, self.n_kv_heads, dev))

    def _eager(self, seqs: list[Sequence], num_new: list[int], want_logits: list[bool] | None
               ) -> torch.Tensor | None:
        ids: list[int] = []
        for s, n in zip(seqs, num_new):
            ids.extend(s.token_slice(s.num_computed, s.num_computed + n))
        batch = AttentionBatch.build([s.block_table for s in seqs],
                                     [s.num_computed + n for s, n in zip(seqs, num_new)],
                                     num_new, self.pool.block_size,
                                     stepwise=[_decoded_run(s, n) for s, n in zip(seqs, num_new)])
        batch.gpu = self._gpu_meta(batch)
        ids_t = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        positions = batch.positions().to(self.device, non_blocking=True)
        hidden = self.model(ids_t, positions, batch)
        return self._advance(seqs, num_new, batch, hidden, want_logits)

    def _advance(self, seqs: list[Sequence], num_new: list[int], batch: AttentionBatch, hidden: torch.Tensor,
                 want_logits: list[bool] | None) -> torch.Tensor | None:
        """Mark the fed tokens computed; logits at each wanted row's last new token."""
        for s, n in zip(seqs, num_new):
            s.num_computed += n
        rows = _logit_rows(num_new, want_logits)
        if not rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])

    def _forward_logits(self, g: DecodeGraph) -> torch.Tensor:
        hidden = self.model(g.ids, g.inputs.positions, g.batch)
        return self.model.compute_logits(hidden)

    def _capture(self, size: int) -> DecodeGraph:
        dev, bs = self.device, self.pool.block_size
        # Row 0 is the graph's token-id input and, at its end, each row's greedy token (so a
        # following step can be fed from the device); row 1 says whether that token is valid.
        res = torch.zeros(2, size, dtype=torch.int64, device=dev)
        # both stages in one pinned buffer that the graph's first kernel reads, and the greedy
        # tokens' two result slots that its greedy kernel writes
        host = torch.zeros(2, stage_bytes(size, self._input_bytes(size)), dtype=torch.uint8, pin_memory=True)
        stages = [self._staging(size, host[p]) for p in range(2)]
        outs_host = torch.zeros(2, 2, size, dtype=torch.int64, pin_memory=True)
        ctl = torch.zeros(2, dtype=torch.int32, device=dev)
        # positions, slots, lengths and block tables share one device buffer laid out as the
        # staging one (``_input_views``), which the graph's first kernel fills from the stage.
        # It starts as a copy of the staging buffer's padded-row values
        raw = stages[0].raw.to(dev)
        inputs = self._input_views(raw, size)
        meta = GpuAttentionMeta(inputs.slots, inputs.tables, inputs.lens, num_partitions(self.max_blocks * bs),
                                grid_splits(size, self.n_kv_heads, dev))
        batch = AttentionBatch(inputs.slots, inputs.tables, inputs.lens, torch.arange(size + 1), bs,
                               [1] * size, [1] * size, gpu=meta)
        g = DecodeGraph(size, res, res[0], stages, raw, inputs, batch, host, outs_host, ctl)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        # compile kernels, set up cuBLAS and reserve greedy_into's workspace outside the capture
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._graph_body(g)
        torch.cuda.current_stream(dev).wait_stream(stream)
        res.zero_()
        graph = torch.cuda.CUDAGraph()
        with paused(), torch.cuda.graph(graph):
            g.logits = self._graph_body(g)
        g.graph = graph
        torch.cuda.current_stream(dev).synchronize()
        g.ctl.zero_()               # the first replay takes stage 0, as the host's first fill
        g.outs_host.zero_()
        self.graphs[size] = g
        return g

    def _graph_body(self, g: DecodeGraph) -> torch.Tensor:
        """What a decode graph runs: its inputs taken from the host stage, the model, the head,
        the greedy tokens (also into the host's result slot)."""
        take_inputs(g.host, g.ctl, g.raw, g.ids, g.size, self.max_blocks, self._tables_offset(g.size))
        logits = self._forward_logits(g)
        greedy_into(logits, g.res, host=(g.outs_host, g.ctl))
        return logits

    @staticmethod
    def _tables_offset(size: int) -> int:
        """Byte offset of the block tables in a graph's input buffer (``_input_views``)."""
        return (20 * size + 15) // 16 * 16

    def _input_bytes(self, size: int) -> int:
        return self._tables_offset(size) + 4 * size * self.max_blocks

    def _input_views(self, raw: torch.Tensor, size: int) -> StepInputs:
        """A graph's step inputs as views of one byte buffer: positions and KV slots (int64),
        lengths (int32), then the block tables (int32 ``[size, max_blocks]``, 16-byte aligned)."""
        t0 = self._tables_offset(size)
        return StepInputs(positions=raw[:8 * size].view(torch.int64), slots=raw[8 * size:16 * size].view(torch.int64),
                          lens=raw[16 * size:20 * size].view(torch.int32),
                          tables=raw[t0:].view(torch.int32).view(size, self.max_blocks))

    def _staging(self, size: int, stage: torch.Tensor) -> StepStage:
        """One step's inputs (the token ids; the rest laid out as the graph's device buffer) as
        numpy-fillable views of ``stage``, a stage of a graph's pinned host buffer
        (``triton_step_inputs.stage_views``). ``copied``: an event after which the device has
        read them."""
        views = stage_views(stage, size, self._input_bytes(size))
        raw, ids, header = views["raw"], views["ids"], views["header"]
        inputs = self._input_views(raw, size)
        inputs.slots.fill_(self.spare_block * self.pool.block_size)
        inputs.lens.fill_(1)
        inputs.tables.fill_(self.spare_block)
        copied = torch.cuda.Event()
        copied.record()
        return StepStage(inputs, ids, raw, copied, header)

    def capture(self, sizes: tuple[int, ...] = GRAPH_BATCH_SIZES) -> None:
        """Capture decode graphs now (largest first) instead of at first use."""
        for size in sorted(sizes, reverse=True):
            if size not in self.graphs:
                self._capture(size)

    def _graph_for(self, n: int) -> DecodeGraph:
        size = next(b for b in GRAPH_BATCH_SIZES if b >= n)
        return self.graphs.get(size) or self._capture(size)

    def _stage(self, g: DecodeGraph, seqs: list[Sequence], host_ids: bool,
               row_positions: list[int] | None = None) -> StepStage:
        """Copy the rows' positions, KV slots, lengths and block tables (and their token ids
        if ``host_ids``; else the ids the previous replay left on the device) into ``g``'s
        stage, which the graph reads itself when it is replayed next. Returns the stage.
        Row r feeds the token at ``row_positions[r]`` of ``seqs[r]`` (default: its ``num_computed``;
        a sequence may fill several rows, one per token)."""
        n, bs = len(seqs), self.pool.block_size
        st = g.stages[g.stage]
        g.stage ^= 1
        st.copied.synchronize()              # the device has read this stage (two steps ago)
        ids, positions, slots = st.ids.numpy(), st.inputs.positions.numpy(), st.inputs.slots.numpy()
        lens, tables = st.inputs.lens.numpy(), st.inputs.tables.numpy()
        width = 1
        for r, s in enumerate(seqs):
            pos = s.num_computed if row_positions is None else row_positions[r]
            bt = s.block_table
            if host_ids:
                ids[r] = s.token_slice(pos, pos + 1)[0]
            positions[r] = pos
            slots[r] = bt[pos // bs] * bs + pos % bs
            lens[r] = pos + 1
            tables[r, :len(bt)] = bt
            width = max(width, len(bt))
        ids[n:] = 0
        positions[n:] = 0
        slots[n:] = self.spare_block * bs
        lens[n:] = 1
        tables[n:, 0] = self.spare_block
        st.header[0] = int(host_ids)        # read by the replay (its first kernel), no copy
        st.header[1] = width
        return st

    def greedy_picks(self) -> tuple[list[int], list[bool]] | None:
        """Greedy tokens of the rows the last ``run`` returned logits for, as its decode graph
        computed them (first maximal index of the raw logits; whether that maximum is above
        -inf), or None when that step did not replay a graph. Saves a reduction and a copy
        per step where plain argmax is all the rows need (speculative verify)."""
        if self._picks is None:
            return None
        pending, keep = self._picks
        tokens, ok = pending.tokens()
        return [tokens[r] for r in keep], [ok[r] for r in keep]

    def _replay(self, seqs: list[Sequence], positions: list[int] | None = None) -> torch.Tensor:
        g = self._graph_for(len(seqs))
        p = g.stage
        st = self._stage(g, seqs, host_ids=True, row_positions=positions)
        g.graph.replay()
        st.copied.record()
        self._last_replay = PendingDecode(seqs, g.outs_host[p], st.copied, g)
        self.graph_replays += 1
        return g.logits[:len(seqs)].clone()

    # -- overlapped decode -------------------------------------------------------------
    @property
    def can_overlap(self) -> bool:
        """``launch`` works here (CPU: run at once; CUDA: needs decode graphs)."""
        return self.device.type == "cpu" or self.cuda_graphs

    def launchable(self, seqs: list[Sequence]) -> bool:
        """These decode rows (blocks for their next token already reserved) can be launched."""
        if self.device.type == "cpu":
            return True
        return (self.cuda_graphs and 0 < len(seqs) <= GRAPH_BATCH_SIZES[-1]
                and max(len(s.block_table) for s in seqs) <= self.max_blocks)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], prev: PendingDecode | None = None) -> PendingDecode:
        """Queue one decode step for ``seqs`` (one new token each, blocks reserved) and return
        without waiting for it; ``num_computed`` advances now.

        ``prev`` None: each row's input is its last token on the host. Else ``prev`` is the
        step just launched for the same rows in the same order, and each row's input is the
        greedy token that step leaves on the device (the host may not know it yet)."""
        if prev is not None and prev.seqs is not seqs and prev.seqs != seqs:
            raise ValueError("a step fed from the device needs the previous step's rows, in order")
        if self.device.type == "cpu":
            return self._launch_cpu(seqs, prev)
        g = self._graph_for(len(seqs))
        if prev is not None and prev.graph is not g:
            raise ValueError("a step fed from the device must replay the previous step's graph")
        p = g.stage
        st = self._stage(g, seqs, host_ids=prev is None)
        g.graph.replay()
        self.graph_replays += 1
        out, done = g.outs_host[p], st.copied     # the greedy kernel wrote the tokens into result slot p
        done.record()
        for s in seqs:
            s.num_computed += 1
        return PendingDecode(seqs, out, done, g)

    @torch.inference_mode()
    def pick_masked(self, pending: PendingDecode, rows: list[int], masks: torch.Tensor) -> None:
        """Pick again, under grammar bitmasks, the greedy tokens of the listed rows of a launched
        decode step (CUDA): the masks are applied to the graph's logits in place and the greedy
        kernel rewrites the step's token-id input (which the next step reads) and its host
        result slot. Queued behind the step; ``pending.tokens()`` waits for it."""
        g = pending.graph
        if g is None:
            raise ValueError("pick_masked needs a step launched from a CUDA graph")
        logits = g.logits[:len(pending.seqs)]
        apply_masks(logits, rows, masks)
        greedy_into(logits, g.res, host=(g.outs_host, g.ctl))
        pending.done.record()

    def _launch_cpu(self, seqs: list[Sequence], prev: PendingDecode | None) -> PendingDecode:
        if prev is not None:
            ids = prev.result[0, :len(seqs)].clone()
        else:
            ids = torch.tensor([s.token_slice(s.num_computed, s.num_computed + 1)[0] for s in seqs],
                               dtype=torch.int64)
        batch = AttentionBatch.build([s.block_table for s in seqs], [s.num_computed + 1 for s in seqs],
                                     [1] * len(seqs), self.pool.block_size)
        hidden = self.model(ids, batch.positions(), batch)
        logits = self.model.compute_logits(hidden)
        out = torch.zeros(2, len(seqs), dtype=torch.int64)
        greedy_into(logits, out)
        for s in seqs:
            s.num_computed += 1
        return PendingDecode(seqs, out, None)
