"""How many KV blocks fit on a GPU (ModelRunner, when num_kvcache_blocks is not given): what the
largest step needs besides the KV cache is measured by running it (warmup), the decode
CUDA graphs' memory by capturing the largest graph of each ladder, and the KV cache takes the rest
of gpu_memory_utilization's share of the device. (On CPU there is no memory to measure: the runner
gives the cache a fixed budget.)"""
import numpy as np
import torch

from nanovllm.layers.sampler import SamplingBatch
from nanovllm.utils.context import Context, forward_context, to_device

# The decode graphs' memory is measured by capturing the largest one; the ladder's other graphs
# share its pool but each adds an executable and pool fragments the probe does not see: a margin.
GRAPH_MEMORY_MARGIN = 1.25


def num_gpu_kv_blocks(runner) -> int:
    """The KV blocks (of runner.kv_block_bytes() each) that fit beside the weights, the largest
    step's peak, the graphs and whatever other processes hold; one block is kept for the spare."""
    device, config = runner.device, runner.config
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warmup(runner)
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


@torch.inference_mode()
def warmup(runner):
    """One forward at the largest step the scheduler can build, then sampling at max_num_seqs rows:
    the peak a step needs besides the KV cache. Every rank runs it (the forward's collectives)."""
    config, device = runner.config, runner.device
    num_tokens = config.max_num_batched_tokens
    lens = [config.max_model_len] * (num_tokens // config.max_model_len)
    if num_tokens % config.max_model_len:
        lens.append(num_tokens % config.max_model_len)
    cu = np.cumsum([0] + lens, dtype=np.int32)
    rows = min(config.max_num_seqs, num_tokens)
    context = Context(cu_seqlens_q_cpu=cu.tolist(), seq_lens_k_cpu=lens, max_seqlen_q=max(lens),
                      max_seqlen_k=max(lens), cu_seqlens_q=to_device(cu, device), cu_seqlens_k=to_device(cu, device),
                      seq_lens_k=to_device(np.array(lens, dtype=np.int32), device),
                      logits_indices=torch.arange(num_tokens - rows, num_tokens, device=device))
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    with forward_context(context):
        logits = runner.warmup_logits(input_ids, positions)
    if logits is None:  # ranks above 0: the LM head gathered the logits to rank 0, which samples
        return
    ones = torch.ones(rows, device=device)
    zeros = torch.zeros(rows, dtype=torch.int64, device=device)
    batch = SamplingBatch(temperatures=ones, seeds=zeros, positions=zeros, top_ks=zeros - 1, top_ps=ones,
                          min_ps=ones * 0, num_logprobs=1)
    # twice, the first one's result held: a step's Redo keeps its probabilities until the next
    # step has sampled (SampledTokens.result), so two steps' worth can be alive at once
    kept = runner.sampler(logits, batch)
    runner.sampler(logits, batch)
    del logits, kept
