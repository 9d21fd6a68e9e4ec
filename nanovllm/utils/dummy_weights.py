"""Dummy weights: random values of the right shapes, for benchmarks (load_format="dummy"; loaded
when asked for)."""
import torch
from torch import nn

from nanovllm.utils.loader import process_weights_after_loading

# Small uniform values keep activations finite through any depth (throughput ignores the values).
DUMMY_WEIGHT_RANGE = 1e-3
# Quantized layers' scales, by name ending (block-FP8's weight_scale_inv and an MoE's w13_scale_inv;
# AWQ's scales), map random codes (fp8 in [-1, 1]; int4 codes minus zero points in [-15, 15]) there too.
DUMMY_SCALES = {"scale_inv": DUMMY_WEIGHT_RANGE, "scales": DUMMY_WEIGHT_RANGE / 15}


@torch.no_grad()
def load_dummy(model: nn.Module, seed: int = 0):
    """Random weights of the right shapes; norms stay at 1 so activations keep a sane scale.
    Quantized layers get random codes (fp8 in [-1, 1], int4 words of random bits) and scales that
    bring their weights to the same small range."""
    generators = {}
    for name, param in model.named_parameters():
        if getattr(param, "optional", False):  # (KV-cache scales: random ones would be negative)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        generator = generators[param.device]
        scale = next((value for ending, value in DUMMY_SCALES.items() if name.endswith(ending)), None)
        if "norm" in name:
            param.fill_(1.0)
        elif scale is not None:
            param.fill_(scale)
        elif param.dtype == torch.int32:  # packed int4 words
            param.random_(generator=generator)
        elif param.dtype.itemsize == 1:   # fp8 codes (uniform_ takes no fp8 tensor)
            param.copy_(torch.empty(param.shape, device=param.device).uniform_(-1, 1, generator=generator))
        else:
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
    process_weights_after_loading(model)
