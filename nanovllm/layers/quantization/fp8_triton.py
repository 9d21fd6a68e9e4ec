"""The block-scaled FP8 GEMM (W8A8: 128 x 128 weight blocks, activations quantized per token per
group of 128 at run time) in two Triton launches (three with split-K); fp8.py holds the arithmetic in
plain PyTorch.

  x [T, K] (bf16/fp16/fp32)   q [N, K] fp8 e4m3   scale_inv [ceil(N / bn), ceil(K / bk)] fp32
  w[n, k] ~= q[n, k] * scale_inv[n // bn, k // bk]          (block = (bn, bk), (128, 128) in practice)

  _per_token_group_quant_kernel   each token's group of bk features scales its largest |x| to 448:
                     scale = max(amax / 448, MIN_SCALE), xq = fp8(clamp(x / scale, -448, 448)), bit
                     for bit fp8.quantize_per_token_group (both divisions correctly rounded).
  _block_fp8_matmul_kernel        [BLOCK_M, BLOCK_N] output tiles over K tiles of BLOCK_K, which
                     divides bk: a K tile lies inside one scale block, so each of its rows (columns)
                     has one activation (weight) scale. tl.dot sums a tile's fp8 x fp8 products, then
                     they are scaled and added to the fp32 accumulator (DeepSeek-V3's promotion every
                     128 products: Hopper's fp8 MMA keeps only ~14 bits while it accumulates, so a K
                     tile must not be longer). Weight scales are looked up per column (offs_n // bn),
                     so BLOCK_N need not divide bn. Ragged T, N and K are masked (loads give 0).
  tiles, split-K (split_k.py) as wide as the shape's program count allows; where the output tiles
                     leave SMs idle, S > 1 splits of whole K tiles, their fp32 partials summed in a
                     fixed order; S = 1 writes the output directly.

Under TRITON_INTERPRET=1 (read at import) the kernels run on CPU tensors in Triton's interpreter, as
tests/test_quant_kernels.py checks them. Its fp32 -> fp8 cast rounds wrongly (triton 3.9: half up, and a
carry out of the mantissa corrupts the exponent), so there the quantization kernel first rounds to the
nearest e4m3 value in fp32 (_round_to_e4m3, ROUND_IN_FP32) and the cast is exact; the GPU's cast rounds
to nearest even itself. Its tl.dot on fp8 is exact (fp16 operands, fp32 sums): no interpreter variant
of the GEMM. (Its fp32 -> bf16 output cast truncates; the tests allow a bf16 ulp.)
"""
import math

import torch
import triton
import triton.language as tl

from nanovllm.layers.quantization.base import FP8, FP8_MAX, MIN_SCALE
from nanovllm.layers.quantization.split_k import (DECODE_MAX_TOKENS, Tiles, check_split_k, num_sms, plan, sum_splits,
                                                  workspace)
from nanovllm.utils.triton_mode import check_kernel_device

# Tiles (split_k.plan picks one per shape, widest first). The GEMM streams the weight (N * K bytes)
# with T rows riding along. Up to DECODE_MAX_TOKENS one 16-row tile holds every token, and 32-column
# tiles give N / 32 programs (128 for N = 4096, about one per SM of an H200), times the K splits;
# 4 stages keep that many K tiles of loads in flight. Beyond, 64-row tiles, as wide as the program
# count allows: 64 x 128 reuses each weight tile over 64 tokens and each activation tile over 128
# columns, 3 stages of (64 + 128) x 128 fp8 bytes = 72 KB shared; narrower ones take 4 stages.
DECODE_BLOCK_M, DECODE_WIDTHS = 16, (32, 16)
PREFILL_BLOCK_M, PREFILL_WIDTHS = 64, (128, 64, 32, 16)
WIDE_STAGES, NARROW_STAGES = 3, 4
MAX_BLOCK_K = 128              # a K tile of 128: the checkpoints' bk, and DeepSeek-V3's promotion interval
MIN_BLOCK_K = 32               # fp8 MMA instructions take K in multiples of 32
NUM_WARPS = 4
# The quantization kernel: QUANT_BLOCK_T tokens' groups per program ([8, 128] values, 8 per thread of
# 4 warps), so a prefill is T / 8 * K / 128 programs (the interpreter pays milliseconds per program).
QUANT_BLOCK_T = 8
QUANT_NUM_WARPS = 4


