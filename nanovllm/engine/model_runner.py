from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs, graph_batch_sizes, padded_batch_size
from nanovllm.engine.scheduler import ScheduledStep
from nanovllm.engine.sequence import (FILTERS, FLAGS, FREQUENCY, HAS_MIN_TOKENS, LOGPROBS, MIN_P, MIN_TOKENS,
                                      PENALIZED, PRESENCE, PROMPT, RANDOM, REPETITION, SEED, TEMPERATURE, TOP_K,
                                      TOP_P, USES_MIN_P, WANTS_LOGPROBS)
from nanovllm.engine.step_batch import BlockTables, StepBatch
from nanovllm.layers.attention import Attention
from nanovllm.layers.backends import get_backend
from nanovllm.layers.sampler import Sampler, SamplingBatch, TokenHistory
from nanovllm.models import resolve_model_class
from nanovllm.utils.context import Context, default_dtype_and_device, forward_context
from nanovllm.utils.loader import load_dummy, load_model
from nanovllm.utils.parallel import TPGroup, tensor_parallel

# On CPU there is no memory to measure: without num_kvcache_blocks the KV cache gets this many
# bytes (capped, like the GPU's budget, at what max_num_seqs full-length sequences could use).
CPU_KV_CACHE_BYTES = 2 << 30
# The decode graphs' memory is measured by capturing the largest one; the ladder's other graphs
# share its pool but each adds an executable and pool fragments the probe does not see: a margin.
GRAPH_MEMORY_MARGIN = 1.25
# prepare() packs a step's inputs into one buffer, each part starting at a multiple of this many
# elements: 16 bytes in int32, as Triton wants its pointers aligned.
ALIGN = 4


