import torch
from torch import nn


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) ("neox" layout, as Hugging Face's rotate_half).
    x: [T, heads, d]; cos, sin: [T, 1, d/2] float32."""
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE with a cos/sin table precomputed for every position up to max_position."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope_scaling!r} is not supported by this model")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, d/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
