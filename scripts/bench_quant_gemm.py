"""Micro-benchmark of the quantized GEMMs against bf16 F.linear: median time per call and the
weight-read bandwidth each reaches (bytes of weights / time).

At decode sizes a linear layer reads its whole weight once per call and does little arithmetic per
byte, so its speed limit is memory bandwidth, and the point of a quantized weight is to read fewer
bytes: bf16 2 bytes per weight, block fp8 1 (+ one fp32 scale per 128 x 128), AWQ int4 1/2 (+ an
fp16 scale and a 4-bit zero per 128 inputs). Each timed pass calls the method once on every one of
`copies` copies of its weights, together at least L2_FLUSH_BYTES, so that each call reads its
weights from DRAM and not from the L2 cache (H200: 50 MB); time per call = pass time / copies.

    python scripts/bench_quant_gemm.py                               # CUDA: T = 1, 16, 256; N = K = 4096
    python scripts/bench_quant_gemm.py --tokens 1 --n 4096 --k 1024 --cuda-graph
    python scripts/bench_quant_gemm.py --tokens 1 --n 1024 --k 4096 --split-k 1       # without split-K
    python scripts/bench_quant_gemm.py --device cpu --tokens 1 20 --n 64 --k 256 --iters 1   # interpreter smoke run

Every method's output is checked against its reference: F.linear against x @ w.T in fp32,
block_fp8_matmul against fp8.block_fp8_matmul_reference, awq_gemm against x @ awq.dequantize.
The "tiles" and "split" columns are the output tile (rows x columns) and the number of K splits each
kernel launched (layers/quantization/split_k.py's plan: chosen by shape and SM count; --split-k
forces the split).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

L2_FLUSH_BYTES = 256 << 20       # 5x an H200's 50 MB L2: a pass over the copies cannot stay in cache
MAX_COPIES = 64                  # enough for the smallest weights benchmarked (AWQ 1024 x 1024: 0.5 MB)
FP8_BLOCK = (128, 128)           # the published FP8 checkpoints' weight blocks
AWQ_GROUP = 128                  # the AWQ checkpoints' input group
# max |out - ref| / max |ref| allowed; ref is computed in fp32 from the same (quantized) weights,
# so what is left is the bf16 rounding of the output (2^-8 relative; 2^-7 under the interpreter,
# whose fp32 -> bf16 cast truncates), of AWQ's dequantized tile, and the accumulation order
# (for fp8 on Hopper: ~14 bits kept inside each 128-deep K tile). A wrong scale or nibble is O(1).
CHECK_TOL = 2e-2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256],
                   help="rows of x (T), one run each: decode, the 17-128 rows of a small batch or a verify step, prefill")
    p.add_argument("--n", type=int, default=4096, help="output features (N); a multiple of 8 for AWQ")
    p.add_argument("--k", type=int, default=4096, help="input features (K); a multiple of 128 for AWQ")
    p.add_argument("--iters", type=int, default=20, help="timed passes over the copies (after one warm-up pass)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu runs the kernels under TRITON_INTERPRET=1 (tiny sizes only)")
    p.add_argument("--cuda-graph", action="store_true", help="time replays of a captured pass instead of eager calls")
    p.add_argument("--split-k", type=int, default=None,
                   help="force this many K splits in both kernels (default: chosen by shape, split_k.plan)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("n", "k", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.split_k is not None and args.split_k < 1:
        p.error(f"--split-k must be >= 1, got {args.split_k}")
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens must all be >= 1, got {args.tokens}")
    if args.n % 8 or args.k % AWQ_GROUP:
        p.error(f"AWQ needs --n a multiple of 8 and --k a multiple of {AWQ_GROUP}, got {args.n} and {args.k}")
    return args


def _import_kernels(device: str):
    """The kernel modules, interpreted on CPU. TRITON_INTERPRET is read when the kernels are
    defined (module import), so it must be set first."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from nanovllm.layers.quantization import awq_triton, fp8_triton
    if fp8_triton.INTERPRETED != (device == "cpu"):
        raise RuntimeError(f"--device {device} needs the kernels {'interpreted' if device == 'cpu' else 'compiled'} "
                           f"(TRITON_INTERPRET={'1' if device == 'cpu' else 'unset'} before they are imported)")
    return fp8_triton, awq_triton


