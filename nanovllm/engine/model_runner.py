import logging
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.batch_state import Need, SamplingInputs
from nanovllm.engine.step_inputs import MAX_GRAPH_BATCH, gather_inputs, graph_batch_sizes, padded_batch_size
from nanovllm.engine.step_batch import StepBatch
from nanovllm.layers.attention import bind_backend, bind_kv_cache, kv_block_bytes
from nanovllm.layers.backends import get_backend
from nanovllm.layers.linear import quantization_scope
from nanovllm.layers.sampler import Sampler, SamplingBatch
from nanovllm.models import resolve_model_class
from nanovllm.utils.context import Context, default_dtype_and_device, forward_context, to_device
from nanovllm.utils.loader import load_model
from nanovllm.utils.parallel import tensor_parallel

if TYPE_CHECKING:
    from nanovllm.engine.cuda_graphs import DecodeGraphs
    from nanovllm.layers.top_k_top_p import Redo
    from nanovllm.utils.tp_group import TPGroup

logger = logging.getLogger(__name__)

# On CPU there is no memory to measure: without num_kvcache_blocks the KV cache gets this many
# bytes (capped, like the GPU's budget, at what max_num_seqs full-length sequences could use).
CPU_KV_CACHE_BYTES = 2 << 30
# A step's inputs travel in one int64 buffer, each part starting at a multiple of this many
# elements (16 bytes): Triton specializes kernels on whether a pointer is 16-byte aligned, so a
# part at an odd offset would compile another variant of every kernel that reads it.
ALIGN = 2


