"""Dummy weights: random values of the right shapes, for benchmarks (load_format="dummy"; loaded
when asked for)."""
import torch
from torch import nn

from nanovllm.utils.loader import process_weights_after_loading

# Biases: small uniform values.
DUMMY_WEIGHT_RANGE = 1e-3
# Fused experts of an FP8 block checkpoint (no preset has them): random fp8 codes in [-1, 1] and
# scales, by name ending (w13_scale_inv), that bring them to DUMMY_WEIGHT_RANGE (throughput alone).
DUMMY_SCALES = {"scale_inv": DUMMY_WEIGHT_RANGE}


@torch.no_grad()
def load_dummy(model: nn.Module, seed: int = 0):
    """Random weights of the right shapes (weight_range); norms stay at 1.
    A linear layer of a quantized checkpoint (block FP8, AWQ) holds what that checkpoint of the
    unquantized model's random weight would (its method's checkpoint_tensors): the same draws in
    the same order, so a quantized model's output can be checked against the unquantized one's
    (bench.py --probe-check)."""
    generators, done = {}, set()
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype.itemsize > 1)
    for module_name, module in model.named_modules():
        params = {name: p for name, p in module.named_parameters(recurse=False) if id(p) not in done}
        done.update(map(id, params.values()))
        if not params:
            continue
        device = next(iter(params.values())).device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        generator = generators[device]
        checkpoint_tensors = getattr(getattr(module, "quant_method", None), "checkpoint_tensors", None)
        if checkpoint_tensors is not None:  # (drawn where the unquantized layer draws its weight)
            weight = random_weight((module.output_size, module.input_size), dtype, device, generator)
            for name, tensor in checkpoint_tensors(weight).items():
                params.pop(name).copy_(tensor)
        for name, param in params.items():
            fill_random(f"{module_name}.{name}", param, generator)
    process_weights_after_loading(model)


def weight_range(shape) -> float:
    """Uniform in +-sqrt(3 / fan_in): variance 1 / fan_in, so that every layer keeps its input's
    scale and has its real share in the output (a weight's inputs are its last axis)."""
    return (3 / shape[-1]) ** 0.5


def random_weight(shape, dtype, device, generator) -> torch.Tensor:
    bound = weight_range(shape)
    return torch.empty(shape, dtype=dtype, device=device).uniform_(-bound, bound, generator=generator)


def fill_random(name: str, param: torch.Tensor, generator):
    scale = next((value for ending, value in DUMMY_SCALES.items() if name.endswith(ending)), None)
    if getattr(param, "optional", False):  # (KV-cache scales: random ones would be negative)
        return
    if "norm" in name:
        param.fill_(1.0)
    elif scale is not None:
        param.fill_(scale)
    elif param.dtype.itemsize == 1:   # fp8 codes (uniform_ takes no fp8 tensor)
        param.copy_(torch.empty(param.shape, device=param.device).uniform_(-1, 1, generator=generator))
    elif param.dim() >= 2:
        param.uniform_(-weight_range(param.shape), weight_range(param.shape), generator=generator)
    else:             # biases
        param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
