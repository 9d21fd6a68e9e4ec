"""Linear layers that know their tensor-parallel shard.

Column-parallel layers split their output features across ranks (no communication); row-parallel
layers split their input features and all-reduce the partial products. Each layer has a
`weight_loader(param, full_checkpoint_tensor[, shard_id])` that checks the tensor has the full,
unsharded shape its config implies (a too-large tensor would otherwise be sliced without complaint)
and copies this rank's slice into `param`.

The quantization hook: a layer built inside `quantization_scope(config)` gets its scheme's method,
`config.linear_method(prefix)` (layers/quantization/__init__.py), which creates its parameters
and applies them; unquantized, it holds `weight` [out, in] and calls F.linear (an unquantized
engine never imports that package). Either way the loaders slice in features: each parameter's
`Axes` say which of its axes holds the output and input features, and how many features one
stored element covers (a quantized layer's scales and packed words): one rule serves every scheme.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import tp_group, tp_rank, tp_size


@dataclass(frozen=True)
class Axes:
    """Where a stored tensor keeps a linear layer's output and input features, and how many
    features one stored element covers along each (AWQ packs 8 output features into an int32; a
    block scale covers 128 x 128 weights): out x in features take ceil(out / output_pack) x ceil(in / input_pack)."""
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


# ---- the quantization scope a model is built in ---------------------------------------------------
_QUANTIZATION = None  # layers/quantization's QuantizationConfig, while a quantized model is built


@contextmanager
def quantization_scope(config):
    """Layers built inside quantize as `config` (a QuantizationConfig, or None) says."""
    global _QUANTIZATION
    previous, _QUANTIZATION = _QUANTIZATION, config
    try:
        yield
    finally:
        _QUANTIZATION = previous


def current_quantization():
    return _QUANTIZATION


def linear_method(prefix: str | None):
    """The quantization method of the linear layer named `prefix` (None: unquantized; a prefix of
    None: a layer that is never quantized)."""
    if _QUANTIZATION is None or prefix is None:
        return None
    return _QUANTIZATION.linear_method(prefix)


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def narrow_features(t: torch.Tensor, dim: int | None, pack: int, start: int, size: int) -> torch.Tensor:
    """Features start .. start + size of `t` along `dim` (stored `pack` to an element; the layer's
    construction checked that inner boundaries fall on whole elements)."""
    if dim is None:
        return t
    first = start // pack
    return t.narrow(dim, first, -(-(start + size) // pack) - first)


def load_features(param: nn.Parameter, loaded: torch.Tensor, full: tuple[int, int],
                  out: tuple[int, int, int] | None = None, inp: tuple[int, int] | None = None):
    """Copy a slice of checkpoint tensor `loaded` into `param`, in features.

    full: the checkpoint tensor's (output, input) features, which its shape must match.
    out: (first output feature taken, how many, where they go in param); inp: (first input
    feature taken, how many). None: all of them."""
    axes = axes_of(param)
    check_shape(loaded, axes.shape(loaded.dim(), *full))
    src, dst = loaded, param.data
    if out is not None:
        start, size, at = out
        src = narrow_features(src, axes.output_dim, axes.output_pack, start, size)
        dst = narrow_features(dst, axes.output_dim, axes.output_pack, at, size)
    if inp is not None:
        src = narrow_features(src, axes.input_dim, axes.input_pack, *inp)
    dst.copy_(src)


class LinearBase(nn.Module):
    """input_size x output_size are this rank's features; output_sizes its parts' (q/k/v, gate/up).
    prefix: the layer's name (model.layers.0.mlp.down_proj), which the quantization scope may
    exclude (modules_to_not_convert); None: never quantized."""
    input_is_sharded = False  # row-parallel layers split their inputs

    def __init__(self, input_size: int, output_size: int, bias: bool, prefix: str | None = "",
                 output_sizes: list[int] | None = None):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = tp_rank(), tp_size(), tp_group()
        self.input_size, self.output_size = input_size, output_size
        self.output_sizes = output_sizes or [output_size]
        self.quant_method = linear_method(prefix)
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        else:
            self.quant_method.create_weights(self, input_size, output_size)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            return F.linear(x, self.weight, self.bias)
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank; never quantized (its one use, an MoE router, stays in full
    precision in the published quantized checkpoints, as in vLLM)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, prefix=None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        load_features(param, loaded, (self.output_size, self.input_size))


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (output features) split evenly across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = "",
                 output_sizes: list[int] | None = None):
        super().__init__(input_size, divide(output_size, tp_size()), bias, prefix, output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        local = self.output_size                                      # rows split evenly
        load_features(param, loaded, (local * self.tp_size, self.input_size), out=(self.tp_rank * local, local, 0))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one GEMM (gate and up projections); local
    weight rows: [shard 0's slice for this rank | shard 1's slice | ...]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, prefix: str = ""):
        self.full_output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, prefix, [divide(s, tp_size()) for s in output_sizes])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        size = self.output_sizes[shard_id]
        load_features(param, loaded, (self.full_output_sizes[shard_id], self.input_size),
                      out=(self.tp_rank * size, size, sum(self.output_sizes[:shard_id])))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM; local rows are [q heads | k heads | v heads] of this rank.
    Query heads split evenly; KV heads too, or, when there are fewer KV heads than ranks, each
    rank holds a copy of the one KV head its query heads attend to."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 prefix: str = ""):
        tp = tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads  # the checkpoint's
        self.num_heads = divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_head_offset = tp_rank() * num_kv_heads // tp  # first KV head this rank holds
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, q_size + 2 * kv_size, bias, prefix, [q_size, kv_size, kv_size])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        q_size, kv_size = self.output_sizes[:2]
        if shard_id == "q":
            out = (self.tp_rank * q_size, q_size, 0)
        else:
            out = (self.kv_head_offset * self.head_dim, kv_size, q_size if shard_id == "k" else q_size + kv_size)
        load_features(param, loaded, (heads * self.head_dim, self.input_size), out=out)


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (input features) split across ranks; partial sums all-reduced."""
    input_is_sharded = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, prefix: str = ""):
        super().__init__(divide(input_size, tp_size()), output_size, bias, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        local = self.input_size                                       # columns split evenly
        load_features(param, loaded, (self.output_size, local * self.tp_size), inp=(self.tp_rank * local, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None  # added once, after the sum
        y = F.linear(x, self.weight, bias) if self.quant_method is None else self.quant_method.apply(self, x, bias)
        if self.tp_size > 1:
            self.tp_group.all_reduce(y)
        return y
