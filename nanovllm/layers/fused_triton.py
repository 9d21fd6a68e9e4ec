"""Fused elementwise kernels (Triton) for the CUDA path: what layers/layernorm.py and
layers/activation.py compute as several PyTorch ops each, in one launch (on CPU under Triton's
interpreter, for tests). The model runner binds them to those modules when its attention backend
is Triton's (TritonBackend.elementwise), once at start-up.

  rms_norm(x, weight, eps, residual=None)  RMSNorm over the last axis of rows [R, D] or heads
      [T, H, D] (q/k norm); with residual, x + residual first, returned too (the pre-norm stream)
  silu_and_mul(x)                          [T, 2d] -> [T, d]: silu(gate) * up

Each rounds where its PyTorch reference does (to the model's dtype after the residual add, after
the normalization, after silu), so they differ from it only in float32 rounding: the sum of
squares is added up in another order, and rsqrt and exp are the device's.
"""
import torch
import triton
import triton.language as tl


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
    y = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * s_ot + h * s_oh + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


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
