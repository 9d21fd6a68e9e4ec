"""RoPE scalings the core's RotaryEmbedding does not compute (it knows "default" and "llama3"):
"linear" (Gemma 3's 4B-27B global layers) and "yarn" (gpt-oss), each as transformers'
modeling_rope_utils computes it, operation for operation, so the float32 tables are bitwise its.
A model whose config names one builds its table here; a plain generate loads none of this.
"""
import math

import torch

from nanovllm.layers.rotary_embedding import RotaryEmbedding, check_rope_parameters, rope_inv_freq

SCALED_ROPE_TYPES = ("linear", "yarn")
YARN_KEYS = ("factor", "original_max_position_embeddings")


def check_scaled_rope(params: dict, head_dim: int):
    """ValueError naming what is missing or unsupported in RoPE parameters `params` (any rope_type)."""
    rope_type = params["rope_type"]
    if rope_type not in SCALED_ROPE_TYPES:
        return check_rope_parameters(params, head_dim)
    missing = [key for key in (YARN_KEYS if rope_type == "yarn" else ("factor",)) if not params.get(key)]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs {missing} in the config's rope parameters")
    if rope_type == "yarn" and params.get("mscale") and params.get("mscale_all_dim"):
        raise ValueError("rope_type 'yarn' with mscale and mscale_all_dim (DeepSeek's) is not supported")
    check_rope_parameters({**params, "rope_type": "default"}, head_dim)


def yarn_inv_freq(head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters): the inverse frequencies, interpolated by
    `factor` below the correction range, extrapolated (kept) above it, ramped between; and the
    attention factor the cos/sin tables are multiplied by (0.1 ln(factor) + 1 unless given)."""
    base, factor = params["rope_theta"], params["factor"]
    original_max = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (head_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def scaled_rotary_embedding(head_dim: int, max_position: int, params: dict) -> RotaryEmbedding:
    """RoPE of params (rope_parameters(config)'s form), whatever its rope_type among the core's and
    SCALED_ROPE_TYPES: a RotaryEmbedding whose cos/sin tables are those of the scaling."""
    check_scaled_rope(params, head_dim)
    if params["rope_type"] not in SCALED_ROPE_TYPES:
        return RotaryEmbedding(head_dim, max_position, params)
    default = {**params, "rope_type": "default"}
    rope = RotaryEmbedding(head_dim, max_position, default)
    if params["rope_type"] == "linear":  # positions divided by factor: the default frequencies divided
        inv_freq, attention_factor = rope_inv_freq(head_dim, default) / params["factor"], 1.0
    else:
        inv_freq, attention_factor = yarn_inv_freq(head_dim, params)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    rope.cos.copy_(freqs.cos() * attention_factor)
    rope.sin.copy_(freqs.sin() * attention_factor)
    return rope
