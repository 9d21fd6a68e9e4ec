"""What every step's inputs use: the input ids and KV slots gathered from the device's tables, and
the CUDA-graph ladder's sizes (eager decode steps pad to them too; the graphs: cuda_graphs.py)."""
import bisect

import torch

# Decode batches above this run eagerly: at that size the step is compute-bound and launch
# overhead, which graphs remove, is a small share of it.
MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured decode batch sizes: 1, 2, 4, 8, every 16, max_batch (a batch pads at most 15 rows)."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_batch} | set(range(16, max_batch, 16)) | {max_batch})


def padded_batch_size(batch: int, sizes: list[int]) -> int:
    """The captured size a decode batch pads to; the batch itself above the ladder (it runs eagerly).
    Eager decode steps record it too (Context.padded_batch), so they split work as their replay would."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else batch


def gather_inputs(token_table: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input id and KV-cache slot (kv_slots) of each new token, [T] each, from its row and position [T]."""
    return token_table[rows, positions], kv_slots(block_tables, rows, positions, block_size)


def kv_slots(block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slot of position p of a row: block_tables[row, p // block_size] * block_size + p % block_size."""
    block_index = positions // block_size  # (four ops, not six: each is a few µs on the host)
    return torch.add(positions, block_tables[rows, block_index] - block_index, alpha=block_size)
