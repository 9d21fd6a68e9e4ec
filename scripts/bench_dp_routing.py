"""Data-parallel routing: the same shared-prefix workload (bench_serving.py's) against two servers of
--data-parallel-size replicas, one routing by prefix and one round robin; the prompt tokens each
served from its prefix caches, and the ratio. Round robin sends every group's requests to every
replica, so each replica's cache must hold every shared prefix; routing by prefix keeps a group on
one replica, so the replicas' caches hold the groups between them: with caches that hold about half
the prefixes (--num-kvcache-blocks), that is the difference between thrashing and hitting. (With
room for every prefix in each cache, round robin pays only one more miss per prefix and replica.)
The ratio depends on the draw of the workload (which prefix each request takes, in which order:
round robin's hits are luck), so each --seeds value draws one and the median ratio is reported.
Each prefix's first request misses on every replica it reaches, whatever the routing; the default
320 requests (20 a prefix) weigh those first misses half as much as 160 did, so that the ratio is
mostly the routing's steady state (160 requests at 16/s: a median of 1.79x; 320 at 32/s: 1.89x).

    python scripts/bench_dp_routing.py                      # a tiny random model on CPU
    python scripts/bench_dp_routing.py --model PATH --num-kvcache-blocks 0 --num-requests 400 \\
        --shared-prefix-groups 32 --shared-prefix-len 2048  # a real model on GPUs (0: the sized cache)
"""
import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "tests")]

import bench_serving  # noqa: E402
from serving import Server  # noqa: E402  (tests/serving.py: a server subprocess on a free port)


def serve_and_measure(args, routing: str, log_dir: str) -> dict:
    flags = ["--data-parallel-size", str(args.data_parallel_size), "--data-parallel-routing", routing,
             "--disable-log-requests"]
    if args.num_kvcache_blocks:
        flags += ["--num-kvcache-blocks", str(args.num_kvcache_blocks)]
    server = Server(args.model, os.path.join(log_dir, f"{routing}.log"), *flags, max_model_len=args.max_model_len)
    try:
        load = argparse.Namespace(**{**vars(args), "base_url": server.url, "api_key": None, "model": None})
        return asyncio.run(bench_serving.run(load))
    finally:
        server.stop(60)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (default: a tiny random model)")
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--num-kvcache-blocks", type=int, default=144,
                   help="each replica's KV blocks (default 144: half of the default workload's 16 prefixes of "
                        "16 blocks, and room for the running sequences)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-requests", type=int, default=320)
    p.add_argument("--request-rate", type=float, default=32.0)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--shared-prefix-groups", type=int, default=16)
    p.add_argument("--shared-prefix-len", type=int, default=256)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                   help="one workload drawn per seed (default 0..4), both routings run on each")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from nanovllm.utils.tiny_model import build_model
            args.model = build_model(os.path.join(tmp, "model"))
        runs = [measure_seed(args, seed, tmp) for seed in args.seeds]
    result = {"runs": runs, "median_prefix_over_round_robin": statistics.median(r["prefix_over_round_robin"]
                                                                                 for r in runs)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"median prefix / round_robin cached tokens over {len(runs)} seeds: "
              f"{result['median_prefix_over_round_robin']:.2f}x")
    return result


def measure_seed(args, seed: int, tmp: str) -> dict:
    load = argparse.Namespace(**{**vars(args), "seed": seed})
    reports = {routing: serve_and_measure(load, routing, tmp) for routing in ("round_robin", "prefix")}
    cached = {routing: r["cached_prompt_tokens"] for routing, r in reports.items()}
    result = {"seed": seed, "cached_prompt_tokens": cached, "prompt_tokens": reports["prefix"]["prompt_tokens"],
              "failed": {routing: r["failed"] for routing, r in reports.items()},
              "prefix_over_round_robin": cached["prefix"] / max(1, cached["round_robin"]),
              "ttft_p50_ms": {routing: r["ttft_p50_ms"] for routing, r in reports.items()},
              "output_throughput": {routing: r["output_throughput"] for routing, r in reports.items()}}
    if not args.json:
        for routing, r in reports.items():
            print(f"seed {seed} {routing:>11}: {r['cached_prompt_tokens']} of {r['prompt_tokens']} prompt tokens from "
                  f"the prefix caches ({r['prefix_cache_hit_rate']:.1%}); TTFT p50 {r['ttft_p50_ms']:.1f} ms; "
                  f"{r['output_throughput']:.1f} output tok/s; {r['failed']} failed")
        print(f"seed {seed} prefix / round_robin cached tokens: {result['prefix_over_round_robin']:.2f}x", flush=True)
    return result


if __name__ == "__main__":
    main()
