"""CUDA-graph bookkeeping that needs no GPU: the batch-size ladder and when a step may replay."""
import pytest
import torch

from nanovllm.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from nanovllm.utils.context import Context


@pytest.mark.parametrize("max_batch", [1, 3, 8, 16, 37, 100, 512])
def test_ladder_covers_every_batch_size(max_batch):
    sizes = graph_batch_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
    for batch in range(1, max_batch + 1):  # each batch pads to a captured size at most 15 rows larger
        assert 0 <= next(s for s in sizes if s >= batch) - batch <= 15


def test_replay_only_for_decode_over_the_cache():
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # can_run reads only the ladder
    graphs.sizes = graph_batch_sizes(32)
    tables = torch.zeros(4, 2, dtype=torch.int32)
    assert graphs.can_run(Context(decode_only=True, block_tables=tables), 4)
    assert not graphs.can_run(Context(decode_only=False, block_tables=tables), 4)   # a prefill chunk
    assert not graphs.can_run(Context(decode_only=True, block_tables=None), 4)      # one-token prompts
    assert not graphs.can_run(Context(decode_only=True, block_tables=tables), 33)   # above the ladder
