"""Compile the fused MoE kernels (layers/moe_triton.py) ahead of time for a CUDA architecture, with
no GPU: every SCALES mode (unquantized, FP8 per channel, FP8 128 x 128 blocks) times every
activation dtype, with the tile sizes triton_experts launches. Triton's wheel carries the CUDA
backend and ptxas, so this finds on a CPU machine what would fail to compile on the GPU
(a conversion or dot the architecture lacks, a constexpr branch that does not type-check).

  python scripts/compile_moe_kernels.py [--arch 90]      # 90: the H100/H200

It checks the installed Triton; the GPU machine's (3.6) can be installed beside it for this:
pip install --no-deps --target /tmp/triton36 triton==3.6.0, then PYTHONPATH=/tmp/triton36:. .
Must run without TRITON_INTERPRET (interpreted kernels cannot be compiled).
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ACTIVATIONS = ("bf16", "fp16", "fp32")
FP8_WEIGHTS = "fp8e4nv"          # torch.float8_e4m3fn
BLOCK = (128, 128)               # the FP8 checkpoints' block


def compile_all(arch: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.layers import moe_triton as m

    if type(m._gate_up_kernel).__name__ != "JITFunction":
        raise SystemExit("the kernels were built for Triton's interpreter: unset TRITON_INTERPRET")
    target = GPUTarget("cuda", arch, 32)
    failures = 0
    for act, scales in itertools.product(ACTIVATIONS, (m.NO_SCALES.value, m.CHANNEL_SCALES.value,
                                                       m.BLOCK_SCALES.value)):
        weights = act if scales == m.NO_SCALES.value else FP8_WEIGHTS
        scale = "fp32" if scales != m.NO_SCALES.value else weights
        fp32 = act == "fp32"
        constants = dict(BLOCK_M=m.SMALL_BLOCK_M, BLOCK_N=m.BLOCK_N_FP32 if fp32 else m.BLOCK_N, BLOCK_K=m.BLOCK_K,
                         DOT_PRECISION="ieee" if fp32 else "tf32", SCALES=scales,
                         GROUP_N=BLOCK[0] if scales == m.BLOCK_SCALES.value else 1,
                         GROUP_K=BLOCK[1] if scales == m.BLOCK_SCALES.value else 1)
        kernels = {
            m._gate_up_kernel: (dict(x_ptr=act, w13_ptr=weights, mid_ptr=act, scale_ptr=scale),
                                dict(constants, TOP_K=2)),
            m._down_kernel: (dict(mid_ptr=act, w2_ptr=weights, out_ptr="fp32", weights_ptr="fp32", scale_ptr=scale),
                             constants),
        }
        for kernel, (pointers, consts) in kernels.items():
            pointers = dict(pointers, sorted_pairs_ptr="i64", block_expert_ptr="i64", num_padded_ptr="i64")
            signature = {name: "constexpr" if name in consts else f"*{pointers[name]}" if name in pointers else "i32"
                         for name in kernel.arg_names}
            what = f"{kernel.__name__} activations {act} SCALES={scales}"
            try:
                compiled = triton.compile(ASTSource(kernel, signature, consts), target=target,
                                          options=dict(num_warps=4, num_stages=3))
                print(f"ok    {what}: {len(compiled.asm['cubin'])} bytes of sm_{arch} code")
            except Exception as e:  # report every variant, then fail
                failures += 1
                print(f"FAIL  {what}: {type(e).__name__}: {e}")
    print(f"triton {triton.__version__}, sm_{arch}: {failures} of {2 * len(ACTIVATIONS) * 3} variants failed")
    return failures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, major*10+minor (default 90)")
    sys.exit(1 if compile_all(parser.parse_args().arch) else 0)
