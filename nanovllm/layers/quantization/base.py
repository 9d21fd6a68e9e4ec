"""The interface between a linear layer and its quantization method, and how a stored parameter's
axes map to the layer's features (which the sharded loaders of layers/linear.py need).

A method (one per scheme) is an object with
  create_weights(layer, input_size, output_size)  register the layer's parameters, for this rank's
                                                  input_size x output_size features
  process_weights_after_loading(layer)            (optional) once every tensor is in: repack
  apply(layer, x, bias) -> y                      y = x W^T + bias, x [T, input_size]
The unquantized layer has none: it keeps today's `weight` [out, in] and F.linear.
"""
from dataclasses import dataclass

import torch
from torch import nn

# The formats the schemes and their kernels share (here, so that a kernel module imports no scheme:
# fp8.py and awq.py load their kernels by name, and a kernel importing its scheme back is a cycle).
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max          # 448: the largest finite e4m3 value
# A scale's floor: an all-zero row or group would otherwise get scale 0 and 0 / 0 = NaN.
MIN_SCALE = 1e-12
PACK = 8                                # AWQ's 4-bit values per int32


@dataclass(frozen=True)
class Axes:
    """Where a stored tensor keeps a linear layer's output and input features, and how many
    features one stored element covers along each (AWQ packs 8 output features into an int32; a
    block scale covers 128 x 128 weights). A checkpoint tensor of a layer with `out` x `in`
    features is then ceil(out / output_pack) x ceil(in / input_pack) along those axes."""
    output_dim: int | None
    input_dim: int | None
    output_pack: int = 1
    input_pack: int = 1

    def shape(self, ndim: int, out_features: int, in_features: int) -> tuple[int, ...]:
        shape = [0] * ndim
        if self.output_dim is not None:
            shape[self.output_dim] = -(-out_features // self.output_pack)
        if self.input_dim is not None:
            shape[self.input_dim] = -(-in_features // self.input_pack)
        return tuple(shape)


WEIGHT_AXES = Axes(output_dim=0, input_dim=1)     # nn.Linear's weight [out, in]
BIAS_AXES = Axes(output_dim=0, input_dim=None)    # [out]


def axes_of(param: torch.Tensor) -> Axes:
    return getattr(param, "axes", WEIGHT_AXES if param.dim() == 2 else BIAS_AXES)


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
