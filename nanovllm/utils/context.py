from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Context:
    """Attention metadata of one forward step, for a batch of B sequences and T new tokens in all.

    cu_seqlens_q  [B+1] int32  prefix sums of new tokens per sequence (rows of the flat batch)
    cu_seqlens_k  [B+1] int32  prefix sums of context lengths (cached + new tokens); None in decode-only steps
    seq_lens_k    [B]   int32  context length of each sequence
    slot_mapping  [T]   int64  cache slot of each new token: block_table[p // bs] * bs + p % bs
    block_tables  [B, W] int32 physical block ids, padded with -1; None when no sequence has cached
                               context, so attention can read the new K/V directly
    logits_indices [S]  int64  rows whose hidden state is turned into logits (sampling sequences),
                               or slice(0, S) when they are the first S rows (a view, no gather)
    decode_only   every sequence computes exactly one token (CUDA graphs and decode kernels apply)
    padded_batch  decode steps: B rounded up to the CUDA-graph ladder (cuda_graphs.padded_batch_size),
                  whether or not this step replays a graph; 0 = not given (B itself)
    max_model_len the bound on every context length; 0 = not given (the block-table width)
                  Split-KV decode sizes its split count from these two, never from B or W, so an eager
                  step and its graph replay (padded rows, W = max_blocks_per_seq) split alike.
    *_cpu         host copies, for backends that loop over sequences
    """
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seq_lens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    logits_indices: torch.Tensor | slice | None = None
    decode_only: bool = False
    padded_batch: int = 0
    max_model_len: int = 0
    cu_seqlens_q_cpu: list[int] | None = None
    seq_lens_k_cpu: list[int] | None = None
    layer_group: object = None  # other layer kinds' step data: gated_delta_net's StateStep, sliding_window's WindowStep


_CONTEXT: Context | None = None


def get_context() -> Context:
    assert _CONTEXT is not None, "model forward called outside forward_context()"
    return _CONTEXT


@contextmanager
def forward_context(context: Context):
    """Make `context` visible to the attention layers for one forward, then restore the one before."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, context
    try:
        yield context
    finally:
        _CONTEXT = previous


@contextmanager
def default_dtype_and_device(dtype: torch.dtype, device: str | torch.device):
    """Build modules directly in `dtype` on `device`, restoring the global defaults afterwards.
    `with torch.device(...)`, not set_default_device: that leaves a device mode installed which
    adds overhead to every later torch call, even when set back."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old_dtype)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device; on CUDA through pinned memory, so the copy is asynchronous
    (the caching host allocator keeps the pinned buffer until the copy is done)."""
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
