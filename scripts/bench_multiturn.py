"""Multi-turn chat against the prefix cache, with the host tier off and on, in one run.

N conversations of M turns share a long system prompt; each turn's prompt is the conversation
so far (system prompt, earlier questions and answers) plus a new question. The conversations
take turns (1's first turn, 2's first turn, ..., 1's second turn, ...) and each request runs
alone, as a user waiting for it would, so by the time a conversation comes back its blocks have
been pushed out of a device cache that holds a fraction of all histories. Off, its history is
recomputed; on (kv_offloading_size), it comes back from host memory.

    python scripts/bench_multiturn.py                      # CPU, the tiny model shape
    python scripts/bench_multiturn.py --dummy qwen3-0.6b --device cuda --conversations 16 --turns 6 \\
        --system-len 2048 --device-cache-fraction 0.25

Reports per turn the mean TTFT, and over the run the prompt tokens computed (not served by
either tier), hits per tier and the copies' bytes and time.
"""
import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import PRESETS, write_dummy_config  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

GIB = 2 ** 30


def conversations(args, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each conversation's questions, as token ids."""
    rng = random.Random(args.seed)
    def tokens(n):
        return [rng.randrange(1, vocab_size) for _ in range(n)]
    return tokens(args.system_len), [[tokens(args.question_len) for _ in range(args.turns)]
                                     for _ in range(args.conversations)]


def total_history_tokens(args) -> int:
    """The tokens all conversations hold at their last turn (prompt and answer)."""
    per_turn = args.question_len + args.answer_len
    return args.conversations * (args.system_len + args.turns * per_turn)


def run(args, path: str, host_gib: float) -> dict:
    block_size = 16
    blocks = -(-total_history_tokens(args) // block_size)
    # the device cache holds this fraction of all histories (at least one longest request)
    longest = args.system_len + args.turns * (args.question_len + args.answer_len)
    device_blocks = max(int(blocks * args.device_cache_fraction), -(-longest // block_size) + 1)
    # (one request at a time: max_num_seqs=1, one CUDA graph)
    llm = LLM(path, device=args.device, load_format="dummy", kvcache_block_size=block_size,
              num_kvcache_blocks=device_blocks, max_model_len=longest + block_size, kv_offloading_size=host_gib,
              enable_prefix_caching=True, max_num_seqs=1)
    system, questions = conversations(args, llm.config.hf_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True)
    history = [list(system) for _ in questions]
    ttft = [[] for _ in range(args.turns)]
    computed = prompt_tokens = 0
    llm.generate([system[:block_size]], SamplingParams(max_tokens=1), use_tqdm=False)  # (warm-up, not counted)
    before = llm.stats()
    for turn in range(args.turns):
        for c, conv in enumerate(questions):
            prompt = history[c] + conv[turn]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            ttft[turn].append(out["metrics"]["ttft_s"])
            computed += len(prompt) - out["num_cached_tokens"]
            prompt_tokens += len(prompt)
            history[c] = prompt + out["token_ids"]
    stats = llm.stats()
    llm.shutdown()
    delta = {k: stats[k] - before[k] for k in ("prefix_cache_queries", "prefix_cache_hits", "host_cache_queries",
                                               "host_cache_hits", "kv_offloaded_bytes", "kv_reloaded_bytes",
                                               "kv_copy_time_s")}
    return {"host_gib": host_gib, "device_blocks": device_blocks, "host_blocks": stats["num_host_blocks"],
            "history_blocks": blocks, "prompt_tokens": prompt_tokens, "prefill_tokens_computed": computed,
            "ttft_ms_per_turn": [1e3 * statistics.mean(t) for t in ttft], **delta}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dummy", default="qwen3-tiny", choices=sorted(PRESETS), help="random weights of this shape")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512, help="tokens of the shared system prompt")
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=16)
    p.add_argument("--device-cache-fraction", type=float, default=0.25,
                   help="device KV blocks as a share of all conversations' histories")
    p.add_argument("--host-gib", type=float, default=None,
                   help="the host tier's size (default: room for every history, twice over)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    path = write_dummy_config(args.dummy)
    if args.host_gib is None:  # every history fits: what the target compares
        probe = LLM(path, device=args.device, load_format="dummy", num_kvcache_blocks=64, max_model_len=64,
                    max_num_seqs=1, enforce_eager=True)  # (only its block size is read)
        args.host_gib = 2 * total_history_tokens(args) / 16 * probe.model_runner.kv_block_bytes() / GIB + 1e-3
        probe.shutdown()
        del probe
    results = {"off": run(args, path, 0), "on": run(args, path, args.host_gib)}
    off, on = results["off"], results["on"]
    print(f"multi-turn: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_len}, "
          f"question {args.question_len}, answer {args.answer_len} tokens; device cache {on['device_blocks']} "
          f"blocks = {on['device_blocks'] / on['history_blocks']:.2f} of all histories ({on['history_blocks']})")
    for name, r in results.items():
        hit = r["prefix_cache_hits"] / max(r["prefix_cache_queries"], 1)
        host_hit = r["host_cache_hits"] / max(r["host_cache_queries"], 1)
        print(f"  host tier {name:3} ({r['host_blocks']:5d} blocks): prefill tokens computed {r['prefill_tokens_computed']:7d}"
              f" of {r['prompt_tokens']}; hit rate device {hit:.1%}, host {host_hit:.1%}; copies out "
              f"{r['kv_offloaded_bytes'] / 2**20:.1f} MiB, in {r['kv_reloaded_bytes'] / 2**20:.1f} MiB, "
              f"{r['kv_copy_time_s'] * 1e3:.1f} ms")
        print("      TTFT per turn (ms): " + ", ".join(f"{t:.1f}" for t in r["ttft_ms_per_turn"]))
    ratio = off["prefill_tokens_computed"] / max(on["prefill_tokens_computed"], 1)
    print(f"  prefill tokens computed, off / on: {ratio:.2f}x")
    results["computed_ratio"] = ratio
    if args.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["computed_ratio"] > 1 else 1)  # (fails if the host tier saved no prefill)
