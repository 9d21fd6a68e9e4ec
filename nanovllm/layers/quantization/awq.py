"""AWQ int4 weights (quant_method "awq", version "gemm", 4 bits, zero point, groups of 128 inputs).

A layer y = x W with W [in, out] (AWQ stores the transpose of nn.Linear's weight) is kept as
  qweight [in, out / 8] int32   eight 4-bit values per int32, along the output features
  qzeros  [in / g, out / 8] int32   each group's zero points, packed the same way
  scales  [in / g, out] fp16        each group's scales
and W[i, o] = (q[i, o] - z[i // g, o]) * s[i // g, o]. AWQ interleaves the eight values of a word:
the value of output column 8 c + j sits in nibble AWQ_NIBBLE[j] (bits 4 AWQ_NIBBLE[j] ..+3), an
order chosen for its CUDA kernel's fast int4 -> fp16 conversion.
"""
import torch

from nanovllm.layers.linear import Axes
from nanovllm.layers.quantization.base import PACK, check_divisible, new_param
from nanovllm.utils.triton_mode import import_kernels

AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)       # column j of a word -> its nibble
_SHIFTS = torch.tensor(AWQ_NIBBLE, dtype=torch.int32) * 4


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] int32 -> [R, C] int32 values in 0..15, in column order."""
    shifts = _SHIFTS.to(packed.device)
    return ((packed[:, :, None] >> shifts) & 0xF).flatten(1)


def pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] integers in 0..15 -> [R, C / 8] int32 in AWQ's nibble order (the inverse of unpack)."""
    v = values.to(torch.int64).view(values.shape[0], -1, PACK)
    words = (v << _SHIFTS.to(torch.int64).to(values.device)).sum(dim=2)   # 32 bits in an int64
    return _wrap_int32(words)


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits (the top nibble makes some negative)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def quantize(w: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [in, out] -> (qweight, qzeros, scales) in AWQ's format, asymmetric per group (round to
    nearest; no activation-aware search: tests build checkpoints with it)."""
    inp, out = w.shape
    groups = w.float().view(inp // group, group, out)
    low, high = groups.amin(dim=1), groups.amax(dim=1)                      # [in / g, out]
    scales = ((high - low) / 15).clamp(min=1e-8)
    zeros = (-low / scales).round().clamp(0, 15)
    q = (groups / scales[:, None] + zeros[:, None]).round().clamp(0, 15).view(inp, out)
    return pack(q), pack(zeros), scales.to(torch.float16)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """W [in, out] in dtype: (q - z) * s, each group's zeros and scales repeated over its rows."""
    q, z = unpack(qweight), unpack(qzeros).repeat_interleave(group, 0)
    return ((q - z).float() * scales.float().repeat_interleave(group, 0)).to(dtype)


class AwqLinearMethod:
    """An AWQ checkpoint's qweight / qzeros / scales load as they are (sharded by whole words of output
    features or whole groups of input rows). The GEMM: our Triton kernel on CUDA, else a matmul."""

    def __init__(self, group: int):
        self.group = group

    def create_weights(self, layer, input_size: int, output_size: int):
        g = self.group
        check_divisible(layer, "output features", layer.output_sizes, PACK, "an AWQ checkpoint")
        check_divisible(layer, "input features", [input_size], g, "an AWQ checkpoint")
        new_param(layer, "qweight", (input_size, output_size // PACK), torch.int32,
                  Axes(output_dim=1, input_dim=0, output_pack=PACK))
        new_param(layer, "qzeros", (input_size // g, output_size // PACK), torch.int32,
                  Axes(output_dim=1, input_dim=0, output_pack=PACK, input_pack=g))
        new_param(layer, "scales", (input_size // g, output_size), torch.float16,
                  Axes(output_dim=1, input_dim=0, input_pack=g))

    def checkpoint_tensors(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a checkpoint of the float weight w [out, in] holds (dummy weights are one)."""
        qweight, qzeros, scales = quantize(w.T.contiguous(), self.group)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales}

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            kernels = import_kernels("nanovllm.layers.quantization.awq_triton", "cuda", "the AWQ GEMM")
            y = kernels.awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, self.group)
        else:
            y = x @ dequantize(layer.qweight, layer.qzeros, layer.scales, self.group, x.dtype)
        return y if bias is None else y + bias
