"""FP8 (e4m3) weights: per-output-channel scales quantized at load, or 128 x 128 block scales read
from a checkpoint.

The arithmetic of each scheme, in plain PyTorch, is here; it is what the CPU runs and the
reference every kernel is tested against.

  per channel   w[o, i] ~= q[o, i] * scale[o]                      scale: [out] float32
  block         w[o, i] ~= q[o, i] * scale_inv[o // bn, i // bk]    scale_inv: [ceil(out/bn), ceil(in/bk)]
                (the published checkpoints' name: it multiplies, despite the "inv")
"""
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max          # 448: the largest finite e4m3 value
# A scale's floor: an all-zero row or group would otherwise get scale 0 and 0 / 0 = NaN.
MIN_SCALE = 1e-12


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q fp8 [out, in], scale float32 [out]): each row's largest |w| maps to 448."""
    scale = (w.abs().amax(dim=1).float() / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def expand_block_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """[ceil(out/bn), ceil(in/bk)] -> [out, in]: every element's own block scale."""
    bn, bk = block
    return scale_inv.repeat_interleave(bn, 0)[:shape[0]].repeat_interleave(bk, 1)[:, :shape[1]]


def quantize_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q fp8 [out, in], scale_inv float32 [ceil(out/bn), ceil(in/bk)]), the format of
    the published FP8 checkpoints (each block's largest |w| maps to 448). Tests build checkpoints
    with it."""
    bn, bk = block
    out, inp = w.shape
    padded = torch.zeros(-(-out // bn) * bn, -(-inp // bk) * bk, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w.float() / expand_block_scales(scale_inv, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale_inv


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
                     ) -> torch.Tensor:
    return (q.float() * expand_block_scales(scale_inv, q.shape, block)).to(dtype)


def quantize_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization of the block-scaled GEMM: x [T, K] -> (q fp8 [T, K],
    scales float32 [T, ceil(K / group)]), each token's groups of `group` features scaled apart."""
    num_tokens, k = x.shape
    padded = torch.zeros(num_tokens, -(-k // group) * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scales = (padded.view(num_tokens, -1, group).abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scales.repeat_interleave(group, 1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales


def block_fp8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                               block: tuple[int, int]) -> torch.Tensor:
    """What the block-scaled FP8 GEMM computes, in float32: x quantized per token in groups of
    block[1] (block[1] == the weight's input block, so each product term has one activation scale
    and one weight scale), times the fp8 weight, each term scaled back. x [T, K], q [N, K] -> [T, N]
    in x.dtype."""
    xq, x_scales = quantize_per_token_group(x, block[1])
    x_deq = xq.float() * x_scales.repeat_interleave(block[1], 1)[:, :x.shape[1]]
    return (x_deq @ dequantize_block(q, scale_inv, block, torch.float32).T).to(x.dtype)
