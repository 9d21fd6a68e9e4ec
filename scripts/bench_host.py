"""Host overhead of a decode step: what the engine spends between two forward calls.

The decoder stack is replaced by a stub that returns zeros at once, and the LM head by one that
returns zero logits, so what remains is the host's share of a step: scheduling, block
bookkeeping, building the step's inputs, sampling (greedy over a small vocabulary: the sampler's
own cost is measured by bench_sampler.py), appending tokens and stop checks. On a GPU all of that
is added to every decode step unless it overlaps the device's work.

    python scripts/bench_host.py            # median µs per pure-decode step at 256 sequences,
                                            # with 16- and 256-token KV blocks

Two workloads per block size: prompts of lengths drawn from 100-600 tokens (as real prompts
vary, some sequence crosses a block boundary, and takes a block, almost every step), and prompts
all of 64 tokens (every sequence crosses a boundary on the same step, so the median step takes
no block at all).
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.context import get_context  # noqa: E402
from nanovllm.utils.tiny_model import build_model  # noqa: E402


def measure(path: str, block_size: int, prompt_lens: list[int], steps: int, **llm_options) -> float:
    """Median µs between consecutive forward calls of steps in which all len(prompt_lens)
    sequences decode."""
    num_seqs = len(prompt_lens)
    max_len = max(prompt_lens) + steps
    blocks = sum(-(-(n + steps) // block_size) for n in prompt_lens)
    llm = LLM(path, kvcache_block_size=block_size, max_num_seqs=num_seqs, max_model_len=max_len + 1,
              num_kvcache_blocks=blocks, max_num_batched_tokens=max(sum(prompt_lens), 1024), **llm_options)
    model = llm.model_runner.model
    hidden, vocab = llm.config.hf_config.hidden_size, llm.config.hf_config.vocab_size
    calls = []  # (time, number of input tokens) at each forward call

    def forward(input_ids, positions):
        calls.append((time.perf_counter(), input_ids.shape[0]))
        return torch.zeros(input_ids.shape[0], hidden)

    model.forward = forward
    model.compute_logits = lambda h: torch.zeros(len(get_context().logits_indices), vocab)  # sampling rows
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    # an interval counts when both of its forward calls were full pure-decode steps
    gaps = [(t1 - t0) * 1e6 for (t0, n0), (t1, n1) in zip(calls, calls[1:]) if n0 == n1 == num_seqs]
    return statistics.median(gaps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[100, 600], metavar=("MIN", "MAX"),
                   help="the varied workload's prompt lengths are drawn from [MIN, MAX]")
    p.add_argument("--equal-prompt-len", type=int, default=64, help="the equal-length workload's prompt length")
    p.add_argument("--steps", type=int, default=200, help="decode steps per sequence")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # host bookkeeping is single-threaded; keep the numbers comparable
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(tmp, tokenizer=False)
        rng = random.Random(0)
        workloads = {f"prompts of {args.prompt_lens[0]}-{args.prompt_lens[1]} tokens":
                     [rng.randint(*args.prompt_lens) for _ in range(args.num_seqs)],
                     f"prompts of {args.equal_prompt_len} tokens": [args.equal_prompt_len] * args.num_seqs}
        results = {}
        for bs in args.block_sizes:
            for name, lens in workloads.items():
                results[bs, name] = us = measure(path, bs, lens, args.steps)
                print(f"block size {bs:4d}, {name:24s}: {us:6.0f} µs per decode step at {args.num_seqs} "
                      f"sequences (median of {args.steps - 1} steps)")
    return results


if __name__ == "__main__":
    main()
