"""Serving benchmark: N streaming completions fired at a running OpenAI-compatible server (start
one with `nanovllm serve MODEL`), arriving as a Poisson process at --request-rate per second (or
all at once), each with random prompt token ids and a fixed output length (ignore_eos).

Reports request throughput, output tokens/s, time to first token and time per output token (p50,
p90, p99), the number of failed requests, and the prompt tokens the server found in its prefix
cache (usage.prompt_tokens_details.cached_tokens) over all prompt tokens; --json prints the same
as one JSON line.

--shared-prefix-groups G: the shared-prefix workload. Each prompt is one of G random prefixes of
--shared-prefix-len tokens (drawn at random per request) followed by --input-len tokens of its
own, as requests of many users sharing a few system prompts or documents: the hit rate then says
how much of the shared prefixes the server's prefix cache served.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-requests 200 --request-rate 20
    python scripts/bench_serving.py --num-requests 200 --shared-prefix-groups 8 --shared-prefix-len 1024
"""
import argparse
import asyncio
import json
import os
import random
import time

import httpx
import numpy as np


async def one_request(client: httpx.AsyncClient, url: str, headers: dict, body: dict) -> dict:
    """Send one streaming request; its timings and token count, or its error."""
    start = time.perf_counter()
    first = None
    tokens, prompt = 0, (0, 0)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                if chunk.get("choices") and first is None:
                    first = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    tokens = usage["completion_tokens"]
                    prompt = (usage["prompt_tokens"], usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if first is None or not tokens:
        return {"error": "no tokens"}
    return {"ttft": first - start, "tpot": (end - first) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens, "end": end, "prompt_tokens": prompt[0], "cached_tokens": prompt[1]}


def make_prompts(args, rng: random.Random) -> list[list[int]]:
    """--num-requests prompts of random token ids: --input-len each, after a shared prefix with
    --shared-prefix-groups (one of that many, --shared-prefix-len each, drawn per request)."""
    prefixes = [[rng.randrange(1, 256) for _ in range(args.shared_prefix_len)]
                for _ in range(args.shared_prefix_groups)]
    return [(prefixes[rng.randrange(len(prefixes))] if prefixes else []) + [rng.randrange(1, 256)
                                                                            for _ in range(args.input_len)]
            for _ in range(args.num_requests)]


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models", headers=headers)
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        tasks = []
        start = time.perf_counter()
        for i, prompt in enumerate(make_prompts(args, rng)):
            body = {"model": model, "prompt": prompt,
                    "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(one_request(client, "/v1/completions", headers, body)))
            if args.request_rate != float("inf") and i + 1 < args.num_requests:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
    done = [r for r in results if "error" not in r]
    failed = [r for r in results if "error" in r]
    duration = (max(r["end"] for r in done) if done else time.perf_counter()) - start
    report = {"model": model, "num_requests": args.num_requests, "completed": len(done), "failed": len(failed),
              "duration_s": duration, "request_throughput": len(done) / duration,
              "output_tokens": sum(r["tokens"] for r in done),
              "output_throughput": sum(r["tokens"] for r in done) / duration,
              "prompt_tokens": sum(r["prompt_tokens"] for r in done),
              "cached_prompt_tokens": sum(r["cached_tokens"] for r in done)}
    report["prefix_cache_hit_rate"] = report["cached_prompt_tokens"] / max(report["prompt_tokens"], 1)
    for metric in ("ttft", "tpot"):
        values = [r[metric] * 1e3 for r in done if r[metric] is not None]
        for p in (50, 90, 99):
            report[f"{metric}_p{p}_ms"] = float(np.percentile(values, p)) if values else None
    if failed:
        report["first_error"] = failed[0]["error"]
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"))
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    p.add_argument("--shared-prefix-groups", type=int, default=0,
                   help="the shared-prefix workload: this many prefixes, one per prompt (0: none)")
    p.add_argument("--shared-prefix-len", type=int, default=512, help="tokens of each shared prefix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = p.parse_args(argv)
    if args.shared_prefix_groups < 0 or args.shared_prefix_len < 1:
        p.error("need --shared-prefix-groups >= 0 and --shared-prefix-len >= 1")
    report = asyncio.run(run(args))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['completed']} of {report['num_requests']} requests completed, {report['failed']} failed, "
              f"in {report['duration_s']:.2f} s")
        print(f"request throughput {report['request_throughput']:.2f} req/s, "
              f"output {report['output_throughput']:.1f} tok/s")
        print(f"prompt tokens from the prefix cache: {report['cached_prompt_tokens']} of {report['prompt_tokens']} "
              f"({report['prefix_cache_hit_rate']:.1%})")
        for metric, name in (("ttft", "time to first token"), ("tpot", "time per output token")):
            figures = ", ".join(f"p{p} {report[f'{metric}_p{p}_ms']:.1f} ms" for p in (50, 90, 99)
                                if report[f"{metric}_p{p}_ms"] is not None)
            print(f"{name}: {figures}")
        if report["failed"]:
            print(f"first error: {report['first_error']}")
    return report


if __name__ == "__main__":
    main()
