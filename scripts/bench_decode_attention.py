"""Micro-benchmark of the Triton split-KV decode kernel: time per call and the fraction of the
device's copy bandwidth it reaches; with --queries 1 + k, of a speculative verify step's attention
(k drafts after each sequence's last token), and with --vs-prefill-kernel of the prefill kernel
over the same step (what took verify steps before they were the decode kernel's).

A decode step reads every sequence's whole K and V once (2 * batch * context * Hkv * D * itemsize
bytes, itemsize 1 for an fp8 cache) and little else, so its speed limit is memory bandwidth. The
reference point is a large device-to-device copy, timed the same way ((read + write) bytes / time).

    python scripts/bench_decode_attention.py                       # CUDA, the defaults below
    python scripts/bench_decode_attention.py --cuda-graph          # also time a captured replay
    python scripts/bench_decode_attention.py --kv-cache-dtype fp8  # over an fp8 (e4m3) cache
    python scripts/bench_decode_attention.py --batch 1 --context 4096 --queries 5 --vs-prefill-kernel
    python scripts/bench_decode_attention.py --device cpu --batch 2 --context 40 --head-dim 32 \\
        --dtype float32 --iters 1                                  # interpreter smoke run

Every timed call also checks its output on the first few sequences against TorchBackend.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COPY_BYTES = 1 << 30             # 1 GiB: far beyond the L2 cache (H200: 50 MB), so DRAM speed is measured
CPU_COPY_BYTES = 1 << 24         # 16 MiB on CPU: the smoke run only needs a number
CHECK_SEQS = 4                   # sequences compared against TorchBackend
CHECK_TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}   # max abs error allowed vs the fp32 reference
# An fp8 cache is checked against TorchBackend over the same fp8 cache and scales: both read the
# same e4m3 values, which the kernel converts to the query's dtype exactly, so the tolerance is
# the query dtype's, as above (the quantization's own error is not the kernel's to check).
# The fp8 cache's k_scale and v_scale. Not 1, so that the check sees a kernel that ignores them:
# randn values (|x| < 7 even over 10^9 draws) / 0.02 stay inside e4m3's +-448.
KV_SCALE = 0.02


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="sequences per decode step")
    p.add_argument("--context", type=int, default=1024, help="context length of every sequence, in tokens")
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--queries", type=int, default=1,
                   help="new tokens per sequence: 1 a decode step, 1 + k a verify step of k drafts")
    p.add_argument("--vs-prefill-kernel", action="store_true",
                   help="also time the prefill kernel on the same step (--queries > 1)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(CHECK_TOL))
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="auto: the cache in --dtype; fp8: in float8_e4m3fn, dequantized inside the kernel")
    p.add_argument("--iters", type=int, default=50, help="timed calls (after as many warm-up calls, at most 10)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu runs the kernels under TRITON_INTERPRET=1 (tiny sizes only)")
    p.add_argument("--cuda-graph", action="store_true", help="also capture the call in a CUDA graph and time replays")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("batch", "context", "num_heads", "num_kv_heads", "head_dim", "block_size", "iters", "queries"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.device == "cpu" and args.dtype == "bfloat16":
        # numpy has no bfloat16: the interpreter stores it as uint16 and its tl.dot multiplies those
        # integers (triton 3.9), so a bf16 result on CPU would be garbage, not a kernel bug
        p.error("--device cpu runs Triton's interpreter, whose tl.dot is wrong for bfloat16: "
                "use --dtype float32 or float16")
    if args.num_heads % args.num_kv_heads:
        p.error(f"--num-heads ({args.num_heads}) must be a multiple of --num-kv-heads ({args.num_kv_heads})")
    if args.queries > args.context:
        p.error(f"--queries ({args.queries}) must be at most --context ({args.context})")
    if args.vs_prefill_kernel and args.queries == 1:
        p.error("--vs-prefill-kernel times a multi-query step: give --queries > 1")
    return args


def _import_backend(device: str):
    """The backend module, interpreted on CPU. TRITON_INTERPRET is read when the kernels are
    defined (module import), so it must be set first; a module already imported compiled cannot
    run on CPU tensors."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from nanovllm.layers.backends import triton_attn
    if device == "cpu" and type(triton_attn._decode_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("--device cpu needs TRITON_INTERPRET=1 before nanovllm.layers.backends.triton_attn is "
                           "imported; it was imported compiled in this process")
    return triton_attn


def _timer(device: str):
    """fn, iters -> seconds per call: CUDA events on the GPU, perf_counter on CPU."""
    import torch

    def run(fn, iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    return run


def copy_bandwidth(device: str, timer, iters: int) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    import torch
    n = (COPY_BYTES if device == "cuda" else CPU_COPY_BYTES) // 2
    src = torch.empty(n, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)                                        # warm-up
    seconds = timer(lambda: dst.copy_(src), max(iters, 5) if device == "cuda" else 3)
    return 2 * n * src.element_size() / seconds


def build_step(args, torch, Context):
    """A decode step (or, --queries > 1, a verify step: the last `queries` tokens of each sequence
    are new): `batch` sequences of `context` tokens each, their blocks a random permutation of the
    cache, the block table as wide as the longest context; with --kv-cache-dtype fp8 the cache holds
    those K/V quantized (scales KV_SCALE)."""
    device, dtype = args.device, getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    # randn on the host for a tiny run; on CUDA fill in place to keep host memory out of it
    if device == "cuda":
        k_cache = torch.randn(shape, dtype=dtype, device=device)
        v_cache = torch.randn(shape, dtype=dtype, device=device)
    else:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    if args.kv_cache_dtype == "fp8":
        from nanovllm.layers.backends.torch_ref import quantize_kv
        scale = torch.tensor(KV_SCALE, device=device)
        k_cache, v_cache = quantize_kv(k_cache, scale), quantize_kv(v_cache, scale)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(args.batch, blocks_per_seq)
    nq = args.queries
    q = torch.randn(args.batch * nq, args.num_heads, args.head_dim, generator=gen).to(dtype).to(device)
    lens = [args.context] * args.batch
    cu = list(range(0, (args.batch + 1) * nq, nq))
    i32 = dict(dtype=torch.int32, device=device)
    context = Context(cu_seqlens_q=torch.tensor(cu, **i32),
                      cu_seqlens_k=torch.arange(args.batch + 1, **i32) * args.context,
                      seq_lens_k=torch.tensor(lens, **i32), max_seqlen_q=nq, max_seqlen_k=args.context,
                      block_tables=tables.to(device), decode_only=nq == 1, cu_seqlens_q_cpu=cu, seq_lens_k_cpu=lens)
    return q, k_cache, v_cache, context


def check(out, q, k_cache, v_cache, context, scale, args, torch, Context, TorchBackend, kv_scales) -> float:
    """Max abs error of the first CHECK_SEQS sequences against TorchBackend in fp32 on the host
    (an fp8 cache stays fp8 there: the reference dequantizes it with the same scales)."""
    n = min(CHECK_SEQS, args.batch)
    used = context.block_tables[:n].flatten().long()
    # only the blocks those sequences use, renumbered, so the host copy stays small
    k_small, v_small = k_cache[used].cpu(), v_cache[used].cpu()
    if args.kv_cache_dtype == "auto":
        k_small, v_small = k_small.float(), v_small.float()
    tables = torch.arange(len(used), dtype=torch.int32).view(n, -1)
    lens = context.seq_lens_k_cpu[:n]
    nq = args.queries
    small = Context(block_tables=tables, decode_only=nq == 1, cu_seqlens_q_cpu=list(range(0, (n + 1) * nq, nq)),
                    seq_lens_k_cpu=lens)
    ref = TorchBackend.forward(q[:n * nq].float().cpu(), None, None, k_small, v_small, small, scale,
                               *(s.cpu() for s in kv_scales))
    return (out[:n * nq].float().cpu() - ref).abs().max().item()


def main(argv=None) -> dict:
    args = parse_args(argv)
    triton_attn = _import_backend(args.device)
    import torch
    from nanovllm.layers.backends.torch_ref import TorchBackend
    from nanovllm.utils.context import Context
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu (with tiny sizes) for a smoke run")

    q, k_cache, v_cache, context = build_step(args, torch, Context)
    scale = args.head_dim ** -0.5
    kv_scales = (torch.tensor(KV_SCALE, device=q.device), torch.tensor(KV_SCALE, device=q.device))  # (read if fp8)
    num_splits = triton_attn.decode_num_splits(args.batch, args.num_kv_heads, context.block_tables.shape[1] * args.block_size,
                                               triton_attn._num_sms(q.device))
    forward = lambda: triton_attn.TritonBackend.forward(q, None, None, k_cache, v_cache, context, scale,  # noqa: E731
                                                        *kv_scales)
    timer = _timer(args.device)

    out = forward()                                      # compiles (or interprets) once
    warmup = min(args.iters, 10)
    timer(forward, warmup)
    seconds = timer(forward, args.iters)
    error = check(out, q, k_cache, v_cache, context, scale, args, torch, Context, TorchBackend, kv_scales)

    itemsize = k_cache.element_size()           # 1 for fp8
    kv_bytes = 2 * args.batch * args.context * args.num_kv_heads * args.head_dim * itemsize
    bandwidth = kv_bytes / seconds
    copy_bw = copy_bandwidth(args.device, timer, args.iters)
    result = dict(batch=args.batch, context=args.context, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                  head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype,
                  kv_cache_dtype=args.kv_cache_dtype, device=args.device,
                  num_splits=num_splits, time_per_call_s=seconds, kv_bytes=kv_bytes, bandwidth_gbs=bandwidth / 1e9,
                  copy_bandwidth_gbs=copy_bw / 1e9, fraction_of_copy=bandwidth / copy_bw,
                  max_abs_error=error, check_ok=error <= CHECK_TOL[args.dtype])

    if args.vs_prefill_kernel:                           # the same step through the prefill kernel alone
        prefill_out = torch.empty_like(q)
        prefill = lambda: triton_attn._prefill(q, None, None, k_cache, v_cache, context, scale,  # noqa: E731
                                               prefill_out, *kv_scales)
        prefill()
        timer(prefill, warmup)
        prefill_seconds = timer(prefill, args.iters)
        prefill_error = check(prefill_out, q, k_cache, v_cache, context, scale, args, torch, Context, TorchBackend,
                              kv_scales)
        result.update(prefill_kernel_time_per_call_s=prefill_seconds, speedup_vs_prefill_kernel=prefill_seconds / seconds,
                      prefill_kernel_check_ok=prefill_error <= CHECK_TOL[args.dtype])

    if args.cuda_graph and args.device == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):                  # warm up on a side stream, as capture requires
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            graph_out = forward()
        graph.replay()
        torch.cuda.synchronize()
        timer(graph.replay, warmup)
        graph_seconds = timer(graph.replay, args.iters)
        result.update(graph_time_per_call_s=graph_seconds, graph_bandwidth_gbs=kv_bytes / graph_seconds / 1e9,
                      graph_matches_eager=bool(torch.equal(graph_out, out)))

    print(f"{'decode' if args.queries == 1 else f'verify ({args.queries} queries each)'} attention: "
          f"batch {args.batch} x context {args.context}, heads {args.num_heads}/{args.num_kv_heads}, "
          f"head_dim {args.head_dim}, block_size {args.block_size}, {args.dtype} "
          f"(KV cache {str(k_cache.dtype).removeprefix('torch.')}) on {args.device}, "
          f"num_splits {num_splits}")
    print(f"  time per call      {seconds * 1e6:12.1f} us")
    print(f"  KV bytes per call  {kv_bytes:12d}  ({kv_bytes / 2**20:.1f} MiB)")
    print(f"  effective          {bandwidth / 1e9:12.1f} GB/s")
    print(f"  device copy        {copy_bw / 1e9:12.1f} GB/s  (read + write of a {'1 GiB' if args.device == 'cuda' else '16 MiB'} copy)")
    print(f"  fraction of copy   {bandwidth / copy_bw:12.3f}")
    if "prefill_kernel_time_per_call_s" in result:
        print(f"  prefill kernel     {result['prefill_kernel_time_per_call_s'] * 1e6:12.1f} us  (the same step; "
              f"split-KV decode is {result['speedup_vs_prefill_kernel']:.2f}x faster; its output "
              f"{'ok' if result['prefill_kernel_check_ok'] else 'FAILED'})")
    if "graph_time_per_call_s" in result:
        print(f"  CUDA graph replay  {result['graph_time_per_call_s'] * 1e6:12.1f} us  "
              f"({result['graph_bandwidth_gbs']:.1f} GB/s, equal to eager: {result['graph_matches_eager']})")
    print(f"  max abs error vs TorchBackend on {min(CHECK_SEQS, args.batch)} sequences: {error:.3g} "
          f"({'ok' if result['check_ok'] else 'FAILED'}, tolerance {CHECK_TOL[args.dtype]})")
    return result


if __name__ == "__main__":
    outcome = main()  # (fails on a wrong result: eager against TorchBackend, or a graph replay unlike eager)
    sys.exit(0 if outcome["check_ok"] and outcome.get("graph_matches_eager", True)
             and outcome.get("prefill_kernel_check_ok", True) else 1)
