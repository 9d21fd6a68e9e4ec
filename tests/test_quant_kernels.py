"""The quantized GEMM kernels (layers/quantization/fp8_triton.py, awq_triton.py) against the plain
PyTorch arithmetic of fp8.py and awq.py.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, which
@triton.jit reads when the kernel modules are imported, so it is set before that). On a CUDA
machine the variable is left alone and the same tests run the compiled kernels on the GPU; the
gpu-marked tests at the end use realistic shapes in bf16. Sizes here are small: the interpreter is
slow.

Tolerances, elementwise, with bound = |a| @ |b| (the sum of the absolute products, so that a
cancelling sum is not held to a relative bound it cannot meet) and u = the largest relative error
of one rounding to the output dtype (ROUNDING: bf16 2^-8, fp16 2^-11, fp32 0 as nothing is
rounded; under triton 3.9's interpreter a cast fp32 -> bf16 truncates instead of rounding, so bf16
gets a whole ulp there, 2^-7):
  kernel vs its emulating reference (fp8: block_fp8_matmul_reference; awq: x @ dequantize in
  fp32), fp32 out:        |out - ref| <= ACCUM_TOL * bound, ACCUM_TOL = 2^-20 (8 fp32 ulps of
                          the bound: the sums are the same, in another order; measured 2.4e-7);
                          for fp8 compiled on Hopper 2^-10 (its fp8 MMA sums a K tile in ~14 bits)
  fp8, out in x's dtype:  + u |ref| (the output's rounding)
  awq, x in bf16/fp16:    + 2u bound (W rounded to x's dtype for the dot, and the output rounding)
  fp8 vs plain dequantize-and-matmul (x unquantized): + the activation quantization's own error,
                          |x - x_q| <= 2^-4 |x| (e4m3's unit roundoff) + 2^-19 amax(x's group)
                          (half the spacing of e4m3's subnormals, 2^-9 * amax / 448)
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed: the quantized GEMM kernels are untested here")

from nanovllm.layers.quantization import awq, awq_triton, fp8, fp8_triton, split_k  # noqa: E402
from nanovllm.layers.quantization.awq_triton import awq_gemm  # noqa: E402
from nanovllm.layers.quantization.fp8_triton import block_fp8_matmul, per_token_group_quant  # noqa: E402

# Ask the modules, not the environment: they may have been imported before this file set the variable.
INTERPRETED = fp8_triton.INTERPRETED
assert awq_triton.INTERPRETED == INTERPRETED
DEVICE = "cpu" if INTERPRETED else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("the kernels were imported compiled (TRITON_INTERPRET off) and there is no CUDA device",
                allow_module_level=True)

ACCUM_TOL = 2.0 ** -20
# Hopper's fp8 MMA keeps ~14 bits while it sums (DeepSeek-V3, section 3.3.2: up to 2% relative
# error over K = 4096 unpromoted); the kernel promotes every 128-deep K tile to fp32, so a tile's
# sum is off by about 2% / 32 = 2^-10.6 of it at worst; 2^-10 of the absolute sum leaves room.
# The same tests compiled on a GPU (DEVICE "cuda") hold the fp8 GEMM to that.
HOPPER_FP8_ACCUM_TOL = 2.0 ** -10
FP8_ACCUM_TOL = ACCUM_TOL if INTERPRETED else HOPPER_FP8_ACCUM_TOL
ROUNDING = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** (-7 if INTERPRETED else -8)}
E4M3_ROUNDOFF = 2.0 ** -4                    # 3 mantissa bits
E4M3_SUBNORMAL_HALF_SPACING = 2.0 ** -19     # of amax: 2^-9 * (amax / 448) / 2 < 2^-19 amax
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK = (128, 128)


def randn(*shape, gen, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def assert_within(out, ref, tol, what):
    """|out - ref| <= tol elementwise, reporting the worst element."""
    err = (out.float() - ref).abs()
    excess = err - tol
    worst = excess.argmax()
    assert excess.max() <= 0, (f"{what}: |out - ref| = {err.flatten()[worst]:.3g} > {tol.flatten()[worst]:.3g} "
                               f"at {divmod(worst.item(), out.shape[1])} ({(excess > 0).sum()} elements over)")


# ---------------------------------------------------------------------------------------------
# FP8: per-token-group activation quantization
# ---------------------------------------------------------------------------------------------
def assert_quant_equal(x, group):
    xq, scales = per_token_group_quant(x, group)
    ref_q, ref_scales = fp8.quantize_per_token_group(x, group)
    assert xq.dtype == fp8.FP8 and xq.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == ref_scales.shape
    assert torch.equal(scales, ref_scales), (scales - ref_scales).abs().max()
    different = xq.view(torch.uint8) != ref_q.view(torch.uint8)
    assert not different.any(), (f"{different.sum()} fp8 bytes differ, e.g. x {x[different][:4].tolist()} -> "
                                 f"{xq[different][:4].float().tolist()}, expected {ref_q[different][:4].float().tolist()}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,k,group", [(1, 100, 128), (7, 300, 128), (5, 512, 128), (3, 200, 64)])
def test_per_token_group_quant_is_bit_exact(num_tokens, k, group, dtype):
    """Rows of very different magnitudes, an all-zero row (MIN_SCALE) and a row of -0.0 and tiny
    values: the same fp8 bytes and the same scales as fp8.quantize_per_token_group."""
    gen = torch.Generator().manual_seed(k + num_tokens)
    magnitude = 10.0 ** torch.empty(num_tokens + 2, 1).uniform_(-4, 4, generator=gen)
    x = (torch.randn(num_tokens + 2, k, generator=gen) * magnitude)
    x[0] = 0.0
    x[1] = -0.0
    x[1, ::3] = torch.randn(x[1, ::3].shape, generator=gen) * 1e-30     # fp32 subnormals, some negative
    assert_quant_equal(x.to(dtype).to(DEVICE), group)


def e4m3_sweep(near_ties: bool = True) -> torch.Tensor:
    """fp32 values in [-448, 448] around every e4m3 value: the values, the midpoints between
    neighbours (ties: to even), and (near_ties) one fp32 ulp on either side of each midpoint."""
    bits = torch.arange(128, dtype=torch.uint8)
    values = bits[bits != 0x7F].view(fp8.FP8).float()                    # 0 .. 448, subnormals included
    mids = (values[1:] + values[:-1]) / 2                                 # exact in fp32
    positive = [values, mids]
    if near_ties:
        positive += [mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e3)),
                     torch.tensor([1e-30, 1e-40, 447.0, 447.99])]
    positive = torch.cat(positive)
    return torch.cat([positive, -positive])


@pytest.mark.parametrize("scale", [1.0, 7.0])
def test_per_token_group_quant_rounds_like_torch(scale):
    """Each row's amax is 448 * scale, so the scale is exactly `scale` and x / scale is exact: the
    fp8 bytes are the rounding of the sweep alone, for every tie and near-tie of e4m3, against
    torch's float -> float8_e4m3fn. Scale 7 (the sweep times 7, still exact in fp32) also tells a
    true division from a multiplication by the rounded 1 / 7, which moves 30 of the ties."""
    values = e4m3_sweep(near_ties=scale == 1.0) * scale
    group = 256
    rows = -(-values.numel() // (group - 1))
    body = torch.zeros(rows * (group - 1))
    body[:values.numel()] = values
    x = torch.cat([torch.full((rows, 1), 448.0 * scale), body.view(rows, group - 1)], dim=1)
    assert_quant_equal(x.to(DEVICE), group)
    assert torch.equal(per_token_group_quant(x.to(DEVICE), group)[1].cpu(), torch.full((rows, 1), scale))


# ---------------------------------------------------------------------------------------------
# FP8: the block-scaled GEMM
# ---------------------------------------------------------------------------------------------
def fp8_case(num_tokens, n, k, dtype, seed, block=BLOCK):
    gen = torch.Generator().manual_seed(seed)
    x = randn(num_tokens, k, gen=gen, dtype=dtype)
    blocks = 10.0 ** torch.empty(-(-n // block[0]), -(-k // block[1])).uniform_(-1, 1, generator=gen)
    w = torch.randn(n, k, generator=gen) * k ** -0.5 * fp8.expand_block_scales(blocks, (n, k), block)  # blocks up to 100x apart
    q, scale_inv = fp8.quantize_block(w, block)
    return x, q.to(DEVICE), scale_inv.to(DEVICE)


def check_fp8(x, q, scale_inv, block=BLOCK, **kwargs):
    """The kernel (fp32 out and x's dtype) against the emulating reference, then against plain
    dequantize-and-matmul; returns the worst errors relative to the bound, for the record.
    kwargs (split_k) go to block_fp8_matmul."""
    bk = block[1]
    w_deq = fp8.dequantize_block(q, scale_inv, block, torch.float32)
    xq, x_scales = fp8.quantize_per_token_group(x, bk)
    x_deq = xq.float() * x_scales.repeat_interleave(bk, 1)[:, :x.shape[1]]
    bound = x_deq.abs() @ w_deq.abs().T
    ref = fp8.block_fp8_matmul_reference(x.float(), q, scale_inv, block)    # fp32 (x.float() is exact)

    out32 = block_fp8_matmul(x, q, scale_inv, block, out_dtype=torch.float32, **kwargs)
    assert out32.dtype == torch.float32 and out32.shape == (x.shape[0], q.shape[0])
    assert_within(out32, ref, FP8_ACCUM_TOL * bound, "fp32 out vs block_fp8_matmul_reference")

    out = block_fp8_matmul(x, q, scale_inv, block, **kwargs)
    assert out.dtype == x.dtype
    assert_within(out, ref, FP8_ACCUM_TOL * bound + ROUNDING[x.dtype] * ref.abs(),
                  f"{x.dtype} out vs block_fp8_matmul_reference")

    # plain: x unquantized, times the dequantized weight
    xf = x.float()
    padded = torch.zeros(x.shape[0], x_scales.shape[1] * bk, device=x.device)
    padded[:, :x.shape[1]] = xf.abs()
    amax = padded.view(x.shape[0], -1, bk).amax(2).repeat_interleave(bk, 1)[:, :x.shape[1]]
    x_err = E4M3_ROUNDOFF * xf.abs() + E4M3_SUBNORMAL_HALF_SPACING * amax
    plain = xf @ w_deq.T
    plain_bound = xf.abs() @ w_deq.abs().T
    assert_within(out32, plain, x_err @ w_deq.abs().T + FP8_ACCUM_TOL * (bound + plain_bound),
                  "fp32 out vs x @ dequantize_block(q).T")
    return (((out32 - ref).abs() / bound).max().item(),
            ((out32 - plain).norm() / plain.norm()).item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,n,k", [(1, 200, 300), (7, 64, 100), (16, 130, 512), (17, 200, 300),
                                            (33, 128, 512), (200, 72, 100)])
def test_block_fp8_matmul_matches_reference(num_tokens, n, k, dtype):
    """Ragged N and K (masks; the last scale block partial), decode tiles (T <= 16) and prefill
    tiles (several M tiles at T = 200), 1 to 4 K blocks."""
    x, q, scale_inv = fp8_case(num_tokens, n, k, dtype, seed=num_tokens * 1000 + n + k)
    check_fp8(x, q, scale_inv)


@pytest.mark.parametrize("num_tokens", [3, 20])
@pytest.mark.parametrize("block", [(96, 64), (64, 32)])
def test_block_fp8_matmul_other_blocks(num_tokens, block):
    """Scale blocks the N tile does not divide (96 rows; 64 against the 128-wide prefill tile: the
    per-column scale lookup) and K tiles narrower than 128 (bk = 64, 32)."""
    x, q, scale_inv = fp8_case(num_tokens, 200, 300, torch.float32, seed=num_tokens + block[0], block=block)
    assert fp8_triton.block_k_for(block[1]) == block[1]
    check_fp8(x, q, scale_inv, block)


def test_block_fp8_matmul_strided_input_and_no_tokens():
    x, q, scale_inv = fp8_case(5, 64, 300, torch.float32, seed=1)
    wide = torch.zeros(5, 400, device=DEVICE)
    wide[:, 50:350] = x
    check_fp8(wide[:, 50:350], q, scale_inv)             # row stride 400: the kernels take strides
    assert block_fp8_matmul(x[:0], q, scale_inv).shape == (0, 64)


def test_block_fp8_matmul_rejects_wrong_inputs():
    x, q, scale_inv = fp8_case(2, 200, 300, torch.float32, seed=2)
    cases = [((x[0], q, scale_inv), "x must be 2-D"),
             ((x.int(), q, scale_inv), "x must be one of"),
             ((x[:, :299], q, scale_inv), r"q must be \[N, K\] = \[N, 299\]"),
             ((x, q.float(), scale_inv), "q must be torch.float8_e4m3fn"),
             ((x, q, scale_inv[:1]), r"scale_inv must be \[ceil\(N / bn\), ceil\(K / bk\)\] = \[2, 3\]"),
             ((x, q, scale_inv.double()), "scale_inv must be torch.float32"),
             ((x, q, scale_inv, (128, 16)), "must be a multiple of 32"),
             ((x, q, scale_inv, (128,)), "block must be two positive ints")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            block_fp8_matmul(*args)
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        block_fp8_matmul(x, q, scale_inv, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="group must be a positive int"):
        per_token_group_quant(x, 0)


# ---------------------------------------------------------------------------------------------
# AWQ: the W4A16 GEMM
# ---------------------------------------------------------------------------------------------
def awq_case(num_tokens, n, k, dtype, seed, group=128, random_bits=False):
    """awq.quantize of a random W [K, N], or (random_bits) uniformly random words (every nibble,
    negative int32 included) with random fp16 scales."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(num_tokens, k, gen=gen, dtype=dtype)
    if random_bits:
        words = lambda rows: torch.randint(-2 ** 31, 2 ** 31, (rows, n // awq.PACK), generator=gen,  # noqa: E731
                                           dtype=torch.int64).to(torch.int32)
        qweight, qzeros = words(k), words(k // group)
        scales = (torch.rand(k // group, n, generator=gen) * 0.02).half()
    else:
        qweight, qzeros, scales = awq.quantize(torch.randn(k, n, generator=gen) * k ** -0.5, group)
    return x, qweight.to(DEVICE), qzeros.to(DEVICE), scales.to(DEVICE)


def check_awq(x, qweight, qzeros, scales, group=128, **kwargs):
    """The kernel against x @ dequantize(...) in fp32; returns the worst error relative to the bound.
    kwargs (split_k) go to awq_gemm."""
    w = awq.dequantize(qweight, qzeros, scales, group, torch.float32)         # [K, N]
    ref = x.float() @ w
    bound = x.float().abs() @ w.abs()
    out = awq_gemm(x, qweight, qzeros, scales, group, **kwargs)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[1])
    assert_within(out, ref, (ACCUM_TOL + 2 * ROUNDING[x.dtype]) * bound, f"awq_gemm in {x.dtype} vs x @ dequantize")
    return ((out.float() - ref).abs() / bound).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,n,k", [(1, 64, 128), (7, 200, 256), (16, 96, 384), (33, 64, 256),
                                            (200, 136, 128)])
def test_awq_gemm_matches_dequantized_matmul(num_tokens, n, k, dtype):
    """1 to 3 groups, N not a multiple of the N tile (200, 96, 136), decode and prefill tiles."""
    check_awq(*awq_case(num_tokens, n, k, dtype, seed=num_tokens * 1000 + n + k))


@pytest.mark.parametrize("num_tokens,group", [(3, 128), (20, 64), (5, 32)])
def test_awq_gemm_random_words_and_small_groups(num_tokens, group):
    """Every bit pattern (the top nibble makes words negative: the shifts must not smear the sign),
    zero points anywhere in 0..15, groups smaller than the K tile."""
    check_awq(*awq_case(num_tokens, 64, 256, torch.float32, seed=num_tokens + group, group=group, random_bits=True),
              group)


def test_awq_gemm_strided_input_and_no_tokens():
    x, qweight, qzeros, scales = awq_case(5, 64, 256, torch.float32, seed=3)
    wide = torch.zeros(5, 300, device=DEVICE)
    wide[:, 20:276] = x
    check_awq(wide[:, 20:276], qweight, qzeros, scales)
    assert awq_gemm(x[:0], qweight, qzeros, scales).shape == (0, 64)


def test_awq_gemm_rejects_wrong_inputs():
    x, qweight, qzeros, scales = awq_case(2, 64, 256, torch.float32, seed=4)
    cases = [((x[0], qweight, qzeros, scales), "x must be 2-D"),
             ((x.int(), qweight, qzeros, scales), "x must be one of"),
             ((x[:, :200], qweight, qzeros, scales), r"x's K \(200"),
             ((x, qweight[:128], qzeros, scales), r"qweight must be int32 \[K, N / 8\] = \[256, N / 8\]"),
             ((x, qweight.float(), qzeros, scales), "qweight must be int32"),
             ((x, qweight, qzeros[:1], scales), r"qzeros must be int32 \[K / group, N / 8\] = \[2, 8\]"),
             ((x, qweight, qzeros, scales[:, :8]), r"scales must be float \[K / group, N\] = \[2, 64\]"),
             ((x, qweight, qzeros, scales, 100), "group must be a power of two")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            awq_gemm(*args)


# ---------------------------------------------------------------------------------------------
# split-K (layers/quantization/split_k.py): forced split counts, the split-count contract
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens,n,k,dtype,splits", [
    (1, 200, 1100, torch.float32, (2, 4, 9)),        # 9 K tiles, the last one ragged (1100 = 8 * 128 + 76)
    (16, 130, 512, torch.bfloat16, (3, 4)),          # 3 splits of 4 tiles: 1, 1 and 2 tiles
    (20, 72, 300, torch.float16, (2, 3)),            # 64-row tiles
])
def test_block_fp8_matmul_split_k(num_tokens, n, k, dtype, splits):
    """Forced split counts up to one K tile per split, at ragged shapes: the same references and
    tolerances as one split (the partials' fp32 sum is the same sum in another order)."""
    x, q, scale_inv = fp8_case(num_tokens, n, k, dtype, seed=num_tokens + n + k)
    assert splits[-1] <= triton.cdiv(k, fp8_triton.block_k_for(BLOCK[1]))
    for s in splits:
        check_fp8(x, q, scale_inv, split_k=s)


@pytest.mark.parametrize("num_tokens,n,k,dtype,group,splits", [
    (1, 200, 512, torch.float32, 128, (3, 16)),      # fp32: K tiles of 32, 16 of them; 3 uneven splits
    (7, 96, 512, torch.bfloat16, 128, (2, 3, 4)),    # K tiles of 128, one per group
    (5, 64, 256, torch.float32, 32, (3, 8)),         # groups of 32, one per tile
    (20, 64, 256, torch.float16, 64, (2, 4)),        # 64-row tiles, K tiles of 64
])
def test_awq_gemm_split_k(num_tokens, n, k, dtype, group, splits):
    x, qweight, qzeros, scales = awq_case(num_tokens, n, k, dtype, seed=num_tokens + n + k, group=group,
                                          random_bits=dtype == torch.float32)
    assert splits[-1] == k // awq_triton.tile_options(num_tokens, group, dtype)[0].block_k
    for s in splits:
        check_awq(x, qweight, qzeros, scales, group, split_k=s)


class GridSpy:
    """Stands in for a kernel: records each launch's grid, then launches the kernel."""
    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


# Real layers (N, K): Qwen3-0.6B's qkv, o, gate_up and down; Llama-3-8B's; Qwen3-30B-A3B's attention
REAL_LAYERS = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
               (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (9216, 2048), (2048, 4096)]
H200_SMS = 132
PLANS = {"fp8": lambda t, n, k, device: fp8_triton.gemm_plan(t, n, k, BLOCK[1], device),
         "awq": lambda t, n, k, device: awq_triton.gemm_plan(t, n, k, 128, torch.bfloat16, device)}


def launched_programs(num_tokens, n, tiles, splits):
    return triton.cdiv(num_tokens, tiles.block_m) * triton.cdiv(n, tiles.block_n) * splits


@pytest.mark.parametrize("kernel", sorted(PLANS))
def test_quantized_gemms_give_every_sm_two_programs_from_17_to_128_tokens(kernel):
    """The issue's target: at T = 64 (and across 17..128, a batch's decode or a verify step) every
    real layer shape launches at least PROGRAMS_PER_SM = 2 programs per SM of an H200, by the plan
    alone (shapes and the SM count). Before the tiles followed the program count, 64 tokens of an
    N = 1024 layer took one 64 x 128 prefill tile per 128 columns and no split: 8 programs."""
    assert split_k.CPU_STAND_IN_SMS == H200_SMS
    cpu = torch.device("cpu")
    for num_tokens in (17, 32, 64, 100, 128):
        for n, k in REAL_LAYERS:
            tiles, splits = PLANS[kernel](num_tokens, n, k, cpu)
            programs = launched_programs(num_tokens, n, tiles, splits)
            assert programs >= split_k.PROGRAMS_PER_SM * H200_SMS, (num_tokens, n, k, tiles, splits)


@pytest.mark.parametrize("kernel", sorted(PLANS))
def test_plan_keeps_prefill_tiles_wide_and_unsplit(kernel):
    """A long prefill's grid fills the chip many times over: the widest tile (the most reuse per
    loaded tile), no partials."""
    for n, k in REAL_LAYERS:
        tiles, splits = PLANS[kernel](4096, n, k, torch.device("cpu"))
        assert (tiles.block_m, tiles.block_n, splits) == (64, 128, 1), (n, k)


def test_plan_contract():
    """plan takes the first option (widest first) whose grid, split by split_k_for, reaches
    PROGRAMS_PER_SM per SM, else the last; split_k_for splits only grids smaller than the SM count,
    no more than wanted, each split at least MIN_K_TILES_PER_SPLIT K tiles."""
    sms = 132
    target = split_k.PROGRAMS_PER_SM * sms
    wide, narrow = split_k.Tiles(64, 128, 128, 4, 3), split_k.Tiles(64, 32, 128, 4, 4)
    assert split_k.plan(4096, 4096, 4096, (wide, narrow), sms) == (wide, 1)      # 2048 programs
    assert split_k.plan(64, 4096, 4096, (wide, narrow), sms) == (wide, 9)        # 32 x 9 = 288
    assert split_k.plan(64, 1024, 1024, (wide, narrow), sms) == (narrow, 4)      # 8 x 4 short; 32 x 4 = 128
    assert split_k.plan(512, 4096, 1024, (wide, narrow), sms) == (narrow, 1)     # 256 unsplit, then 1024
    # exactly PROGRAMS_PER_SM per SM is enough: the wide option is taken, not passed over
    assert split_k.plan(64, 264 * 128, 4096, (wide, narrow), sms) == (wide, 1)   # 264 programs unsplit
    assert split_k.plan(64, 66 * 128, 4096, (wide, narrow), sms) == (wide, 4)    # 66 x 4 = 264
    assert split_k.split_k_for(131, 1 << 16, 128, sms) == 3                       # one SM idle: split
    assert split_k.split_k_for(132, 1 << 16, 128, sms) == 1                       # every SM busy
    assert split_k.split_k_for(1, 3 * 128, 128, sms) == 1                         # 3 K tiles: too few to split
    for grid in (1, 7, 32, 100, 131, 132, 500):
        for k in (32, 300, 1024, 4096, 12288):
            for block_k in (32, 64, 128):
                s = split_k.split_k_for(grid, k, block_k, sms)
                k_tiles = triton.cdiv(k, block_k)
                assert 1 <= s <= max(1, k_tiles // split_k.MIN_K_TILES_PER_SPLIT) <= max(1, k_tiles)
                if grid >= sms:
                    assert s == 1
                elif s > 1:                                                       # no more splits than wanted
                    assert (s - 1) * grid < target
    for num_tokens in (1, 16, 17, 64, 300):
        for n in (8, 200, 1024, 4096):
            options = fp8_triton.tile_options(num_tokens, 128)
            tiles, s = split_k.plan(num_tokens, n, 4096, options, sms)
            reaching = [o for o in options if launched_programs(
                num_tokens, n, o, split_k.split_k_for(launched_programs(num_tokens, n, o, 1), 4096, 128, sms)) >= target]
            assert tiles == (reaching[0] if reaching else options[-1])
    assert split_k.num_sms(torch.device("cpu")) == split_k.CPU_STAND_IN_SMS


@pytest.mark.parametrize("num_tokens", [5, 40])
def test_every_tile_option_matches_the_references(num_tokens, monkeypatch):
    """Each tile either wrapper may launch (every option of tile_options, at 16- and 64-row tiles,
    each dtype's), forced one at a time, computes the same GEMM: the references and tolerances of
    check_fp8 / check_awq, at a ragged N, with and without a split."""
    fp8_options, awq_options = fp8_triton.tile_options, awq_triton.tile_options
    for i in range(len(fp8_options(num_tokens, BLOCK[1]))):
        monkeypatch.setattr(fp8_triton, "tile_options", lambda *a, i=i: (fp8_options(*a)[i],))
        x, q, scale_inv = fp8_case(num_tokens, 200, 512, torch.bfloat16, seed=i)
        for s in (None, 1):
            check_fp8(x, q, scale_inv, split_k=s)
    for dtype in (torch.bfloat16, torch.float32):
        for i in range(len(awq_options(num_tokens, 128, dtype))):
            monkeypatch.setattr(awq_triton, "tile_options", lambda *a, i=i: (awq_options(*a)[i],))
            for s in (None, 1):
                check_awq(*awq_case(num_tokens, 136, 512, dtype, seed=i), split_k=s)


def test_split_k_is_chosen_by_shape_and_one_split_writes_the_output(monkeypatch):
    """The wrappers launch gemm_plan's tiles and split count for the shape whatever the data (what
    lets a CUDA graph capture and an eager call of one shape split alike); one split launches no
    sum kernel."""
    gemm = GridSpy(fp8_triton._block_fp8_matmul_kernel)
    awq_kernel = GridSpy(awq_triton._awq_gemm_kernel)
    sums = GridSpy(split_k._sum_splits_kernel)
    monkeypatch.setattr(fp8_triton, "_block_fp8_matmul_kernel", gemm)
    monkeypatch.setattr(awq_triton, "_awq_gemm_kernel", awq_kernel)
    monkeypatch.setattr(split_k, "_sum_splits_kernel", sums)
    device = torch.device(DEVICE)
    for seed in (1, 2):                                  # same shapes, other data: the same grids
        x, q, scale_inv = fp8_case(2, 64, 1024, torch.float32, seed=seed)
        check_fp8(x, q, scale_inv)
        xa, qweight, qzeros, scales = awq_case(2, 64, 1024, torch.bfloat16, seed=seed)
        check_awq(xa, qweight, qzeros, scales)
    tiles, splits = fp8_triton.gemm_plan(2, 64, 1024, BLOCK[1], device)
    awq_tiles, awq_splits = awq_triton.gemm_plan(2, 64, 1024, 128, torch.bfloat16, device)
    # 8 K tiles of 128: at most 4 splits of 2; no tile fills the chip, so the narrowest, split 4 ways
    assert (tiles.block_n, splits, awq_tiles.block_n, awq_splits) == (16, 4, 32, 4)
    assert gemm.grids == [(1, 4, 4)] * 4 and awq_kernel.grids == [(1, 2, 4)] * 2
    assert len(sums.grids) == 6
    sums.grids.clear()
    x, q, scale_inv = fp8_case(300, 256, 256, torch.float32, seed=3)    # 2 K tiles: too few to split
    block_fp8_matmul(x, q, scale_inv, BLOCK)
    assert gemm.grids[-1] == (5, 16, 1) and sums.grids == []


def test_split_k_rejects_wrong_counts():
    x, q, scale_inv = fp8_case(2, 64, 300, torch.float32, seed=5)       # 3 K tiles
    xa, qweight, qzeros, scales = awq_case(2, 64, 256, torch.bfloat16, seed=5)   # 2 K tiles
    for bad in (0, 4, 1.0, True, "2"):
        with pytest.raises(ValueError, match=r"split_k must be None \(chosen by shape\) or an int in 1\.\.3"):
            block_fp8_matmul(x, q, scale_inv, BLOCK, split_k=bad)
    with pytest.raises(ValueError, match=r"an int in 1\.\.2"):
        awq_gemm(xa, qweight, qzeros, scales, 128, split_k=3)


# ---------------------------------------------------------------------------------------------
# the micro-benchmark's CPU smoke run
# ---------------------------------------------------------------------------------------------
def test_bench_quant_gemm_cpu_smoke(capsys):
    if DEVICE != "cpu":
        pytest.skip("the CPU smoke run is for interpreter machines")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_quant_gemm
    results = bench_quant_gemm.main(["--device", "cpu", "--tokens", "1", "20", "--n", "64", "--k", "1024",
                                     "--iters", "1"])
    out = capsys.readouterr().out
    assert [r["tokens"] for r in results] == [1, 1, 1, 20, 20, 20]
    assert {r["method"] for r in results} == {"bf16 F.linear", "block_fp8_matmul", "awq_gemm"}
    assert all(r["check_ok"] and r["time_per_call_s"] > 0 and r["weight_gbs"] > 0 for r in results)
    fp8_row = next(r for r in results if r["method"] == "block_fp8_matmul")
    assert fp8_row["weight_bytes"] == 64 * 1024 + 1 * 8 * 4          # fp8 bytes + the [1, 8] fp32 scales
    # 8 K tiles of 128 (AWQ's 64-row tiles: 16 of 64): splits of 2, the narrowest tiles (CPU_STAND_IN_SMS)
    assert [r["split_k"] for r in results] == [None, 4, 4, None, 4, 8]
    assert [r["tiles"] for r in results] == [None, "16x16", "16x32", None, "64x16", "64x32"]
    assert "GB/s" in out and "max error" in out and "split" in out


# ---------------------------------------------------------------------------------------------
# GPU: compiled, bf16, realistic shapes (scripts/gpu_check.sh runs these)
# ---------------------------------------------------------------------------------------------
# (N, K): a 4096 x 4096 layer, and Qwen3-0.6B's qkv (4096 x hidden 1024) and down (1024 x intermediate 3072)
GPU_SHAPES = [(4096, 4096), (4096, 1024), (1024, 3072)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                                reason="needs a CUDA device and compiled (not interpreted) kernels")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_block_fp8_matmul_bf16(num_tokens, n, k):
    gen = torch.Generator().manual_seed(num_tokens + n + k)
    x = randn(num_tokens, k, gen=gen, dtype=torch.bfloat16)
    q, scale_inv = fp8.quantize_block(randn(n, k, gen=gen, scale=k ** -0.5))
    assert_quant_equal(x, BLOCK[1])                      # the hardware fp8 cast, bit for bit
    check_fp8(x, q, scale_inv)                           # fp32 and bf16 out, HOPPER_FP8_ACCUM_TOL


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_awq_gemm_bf16(num_tokens, n, k):
    gen = torch.Generator().manual_seed(num_tokens + n + k)
    x = randn(num_tokens, k, gen=gen, dtype=torch.bfloat16)
    qweight, qzeros, scales = awq.quantize(randn(k, n, gen=gen, scale=k ** -0.5), 128)
    check_awq(x, qweight, qzeros, scales)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    """No host sync in either wrapper: both capture into a CUDA graph and replay on new inputs,
    bit-equal to eager calls; at this shape both split K (their workspace from the graph's pool)."""
    gen = torch.Generator().manual_seed(0)
    x = randn(16, 1024, gen=gen, dtype=torch.bfloat16)
    assert fp8_triton.gemm_plan(16, 512, 1024, BLOCK[1], x.device)[1] > 1
    assert awq_triton.gemm_plan(16, 512, 1024, 128, torch.bfloat16, x.device)[1] > 1
    q, scale_inv = fp8.quantize_block(randn(512, 1024, gen=gen, scale=1024 ** -0.5))
    qweight, qzeros, scales = awq.quantize(randn(1024, 512, gen=gen, scale=1024 ** -0.5), 128)
    calls = (lambda: block_fp8_matmul(x, q, scale_inv, BLOCK), lambda: awq_gemm(x, qweight, qzeros, scales, 128))
    for call in calls:
        call()                                           # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    x.copy_(randn(16, 1024, gen=gen, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for out, call in zip(outs, calls):
        torch.testing.assert_close(out, call(), atol=0, rtol=0)


def test_token_count_arguments_are_not_specialized():
    """The kernels compile once whatever T: its arguments are do-not-specialize, and those names are
    parameters of their kernels (a typo would silently do nothing)."""
    import inspect
    for kernel, names in ((fp8_triton._per_token_group_quant_kernel, fp8_triton.QUANT_DYNAMIC_ARGS),
                          (fp8_triton._block_fp8_matmul_kernel, fp8_triton.GEMM_DYNAMIC_ARGS),
                          (awq_triton._awq_gemm_kernel, awq_triton.GEMM_DYNAMIC_ARGS)):
        kept = kernel.do_not_specialize if hasattr(kernel, "do_not_specialize") else kernel.kwargs["do_not_specialize"]
        params = list(inspect.signature(kernel.fn).parameters)
        assert {params[n] if isinstance(n, int) else n for n in kept} == set(names) <= set(params)
