"""Linear layers that know their tensor-parallel shard.

Column-parallel layers split their output features across ranks (no communication); row-parallel
layers split their input features and all-reduce the partial products. Each layer has a
`weight_loader(param, full_checkpoint_tensor[, shard_id])` that checks the tensor has the full,
unsharded shape its config implies (a too-large tensor would otherwise be sliced without complaint)
and copies this rank's slice into `param`.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import tp_group, tp_rank, tp_size


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = tp_rank(), tp_size(), tp_group()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, param.shape)
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (output features) split evenly across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_size()), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, (param.shape[0] * self.tp_size, *param.shape[1:]))  # rows split evenly
        param.data.copy_(loaded.chunk(self.tp_size, 0)[self.tp_rank])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one GEMM (gate and up projections).

    Local weight rows: [shard 0's slice for this rank | shard 1's slice | ...].
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.chunk(self.tp_size, 0)[self.tp_rank])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM; local rows are [q heads | k heads | v heads] of this rank.

    Query heads split evenly. KV heads split too, or, when there are fewer KV heads than ranks,
    each rank holds a copy of the one KV head its query heads attend to.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads  # the checkpoint's
        self.num_heads = divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_head_offset = tp_rank() * num_kv_heads // tp  # first KV head this rank holds
        LinearBase.__init__(self, hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_shape(loaded, (heads * self.head_dim, *param.shape[1:]))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src_start = param.data.narrow(0, 0, q_size), self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            dst, src_start = param.data.narrow(0, offset, kv_size), self.kv_head_offset * self.head_dim
        dst.copy_(loaded.narrow(0, src_start, dst.shape[0]))


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (input features) split across ranks; partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_size()), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if param.dim() == 1:  # the bias is added once, after the reduction
            check_shape(loaded, param.shape)
            param.data.copy_(loaded)
        else:
            check_shape(loaded, (param.shape[0], param.shape[1] * self.tp_size))  # columns split evenly
            param.data.copy_(loaded.chunk(self.tp_size, 1)[self.tp_rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            self.tp_group.all_reduce(y)
        return y
