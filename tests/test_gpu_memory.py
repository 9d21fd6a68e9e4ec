"""engine/gpu_memory.py's sizing arithmetic, with torch.cuda's memory queries stood in for (the
real measurement runs in scripts/gpu_check.sh): the KV cache gets gpu_memory_utilization's share
less the weights and others' memory, the largest step's peak and the graphs' (with their margin)."""
from types import SimpleNamespace

import torch

from nanovllm.engine import gpu_memory

GiB = 1 << 30


class FakeRunner:
    """What num_gpu_kv_blocks reads of a ModelRunner; probing the graphs takes 1 GiB until unbound."""

    def __init__(self, use_graphs: bool):
        self.device, self.use_graphs = torch.device("cuda", 0), use_graphs
        self.config = SimpleNamespace(gpu_memory_utilization=0.5, max_blocks_per_seq=4)
        self.calls, self.free = [], 60 * GiB

    def kv_block_bytes(self):
        return GiB // 4

    def bind_kv_cache(self, num_blocks):
        self.calls.append(("bind", num_blocks))
        if num_blocks is None:  # (the probe's graphs and cache are gone)
            self.free += GiB

    def probe_graphs(self):
        self.free -= GiB
        return ["graphs"]


def test_the_kv_cache_gets_the_share_left_after_weights_peak_and_graphs(monkeypatch):
    for use_graphs, graph_gib in ((False, 0), (True, gpu_memory.GRAPH_MEMORY_MARGIN)):
        runner = FakeRunner(use_graphs)
        cuda = torch.cuda
        # 100 GiB device, 60 free: 40 in use, of which this process reserved 30 (others: 10); peak step 5
        monkeypatch.setattr(gpu_memory, "warmup", lambda runner: runner.calls.append("warmup"))
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device: None)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: 5 * GiB)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device: 30 * GiB)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device: (runner.free, 100 * GiB))
        blocks = gpu_memory.num_gpu_kv_blocks(runner)
        # 50 GiB share - 10 others' - 5 peak - the graphs', in quarter-GiB blocks, less the spare one
        assert blocks == int((50 - 10 - 5 - graph_gib) * GiB) // (GiB // 4) - 1
        assert runner.calls[0] == "warmup"
        assert runner.calls[1:] == ([("bind", 4), ("bind", None)] if use_graphs else [])
