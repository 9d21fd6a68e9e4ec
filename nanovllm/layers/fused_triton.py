"""Fused elementwise kernels (Triton) for the CUDA path: what layers/layernorm.py and
layers/activation.py compute as several PyTorch ops each, in one launch (on CPU under Triton's
interpreter, for tests). The model runner binds them to those modules when its attention backend
is Triton's (TritonBackend.elementwise), once at start-up.

  rms_norm(x, weight, eps, residual=None)  RMSNorm over the last axis of rows [R, D] or heads
      [T, H, D] (q/k norm); with residual, x + residual first, returned too (the pre-norm stream)
  silu_and_mul(x)                          [T, 2d] -> [T, d]: silu(gate) * up
  qk_norm_rope(q, k, q_norm, k_norm, ...)  each head of q [T, H, D] and k [T, Hkv, D] through its
      RMSNorm (where the family has one: Qwen3), then RoPE at its token's position, all in one
      launch, cos/sin read from the table in the kernel (no gather per layer)

Each rounds where its PyTorch reference does (to the model's dtype after the residual add, after
the normalization, after silu), so they differ from it only in float32 rounding: the sum of
squares is added up in another order, and rsqrt and exp are the device's.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _normalized(xf, inv, w, dtype: tl.constexpr):
    """weight * (x / rms(x)) rounded as layernorm.RMSNorm rounds: x / rms in float32, to the model's
    dtype, then the product with the weight (in float32, rounded again). xf float32, inv its 1 / rms."""
    return (w.to(tl.float32) * (xf * inv).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, num_heads, n_cols, eps,
                     s_xt, s_xh, s_rt, s_rh, s_ot, s_oh, s_st, s_sh,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # (token, head) for [T, H, D]; a token for [T, D] (num_heads 1)
    t, h = row // num_heads, row % num_heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + t * s_xt + h * s_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # x + residual in the model's dtype, as the reference adds them
        r = tl.load(res_ptr + t * s_rt + h * s_rh + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + t * s_st + h * s_sh + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * s_ot + h * s_oh + cols, _normalized(xf, inv, w, x.dtype), mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, token stride, head stride) of [T, D] or [T, H, D], the last axis contiguous."""
    if x.stride(-1) != 1:
        raise ValueError(f"rms_norm needs its last axis contiguous, got strides {x.stride()}")
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """layernorm.RMSNorm's forward in one kernel: y, or (y, x + residual) with a residual."""
    num_tokens, num_heads, s_xt, s_xh = _rows(x)
    n_cols = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    res = residual if residual is not None else x
    _, _, s_rt, s_rh = _rows(res)
    _, _, s_ot, s_oh = _rows(out)
    if num_tokens * num_heads:
        _rms_norm_kernel[(num_tokens * num_heads,)](
            x, res, weight, out, summed, num_heads, n_cols, eps, s_xt, s_xh, s_rt, s_rh, s_ot, s_oh, s_ot, s_oh,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols), num_warps=4)
    return (out, summed) if residual is not None else out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, s_x, s_o, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * s_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # (rounded, as F.silu returns it)
    tl.store(out_ptr + row * s_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """activation.SiluAndMul's forward in one kernel: [T, 2d] (rows contiguous) -> [T, d]."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs [T, 2d] with contiguous rows, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, SILU_BLOCK))](x, out, d, x.stride(0), out.stride(0),
                                                                       BLOCK=SILU_BLOCK, num_warps=4)
    return out


@triton.jit
def _norm_rope_heads(x_ptr, s_h, w_ptr, out_ptr, s_oh, first, num_heads, cos, sin, eps, HALF: tl.constexpr,
                     HAS_NORM: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """Heads first .. first + HEADS of one token as one [HEADS, BLOCK] tile, each row a head: its
    RMSNorm (HAS_NORM), then its pairs (x[i], x[i + D/2]) rotated, as rotary_embedding.apply_rotary."""
    h = first + tl.arange(0, HEADS)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    mask = (h < num_heads) & (i < HALF)
    x1 = tl.load(x_ptr + h * s_h + i, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + h * s_h + HALF + i, mask=mask, other=0.0)
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.math.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = _normalized(f1, inv, tl.load(w_ptr + i, mask=i < HALF, other=0.0), x1.dtype)
        x2 = _normalized(f2, inv, tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0), x2.dtype)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(out_ptr + h * s_oh + i, (f1 * cos - f2 * sin).to(x1.dtype), mask=mask)
    tl.store(out_ptr + h * s_oh + HALF + i, (f2 * cos + f1 * sin).to(x1.dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_out_ptr,
                         num_q_heads, num_k_heads, eps, s_qt, s_qh, s_kt, s_kh, s_oqt, s_oqh, s_okt, s_okh,
                         HALF: tl.constexpr, HAS_NORM: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    t, part = tl.program_id(0), tl.program_id(1)  # a token, and a tile of HEADS of its q heads, then k heads
    i = tl.arange(0, BLOCK)[None, :]
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + pos * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + i, mask=i < HALF, other=0.0)
    q_parts = tl.cdiv(num_q_heads, HEADS)
    if part < q_parts:
        _norm_rope_heads(q_ptr + t * s_qt, s_qh, qw_ptr, q_out_ptr + t * s_oqt, s_oqh, part * HEADS, num_q_heads,
                         cos, sin, eps, HALF, HAS_NORM, HEADS, BLOCK)
    else:
        _norm_rope_heads(k_ptr + t * s_kt, s_kh, kw_ptr, k_out_ptr + t * s_okt, s_okh, (part - q_parts) * HEADS,
                         num_k_heads, cos, sin, eps, HALF, HAS_NORM, HEADS, BLOCK)


# Heads per program of qk_norm_rope: a tile of up to 8 heads rather than a program per head (Qwen3-0.6B's
# 16 + 8 heads: 3 programs a token, not 24). Under the interpreter (CPU tests) each program is Python:
# one a head, qk_norm_rope took 62% of test_bench_warm_up_compiles_every_variant_of_the_run's samples.
QK_ROPE_HEADS = 8


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding's forward, q_norm / k_norm (RMSNorms, or None) first, in one kernel. q [T, H, D]
    and k [T, Hkv, D] (each head's D contiguous), cos / sin [max_position, D / 2] float32 (contiguous),
    positions [T] -> new contiguous q, k."""
    num_tokens, num_q_heads, head_dim = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride() != (head_dim // 2, 1):
        raise ValueError(f"qk_norm_rope needs each head contiguous and a contiguous cos/sin table, got strides "
                         f"{q.stride()}, {k.stride()}, {cos.stride()}")
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                       device=k.device)
    if num_tokens:
        has_norm = q_norm is not None
        q_weight, k_weight = (q_norm.weight, k_norm.weight) if has_norm else (q, k)  # (unread without norms)
        parts = triton.cdiv(num_q_heads, QK_ROPE_HEADS) + triton.cdiv(k.shape[1], QK_ROPE_HEADS)
        _qk_norm_rope_kernel[(num_tokens, parts)](
            q, k, q_weight, k_weight, cos, sin, positions, q_out, k_out, num_q_heads, k.shape[1],
            q_norm.eps if has_norm else 0.0, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), HALF=head_dim // 2,
            HAS_NORM=has_norm, HEADS=QK_ROPE_HEADS, BLOCK=triton.next_power_of_2(head_dim // 2), num_warps=2)
    return q_out, k_out
