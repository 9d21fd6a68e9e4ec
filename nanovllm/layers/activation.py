import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up, the two halves of a merged gate/up projection."""
    kernels = None  # the fused kernels (layers/fused_triton.py) where attention.bind_backend binds them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_and_mul(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
