"""Prefill/decode disaggregation against one colocated engine, on one mixed load: short prompts that
decode for long (the running decodes), and long prompts arriving while they run. Both see the same
arrivals; the script checks that every request's tokens are the same (exit status 1 if any differ)
and prints TTFT and TPOT (p50, p90) for each kind of request, for both.

Colocated, a long prompt's prefill shares the steps of the running decodes (chunked prefill): their
TPOT rises while it runs. Disaggregated, the prefill engine computes it, and the decode engine only
pulls its K/V (over torch.distributed, beside its steps) and computes its last tokens.

    python scripts/disagg_demo.py                         # a tiny random model on CPU
    python scripts/disagg_demo.py --model PATH --device cuda --long-len 8192 --num-decodes 64
"""
import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.distributed.disaggregation import DisaggregatedLLM  # noqa: E402


def workload(args) -> list[tuple[float, list[int], SamplingParams, str]]:
    """(arrival s, prompt, params, kind): the decodes at 0, then a long prompt every --long-every s."""
    rng = np.random.default_rng(args.seed)
    decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=args.long_tokens, ignore_eos=True)
    load = [(0.0, rng.integers(1, 400, args.short_len).tolist(), decode, "decode") for _ in range(args.num_decodes)]
    load += [(args.long_after + i * args.long_every, rng.integers(1, 400, args.long_len).tolist(), long, "long")
             for i in range(args.num_long)]
    return load


def colocated(model: str, options: dict, load) -> list[dict]:
    """One engine: each request added at its arrival, the engine stepped in between."""
    llm = LLM(model, **options)
    start, pending, requests = time.perf_counter(), sorted(load, key=lambda r: r[0]), []
    while pending or not llm.is_finished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, ids, params, _ = pending.pop(0)
            requests.append(llm.add_request(ids, params))
        if llm.is_finished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        llm.step()
    outputs = [{**llm.outputs.output(samples), "metrics": samples[0].metrics()} for samples in requests]
    llm.shutdown()
    order = sorted(range(len(load)), key=lambda i: load[i][0])  # (requests were added in arrival order)
    return [outputs[order.index(i)] for i in range(len(load))]


def disaggregated(model: str, options: dict, load) -> tuple[list[dict], int]:
    with DisaggregatedLLM(model, options) as llm:
        futures = [None] * len(load)
        start = time.perf_counter()

        def submit_all():
            for i in sorted(range(len(load)), key=lambda i: load[i][0]):
                time.sleep(max(0.0, load[i][0] - (time.perf_counter() - start)))
                futures[i] = llm.submit(load[i][1], load[i][2])
        submitter = threading.Thread(target=submit_all)
        submitter.start()
        submitter.join()
        outputs = [f.result() for f in futures]
        return outputs, llm.num_steps_during_pulls


def summary(outputs: list[dict], load, kind: str) -> str:
    metrics = [o["metrics"] for o, r in zip(outputs, load) if r[3] == kind]
    ttft = [m["ttft_s"] * 1e3 for m in metrics if m["ttft_s"] is not None]
    tpot = [m["tpot_s"] * 1e3 for m in metrics if m["tpot_s"] is not None]
    return (f"TTFT p50 {np.percentile(ttft, 50):7.1f} ms, p90 {np.percentile(ttft, 90):7.1f} ms; "
            f"TPOT p50 {np.percentile(tpot, 50):6.2f} ms, p90 {np.percentile(tpot, 90):6.2f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (default: a tiny random model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-decodes", type=int, default=8, help="short prompts decoding for long, from the start")
    p.add_argument("--short-len", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=192)
    p.add_argument("--num-long", type=int, default=4, help="long prompts arriving while those decode")
    p.add_argument("--long-len", type=int, default=768)
    p.add_argument("--long-tokens", type=int, default=8)
    p.add_argument("--long-after", type=float, default=0.2, help="s: the first long prompt's arrival")
    p.add_argument("--long-every", type=float, default=0.2, help="s between long prompts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from nanovllm.utils.tiny_model import build_model
            model = build_model(os.path.join(tmp, "model"), max_position_embeddings=2048)
        options = {"device": args.device, "max_model_len": args.long_len + args.decode_tokens + 16}
        if args.device == "cpu":
            options["dtype"] = "float32"
        load = workload(args)
        together = colocated(model, options, load)
        apart, steps_during_pulls = disaggregated(model, options, load)
    differ = [i for i, (a, b) in enumerate(zip(together, apart)) if a["token_ids"] != b["token_ids"]]
    print(f"{len(load)} requests ({args.num_decodes} decoding {args.decode_tokens} tokens, {args.num_long} of "
          f"{args.long_len}-token prompts arriving from {args.long_after} s); tokens identical: {not differ}")
    for kind in ("decode", "long"):
        print(f"  {kind:>6}  colocated:     {summary(together, load, kind)}")
        print(f"  {kind:>6}  disaggregated: {summary(apart, load, kind)}")
    cached = sum(o["num_cached_tokens"] for o, r in zip(apart, load) if r[3] == "long")
    print(f"  the decode engine took {cached} prompt tokens' K/V from the prefill engine, and ran "
          f"{steps_during_pulls} steps while transfers were under way")
    if differ:
        print(f"requests whose tokens differ from the colocated engine's: {differ}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
