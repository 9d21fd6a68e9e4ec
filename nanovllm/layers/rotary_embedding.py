import math

import torch
from torch import nn

# The rope types this file computes; any other (yarn, linear, dynamic, longrope, ...) is refused.
SUPPORTED_ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names no rope_theta


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one dict: rope_type, rope_theta and the type's own keys.
    transformers >= 5 keeps them in `config.rope_parameters`; older releases in `config.rope_theta`
    plus an optional `config.rope_scaling` dict (whose type key may be the legacy "type")."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", DEFAULT_ROPE_THETA))
    params = dict(params)
    params.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


def check_rope_parameters(params: dict, head_dim: int):
    """ValueError naming the option when RoPE asks for something this file does not compute."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported; only 1.0")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} is not supported: rotary embeddings need an even head_dim")
    missing = [key for key in LLAMA3_KEYS if rope_type == "llama3" and params.get(key) is None]
    if missing:
        raise ValueError(f"rope_type 'llama3' needs {missing} in the config's rope parameters")


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, computed as transformers does, operation for
    operation (`_compute_default_rope_parameters` / `_compute_llama3_parameters`), so the cos/sin
    tables are bitwise the same in float32."""
    check_rope_parameters(params, head_dim)
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if params["rope_type"] == "default":
        return inv_freq
    # llama3 (Llama 3.1+): wavelengths longer than the pretraining context / low_freq_factor are
    # stretched by `factor`, shorter than context / high_freq_factor kept, those between interpolated.
    factor, low_freq_factor, high_freq_factor, old_context_len = (params[key] for key in LLAMA3_KEYS)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) ("neox" layout, as Hugging Face's rotate_half).
    x: [T, heads, d]; cos, sin: [T, 1, d/2] float32."""
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE with a cos/sin table precomputed for every position up to max_position.
    `params` is `rope_parameters(config)`; one instance serves every layer of a model."""
    kernels = None  # the fused kernels (layers/fused_triton.py) where attention.bind_backend binds them

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, d/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None):
        """q [T, H, D], k [T, Hkv, D] rotated at their positions, after q_norm / k_norm where given."""
        if self.kernels is not None:
            return self.kernels.qk_norm_rope(q, k, q_norm, k_norm, self.cos, self.sin, positions)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
