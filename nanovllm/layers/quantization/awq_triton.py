"""The AWQ int4 GEMM (W4A16): y = x W with W kept packed, unpacked tile by tile in registers.
awq.py holds the format and its arithmetic in plain PyTorch; this kernel computes the same thing.

  x [T, K] (bf16/fp16/fp32)   qweight [K, N / 8] int32   qzeros [K / g, N / 8] int32   scales [K / g, N] fp16
  W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]; q[k, 8c + j] is nibble AWQ_NIBBLE[j] of
  qweight[k, c], AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7), i.e. nibble (j // 2) + 4 (j % 2).

  _awq_gemm_kernel   [BLOCK_M, BLOCK_N] output tiles over K tiles of BLOCK_K. Per K tile it loads the
                     packed words, qweight[k-tile, BLOCK_N / 8 words] (BLOCK_N / 2 bytes per row),
                     repeats each word 8 times along N (three tl.interleave, in registers), shifts
                     column n by 4 * nibble(n % 8) and masks 4 bits; likewise the group's zero points
                     (one packed row: BLOCK_K divides g, so a K tile lies in one group) and scales.
                     W = (q - z) * s is formed in fp32 (exact: a 4-bit integer times an fp16 scale),
                     rounded once to x's dtype, and fed to tl.dot with an fp32 accumulator.
  tiles, split-K (split_k.py) as wide as the shape's program count allows; where the output tiles
                     leave SMs idle, S > 1 splits of whole K tiles, their fp32 partials summed in a
                     fixed order; S = 1 writes the output directly.
K is a multiple of g (the format's groups) and N of 8 (the packing), both checked; T is masked.

Under TRITON_INTERPRET=1 (read at import) the kernel runs on CPU tensors in Triton's interpreter, as
tests/test_quant_kernels.py checks it. That interpreter's tl.dot multiplies bf16 operands as the uint16
integers it stores them in (triton 3.9), so there (DOT_IN_FP32) both tiles are widened to fp32 just
before the dot, after W's rounding to x's dtype: the same products, summed in fp32 as on the GPU. (Its
fp32 -> bf16 casts truncate; the tests allow a bf16 ulp.)
"""
import torch
import triton
import triton.language as tl

from nanovllm.layers.quantization.base import PACK
from nanovllm.layers.quantization.split_k import (DECODE_MAX_TOKENS, Tiles, check_split_k, num_sms, plan, sum_splits,
                                                  workspace)
from nanovllm.utils.triton_mode import check_kernel_device

# Tiles (split_k.plan picks one per shape, widest first). A tile's qweight row is BLOCK_N / 2 bytes:
# 64 columns make one 32-byte DRAM sector (32 half of one, taken only where wider tiles leave SMs
# idle). The W tile is built in registers ([BLOCK_K, BLOCK_N] fp32), so BLOCK_K * BLOCK_N / (32 *
# num_warps) values per thread bound the tiles: at most 64 columns by K tiles of 128 (4 warps: 64 a
# thread). Up to DECODE_MAX_TOKENS one 16-row tile holds every token, over N / 64 programs times the K
# splits, 4 stages. Beyond, 64-row tiles over K tiles of 64, as wide as the program count allows:
# 64 x 128 reuses each unpacked W tile (ALU work per weight) over 64 tokens; 8 warps keep it at 32
# values per thread; 3 stages.
DECODE_BLOCK_M, DECODE_BLOCK_K, DECODE_WIDTHS, DECODE_WARPS, DECODE_STAGES = 16, 128, (64, 32), 4, 4
PREFILL_BLOCK_M, PREFILL_BLOCK_K, PREFILL_WIDTHS, PREFILL_WARPS, PREFILL_STAGES = 64, 64, (128, 64, 32), 8, 3
# fp32 x (tests only: AWQ runs in fp16/bf16) takes the exact ("ieee") FMA path: at most 64 x 32 tiles,
# else sm_90 spills registers (ptxas -v: 236 bytes at decode, 1.6 KB at prefill with the tiles above)
FP32_MAX_BLOCK_N, FP32_BLOCK_K = 64, 32


