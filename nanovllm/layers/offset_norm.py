import torch
from torch import nn


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, then rounded to x's dtype: the norm of Gemma 3 and of
    Qwen3.5 (transformers' GemmaRMSNorm, Qwen3_5RMSNorm). Its weights start at 0, and Llama's
    RMSNorm (layers/layernorm.py) rounds before scaling, so neither it nor its fused kernel serves."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)
