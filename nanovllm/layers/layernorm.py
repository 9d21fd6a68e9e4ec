import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32. With `residual`, first x += residual and return
    (y, x): the pre-norm transformer's residual stream travels alongside the normalized output."""
    kernels = None  # the fused kernels (layers/fused_triton.py) where attention.bind_backend binds them

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
