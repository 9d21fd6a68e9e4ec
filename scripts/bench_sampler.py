"""Micro-benchmark: the sampler's cost per decode step (default: batch 256, vocab 151,936, CPU).

    python scripts/bench_sampler.py [--batch 256] [--vocab 151936] [--device cpu] [--iters 5]

Times BatchState.sampling_inputs + ModelRunner.sampling_batch + Sampler for a decode step in
several configurations and prints each one's time and its cost over plain greedy argmax.

The logits are peaked like a language model's (LOGIT_SCALE). Two more lines show the cases where
top-p cannot be served from the most likely NUM_CANDIDATES tokens and sorts whole rows: flat logits
(the nucleus holds half the vocabulary) and logits rounded to bfloat16, as an LM head in bf16 gives,
whose ties often straddle the top-p cut.

Two last lines time the plain draws, without the engine around them: temperature alone
(softmax, then inverse-transform sampling) and a full-sort top-p (layers/top_k_top_p.full_way)
on the same peaked logits. Their ratio decides whether top_k_top_p.py's candidate draw and its
redraw protocol earn their lines (scripts/gpu_steps.py's top_p step: above 1.5x on a GPU).
"""
import argparse
import os
import sys
import time
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import SamplingParams  # noqa: E402
from nanovllm.engine.batch_state import BatchState  # noqa: E402
from nanovllm.engine.model_runner import ModelRunner  # noqa: E402
from nanovllm.engine.sequence import Sequence  # noqa: E402
from nanovllm.layers.inverse_transform import sample_from  # noqa: E402
from nanovllm.layers.sampler import Sampler  # noqa: E402
from nanovllm.layers.top_k_top_p import full_way  # noqa: E402

# Standard normal logits over a 150k vocabulary are nearly flat: at temperature 0.8 the 0.9 nucleus
# holds ~78k tokens. Scaled by 4 the top token has ~0.26 and the nucleus ~90 tokens (at most ~300),
# like a language model's next-token distribution.
LOGIT_SCALE = 4.0

CONFIGS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "temperature+top_p": dict(temperature=0.8, top_p=0.9),
    "temperature+top_k+top_p+min_p": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "temperature+penalties": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "all of the above": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                             frequency_penalty=0.5, repetition_penalty=1.1),
    "temperature+top_p, flat logits": dict(temperature=0.8, top_p=0.9),
    "temperature+top_p, bf16 logits": dict(temperature=0.8, top_p=0.9),
}
LOGITS = {"temperature+top_p, flat logits": "flat", "temperature+top_p, bf16 logits": "bf16"}  # others: "peaked"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    # only what sampling_batch reads: the device and the token table (penalties read it)
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = device
    length = args.prompt_len + args.output_len
    runner.token_table = torch.zeros(args.batch + 1, length + 1, dtype=torch.int32, device=device)
    sampler = Sampler()
    normal = torch.randn(args.batch, args.vocab, device=device)
    logits_of = {"flat": normal, "peaked": LOGIT_SCALE * normal, "bf16": (LOGIT_SCALE * normal).bfloat16().float()}
    gen = torch.Generator().manual_seed(0)
    results = {}
    for name, params in CONFIGS.items():
        seqs, state = [], BatchState(args.batch)
        for i in range(args.batch):
            ids = torch.randint(0, args.vocab, (length,), generator=gen)
            seq = Sequence(ids[:args.prompt_len].tolist(), SamplingParams(max_tokens=4096, **params), seed=i)
            seq.token_ids.extend(ids[args.prompt_len:].tolist())
            state.take_row(seq)
            runner.token_table[seq.row, :length] = ids.to(torch.int32)
            seqs.append(seq)
        rows = np.array([seq.row for seq in seqs])
        positions = np.full(args.batch, length)  # a decode step: each samples the token after its last
        logits = logits_of[LOGITS.get(name, "peaked")]
        times = []
        for _ in range(args.iters + 1):  # the first call warms up
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            inputs = state.sampling_inputs(rows, positions, seqs)
            tokens, _, redo = sampler(logits, runner.sampling_batch(inputs, args.vocab))
            if redo is not None:  # what reading the tokens does (SampledTokens.result)
                redo.redraw_into(tokens)
            tokens.tolist()
            times.append(time.perf_counter() - start)
        results[name] = min(times[1:])
    results.update(time_plain_draws(logits_of["peaked"], args.iters, device))
    base = results["greedy"]
    print(f"sampler, batch {args.batch}, vocab {args.vocab}, {args.device}: best of {args.iters}")
    for name, t in results.items():
        print(f"  {name:32s} {t * 1e3:8.2f} ms/step  (+{(t - base) * 1e3:7.2f} ms over greedy)")
    return results


def time_plain_draws(logits: torch.Tensor, iters: int, device: torch.device) -> dict[str, float]:
    """Best-of-iters seconds of a temperature-only draw and of a full-sort top-p draw (0.9) of logits [B, V]."""
    rows = logits.shape[0]
    uniform = torch.rand(rows, device=device, dtype=torch.float64)
    top_ks = torch.zeros(rows, dtype=torch.long, device=device)      # (0: top-k off)
    top_ps = torch.full((rows,), 0.9, device=device)
    draws = {"plain: temperature": lambda p: sample_from(p, uniform),
             "plain: sort-based top_p": lambda p: full_way(p, uniform, top_ks, top_ps, None)}
    results = {}
    for name, draw in draws.items():
        times = []
        for _ in range(iters + 1):  # the first call warms up
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            draw(torch.softmax(logits / 0.8, -1)).tolist()
            times.append(time.perf_counter() - start)
        results[name] = min(times[1:])
    return results


if __name__ == "__main__":
    main()
