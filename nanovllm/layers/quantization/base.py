"""The interface between a linear layer and its quantization method (a stored parameter's axes,
layers/linear.py's Axes, map it to the layer's features for the sharded loaders).

A method (one per scheme) is an object with
  create_weights(layer, input_size, output_size)  register the parameters of this rank's features
  process_weights_after_loading(layer)            (optional) once every tensor is in: repack
  apply(layer, x, bias) -> y                      y = x W^T + bias, x [T, input_size]
The unquantized layer has none: it keeps today's `weight` [out, in] and F.linear.
"""
import torch
from torch import nn

from nanovllm.layers.linear import Axes

# The formats the schemes and their kernels share (here, so that a kernel module imports no scheme:
# fp8.py and awq.py load their kernels by name, and a kernel importing its scheme back is a cycle).
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max          # 448: the largest finite e4m3 value
MIN_SCALE = 1e-12                       # a scale's floor: an all-zero row or group would give 0 / 0 = NaN
PACK = 8                                # AWQ's 4-bit values per int32


def new_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, axes: Axes) -> nn.Parameter:
    """Register an uninitialized parameter `name` on `layer` (on the default device), with its axes.
    (Plain data on the parameter, no bound method: no reference cycle keeps the weights alive.)"""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.axes = axes
    layer.register_parameter(name, param)
    return param


def check_divisible(layer: nn.Module, what: str, sizes: list[int], unit: int, scheme: str):
    """A packed or sharded boundary must fall on a whole stored element (block, packed word,
    group); a ValueError at start-up names the sizes otherwise."""
    if any(size % unit for size in sizes):
        raise ValueError(f"{scheme} needs the {what} of each part of a linear layer on each rank to be a multiple of "
                         f"{unit}, got {sizes} (tensor_parallel_size={layer.tp_size}); this model's shape or this "
                         f"tensor_parallel_size cannot be quantized so")