def flatten_writes(writes: list[tuple[int, int, list[int]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, offset, values) segments as three flat [N] arrays: each value's row and column."""
    rows, cols, values = [], [], []
    for row, offset, segment in writes:
        rows += [row] * len(segment)
        cols += range(offset, offset + len(segment))
        values += segment
    return np.array(rows), np.array(cols), np.array(values)


class SampledTokens:
    """A launched step's sampled tokens (and logprobs) on their way to the host: the copies are
    queued behind the step on the device, into pinned memory, and result() waits for them."""
    prompt_logprobs: list | None = None  # prompt_logprobs.prompt_logprobs' (the engine reads them after result())

    def __init__(self, tokens: torch.Tensor | None = None, logprobs: tuple | None = None,
                 num_logprobs: list[int | None] | None = None, redo: "Redo | None" = None):
        self.num_logprobs = num_logprobs  # per sampling row: its SamplingParams.logprobs
        self.redo = redo
        self.corrected: list[int] = []  # result(): the sampling rows redrawn there (see Redo)
        self.event = None
        self.wait_s = 0.0  # how long result() waited for the device
        redo_mask = redo.mask if redo is not None else None
        if tokens is not None and tokens.is_cuda:  # (a CUDA->CPU non_blocking copy lands in pinned memory)
            tokens = tokens.to("cpu", non_blocking=True)
            logprobs = tuple(t.to("cpu", non_blocking=True) if t is not None else None
                             for t in logprobs) if logprobs is not None else None
            redo_mask = redo_mask.to("cpu", non_blocking=True) if redo_mask is not None else None
            self.event = torch.cuda.Event()
            self.event.record()
        self.tokens, self.logprobs, self.redo_mask = tokens, logprobs, redo_mask

    def result(self) -> tuple[list[int], list[dict] | None]:
        """The sampled token per sampling row, and (when any asked) per-row logprob dicts
        {token_id: logprob} holding the chosen token and the top `logprobs` alternatives."""
        if self.tokens is None:
            return [], None
        if self.event is not None:
            start = perf_counter()
            self.event.synchronize()
            self.wait_s = perf_counter() - start
        tokens = self.tokens.tolist()
        chosen = self.logprobs[0].tolist() if self.logprobs is not None else None
        if self.redo_mask is not None and self.redo_mask.any():  # (rare: layers/top_k_top_p.py)
            self.corrected = self.redo.redraw_flagged(self.redo_mask, tokens, chosen)
        if self.logprobs is None:
            return tokens, None
        from nanovllm.features.logprobs import logprob_dicts  # (logprobs' layer: loaded when a row asks)
        return tokens, logprob_dicts(tokens, chosen, *self.logprobs[1:], self.num_logprobs)


@dataclass
class DeferredSampling:
    """A step whose forward is launched and whose sampling is not yet (ModelRunner.sample)."""
    batch: StepBatch
    logits: torch.Tensor | None
    inputs: "StepInputs"


@dataclass
class StepLayout:
    """A step's host arrays, as ModelRunner._layout() builds them."""
    parts: dict[str, np.ndarray]  # what goes to the device: rows, positions [T]; cu_q, lens_k, ...
    cu_q: np.ndarray              # [B+1] prefix sums of the new tokens
    lens_k: np.ndarray            # [B] context length of each sequence
    decode_only: bool             # every sequence computes one token
    all_sample: bool              # ... and samples it
    graph_size: int               # the CUDA graph it replays at (rows, positions padded to it); 0: eager
    graphs: "DecodeGraphs | None" = None  # the graphs it replays (decode, or speculative decode)


@dataclass
class StepInputs:
    """One step laid out on the device: the row and position of each new token, back to back."""
    rows: torch.Tensor        # [T] int64
    positions: torch.Tensor   # [T] int64
    context: Context
    input_ids: torch.Tensor | None  # [T] eager steps (a graph replay gathers its own)
    graph_size: int           # the captured batch size it replays at; 0: eager
    graphs: "DecodeGraphs | None" = None  # ... of these graphs; a replay takes rows, positions (of
    num_new: torch.Tensor | None = None   # each one's last new token, padded) and num_new (speculative)
    sampled_at: tuple | None = None       # (rows, positions) [S] each: where each sampled token goes
    prompt_logprobs: list | None = None   # prompt_logprobs.prompt_logprobs' (rank 0)


class ModelRunner:
    """Runs steps of the model over the paged KV cache, and samples. Every rank has one; rank 0's
    is handed the tensor-parallel `workers` (engine/workers.py) and sends them each step.

    Its device state, indexed by the rows of the running batch (engine/batch_state.py), one extra
    row of scratch for the padding rows of CUDA graphs:
      token_table  [rows + 1, max_model_len] int32  each running sequence's tokens: written when
                   it takes its row (StepBatch.new_tokens) and by the sampler, which writes each
                   token it draws at its position. Every step gathers its input ids from it, so a
                   decode step's inputs are the last step's samples without the host seeing them.
      block_tables [rows + 1, max_blocks_per_seq] int32  each one's block table, grown by
                   StepBatch.new_blocks; the scratch row points at the spare KV block.
    """
    graph_group_context = None  # other layer groups' part of a captured step's Context (window_blocks.py)

    def __init__(self, config: Config, group: "TPGroup | None" = None, workers=None):
        self.config = config
        self.block_size = config.block_size
        self.workers = workers  # rank 0 with tensor parallelism: the processes of ranks 1..
        self.group = group
        self.rank = group.rank if group is not None else 0
        self.recorder = None    # bench.py's StepRecorder, timing each step's device work (LLMEngine.attach_recorder)
        self.last_message_bytes = 0
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: Config):
        self._load(config)
        self.num_kv_blocks = self._allocate_kv_cache()
        self.host_copies = None  # the host tier's copies (features/host_tier.py), when kv_offloading_size asks
        if config.kv_offloading_size:
            from nanovllm.features.host_tier import HostCopies  # (the host tier's layer: loaded when asked for)
            self.host_copies = HostCopies(config, self.kv_cache, self.kv_block_bytes(), self._smallest_over_ranks)
        self.num_host_blocks = self.host_copies.num_blocks if self.host_copies is not None else 0
        self._capture(config)

    def _load(self, config: Config):
        """The device, the model with its weights and attention backend, the sampler, the tables."""
        index = (self.group.local_rank if self.group is not None else 0) if config.device == "cuda" else None
        self.device = torch.device(config.device, index)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = self._build_model(resolve_model_class(config.hf_config, config.max_model_len))
        start = perf_counter()
        if config.load_format == "dummy":
            from nanovllm.utils.dummy_weights import load_dummy  # (benchmarks': loaded when asked for)
            load_dummy(self.model)
        else:
            load_model(self.model, config.model, show_progress=self.rank == 0)
        if self.rank == 0:
            logger.info("Loading weights (load_format=%s) took %.2f s", config.load_format, perf_counter() - start)
        self.attention_layers = bind_backend(self.model, get_backend(config.attention_backend, config.device))
        self.sampler = Sampler()
        self.scratch_row = config.max_num_seqs
        rows = config.max_num_seqs + 1  # (the last: scratch_row)
        self.token_table = torch.zeros(rows, config.max_model_len, dtype=torch.int32, device=self.device)
        self.block_tables = torch.zeros(rows, config.max_blocks_per_seq, dtype=torch.int32, device=self.device)
        self.arange = np.arange(rows)  # (read-only: prepare() slices it)
        # The torch backend loops over sequences on the host: it cannot be captured.
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager and config.attention_backend != "torch"
        # The CUDA-graph ladder, eager steps included: they record the size they pad to (Context.padded_batch).
        self.graph_sizes = graph_batch_sizes(min(config.max_num_seqs, MAX_GRAPH_BATCH))

    def _build_model(self, model_class: type):
        """This rank's model, its weights not loaded: the shard of its tensor-parallel rank."""
        config = self.config
        tp = self.group.tp if self.group is not None else None
        with default_dtype_and_device(config.dtype, self.device), tensor_parallel(tp), \
                quantization_scope(config.quant_config):
            return model_class(config.hf_config, config.max_model_len)

    def _capture(self, config: Config):
        """The decode steps' CUDA graphs, once the KV cache is bound."""
        self.graphs = self._capture_graphs() if self.use_graphs else None

    def _capture_graphs(self, largest_only: bool = False, query_len: int = 1) -> "DecodeGraphs":
        from nanovllm.engine.cuda_graphs import DecodeGraphs  # (CUDA's: loaded where graphs are captured)
        max_batch = self.graph_sizes[-1]
        return DecodeGraphs(self.model, self.token_table, self.block_tables, self.block_size, self.scratch_row,
                            max_batch, self.config.max_model_len, self.config.hf_config.hidden_size,
                            self.config.dtype, sizes=[max_batch] if largest_only else None, query_len=query_len,
                            show_progress=self.rank == 0 and not largest_only, group_context=self.graph_group_context)

    # ---- KV cache ---------------------------------------------------------------------------
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block (of every layer, K and V)."""
        return kv_block_bytes(self.attention_layers, self.block_size, self.config.kv_dtype)

    def _num_kv_blocks(self) -> int:
        config = self.config
        if config.num_kvcache_blocks is not None:
            return config.num_kvcache_blocks
        # never more than max_num_seqs sequences of max_model_len tokens could hold at once
        most_useful = config.max_num_seqs * config.max_blocks_per_seq
        if self.device.type == "cpu":
            return min(CPU_KV_CACHE_BYTES // self.kv_block_bytes(), most_useful)
        from nanovllm.engine.gpu_memory import num_gpu_kv_blocks  # (CUDA's: loaded where memory is measured)
        return min(num_gpu_kv_blocks(self), most_useful)

    def warmup_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """(gpu_memory.warmup) The model's forward and logits on this rank's share: the peak of a step."""
        return self.model.compute_logits(self.model(input_ids, positions))

    def probe_graphs(self) -> list["DecodeGraphs"]:
        """The largest graph of each ladder the runner will capture (gpu_memory.py measures them)."""
        return [self._capture_graphs(largest_only=True)]

    def _allocate_kv_cache(self) -> int:
        config = self.config
        num_blocks = self._smallest_over_ranks(self._num_kv_blocks())  # every rank holds the same blocks
        if num_blocks < config.max_blocks_per_seq:
            raise ValueError(f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, fewer than the "
                             f"{config.max_blocks_per_seq} one sequence of max_model_len={config.max_model_len} needs; "
                             f"raise num_kvcache_blocks or gpu_memory_utilization, or lower max_model_len")
        self.bind_kv_cache(num_blocks)
        return num_blocks

    def _smallest_over_ranks(self, count: int) -> int:
        """The smallest of every rank's count (tensor parallelism); count itself on one rank."""
        if self.group is None:
            return count
        return int(self.group.all_reduce(torch.tensor([count], device=self.device), dist.ReduceOp.MIN).item())

    def bind_kv_cache(self, num_blocks: int | None):
        """Allocate a KV cache of num_blocks usable blocks, bound to the layers (None: unbind, free it)."""
        self.kv_cache = None  # (the old one is freed before the new one is allocated)
        self.kv_cache = bind_kv_cache(self.attention_layers, num_blocks, self.block_size, self.config.kv_dtype,
                                      self.device)
        if num_blocks is not None:
            self.block_tables[self.scratch_row] = num_blocks

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: StepBatch, sampling: SamplingInputs, defer_sampling: bool = False
               ) -> "SampledTokens | DeferredSampling":
        """Start one step (rank 0) and return without waiting for the device: the sampled tokens
        come back through the returned handle (and are in the token table for the next step).
        defer_sampling: only the forward now, sample() later (a grammar mask needs the step before's)."""
        if self.group is not None and self.workers is None:
            raise RuntimeError("this LLM has been shut down (its tensor-parallel workers are gone)")
        if self.workers is not None:
            self.last_message_bytes = self.workers.call("execute", batch)
        if self.recorder is not None:
            self.recorder.device_step_started()
        try:
            self._copy_host_blocks(batch)
            forward = self._forward(batch, sampling)
        except BaseException:  # e.g. Ctrl-C mid-step: with workers, the ranks are out of step for good
            self.close()
            raise
        return forward if defer_sampling else self.sample(forward, sampling)

    def _copy_host_blocks(self, batch: StepBatch):
        """The host tier's copies of the step (features/host_tier.py), on every rank before its forward."""
        if self.host_copies is not None:
            self.host_copies.copy(batch.offloads, batch.reloads)

    def _forward(self, batch: StepBatch, sampling: SamplingInputs) -> "DeferredSampling":
        """The step's forward through the model (rank 0), its sampling not queued yet."""
        logits, inputs = self.run(batch, self.model, self.graphs)
        return DeferredSampling(batch, logits, inputs)

    def sample(self, step: "DeferredSampling", sampling: SamplingInputs) -> SampledTokens:
        """Queue a launched step's sampling (rank 0); its prompt logprobs ride along with its tokens.
        The caller runs it in inference mode (launch(); Grammars.sample_deferred): a few µs per entry."""
        out = self._draw(step, sampling) if step.logits is not None else SampledTokens()
        out.prompt_logprobs = step.inputs.prompt_logprobs if step.inputs is not None else None
        if self.recorder is not None:
            self.recorder.device_step_ended(step.batch)
        return out

    def _draw(self, step: "DeferredSampling", sampling: SamplingInputs) -> SampledTokens:
        """The sampler's tokens for the step's logits, written into the token table."""
        tokens, logprobs, redo = self.sampler.forward(step.logits, self.sampling_batch(sampling, step.logits.shape[-1]))
        self._keep_sampled(tokens, step.inputs)
        return SampledTokens(tokens, logprobs, sampling.num_logprobs, redo)

    @torch.inference_mode()
    def execute(self, batch: StepBatch):
        """Ranks above 0: their share of a step (rank 0 runs it through launch())."""
        self._copy_host_blocks(batch)
        _, inputs = self.run(batch, self.model, self.graphs)
        if batch.samples.any():  # rank 0's _keep_sampled(): the tokens it drew, into this rank's table too
            self._keep_sampled(torch.empty(int(batch.samples.sum()), dtype=torch.int64, device=self.device), inputs)

    def run(self, batch: StepBatch, model, graphs: "DecodeGraphs | None"
            ) -> tuple[torch.Tensor | None, StepInputs | None]:
        """The forward of a step through model (the target, or the draft model with its graphs), and
        its logits on rank 0 when a sequence samples (else None). A step of no sequences: (None, None)."""
        inputs = self.prepare(batch, graphs)
        if inputs is None:
            return None, None
        with forward_context(inputs.context):
            if inputs.graph_size:  # (the logits' rows index the replay's padded rows)
                hidden = inputs.graphs.replay(inputs.rows, inputs.positions, inputs.graph_size, inputs.num_new)
            else:
                hidden = model(inputs.input_ids, inputs.positions)
            logits = model.compute_logits(hidden) if batch.samples.any() else None
        if batch.prompt_logprobs and model is self.model:  # (an observer of the forward)
            from nanovllm.features.prompt_logprobs import prompt_logprobs  # (prompt logprobs' layer: loaded when used)
            inputs.prompt_logprobs = prompt_logprobs(self.model, self.token_table, hidden, batch, inputs.context,
                                                     self.rank)
        return logits, inputs

    def _keep_sampled(self, tokens: torch.Tensor, inputs: StepInputs):
        """Write the step's sampled tokens ([S], on the device) into the token table after each row's chunk,
        where the next step reads its input ids (tensor parallel: rank 0 broadcasts them first, device-side)."""
        if self.group is not None:
            self.group.broadcast(tokens)
        rows, positions = inputs.sampled_at
        self.token_table[rows, positions] = tokens.to(torch.int32)

    def prepare(self, batch: StepBatch, graphs: "DecodeGraphs | None") -> StepInputs | None:
        """Lay a step out as flat tensors, the new tokens of all sequences back to back, with their
        attention metadata, writing its block-table entries and new rows' tokens on the way, all in
        one copy. graphs: those it may replay. A batch of no sequences only writes the tables (None)."""
        layout = self._layout(batch, graphs) if batch.num_seqs else None
        d = self.upload({**(layout.parts if layout else {}), **self._table_writes(batch)})
        if "block_ids" in d:
            self.block_tables[d["block_rows"], d["block_cols"]] = d["block_ids"].int()
        if "token_ids" in d:
            self.token_table[d["token_rows"], d["token_cols"]] = d["token_ids"].int()
        if layout is None:
            return None
        context = self._context(batch, layout, d)
        input_ids = None
        if not layout.graph_size:  # (a graph gathers its own)
            input_ids, context.slot_mapping = gather_inputs(self.token_table, self.block_tables, d["rows"],
                                                            d["positions"], self.block_size)
        sampled_at = ((d["rows"][:batch.num_seqs], d["lens_k"]) if layout.all_sample
                      else (d["sample_rows"], d["sample_ends"]))
        return StepInputs(d["rows"], d["positions"], context, input_ids, layout.graph_size, layout.graphs,
                          d.get("num_new"), sampled_at)

    def _layout(self, batch: StepBatch, graphs: "DecodeGraphs | None") -> "StepLayout":
        """The host's part of prepare(): each new token's row and position, and attention's arrays."""
        num_seqs = batch.num_seqs
        starts, num_new = batch.starts.astype(np.int64), batch.num_new.astype(np.int64)  # [B]
        cu_q = np.zeros(num_seqs + 1, dtype=np.int64)                                # [B+1]
        num_new.cumsum(out=cu_q[1:])
        num_tokens = int(cu_q[-1])
        decode_only = num_tokens == num_seqs  # (every sequence has at least one new token)
        if decode_only:
            rows, positions = batch.rows, starts                                     # [T] = [B]
        else:
            seq_of_token = np.repeat(self.arange[:num_seqs], num_new)                # [T]
            rows = batch.rows[seq_of_token]
            positions = starts[seq_of_token] + (np.arange(num_tokens) - cu_q[:-1][seq_of_token])
        graph_size, replayed = 0, None
        if decode_only and graphs is not None and num_seqs <= graphs.max_batch:
            graph_size, replayed = padded_batch_size(num_seqs, graphs.sizes), graphs  # padding: the scratch row
            rows = np.concatenate([rows, np.full(graph_size - num_seqs, self.scratch_row)])
            positions = np.concatenate([positions, np.zeros(graph_size - num_seqs, dtype=np.int64)])
        lens_k = starts + num_new                                                    # [B]
        parts = {"rows": rows, "positions": positions, "cu_q": cu_q, "lens_k": lens_k}
        all_sample = decode_only and batch.samples.all()  # (then the logits rows are 0..B-1)
        if not all_sample:  # (else every sequence samples: rows[:B] and lens_k say where each token goes)
            parts["logits_indices"] = (cu_q[1:] - 1)[batch.samples]
            parts["sample_rows"], parts["sample_ends"] = batch.rows[batch.samples], lens_k[batch.samples]
        if not decode_only:
            parts["step_rows"] = batch.rows
            parts["cu_k"] = np.concatenate([[0], np.cumsum(lens_k)])
        return StepLayout(parts, cu_q, lens_k, decode_only, all_sample, graph_size, replayed)

    def _table_writes(self, batch: StepBatch) -> dict[str, np.ndarray]:
        """The step's writes into the block tables and the token table, as flat (row, column, value)."""
        parts = {}
        if batch.new_blocks:
            parts["block_rows"], parts["block_cols"], parts["block_ids"] = flatten_writes(batch.new_blocks)
        token_writes = self._token_writes(batch)
        if token_writes:
            parts["token_rows"], parts["token_cols"], parts["token_ids"] = flatten_writes(token_writes)
        return parts

    @staticmethod
    def _token_writes(batch: StepBatch) -> list[tuple[int, int, list[int]]]:
        """The step's (row, position, tokens) token-table writes: new rows' tokens, redrawn ones (Redo)."""
        return ([(row, 0, tokens) for row, tokens in batch.new_tokens]
                + [(row, position, [token]) for row, position, token in batch.fixed_tokens])

    def _context(self, batch: StepBatch, layout: "StepLayout", d: dict[str, torch.Tensor]) -> Context:
        """The attention metadata of the step (slot_mapping is the caller's)."""
        lens_k, decode_only = layout.lens_k, layout.decode_only
        max_len_k = int(lens_k.max())
        # some sequence attends to cached K/V: pass block tables (else attention reads the new K/V)
        has_context = max_len_k > 1 if decode_only else bool(batch.starts.any())
        width = -(-max_len_k // self.block_size) if has_context else 0
        step_rows = d["rows"] if decode_only else d["step_rows"]
        return Context(
            cu_seqlens_q=d["cu_q"].int(), cu_seqlens_k=d["cu_k"].int() if "cu_k" in d else None,
            seq_lens_k=d["lens_k"].int(), max_seqlen_q=1 if decode_only else int(batch.num_new.max()),
            max_seqlen_k=max_len_k, max_model_len=self.config.max_model_len,
            block_tables=self.block_tables[step_rows, :width] if has_context and not layout.graph_size else None,
            # sampling rows' last tokens: when each samples one, the first B rows (a view; a gather: ~40 µs at B=256)
            logits_indices=slice(0, batch.num_seqs) if layout.all_sample else d["logits_indices"],
            decode_only=decode_only, cu_seqlens_q_cpu=layout.cu_q.tolist(), seq_lens_k_cpu=lens_k.tolist(),
            padded_batch=padded_batch_size(batch.num_seqs, self.graph_sizes) if decode_only else 0)

    def upload(self, parts: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Named int64 host arrays on the device, in one copy of one buffer (each part aligned)."""
        sizes = [-(-len(part) // ALIGN) * ALIGN for part in parts.values()]
        flat, start = np.empty(sum(sizes), dtype=np.int64), 0
        for part, size in zip(parts.values(), sizes):
            flat[start:start + len(part)] = part
            start += size
        chunks = to_device(flat, self.device).split(sizes)  # (one op for all the views: a slice each costs ~1 µs)
        # (sizes, not len(chunk): a tensor's len() is a Python-level call, ~0.5 µs each)
        return {name: chunk if size == len(part) else chunk[:len(part)]
                for (name, part), chunk, size in zip(parts.items(), chunks, sizes)}

    def sampling_batch(self, inputs: SamplingInputs, vocab_size: int) -> SamplingBatch:
        """The step's sampling parameters as device tensors, [S] each, only those some row uses: one
        copy of the int64 ones, one of the float32 ones (and the logits processors', when a row has one)."""
        needs = inputs.needs
        ints, floats = {}, {}
        if needs & Need.RANDOM:  # the noise: a function of (seed, position)
            ints["positions"], ints["seeds"] = inputs.positions, inputs.seeds
            floats["temperatures"] = inputs.temperatures
        if needs & Need.FILTERS:
            ints["top_ks"], floats["top_ps"] = inputs.top_ks, inputs.top_ps
        if needs & Need.MIN_P:
            floats["min_ps"] = inputs.min_ps
        ints, floats = self._stacked(ints, np.int64), self._stacked(floats, np.float32)
        batch = SamplingBatch(temperatures=floats.get("temperatures"), seeds=ints.get("seeds"),
                              positions=ints.get("positions"), top_ks=ints.get("top_ks"), top_ps=floats.get("top_ps"),
                              min_ps=floats.get("min_ps"), all_greedy=not needs & Need.RANDOM)
        if needs & Need.LOGPROBS:
            batch.num_logprobs = max(k for k in inputs.num_logprobs if k is not None)
        if inputs.processors is not None:
            from nanovllm.features.logits_processors import processor_tensors  # (their layer: loaded when used)
            batch.processors = processor_tensors(inputs.processors, inputs.rows, inputs.positions, self.token_table,
                                                 vocab_size)
        return batch

    def _stacked(self, arrays: dict[str, np.ndarray], dtype) -> dict[str, torch.Tensor]:
        """Equal-length host arrays on the device, in one copy."""
        if not arrays:
            return {}
        stacked = to_device(np.stack([a.astype(dtype, copy=False) for a in arrays.values()]), self.device)
        return dict(zip(arrays, stacked))

    def close(self):
        """End the worker processes (rank 0); the runner is unusable afterwards."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