# ---- kernel ---------------------------------------------------------------------------------
@triton.jit
def _unpack_awq(words, offs_n):
    """words [..., C] int32 -> [..., 8 C] int32 values in 0..15, offs_n the columns they are for:
    column 8 c + j is nibble AWQ_NIBBLE[j] = j // 2 + 4 (j % 2) of word c."""
    words = tl.interleave(words, words)                  # each word twice, then 4 times, then 8 times
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    j = offs_n % 8
    shifts = ((j // 2) + (j % 2) * 4) * 4
    return (words >> shifts) & 0xF


# Arguments that change with the step's token count, never specialized on (fp8_triton.py's reason);
# s_os is the split-K workspace's stride, T * N.
GEMM_DYNAMIC_ARGS = ["T", "s_os"]


@triton.jit(do_not_specialize=GEMM_DYNAMIC_ARGS)
def _awq_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, T, N, K,
                     s_xt, s_xk, s_qk, s_qc, s_zg, s_zc, s_sg, s_sn, s_os, s_ot, s_on,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid (ceil(T / BLOCK_M), ceil(N / BLOCK_N), S): out[s, m, n] = sum over split s's K tiles of
    x[m, k] W[k, n]. With S = 1, s_os = 0 and out is the [T, N] result; else the fp32 workspace
    [S, T, N] that split_k sums."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_n.to(tl.int64) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)    # the tile's packed words
    m_ok = offs_m < T
    n_ok = offs_n < N
    c_ok = offs_c < N // 8                               # N is a multiple of 8: whole words or none
    # split pid_k's K tiles: [pid_k * k_tiles // S, (pid_k + 1) * k_tiles // S), none empty (S <= k_tiles)
    k_tiles = K // BLOCK_K
    k_begin = (pid_k * k_tiles // tl.num_programs(2)) * BLOCK_K
    k_end = ((pid_k + 1) * k_tiles // tl.num_programs(2)) * BLOCK_K
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * s_xt + offs_k[None, :] * s_xk          # [BLOCK_M, BLOCK_K]
    qw_ptrs = qw_ptr + offs_k[:, None] * s_qk + offs_c[None, :] * s_qc        # [BLOCK_K, BLOCK_N / 8]
    qz_ptrs = qz_ptr + offs_c * s_zc                                          # [BLOCK_N / 8], group 0
    s_ptrs = s_ptr + offs_n * s_sn                                            # [BLOCK_N], group 0

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):            # K % GROUP == 0 and GROUP % BLOCK_K == 0: no K mask
        g = k0 // GROUP
        zeros = _unpack_awq(tl.load(qz_ptrs + g * s_zg, mask=c_ok, other=0), offs_n)           # [BLOCK_N]
        scales = tl.load(s_ptrs + g * s_sg, mask=n_ok, other=0.0).to(tl.float32)               # [BLOCK_N]
        q = _unpack_awq(tl.load(qw_ptrs, mask=c_ok[None, :], other=0), offs_n[None, :])        # [BLOCK_K, BLOCK_N]
        w = ((q - zeros[None, :]).to(tl.float32) * scales[None, :]).to(x_ptr.dtype.element_ty)
        a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * s_xk
        qw_ptrs += BLOCK_K * s_qk

    out_ptrs = out_ptr + pid_k.to(tl.int64) * s_os + offs_m[:, None] * s_ot + offs_n[None, :] * s_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---- host side ------------------------------------------------------------------------------
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETED = type(_awq_gemm_kernel).__name__ == "InterpretedFunction"


def tile_options(num_tokens: int, group: int, dtype: torch.dtype) -> tuple[Tiles, ...]:
    """The tiles split_k.plan may pick for num_tokens rows of x.dtype dtype, widest first; BLOCK_K no
    larger than the group (it must divide it)."""
    if num_tokens <= DECODE_MAX_TOKENS:
        block_m, block_k, widths, warps, stages = (DECODE_BLOCK_M, DECODE_BLOCK_K, DECODE_WIDTHS, DECODE_WARPS,
                                                   DECODE_STAGES)
    else:
        block_m, block_k, widths, warps, stages = (PREFILL_BLOCK_M, PREFILL_BLOCK_K, PREFILL_WIDTHS, PREFILL_WARPS,
                                                   PREFILL_STAGES)
    if dtype == torch.float32:
        widths = sorted({min(width, FP32_MAX_BLOCK_N) for width in widths}, reverse=True)
        block_k = FP32_BLOCK_K
    return tuple(Tiles(block_m, width, min(block_k, group), warps, stages) for width in widths)


def gemm_plan(num_tokens: int, n: int, k: int, group: int, dtype: torch.dtype,
              device: torch.device) -> tuple[Tiles, int]:
    """The (tiles, split count) awq_gemm launches for these shapes on this device."""
    return plan(num_tokens, n, k, tile_options(num_tokens, group, dtype), num_sms(device))


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group: int = 128, split_k: int | None = None) -> torch.Tensor:
    """x @ awq.dequantize(qweight, qzeros, scales, group), without the dequantized matrix: [T, N] in
    x.dtype (shapes as above; scales in any float dtype). split_k: None splits K as gemm_plan
    chooses; an int in 1..K / BLOCK_K forces that many (tests, benchmarks: the same sum reordered)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    # BLOCK_K = min(tile, group) must divide the group and be a power of two >= 16 (tl.dot)
    if not isinstance(group, int) or group < 16 or group & (group - 1):
        raise ValueError(f"group must be a power of two >= 16, got {group!r}")
    num_tokens, k = x.shape
    if k % group:
        raise ValueError(f"x's K ({k}, x {tuple(x.shape)}) must be a multiple of group ({group})")
    if qweight.dim() != 2 or qweight.shape[0] != k or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [K, N / 8] = [{k}, N / 8] (K from x {tuple(x.shape)}), "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    words = qweight.shape[1]
    n = words * PACK
    if tuple(qzeros.shape) != (k // group, words) or qzeros.dtype != torch.int32:
        raise ValueError(f"qzeros must be int32 [K / group, N / 8] = [{k // group}, {words}], "
                         f"got {qzeros.dtype} {tuple(qzeros.shape)}")
    if tuple(scales.shape) != (k // group, n) or not scales.dtype.is_floating_point:
        raise ValueError(f"scales must be float [K / group, N] = [{k // group}, {n}] (fp16 in AWQ checkpoints), "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    check_kernel_device(__name__, INTERPRETED, x, qweight, qzeros, scales)

    out = torch.empty((num_tokens, n), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tiles, planned_split = gemm_plan(num_tokens, n, k, group, x.dtype, x.device)
    split_k = planned_split if split_k is None else split_k
    check_split_k(split_k, k // tiles.block_k)
    dest = workspace(split_k, out)                       # out, or fp32 [split_k, T, N] partials
    grid = (triton.cdiv(num_tokens, tiles.block_m), triton.cdiv(n, tiles.block_n), split_k)
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, dest, num_tokens, n, k,
        *x.stride(), *qweight.stride(), *qzeros.stride(), *scales.stride(),
        dest.stride(0) if split_k > 1 else 0, *dest.stride()[-2:],
        GROUP=group, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_IN_FP32=INTERPRETED,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",   # fp32 would otherwise go through TF32
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return sum_splits(dest, out)