def _time_pass(device: str, fn) -> float:
    """Seconds one call of fn takes: CUDA events on the GPU, perf_counter on CPU."""
    import torch
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_methods(args, torch, fp8, awq, fp8_triton, awq_triton):
    """{name: (weight bytes, [weights per copy], call(x, weights), reference(x), launch(T))} from one
    random bf16 weight w [N, K], quantized for each scheme on the device; launch(T) is the (tiles,
    K splits) the method launches for T tokens ((None, None) for F.linear)."""
    gen = torch.Generator().manual_seed(args.seed)
    w = (torch.randn(args.n, args.k, generator=gen) * args.k ** -0.5).to(args.device).bfloat16()
    q, scale_inv = fp8.quantize_block(w.float(), FP8_BLOCK)
    qweight, qzeros, scales = awq.quantize(w.float().T.contiguous(), AWQ_GROUP)     # AWQ keeps W [K, N]
    w_awq = awq.dequantize(qweight, qzeros, scales, AWQ_GROUP, torch.float32)
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)              # noqa: E731
    import torch.nn.functional as F
    device = torch.device(args.device)
    forced = args.split_k
    launched = lambda plan: (f"{plan[0].block_m}x{plan[0].block_n}", forced or plan[1])  # noqa: E731
    return {
        "bf16 F.linear": (nbytes(w), (w,), lambda x, ws: F.linear(x, *ws),
                          lambda x: x.float() @ w.float().T, lambda t: (None, None)),
        "block_fp8_matmul": (nbytes(q, scale_inv), (q, scale_inv),
                             lambda x, ws: fp8_triton.block_fp8_matmul(x, *ws, FP8_BLOCK, split_k=forced),
                             lambda x: fp8.block_fp8_matmul_reference(x.float(), q, scale_inv, FP8_BLOCK),
                             lambda t: launched(fp8_triton.gemm_plan(t, args.n, args.k, FP8_BLOCK[1], device))),
        "awq_gemm": (nbytes(qweight, qzeros, scales), (qweight, qzeros, scales),
                     lambda x, ws: awq_triton.awq_gemm(x, *ws, AWQ_GROUP, split_k=forced),
                     lambda x: x.float() @ w_awq,
                     lambda t: launched(awq_triton.gemm_plan(t, args.n, args.k, AWQ_GROUP, torch.bfloat16, device))),
    }


def bench_one(args, torch, name, weight_bytes, weights, call, reference, launch, num_tokens, gen) -> dict:
    copies = 1 if args.device == "cpu" else max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // weight_bytes)))
    sets = [weights] + [tuple(t.clone() for t in weights) for _ in range(copies - 1)]
    x = torch.randn(num_tokens, args.k, generator=gen).to(args.device).bfloat16()
    run_pass = lambda: [call(x, ws) for ws in sets]      # noqa: E731
    out = run_pass()[0]                                  # compiles (or interprets) once; warm-up
    timed = run_pass
    if args.cuda_graph and args.device == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):                  # warm up on a side stream, as capture requires
            run_pass()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_pass()
        graph.replay()
        timed = graph.replay
    passes = [_time_pass(args.device, timed) for _ in range(args.iters)]
    seconds = statistics.median(passes) / copies
    ref = reference(x)
    error = ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
    return dict(method=name, tokens=num_tokens, n=args.n, k=args.k, device=args.device, copies=copies,
                tiles=launch(num_tokens)[0], split_k=launch(num_tokens)[1],
                time_per_call_s=seconds, weight_bytes=weight_bytes, weight_gbs=weight_bytes / seconds / 1e9,
                max_rel_error=error, check_ok=error <= CHECK_TOL, cuda_graph=bool(args.cuda_graph and args.device == "cuda"))


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    fp8_triton, awq_triton = _import_kernels(args.device)
    import torch
    from nanovllm.layers.quantization import awq, fp8
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu (with tiny sizes) for a smoke run")
    methods = build_methods(args, torch, fp8, awq, fp8_triton, awq_triton)
    gen = torch.Generator().manual_seed(args.seed + 1)
    results = []
    print(f"quantized GEMM: N {args.n} x K {args.k}, x in bfloat16 on {args.device}"
          f"{', CUDA graph replays' if args.cuda_graph and args.device == 'cuda' else ''}")
    print(f"  {'T':>5}  {'method':<18} {'tiles':>6} {'split':>5} {'median us':>11} {'weight MiB':>11} {'GB/s':>9} "
          f"{'max error':>10}  check")
    for num_tokens in args.tokens:
        for name, (weight_bytes, weights, call, reference, launch) in methods.items():
            r = bench_one(args, torch, name, weight_bytes, weights, call, reference, launch, num_tokens, gen)
            results.append(r)
            print(f"  {num_tokens:>5}  {name:<18} {r['tiles'] or '-':>6} {r['split_k'] or '-':>5} {r['time_per_call_s'] * 1e6:>11.1f} "
                  f"{weight_bytes / 2**20:>11.2f} {r['weight_gbs']:>9.1f} {r['max_rel_error']:>10.2e}  "
                  f"{'ok' if r['check_ok'] else 'FAILED'}")
    print("  (tiles: output tile rows x columns; split: K splits launched; GB/s: the layer's weight bytes / median time per call; "
          "max error: max |out - ref| / max |ref|)")
    return results


if __name__ == "__main__":
    sys.exit(0 if all(r["check_ok"] for r in main()) else 1)
