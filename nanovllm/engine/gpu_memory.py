"""How many KV blocks fit on a GPU (ModelRunner, when num_kvcache_blocks is not given): what the
largest step needs besides the KV cache is measured by running it (ModelRunner.warmup), the decode
CUDA graphs' memory by capturing the largest graph of each ladder, and the KV cache takes the rest
of gpu_memory_utilization's share of the device. (On CPU there is no memory to measure: the runner
gives the cache a fixed budget.)"""
import torch

# The decode graphs' memory is measured by capturing the largest one; the ladder's other graphs
# share its pool but each adds an executable and pool fragments the probe does not see: a margin.
GRAPH_MEMORY_MARGIN = 1.25


def num_gpu_kv_blocks(runner) -> int:
    """The KV blocks (of runner.kv_block_bytes() each) that fit beside the weights, the largest
    step's peak, the graphs and whatever other processes hold; one block is kept for the spare."""
    device, config = runner.device, runner.config
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner.warmup()
    peak = torch.cuda.max_memory_allocated(device)
    graph_bytes = graph_memory(runner) if runner.use_graphs else 0
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = total * config.gpu_memory_utilization - used_by_others - peak - graph_bytes
    return max(0, int(budget) // runner.kv_block_bytes() - 1)  # - 1: the spare block


def graph_memory(runner) -> int:
    """Device memory the decode CUDA graphs will hold, measured before the KV cache takes the
    rest: runner.probe_graphs() captures the largest batch of each ladder once over a throwaway
    cache of one sequence's blocks, and the drop in free memory (pools, static buffers, the
    graphs) is what capture takes; GRAPH_MEMORY_MARGIN covers the smaller graphs."""
    torch.cuda.empty_cache()
    runner.bind_kv_cache(runner.config.max_blocks_per_seq)
    free_before = torch.cuda.mem_get_info(runner.device)[0]
    graphs = runner.probe_graphs()
    used = free_before - torch.cuda.mem_get_info(runner.device)[0]
    del graphs
    runner.bind_kv_cache(None)
    torch.cuda.empty_cache()
    return int(used * GRAPH_MEMORY_MARGIN)
