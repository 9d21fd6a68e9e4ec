"""Micro-benchmark: what structured outputs cost a decode step (CPU, a tiny random model).

    python scripts/bench_structured.py [--num-seqs 64] [--tokens 48] [--repeats 3]

Runs a batch of --num-seqs requests decoding --tokens tokens each, every one constrained by the
same JSON schema (a string of exactly --tokens characters: the grammar stays open to the end),
then the same batch unconstrained, in the synchronous loop and with overlap scheduling, and prints
the median time per decode step of the full batch and per output token, with the ratio
constrained / unconstrained. (With overlap a constrained sequence skips the step planned while its
token is in flight: its tokens per second are what that costs.)
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.utils.tiny_model import build_model  # noqa: E402


def run(llm, num_seqs: int, tokens: int, constrained: bool) -> tuple[float, float]:
    """(median seconds of a step that decodes all num_seqs, seconds per output token)."""
    schema = {"type": "string", "minLength": tokens, "maxLength": tokens}
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=schema) if constrained else None)
    for i in range(num_seqs):
        llm.add_request([1 + i % 300, 2, 3, 4], params)
    steps, start, produced = [], time.perf_counter(), 0
    while not llm.is_finished():
        t = time.perf_counter()
        done = llm.step()
        produced += len(done)
        if len(done) == num_seqs:
            steps.append(time.perf_counter() - t)
    return statistics.median(steps), (time.perf_counter() - start) / produced


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    path = build_model(tempfile.mkdtemp(prefix="nanovllm-structured-"))
    for overlap in (False, True):
        with LLM(path, max_model_len=256, async_scheduling=overlap, max_num_seqs=args.num_seqs) as llm:
            run(llm, args.num_seqs, 8, True)  # warm-up: the grammar compiled, the kernels run once
            results = {kind: [run(llm, args.num_seqs, args.tokens, kind == "constrained")
                              for _ in range(args.repeats)] for kind in ("unconstrained", "constrained")}
        step = {k: statistics.median(r[0] for r in v) for k, v in results.items()}
        token = {k: statistics.median(r[1] for r in v) for k, v in results.items()}
        loop = "overlap" if overlap else "synchronous"
        print(f"{loop:11s}: step of {args.num_seqs} sequences {step['unconstrained'] * 1e3:.2f} ms unconstrained, "
              f"{step['constrained'] * 1e3:.2f} ms constrained ({step['constrained'] / step['unconstrained']:.3f}x); "
              f"per output token {token['unconstrained'] * 1e6:.1f} / {token['constrained'] * 1e6:.1f} us "
              f"({token['constrained'] / token['unconstrained']:.3f}x)")


if __name__ == "__main__":
    main()
