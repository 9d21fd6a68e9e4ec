import bisect

import torch

from nanovllm.utils.context import Context, forward_context

# Decode batches above this run eagerly: at that size the step is compute-bound and launch
# overhead, which graphs remove, is a small share of it.
MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The ladder of captured decode batch sizes: 1, 2, 4, 8, then every 16, and max_batch itself,
    so that any batch pads to a captured size at most 15 rows larger."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_batch} | set(range(16, max_batch, 16)) | {max_batch})


def padded_batch_size(batch: int, sizes: list[int]) -> int:
    """The captured size a decode batch pads to; the batch itself above the ladder (it runs eagerly).
    Eager decode steps record it too (Context.padded_batch): kernels that size their work from it
    then do the same in an eager step as in its graph replay."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else batch


class DecodeGraphs:
    """CUDA graphs of the model's decode forward, one per batch size of the ladder, sharing one
    memory pool. Each step's inputs are copied into static buffers and the batch is padded to the
    next captured size; padding rows get slot -1 (the spare KV block), context length 0 and an
    all -1 block table, and stale block-table entries of earlier, longer steps are cleared."""

    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, max_model_len: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, sizes: list[int] | None = None):
        """sizes: the batch sizes to capture, graph_batch_sizes(max_batch) by default (a subset, e.g.
        [max_batch] alone, to measure what capture costs)."""
        self.model = model
        self.sizes = sorted(sizes) if sizes is not None else graph_batch_sizes(max_batch)
        self.max_model_len = max_model_len
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.output = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        # Under inference mode, as every step runs (ModelRunner.execute): otherwise autograd would
        # record the captured forward and keep its activations alive in the graphs' pool.
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                graph = torch.cuda.CUDAGraph()
                with forward_context(self._context(size)):
                    self.output[:size] = model(self.input_ids[:size], self.positions[:size])  # warm-up, JIT
                    with torch.cuda.graph(graph, pool):
                        self.output[:size] = model(self.input_ids[:size], self.positions[:size])
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def _context(self, size: int) -> Context:
        return Context(cu_seqlens_q=self.cu_seqlens_q[:size + 1], seq_lens_k=self.seq_lens[:size], max_seqlen_q=1,
                       max_seqlen_k=self.max_model_len, slot_mapping=self.slot_mapping[:size],
                       block_tables=self.block_tables[:size], decode_only=True, padded_batch=size,
                       max_model_len=self.max_model_len)

    def can_run(self, context: Context, batch: int) -> bool:
        """Decode-only steps over the cache (not a first step of one-token prompts, which has no
        block tables yet), up to the largest captured batch."""
        return context.decode_only and context.block_tables is not None and batch <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        batch = input_ids.shape[0]
        size = padded_batch_size(batch, self.sizes)
        self.input_ids[:batch] = input_ids
        self.positions[:batch] = positions
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:batch] = context.slot_mapping
        self.seq_lens.zero_()
        self.seq_lens[:batch] = context.seq_lens_k
        self.block_tables.fill_(-1)
        self.block_tables[:batch, :context.block_tables.shape[1]] = context.block_tables
        self.graphs[size].replay()
        return self.output[:batch]
