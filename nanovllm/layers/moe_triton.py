"""The fused mixture-of-experts kernel: every token's top-k experts in two Triton launches.

Token t's slot j is "pair" p = t * k + j, P = T * k pairs. The pairs are grouped by expert, and each
group runs as one tiled matmul against its expert's weights:

  align_by_expert   (plain PyTorch) sorts the pairs by expert, each expert's run padded with the
                    sentinel P to whole tiles of BLOCK_M, so a tile belongs to one expert.
  _gate_up_kernel   grid (tiles of BLOCK_M pairs, tiles of BLOCK_N intermediate columns): the rows
                    x[p // k] times the expert's gate rows and up rows (two fp32 accumulators), and
                    silu(gate) * up written to row p of an intermediate buffer [P, I].
  _down_kernel      the same over hidden columns: intermediate rows times the expert's w2, times the
                    pair's routing weight, to row p of out_pairs [P, H] (fp32).
Then out = out_pairs.view(T, k, H).sum(1).

FP8 weights (layers/quantization/fp8.py) are dequantized in registers, chosen by the constexpr
SCALES (NO_SCALES compiles to the plain kernels):
  CHANNEL_SCALES  w[e, n, k] = q[e, n, k] * scale[e, n]: a per-output-column scale factors out of
                  the sum over k, so it multiplies the fp32 accumulator once, after the loop.
  BLOCK_SCALES    w[e, n, k] = q[e, n, k] * scale_inv[e, n // GROUP_N, k // GROUP_K]: BLOCK_K
                  divides GROUP_K, so a K tile lies in one block column; each tile's product is
                  scaled by its columns' block scales before it is accumulated.
The fp8 tile is converted to the activation dtype first (exact: every e4m3 value is a bf16, fp16 and
fp32 value); the products accumulate in fp32.

No device value is read on the host (CUDA-graph safe): buffers and grid are sized from the bound
max_padded = P + E * (BLOCK_M - 1) (in whole tiles); tiles past the padded length num_padded, which
stays on the device, return at once.

Under TRITON_INTERPRET=1 (read at import: utils/triton_mode.py) the kernels run on CPU tensors in
Triton's interpreter, as the tests check them against torch_experts.
"""
import torch
import triton
import triton.language as tl

# Tiles. tl.dot needs >= 16 rows and columns. BLOCK_M = pairs per tile: 16 while an average
# expert gets fewer than LARGE_BLOCK_M pairs (decode: mostly padding otherwise), 64 beyond.
SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
BLOCK_N = 64                   # output columns per program (bf16/fp16)
BLOCK_K = 32                   # reduction step
BLOCK_N_FP32 = 32              # fp32 takes the exact ("ieee") FMA path: smaller tiles, fewer registers

# The constexpr SCALES (see the module docstring); tl.constexpr, as a kernel may read no other
# globals. The host passes their .value.
NO_SCALES, CHANNEL_SCALES, BLOCK_SCALES = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