def to_device(values, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """A host list or tensor on the device; through pinned memory when `pin`, so the copy is async."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if pin:
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class SampledTokens:
    """A launched step's sampled tokens (and logprobs) on their way to the host: the copies are
    queued behind the step on the device, into pinned memory, and result() waits for them."""

    def __init__(self, tokens: torch.Tensor | None = None, logprobs: tuple | None = None,
                 num_logprobs: list[int | None] | None = None):
        self.num_logprobs = num_logprobs  # per sampling sequence: its SamplingParams.logprobs
        self.event = None
        self.array: np.ndarray | None = None  # result()'s tokens as an array
        if tokens is not None and tokens.is_cuda:  # (a CUDA->CPU non_blocking copy lands in pinned memory)
            tokens = tokens.to("cpu", non_blocking=True)
            logprobs = tuple(t.to("cpu", non_blocking=True) if t is not None else None
                             for t in logprobs) if logprobs is not None else None
            self.event = torch.cuda.Event()
            self.event.record()
        self.tokens, self.logprobs = tokens, logprobs

    def result(self) -> tuple[list[int], list[dict] | None]:
        """The sampled token per sequence, and (when any asked) per-sequence logprob dicts
        {token_id: logprob} holding the chosen token and the top `logprobs` alternatives."""
        if self.tokens is None:
            return [], None
        if self.event is not None:
            self.event.synchronize()
        self.array = self.tokens.numpy()
        tokens = self.array.tolist()
        if self.logprobs is None:
            return tokens, None
        chosen, top_values, top_ids = (t.tolist() if t is not None else None for t in self.logprobs)
        dicts = []
        for i, k in enumerate(self.num_logprobs):
            if k is None:
                dicts.append(None)
                continue
            d = dict(zip(top_ids[i][:k], top_values[i][:k])) if k else {}
            d[tokens[i]] = chosen[i]
            dicts.append(d)
        return tokens, dicts


class ModelRunner:
    """Turns a scheduled batch into flat tensors, runs the model over the paged KV cache, samples.

    With tensor parallelism, rank 0's runner (group None: it builds the group and spawns the other
    ranks) sends each step's `StepBatch` to the workers' runners, and all ranks execute it together.
    """

    def __init__(self, config: Config, group: TPGroup | None = None):
        self.config = config
        self.block_size = config.block_size
        self.workers = None
        if group is None and config.tensor_parallel_size > 1:
            from nanovllm.engine.workers import Workers
            self.workers = Workers(config)
            group = self.workers.group
        self.group = group
        self.rank = group.rank if group is not None else 0
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: Config):
        if config.device == "cuda":
            self.device = torch.device("cuda", self.rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.pin = self.device.type == "cuda"  # pinned host buffers make host->device copies async
        self.tables = BlockTables(config.max_num_seqs, config.max_blocks_per_seq, config.block_size)
        # CUDA only, set to a list to time steps on the device (bench.py): per step (decode only?,
        # start event, end event), the start recorded before the step's first launch.
        self.step_events: list | None = None
        self.last_message_bytes = 0
        model_class = resolve_model_class(config.hf_config, config.max_model_len)
        with default_dtype_and_device(config.dtype, self.device), tensor_parallel(self.group):
            self.model = model_class(config.hf_config, config.max_model_len)
        if config.load_format == "dummy":
            load_dummy(self.model)
        else:
            load_model(self.model, config.model)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = get_backend(config.attention_backend, config.device)
        for layer in self.attention_layers:
            layer.backend = backend
        self.sampler = Sampler()
        self.last_sampled: torch.Tensor | None = None  # [S] the last step's sampled tokens, on the device
        self.arange = np.arange(config.max_num_seqs + 1)  # (read-only: prepare() slices it)
        # (a function of its own, not the bound self._to_device: that would make a reference cycle
        # runner -> history -> runner, keeping the model alive after `del llm` until gc runs)
        self.token_history = TokenHistory(config.max_num_seqs, config.max_model_len,
                                          partial(to_device, device=self.device, pin=self.pin))
        # The torch backend loops over sequences on the host: it cannot be captured.
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager and config.attention_backend != "torch"
        # The CUDA-graph ladder, eager steps included: a decode step records the size it pads to
        # (Context.padded_batch), from which attention sizes its split-KV the same in both paths.
        self.graph_sizes = graph_batch_sizes(min(config.max_num_seqs, MAX_GRAPH_BATCH))
        self.num_kv_blocks = self._allocate_kv_cache()
        self.graphs = self._capture_graphs() if self.use_graphs else None

    def _capture_graphs(self, largest_only: bool = False) -> DecodeGraphs:
        config = self.config
        max_batch = self.graph_sizes[-1]
        return DecodeGraphs(self.model, max_batch, config.max_blocks_per_seq, config.max_model_len,
                            config.hf_config.hidden_size, config.dtype, self.device,
                            sizes=[max_batch] if largest_only else None)

    # ---- KV cache ---------------------------------------------------------------------------
    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim * self.config.dtype.itemsize
        return self.block_size * per_token

    def _num_kv_blocks(self) -> int:
        config = self.config
        if config.num_kvcache_blocks is not None:
            return config.num_kvcache_blocks
        # never more than max_num_seqs sequences of max_model_len tokens could hold at once
        most_useful = config.max_num_seqs * config.max_blocks_per_seq
        if self.device.type == "cpu":
            return min(CPU_KV_CACHE_BYTES // self.kv_block_bytes(), most_useful)
        # CUDA: what the largest step needs besides the KV cache is measured by running it.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup()
        peak = torch.cuda.max_memory_allocated(self.device)
        graph_bytes = self._graph_memory() if self.use_graphs else 0
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * config.gpu_memory_utilization - used_by_others - peak - graph_bytes
        return min(max(0, int(budget) // self.kv_block_bytes() - 1), most_useful)  # - 1: the spare block

    def _graph_memory(self) -> int:
        """Device memory the decode CUDA graphs will hold, measured before the KV cache takes the
        rest: the largest batch of the ladder is captured once over a throwaway cache of one
        sequence's blocks, and the drop in free memory (its pool, static buffers and the graph
        itself) is what capture takes. The ladder's smaller graphs share that pool; their own
        executables are what GRAPH_MEMORY_MARGIN allows for."""
        torch.cuda.empty_cache()
        self._bind_kv_cache(self.config.max_blocks_per_seq)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graphs = self._capture_graphs(largest_only=True)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        del graphs
        self._bind_kv_cache(None)
        torch.cuda.empty_cache()
        return int(used * GRAPH_MEMORY_MARGIN)

    def _allocate_kv_cache(self) -> int:
        config = self.config
        num_blocks = self._num_kv_blocks()
        if self.group is not None:  # every rank must hold the same blocks: take the smallest count
            count = self.group.all_reduce(torch.tensor([num_blocks], device=self.device), dist.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks < config.max_blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, fewer than the "
                f"{config.max_blocks_per_seq} that one sequence of max_model_len={config.max_model_len} "
                f"tokens needs; raise num_kvcache_blocks or gpu_memory_utilization, or lower max_model_len")
        self._bind_kv_cache(num_blocks)
        return num_blocks

    def _bind_kv_cache(self, num_blocks: int | None):
        """Allocate a KV cache of num_blocks usable blocks and hand each attention layer its slices
        (None: unbind and free it)."""
        self.kv_cache = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None
        if num_blocks is None:
            return
        layer = self.attention_layers[0]
        # [K/V, layer, block, slot in block, kv head, head dim]. One spare block at the end, never
        # handed out: slot -1 (CUDA-graph padding rows) writes into its last slot, harmlessly.
        cache = torch.zeros(2, len(self.attention_layers), num_blocks + 1, self.block_size, layer.num_kv_heads,
                            layer.head_dim, dtype=self.config.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
        self.kv_cache = cache

    @torch.inference_mode()
    def _warmup(self):
        """One forward at the largest step the scheduler can build, plus sampling at max_num_seqs rows."""
        config = self.config
        num_tokens = config.max_num_batched_tokens
        lens = [config.max_model_len] * (num_tokens // config.max_model_len)
        if num_tokens % config.max_model_len:
            lens.append(num_tokens % config.max_model_len)
        cu = torch.tensor([0] + lens).cumsum(0).tolist()
        rows = min(config.max_num_seqs, num_tokens)
        context = Context(cu_seqlens_q_cpu=cu, seq_lens_k_cpu=lens, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                          cu_seqlens_q=self._to_device(cu, torch.int32), cu_seqlens_k=self._to_device(cu, torch.int32),
                          seq_lens_k=self._to_device(lens, torch.int32),
                          logits_indices=self._to_device(list(range(num_tokens - rows, num_tokens)), torch.int64))
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        with forward_context(context):
            logits = self.model.compute_logits(self.model(input_ids, positions))
        if logits is None:  # ranks above 0: the LM head gathered the logits to rank 0, which samples
            return
        ones = torch.ones(rows, device=self.device)
        zeros = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.sampler(logits, SamplingBatch(temperatures=ones, seeds=zeros, positions=zeros, top_ks=zeros - 1,
                                           top_ps=ones, min_ps=ones * 0, num_logprobs=1))
        del logits

    # ---- one step ---------------------------------------------------------------------------
    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device, self.pin)

    def prepare(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, Context]:
        """Flatten a step: the new tokens of all sequences, back to back, and their attention metadata.

        Vectorized over the persistent block tables (numpy on the host), and everything the
        device needs goes over in one host-to-device copy of one buffer (int64 parts, then int32)."""
        num_seqs, bs = len(batch.seq_ids), self.block_size
        starts = batch.starts.astype(np.int64)                                       # [B]
        rows = self.tables.rows_of(batch.seq_ids)                                    # [B]
        decode_only = len(batch.token_ids) == num_seqs  # (every sequence has at least one new token)
        if decode_only:
            cu_q = self.arange[:num_seqs + 1]                                        # [B+1]
            num_new, positions, seq_rows, samples = 1, starts, rows, None            # [T] = [B]
        else:
            cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
            num_new = batch.num_new.astype(np.int64)                                 # [B]
            np.cumsum(num_new, out=cu_q[1:])
            seq_of_token = np.repeat(np.arange(num_seqs), num_new)                   # [T]
            positions = starts[seq_of_token] + np.arange(len(seq_of_token)) - cu_q[:-1][seq_of_token]
            seq_rows, samples = rows[seq_of_token], batch.samples
        lens_k = starts + num_new                                                    # [B]
        block, offset = np.divmod(positions, bs)
        slot_mapping = self.tables.tables[seq_rows, block] * bs + offset             # [T]
        max_len_k = int(lens_k.max())
        # some sequence attends to cached K/V: pass block tables
        has_context = max_len_k > 1 if decode_only else bool(starts.any())
        width = -(-max_len_k // bs) if has_context else 0
        logits_indices = self.arange[:num_seqs] if samples is None else (cu_q[1:] - 1)[samples]  # [S]
        cu_k = None  # [B+1], for the prefill kernels only
        if not decode_only:
            cu_k = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(lens_k, out=cu_k[1:])
        # int64 parts, then the int32 ones
        num_from_last = len(batch.from_last_step) // 2
        # A decode step whose every input token is the last step's sampled one, in the same order
        # (overlap scheduling's steady state): the input ids are that tensor itself.
        feeds_back = (decode_only and num_from_last == num_seqs
                      and (batch.from_last_step is self.tables.feedback(num_seqs)  # (rank 0's steady state)
                           or (batch.from_last_step[num_seqs:] == self.arange[:num_seqs]).all()))
        parts = [positions, slot_mapping, logits_indices]
        if not feeds_back:
            parts.insert(0, batch.token_ids)
            if num_from_last:  # [2 * P]: indices in input_ids, then rows of last_sampled
                parts.append(batch.from_last_step)
        num_int64 = len(parts)
        parts += [cu_q, lens_k, self.tables.tables[rows, :width].ravel()]             # ..., [B * W]
        if cu_k is not None:
            parts.append(cu_k)
        # Each part starts at a multiple of ALIGN elements: Triton specializes kernels on whether
        # a pointer is 16-byte aligned, so a view at an odd offset would compile another variant.
        offsets, end = [], 0
        for p in parts:
            offsets.append(end)
            end += -(-len(p) // ALIGN) * ALIGN
        flat = np.zeros(end, dtype=np.int64)
        flat32 = flat.view(np.int32)  # the int32 parts are written as int32 into the same buffer
        for i, (p, o) in enumerate(zip(parts, offsets)):
            if i < num_int64:
                flat[o:o + len(p)] = p
            else:
                flat32[2 * o:2 * o + len(p)] = p
        flat = self._to_device(torch.from_numpy(flat), torch.int64)
        flat32 = flat.view(torch.int32)
        views = [flat[o:o + len(p)] if i < num_int64 else flat32[2 * o:2 * o + len(p)]
                 for i, (p, o) in enumerate(zip(parts, offsets))]
        cu_q_d, lens_d, tables_d, *cu_k_d = views[num_int64:]
        if feeds_back:
            pos, slots, logits_d = views[:num_int64]
            input_ids = self.last_sampled[:num_seqs]
        else:
            input_ids, pos, slots, logits_d, *last = views[:num_int64]
            if last:  # tokens the last step sampled, still on the device: overlap scheduling
                dst, src = last[0].view(2, -1)
                input_ids[dst] = self.last_sampled[src]
        context = Context(
            cu_seqlens_q=cu_q_d, cu_seqlens_k=cu_k_d[0] if cu_k_d else None, seq_lens_k=lens_d,
            max_seqlen_q=1 if decode_only else int(num_new.max()), max_seqlen_k=max_len_k,
            slot_mapping=slots, block_tables=tables_d.view(num_seqs, width) if has_context else None,
            logits_indices=logits_d, decode_only=decode_only, cu_seqlens_q_cpu=cu_q.tolist(),
            seq_lens_k_cpu=lens_k.tolist(),
            padded_batch=padded_batch_size(num_seqs, self.graph_sizes) if decode_only else 0,
            max_model_len=self.config.max_model_len)
        return input_ids, pos, context

    def sampling_batch(self, step: ScheduledStep, vocab_size: int) -> SamplingBatch:
        """Gather the sampling parameters of the step's sampling rows, written once per sequence
        in the scheduler's SeqState, into device tensors: one copy of the int rows and one of the
        float rows, each holding only what some row of the batch uses."""
        ints = step.ints if step.all_sample else step.ints[:, step.samples]  # [NUM_INTS, S]
        needs = int(np.bitwise_or.reduce(ints[FLAGS]))  # what any row of the batch needs
        all_greedy = not needs & RANDOM
        filters, min_p, penalties = needs & FILTERS, needs & USES_MIN_P, needs & PENALIZED
        if needs & (RANDOM | FILTERS | USES_MIN_P | PENALIZED):
            floats = step.state.floats[:, step.index if step.all_sample else step.cols[step.samples]]  # [6, S]
        int_rows, float_rows = [], []
        if not all_greedy:  # greedy rows use none of these: the sampler takes the argmax
            int_rows += [ints[SEED], step.ends[step.samples]]  # (the position of the token sampled)
            float_rows.append(floats[TEMPERATURE])
        if filters:
            int_rows.append(ints[TOP_K])
            float_rows.append(floats[TOP_P])
        if min_p:
            float_rows.append(floats[MIN_P])
        if penalties:
            float_rows += [floats[PRESENCE], floats[FREQUENCY], floats[REPETITION]]
        ints_d = iter(self._to_device(torch.from_numpy(np.stack(int_rows)), torch.int64)) if int_rows else None
        floats_d = iter(self._to_device(torch.from_numpy(np.stack(float_rows)), torch.float32)) if float_rows else None
        batch = SamplingBatch(temperatures=None if all_greedy else next(floats_d),
                              seeds=None if all_greedy else next(ints_d),
                              positions=None if all_greedy else next(ints_d), all_greedy=all_greedy)
        if filters:
            batch.top_ks, batch.top_ps = next(ints_d), next(floats_d)
        if min_p:
            batch.min_ps = next(floats_d)
        if penalties or needs & HAS_MIN_TOKENS:
            sampling = [step.seqs[i] for i in np.flatnonzero(step.samples).tolist()]
        if penalties:
            batch.penalties = (*self.token_history.inputs(sampling, vocab_size), next(floats_d), next(floats_d),
                               next(floats_d))
        if needs & HAS_MIN_TOKENS:  # min_tokens: no stop token can be drawn yet
            early = np.flatnonzero(step.ends[step.samples] - ints[PROMPT] < ints[MIN_TOKENS]).tolist()
            banned = [(i, t) for i in early for t in sampling[i].stop_ids]
            if banned:
                batch.banned = tuple(self._to_device(torch.tensor(list(zip(*banned)), dtype=torch.int64),
                                                     torch.int64))
        if needs & WANTS_LOGPROBS:
            batch.num_logprobs = int(ints[LOGPROBS].max())
        return batch

    @torch.inference_mode()
    def launch(self, step: ScheduledStep) -> "SampledTokens":
        """Start one step (rank 0) and return without waiting for the device: the sampled tokens
        come back through the returned handle, and stay on the device as the next step's input
        ids for these sequences (`last_sampled`)."""
        if self.group is not None and self.workers is None:
            raise RuntimeError("this LLM has been shut down (its tensor-parallel workers are gone)")
        batch = self.tables.encode(step)
        if self.workers is not None:
            self.last_message_bytes = self.workers.call("execute", batch)
        if self.step_events is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        try:
            logits = self.execute(batch)
        except BaseException:  # e.g. Ctrl-C mid-step: with workers, the ranks are out of step for good
            self.close()
            raise
        out = SampledTokens()
        if logits is not None:
            sampling_batch = self.sampling_batch(step, logits.shape[-1])
            tokens, logprobs = self.sampler.forward(logits, sampling_batch)  # (no module hooks to run)
            if sampling_batch.penalties is not None:
                self.token_history.record(tokens)
            self._share_sampled(tokens)
            num_logprobs = None
            if logprobs is not None:  # per sampling row: its SamplingParams.logprobs
                num_logprobs = [k if k >= 0 else None for k in step.state.ints[LOGPROBS, step.cols[step.samples]].tolist()]
            out = SampledTokens(tokens, logprobs, num_logprobs)
        if self.step_events is not None:  # the end of the step's device work, not of the readback
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.step_events.append((bool((batch.num_new == 1).all()), start, end))
        return out

    def _share_sampled(self, tokens: torch.Tensor):
        """Keep a step's sampled tokens on the device as the next step's input ids. With overlap
        scheduling and tensor parallelism every rank needs them: rank 0 broadcasts them, a
        device-side collective with no host round trip (the other ranks receive in execute())."""
        self.last_sampled = tokens
        if self.group is not None and self.config.async_scheduling:
            self.group.broadcast(tokens)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor | None:
        """Every rank's share of a step: the forward, and logits on rank 0 when a sequence samples."""
        if self.rank > 0:
            self.tables.apply(batch)
        input_ids, positions, context = self.prepare(batch)
        with forward_context(context):
            if self.graphs is not None and self.graphs.can_run(context, len(batch.seq_ids)):
                hidden = self.graphs.run(input_ids, positions, context)
            else:
                hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden) if batch.samples.any() else None
        if self.rank > 0 and logits is None and batch.samples.any() and self.config.async_scheduling:
            # rank 0's _share_sampled(): this step's tokens, the next step's input ids
            self.last_sampled = self.group.broadcast(
                torch.empty(int(batch.samples.sum()), dtype=torch.int64, device=self.device))
        return logits

    def close(self):
        """End the worker processes (rank 0); the runner is unusable afterwards."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