# ---- kernels --------------------------------------------------------------------------------
@triton.jit
def _round_to_e4m3(y):
    """y fp32 in [-448, 448] -> the nearest e4m3 value (ties to even), still in fp32.

    e4m3 has 3 mantissa bits, so in the binade [2^e, 2^(e+1)) its values are 2^(e-3) apart; below
    2^-6 (its smallest normal) the subnormals keep that spacing, 2^-9. Adding c = 1.5 * 2^(u + 23)
    to |y| < 2^(u + 22) lands in [2^(u + 23), 2^(u + 24)), where fp32's own spacing is 2^u: the fp32
    addition rounds |y| to a multiple of 2^u, to nearest even, and subtracting c is exact."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)    # floor(log2 |y|), at least e4m3's -6
    ulp_exp = exponent - 3
    magic = (((ulp_exp + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)   # 1.5 * 2^(u + 23)
    rounded = (tl.abs(y) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)         # the sign bit, so that -0.0 stays -0.0


# Arguments that change with the step's token count: never specialized on (Triton would compile a
# variant for T = 1, for T divisible by 16, and for the rest: a shape the warm-up missed would stop
# a run to compile). s_os is the split-K workspace's stride, T * N.
QUANT_DYNAMIC_ARGS = ["T"]
GEMM_DYNAMIC_ARGS = ["T", "s_os"]


@triton.jit(do_not_specialize=QUANT_DYNAMIC_ARGS)
def _per_token_group_quant_kernel(x_ptr, xq_ptr, xs_ptr, T, K,
                                  s_xt, s_xk, s_qt, s_qk, s_st, s_sg,
                                  GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                                  FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """Grid (ceil(T / BLOCK_T), ceil(K / GROUP)): xq[t, group g], xs[t, g] = quantize(x[t, group g])
    for BLOCK_T tokens t. BLOCK is GROUP rounded up to a power of two (tl.arange needs one)."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    offs_k = g * GROUP + lane
    ok = (offs_t < T)[:, None] & ((lane < GROUP) & (offs_k < K))[None, :]            # [BLOCK_T, BLOCK]
    x = tl.load(x_ptr + offs_t[:, None] * s_xt + offs_k[None, :] * s_xk, mask=ok, other=0.0).to(tl.float32)
    # correctly rounded divisions, as torch's (Triton's plain fp32 `/` is approximate on NVIDIA)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), MIN_SCALE)   # [BLOCK_T]
    y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    if ROUND_IN_FP32:                                    # the interpreter's fp8 cast needs exact input
        y = _round_to_e4m3(y)
    tl.store(xq_ptr + offs_t[:, None] * s_qt + offs_k[None, :] * s_qk, y.to(xq_ptr.dtype.element_ty), mask=ok)
    tl.store(xs_ptr + offs_t * s_st + g * s_sg, scale, mask=offs_t < T)