# ---- kernels --------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x_ptr, w13_ptr, mid_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, scale_ptr,
                    num_pairs, hidden, inter,
                    s_xt, s_xh, s_we, s_wn, s_wk, s_mp, s_mi, s_se, s_sn, s_sk,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr):
    """Grid (max_padded / BLOCK_M, cdiv(I, BLOCK_N)): mid[p] = silu(x[p // k] @ gate.T) * (x[p // k] @ up.T).

    scale_ptr (unread when SCALES is NO_SCALES): w13's scales, [E, 2I] per channel or
    [E, 2I / GROUP_N, cdiv(H, GROUP_K)] per block, strides s_se, s_sn(, s_sk)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):       # past the padded pairs: nothing to do
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))   # int64; P = padding
    pair_ok = pair < num_pairs
    token = pair // TOP_K
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * s_xt + offs_k[None, :] * s_xh                  # [BLOCK_M, BLOCK_K]
    gate_ptrs = w13_ptr + expert * s_we + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + inter * s_wn                   # the up rows follow the gate rows

    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # the scales of this tile's gate and up columns, [BLOCK_N] pointers: a row of scales per column,
    # or per block of GROUP_N columns (the up rows' scales follow the gate rows', as the rows do)
    if SCALES == CHANNEL_SCALES:
        gate_scale_ptrs = scale_ptr + expert * s_se + offs_n * s_sn
        up_scale_ptrs = gate_scale_ptrs + inter * s_sn
    if SCALES == BLOCK_SCALES:
        gate_scale_ptrs = scale_ptr + expert * s_se + (offs_n // GROUP_N) * s_sn
        up_scale_ptrs = gate_scale_ptrs + (inter // GROUP_N) * s_sn
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        xt = tl.load(x_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if SCALES == NO_SCALES:
            acc_gate = tl.dot(xt, gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(xt, up, acc_up, input_precision=DOT_PRECISION)
        elif SCALES == CHANNEL_SCALES:
            acc_gate = tl.dot(xt, gate.to(xt.dtype), acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(xt, up.to(xt.dtype), acc_up, input_precision=DOT_PRECISION)
        else:  # this K tile's block column: one scale per output column
            gate_scale = tl.load(gate_scale_ptrs + (k0 // GROUP_K) * s_sk, mask=n_ok, other=0.0)
            up_scale = tl.load(up_scale_ptrs + (k0 // GROUP_K) * s_sk, mask=n_ok, other=0.0)
            acc_gate += tl.dot(xt, gate.to(xt.dtype), input_precision=DOT_PRECISION) * gate_scale[None, :]
            acc_up += tl.dot(xt, up.to(xt.dtype), input_precision=DOT_PRECISION) * up_scale[None, :]
        x_ptrs += BLOCK_K * s_xh
        gate_ptrs += BLOCK_K * s_wk
        up_ptrs += BLOCK_K * s_wk
    if SCALES == CHANNEL_SCALES:
        acc_gate *= tl.load(gate_scale_ptrs, mask=n_ok, other=0.0)[None, :]
        acc_up *= tl.load(up_scale_ptrs, mask=n_ok, other=0.0)[None, :]

    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # silu(gate) * up, in fp32
    tl.store(mid_ptr + pair[:, None] * s_mp + offs_n[None, :] * s_mi, act.to(mid_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(mid_ptr, w2_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
                 scale_ptr,
                 num_pairs, hidden, inter,
                 s_mp, s_mi, s_we, s_wn, s_wk, s_op, s_oh, s_se, s_sn, s_sk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr,
                 SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr):
    """Grid (max_padded / BLOCK_M, cdiv(H, BLOCK_N)): out_pairs[p] = weights[p] * (mid[p] @ w2[e].T).

    scale_ptr (unread when SCALES is NO_SCALES): w2's scales, [E, H] per channel or
    [E, cdiv(H, GROUP_N), I / GROUP_K] per block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    mid_ptrs = mid_ptr + pair[:, None] * s_mp + offs_k[None, :] * s_mi              # [BLOCK_M, BLOCK_K]
    w_ptrs = w2_ptr + expert * s_we + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk   # [BLOCK_K, BLOCK_N]

    if SCALES == CHANNEL_SCALES:
        scale_ptrs = scale_ptr + expert * s_se + offs_n * s_sn             # [BLOCK_N]
    if SCALES == BLOCK_SCALES:
        scale_ptrs = scale_ptr + expert * s_se + (offs_n // GROUP_N) * s_sn

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k < inter - k0
        a = tl.load(mid_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALES == NO_SCALES:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        elif SCALES == CHANNEL_SCALES:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        else:
            scale = tl.load(scale_ptrs + (k0 // GROUP_K) * s_sk, mask=n_ok, other=0.0)
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION) * scale[None, :]
        mid_ptrs += BLOCK_K * s_mi
        w_ptrs += BLOCK_K * s_wk
    if SCALES == CHANNEL_SCALES:
        acc *= tl.load(scale_ptrs, mask=n_ok, other=0.0)[None, :]

    weight = tl.load(weights_ptr + pair, mask=pair_ok, other=0.0)                   # fp32 routing weight
    tl.store(out_ptr + pair[:, None] * s_op + offs_n[None, :] * s_oh, acc * weight[:, None],
             mask=pair_ok[:, None] & n_ok[None, :])


# ---- host side ------------------------------------------------------------------------------
def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Large tiles once an average expert fills one; small ones otherwise (less padding)."""
    return LARGE_BLOCK_M if num_pairs >= LARGE_BLOCK_M * num_experts else SMALL_BLOCK_M


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs of ids [T, k] by expert, each expert's run padded to whole tiles.

    Returns (sorted_pairs [max_padded] int64: pair indices, the sentinel P in padding; block_expert
    [max_padded / block_m] int64: each tile's expert, E - 1 past num_padded; num_padded [1] int64: the
    padded length, on the device). No host sync or data-dependent shape: CUDA-graph safe.
    """
    flat = ids.flatten().to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    max_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)                        # where each expert's padded run ends
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts                    # and where its run starts without padding

    order = torch.argsort(flat, stable=True)             # pair indices, grouped by expert
    expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[expert]     # position within its expert's run
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, padded_start[expert] + rank, order)

    tile_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert, padded_end[-1:]


def scale_arguments(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None):
    """A kernel's scale arguments for weights w [E, N, K]: (scale tensor, its three strides, SCALES,
    GROUP_N, GROUP_K). Per channel scale is [E, N] (its stride along K is 0); per block it is
    [E, cdiv(N, bn), cdiv(K, bk)]. Unquantized: w itself stands in for the pointer, never read."""
    num_experts, n, k = w.shape
    if scale is None:
        return w, 0, 0, 0, NO_SCALES.value, 1, 1
    if block is None:
        expected = (num_experts, n)
        kind, strides = CHANNEL_SCALES.value, (*scale.stride(), 0)
    else:
        expected = (num_experts, triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
        kind, strides = BLOCK_SCALES.value, scale.stride()
    if tuple(scale.shape) != expected:
        raise ValueError(f"scales of shape {tuple(scale.shape)} for weights {tuple(w.shape)}"
                         f"{f' in {block} blocks' if block else ''}; expected {expected}")
    return (scale, *strides, kind, *(block or (1, 1)))


def triton_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """The fused experts, same contract as torch_experts in layers/moe.py (weights float32, ids int64).

    FP8 scales as scale_arguments takes them; per block, I must be a multiple of bn (the up rows'
    blocks start where the gate rows' end) and bk one of BLOCK_K.
    """
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w2.shape
    if w13.shape != (num_experts, 2 * inter, hidden) or x.shape != (num_tokens, hidden):
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, ids {tuple(ids.shape)}")
    if (w13_scale is None) != (w2_scale is None) or (w13_scale is None and w13.dtype != x.dtype):
        raise ValueError(f"weights in {w13.dtype} / {w2.dtype} for activations in {x.dtype}: quantized weights "
                         f"come with both w13_scale and w2_scale, unquantized ones in the activations' dtype")
    if block is not None and (inter % block[0] or block[1] % BLOCK_K):
        raise ValueError(f"block-scaled weights need the intermediate size ({inter}) to be a multiple of the "
                         f"block's {block[0]} rows and the block's {block[1]} columns a multiple of "
                         f"BLOCK_K={BLOCK_K}; block {block}")
    w13_scale_args = scale_arguments(w13, w13_scale, block)
    w2_scale_args = scale_arguments(w2, w2_scale, block)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = choose_block_m(num_pairs, num_experts)
    sorted_pairs, block_expert, num_padded = align_by_expert(ids, num_experts, block_m)
    num_tiles = block_expert.shape[0]
    fp32 = x.dtype == torch.float32
    block_n = BLOCK_N_FP32 if fp32 else BLOCK_N
    precision = "ieee" if fp32 else "tf32"               # fp32 would otherwise go through TF32

    scale, *scale_strides, scales, group_n, group_k = w13_scale_args
    mid = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        x, w13, mid, sorted_pairs, block_expert, num_padded, scale, num_pairs, hidden, inter,
        *x.stride(), *w13.stride(), *mid.stride(), *scale_strides,
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, DOT_PRECISION=precision,
        SCALES=scales, GROUP_N=group_n, GROUP_K=group_k, num_warps=4, num_stages=3)

    scale, *scale_strides, scales, group_n, group_k = w2_scale_args
    out_pairs = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32)
    _down_kernel[(num_tiles, triton.cdiv(hidden, block_n))](
        mid, w2, out_pairs, flat_weights, sorted_pairs, block_expert, num_padded, scale, num_pairs, hidden, inter,
        *mid.stride(), *w2.stride(), *out_pairs.stride(), *scale_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, DOT_PRECISION=precision,
        SCALES=scales, GROUP_N=group_n, GROUP_K=group_k, num_warps=4, num_stages=3)
    return out_pairs.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
