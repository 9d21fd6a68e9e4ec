"""CUDA graphs of decode steps (ModelRunner loads this module where it captures them: CUDA, not enforce_eager)."""
from time import perf_counter

import torch

from nanovllm.engine.step_inputs import gather_inputs, graph_batch_sizes
from nanovllm.utils.context import Context, forward_context
from nanovllm.utils.logging import progress

class DecodeGraphs:
    """CUDA graphs of a decode step, one per batch size of the ladder, sharing one memory pool.

    A graph takes the step as the (row, position) of each sequence's last new token, in static
    buffers, and does all the rest on the device: it gathers the input ids from the token table
    and the block tables from theirs, computes the slots, and runs the model. A replay is then
    one copy of the inputs and the replay itself. Padding rows hold the scratch row: they read
    its tokens and write K/V into the spare block, which nobody reads.

    query_len 1 + k: a speculative decode step, where each sequence computes its last token and
    up to k drafts (num_new in all, given per row). Every sequence runs query_len query tokens,
    padded at the front: its real ones are its last num_new, so with attention's causal mask
    aligned to the bottom right (query j of n sees keys up to L - n + j, L = position + 1) each
    real token sees exactly its own prefix. The padding tokens sit at earlier positions (clamped
    at 0) and write their K/V into the spare block, never read: padding at the end would put them
    past the sequence, beyond its blocks and max_model_len. Attention runs the multi-query paged
    path; hidden states come back [size * query_len], row i * query_len + j for token j of row i.
    """

    def __init__(self, model, token_table: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 scratch_row: int, max_batch: int, max_model_len: int, hidden_size: int, dtype: torch.dtype,
                 sizes: list[int] | None = None, show_progress: bool = False, query_len: int = 1,
                 group_context=None):
        """sizes: the batch sizes to capture (default graph_batch_sizes(max_batch); [max_batch] alone
        measures what capture costs). show_progress: a bar over the sizes when capture takes a while.
        group_context(context, rows, positions): adds other layer groups' part to the step's Context
        (Context.layer_group; features/window_blocks.py's window tables), captured with the rest."""
        start = perf_counter()
        device = token_table.device
        self.model, self.token_table, self.block_tables = model, token_table, block_tables
        self.block_size, self.max_model_len, self.scratch_row = block_size, max_model_len, scratch_row
        self.query_len, self.group_context = query_len, group_context
        self.sizes = sorted(sizes) if sizes is not None else graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        # rows, positions of the last new tokens, numbers of new tokens (query_len > 1)
        self.inputs = torch.zeros(3, max_batch, dtype=torch.int64, device=device)
        self.inputs[0], self.inputs[1] = scratch_row, query_len - 1
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device) * query_len
        self.output = torch.zeros(max_batch * query_len, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        # Under inference mode, as every step runs (ModelRunner.launch): otherwise autograd would
        # record the captured forward and keep its activations alive in the graphs' pool.
        with torch.inference_mode():  # (largest first: smaller graphs reuse its pool)
            for size in progress(reversed(self.sizes), "Capturing CUDA graphs", enabled=show_progress,
                                 total=len(self.sizes), unit="graph"):
                graph = torch.cuda.CUDAGraph()
                self.forward(size)  # warm-up: compiles the kernels outside the capture
                with torch.cuda.graph(graph, pool):
                    self.forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        self.capture_s = perf_counter() - start  # for the start-up summary

    def forward(self, size: int):
        """The decode step of the first `size` rows of the static inputs (what a graph captures)."""
        rows, last = self.inputs[0, :size], self.inputs[1, :size]
        if self.query_len == 1:
            input_ids, slots = gather_inputs(self.token_table, self.block_tables, rows, last, self.block_size)
            context = Context(cu_seqlens_q=self.cu_seqlens_q[:size + 1], seq_lens_k=(last + 1).int(), max_seqlen_q=1,
                              max_seqlen_k=self.max_model_len, slot_mapping=slots, block_tables=self.block_tables[rows],
                              decode_only=True, padded_batch=size, max_model_len=self.max_model_len)
            positions = last
        else:
            q = self.query_len
            offsets = torch.arange(1 - q, 1, device=rows.device)                   # [Q]: 1 - Q, ..., 0
            positions = (last[:, None] + offsets).clamp_(min=0).view(-1)            # [size * Q]
            token_rows = rows[:, None].expand(size, q).reshape(-1)
            input_ids, slots = gather_inputs(self.token_table, self.block_tables, token_rows, positions,
                                             self.block_size)
            padding = (offsets[None, :] <= -self.inputs[2, :size, None]).view(-1)  # before its num_new
            spare = self.block_tables[self.scratch_row, 0].long() * self.block_size
            slots = torch.where(padding, spare + positions % self.block_size, slots)
            lens = (last + 1).int()
            context = Context(cu_seqlens_q=self.cu_seqlens_q[:size + 1],
                              cu_seqlens_k=torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)]),
                              seq_lens_k=lens, max_seqlen_q=q, max_seqlen_k=self.max_model_len, slot_mapping=slots,
                              block_tables=self.block_tables[rows], max_model_len=self.max_model_len,
                              cu_seqlens_q_cpu=list(range(0, (size + 1) * q, q)))  # (no one-token rows)
        if self.group_context is not None:
            self.group_context(context, rows if self.query_len == 1 else token_rows, positions)
        with forward_context(context):
            self.output[:size * self.query_len] = self.model(input_ids, positions)

    def replay(self, rows: torch.Tensor, positions: torch.Tensor, size: int,
               num_new: torch.Tensor | None = None) -> torch.Tensor:
        """Run the graph of `size` for these rows and last positions ([size] each, padded; and
        num_new when query_len > 1), on the device: the hidden states [size * query_len]."""
        self.inputs[0, :size].copy_(rows)
        self.inputs[1, :size].copy_(positions)
        if num_new is not None:
            self.inputs[2, :size].copy_(num_new)
        self.graphs[size].replay()
        return self.output[:size * self.query_len]