@triton.jit(do_not_specialize=GEMM_DYNAMIC_ARGS)
def _block_fp8_matmul_kernel(xq_ptr, xs_ptr, q_ptr, ws_ptr, out_ptr, T, N, K,
                             s_xt, s_xk, s_xst, s_xsk, s_qn, s_qk, s_wsn, s_wsk, s_os, s_ot, s_on,
                             SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (ceil(T / BLOCK_M), ceil(N / BLOCK_N), S): out[s, m, n] = sum over split s's K tiles of
    dot(xq, q^T) * xs[m, kb] * ws[n // SCALE_BLOCK_N, kb], kb = k0 // SCALE_BLOCK_K. With S = 1,
    s_os = 0 and out is the [T, N] result; else the fp32 workspace [S, T, N] that split_k sums."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < T
    n_ok = offs_n < N
    # split pid_k's K tiles: [pid_k * k_tiles // S, (pid_k + 1) * k_tiles // S), none empty (S <= k_tiles);
    # the last split's end, k_tiles * BLOCK_K, may pass K: its ragged tile is masked
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_begin = (pid_k * k_tiles // tl.num_programs(2)) * BLOCK_K
    k_end = ((pid_k + 1) * k_tiles // tl.num_programs(2)) * BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = xq_ptr + offs_m[:, None] * s_xt + (k_begin + offs_k[None, :]) * s_xk   # [BLOCK_M, BLOCK_K]
    q_ptrs = q_ptr + offs_n[None, :] * s_qn + (k_begin + offs_k[:, None]) * s_qk    # [BLOCK_K, BLOCK_N]: q^T's tile
    xs_ptrs = xs_ptr + offs_m * s_xst                                         # [BLOCK_M]
    ws_ptrs = ws_ptr + (offs_n // SCALE_BLOCK_N) * s_wsn                      # [BLOCK_N]: each column's block row

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = offs_k < K - k0                           # only the last K tile is ragged
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(q_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        kb = k0 // SCALE_BLOCK_K                         # the K tile's scale block (BLOCK_K divides it)
        a_scale = tl.load(xs_ptrs + kb * s_xsk, mask=m_ok, other=0.0)
        b_scale = tl.load(ws_ptrs + kb * s_wsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        x_ptrs += BLOCK_K * s_xk
        q_ptrs += BLOCK_K * s_qk

    out_ptrs = out_ptr + pid_k.to(tl.int64) * s_os + offs_m[:, None] * s_ot + offs_n[None, :] * s_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---- host side ------------------------------------------------------------------------------
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETED = type(_block_fp8_matmul_kernel).__name__ == "InterpretedFunction"


def _check_activations(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be one of {ACTIVATION_DTYPES}, got {x.dtype}")


def per_token_group_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq fp8 e4m3 [T, K], scales fp32 [T, ceil(K / group)]), bit for bit
    fp8.quantize_per_token_group(x, group)."""
    _check_activations(x)
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    check_kernel_device(__name__, INTERPRETED, x)
    num_tokens, k = x.shape
    num_groups = triton.cdiv(k, group)
    xq = torch.empty((num_tokens, k), dtype=FP8, device=x.device)
    scales = torch.empty((num_tokens, num_groups), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or k == 0:
        return xq, scales
    _per_token_group_quant_kernel[(triton.cdiv(num_tokens, QUANT_BLOCK_T), num_groups)](
        x, xq, scales, num_tokens, k, *x.stride(), *xq.stride(), *scales.stride(),
        GROUP=group, BLOCK=triton.next_power_of_2(group), BLOCK_T=QUANT_BLOCK_T, FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE, ROUND_IN_FP32=INTERPRETED, num_warps=QUANT_NUM_WARPS)
    return xq, scales


def block_k_for(bk: int) -> int:
    """The GEMM's K tile for scale blocks bk wide: the largest power of two <= MAX_BLOCK_K that
    divides bk (so each K tile has one scale), or a ValueError if that is below MIN_BLOCK_K."""
    block_k = math.gcd(bk, MAX_BLOCK_K)
    if block_k < MIN_BLOCK_K:
        raise ValueError(f"block[1] (bk) must be a multiple of {MIN_BLOCK_K} (the fp8 GEMM's K tile divides it), "
                         f"got {bk}")
    return block_k


def tile_options(num_tokens: int, bk: int) -> tuple[Tiles, ...]:
    """The tiles split_k.plan may pick for num_tokens rows, widest first (K tiles of block_k_for(bk))."""
    block_m, widths = ((DECODE_BLOCK_M, DECODE_WIDTHS) if num_tokens <= DECODE_MAX_TOKENS
                       else (PREFILL_BLOCK_M, PREFILL_WIDTHS))
    block_k = block_k_for(bk)
    return tuple(Tiles(block_m, width, block_k, NUM_WARPS, WIDE_STAGES if width == 128 else NARROW_STAGES)
                 for width in widths)


def gemm_plan(num_tokens: int, n: int, k: int, bk: int, device: torch.device) -> tuple[Tiles, int]:
    """The (tiles, split count) block_fp8_matmul launches for these shapes on this device."""
    return plan(num_tokens, n, k, tile_options(num_tokens, bk), num_sms(device))


def block_fp8_matmul(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int] = (128, 128), out_dtype: torch.dtype | None = None,
                     split_k: int | None = None) -> torch.Tensor:
    """x @ w.T with w the block-scaled fp8 weight (q, scale_inv): fp8.block_fp8_matmul_reference's
    [T, N] (shapes as above) in out_dtype (default x.dtype). split_k: None splits K as gemm_plan
    chooses; an int in 1..ceil(K / BLOCK_K) forces that many (tests, benchmarks: the same sum reordered)."""
    _check_activations(x)
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"block must be two positive ints (bn, bk), got {block!r}")
    bn, bk = block
    block_k = block_k_for(bk)
    num_tokens, k = x.shape
    if q.dim() != 2 or q.shape[1] != k:
        raise ValueError(f"q must be [N, K] = [N, {k}] (K from x {tuple(x.shape)}), got shape {tuple(q.shape)}")
    if q.dtype != FP8:
        raise ValueError(f"q must be {FP8}, got {q.dtype}")
    n = q.shape[0]
    scale_shape = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(scale_inv.shape) != scale_shape:
        raise ValueError(f"scale_inv must be [ceil(N / bn), ceil(K / bk)] = {list(scale_shape)} for q "
                         f"{tuple(q.shape)} and block {tuple(block)}, got shape {tuple(scale_inv.shape)}")
    if scale_inv.dtype != torch.float32:
        raise ValueError(f"scale_inv must be torch.float32, got {scale_inv.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"out_dtype must be one of {ACTIVATION_DTYPES}, got {out_dtype}")
    check_kernel_device(__name__, INTERPRETED, x, q, scale_inv)

    out = torch.empty((num_tokens, n), dtype=out_dtype, device=x.device)
    if num_tokens == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tiles, planned_split = gemm_plan(num_tokens, n, k, bk, x.device)
    split_k = planned_split if split_k is None else split_k
    check_split_k(split_k, triton.cdiv(k, block_k))
    xq, x_scales = per_token_group_quant(x, bk)          # [T, K] fp8, [T, ceil(K / bk)] fp32
    dest = workspace(split_k, out)                       # out, or fp32 [split_k, T, N] partials
    grid = (triton.cdiv(num_tokens, tiles.block_m), triton.cdiv(n, tiles.block_n), split_k)
    _block_fp8_matmul_kernel[grid](
        xq, x_scales, q, scale_inv, dest, num_tokens, n, k,
        *xq.stride(), *x_scales.stride(), *q.stride(), *scale_inv.stride(),
        dest.stride(0) if split_k > 1 else 0, *dest.stride()[-2:],
        SCALE_BLOCK_N=bn, SCALE_BLOCK_K=bk, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return sum_splits(dest, out)
