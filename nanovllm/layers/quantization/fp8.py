"""FP8 (e4m3) weights: per-output-channel scales quantized at load, or 128 x 128 block scales read
from a checkpoint. Each scheme's arithmetic in plain PyTorch: what the CPU runs, and the reference
the kernels are tested against.

  per channel   w[o, i] ~= q[o, i] * scale[o]                      scale: [out] float32
  block         w[o, i] ~= q[o, i] * scale_inv[o // bn, i // bk]    scale_inv: [ceil(out/bn), ceil(in/bk)]
                (the published checkpoints' name: it multiplies, despite the "inv")
"""
import torch
import torch.nn.functional as F

from nanovllm.layers.linear import BIAS_AXES, WEIGHT_AXES, Axes
from nanovllm.layers.quantization.base import FP8, FP8_MAX, MIN_SCALE, check_divisible, new_param
from nanovllm.utils.triton_mode import import_kernels


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
    """w [out, in] -> (q fp8 [out, in], scale_inv float32 [ceil(out/bn), ceil(in/bk)]), the published
    FP8 checkpoints' format (each block's largest |w| maps to 448); tests build checkpoints with it."""
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
    """What the block-scaled FP8 GEMM computes, in float32: x quantized per token in groups of block[1]
    (the weight's input block, so each product has one activation and one weight scale), times the
    fp8 weight, each term scaled back. x [T, K], q [N, K] -> [T, N] in x.dtype."""
    xq, x_scales = quantize_per_token_group(x, block[1])
    x_deq = xq.float() * x_scales.repeat_interleave(block[1], 1)[:, :x.shape[1]]
    return (x_deq @ dequantize_block(q, scale_inv, block, torch.float32).T).to(x.dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q fp8 [T, K], scales float32 [T, 1]): the activations of a per-channel GEMM."""
    scales = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def has_fp8_tensor_cores(x: torch.Tensor) -> bool:
    """torch._scaled_mm's FP8 GEMMs need compute capability 8.9 (Ada) or newer."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


# ---- the linear methods ---------------------------------------------------------------------------
class Fp8LinearMethod:
    """quantization="fp8" on an unquantized checkpoint: the weight loads as it is (peak memory: the
    unquantized model's), then each row is quantized with its own scale. The GEMM: torch._scaled_mm
    (activations per token) where FP8 tensor cores exist, else the weight dequantized and F.linear."""

    scaled_mm = False  # whether apply() takes torch._scaled_mm (known once the weights are on their device)

    def create_weights(self, layer, input_size: int, output_size: int):
        new_param(layer, "weight", (output_size, input_size), torch.get_default_dtype(), WEIGHT_AXES)

    def process_weights_after_loading(self, layer):
        q, scale = quantize_per_channel(layer.weight.data)
        del layer.weight
        new_param(layer, "weight", q.shape, FP8, WEIGHT_AXES).data = q
        new_param(layer, "weight_scale", scale.shape, torch.float32, BIAS_AXES).data = scale
        # _scaled_mm's row-wise scaling: FP8 tensor cores, and both sizes of the weight a multiple of 16
        self.scaled_mm = has_fp8_tensor_cores(q) and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.scaled_mm and x.dtype == torch.bfloat16:  # (row-wise scaling writes bf16 only)
            xq, x_scale = quantize_per_token(x)
            return torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale[None],
                                    bias=bias, out_dtype=x.dtype)
        return F.linear(x, dequantize_per_channel(layer.weight, layer.weight_scale, x.dtype), bias)


class Fp8BlockLinearMethod:
    """A block-quantized FP8 checkpoint (Qwen3-*-FP8): `weight` fp8 [out, in] and `weight_scale_inv`
    load as they are. The GEMM on CUDA with FP8 tensor cores (8.9+): our Triton kernel; elsewhere the
    weight dequantized and F.linear."""
    use_kernel = False

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def create_weights(self, layer, input_size: int, output_size: int):
        bn, bk = self.block
        if len(layer.output_sizes) > 1 or layer.tp_size > 1:  # parts and shards begin on a block
            check_divisible(layer, "output features", layer.output_sizes, bn, "a block-quantized fp8 checkpoint")
        if layer.input_is_sharded and layer.tp_size > 1:
            check_divisible(layer, "input features", [input_size], bk, "a block-quantized fp8 checkpoint")
        new_param(layer, "weight", (output_size, input_size), FP8, WEIGHT_AXES)
        new_param(layer, "weight_scale_inv", (-(-output_size // bn), -(-input_size // bk)), torch.float32,
                  Axes(output_dim=0, input_dim=1, output_pack=bn, input_pack=bk))

    def checkpoint_tensors(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a checkpoint of the float weight w [out, in] holds (dummy weights are one)."""
        q, scale_inv = quantize_block(w, self.block)
        return {"weight": q, "weight_scale_inv": scale_inv}

    def process_weights_after_loading(self, layer):
        self.use_kernel = has_fp8_tensor_cores(layer.weight)  # (its fp8 x fp8 dot needs them)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.use_kernel:
            y = fp8_kernels().block_fp8_matmul(x, layer.weight, layer.weight_scale_inv, self.block)
            return y if bias is None else y + bias
        return F.linear(x, dequantize_block(layer.weight, layer.weight_scale_inv, self.block, x.dtype), bias)


def fp8_kernels():
    return import_kernels("nanovllm.layers.quantization.fp8_triton", "cuda", "the block-scaled fp8 GEMM")
