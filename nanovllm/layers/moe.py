"""Mixture-of-experts MLP: a router picks each token's top-k experts; each expert is a gated MLP.

Weights of a layer's experts are packed at load time into two tensors, as the fused kernel wants
them: w13 [experts, 2 x intermediate, hidden] (each expert's gate rows, then its up rows) and
w2 [experts, hidden, intermediate]. With tensor parallelism every rank holds a slice of each
expert's intermediate dimension (column-parallel gate/up, row-parallel down) and the layer's
output is all-reduced once.

The expert computation has two implementations behind one function, as attention has backends:
`torch_experts` (readable, any device, the reference) and the fused Triton kernel of
`layers/moe_triton.py` (CUDA), which `experts_forward` picks on CUDA.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear, divide
from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import tp_group, tp_rank, tp_size
from nanovllm.utils.triton_mode import import_kernels


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (in float32), each token's top_k, renormalized to sum to 1 when
    asked. Returns (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The reference: tokens grouped by expert, one gated MLP per expert that has tokens, each
    result scaled by its routing weight and added back to its token.

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights [T, k]; ids [T, k]. Returns [T, H] in x.dtype.
    """
    num_tokens, top_k = ids.shape
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)                    # (token, slot) pairs by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    flat_weights = weights.flatten()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        hidden = F.linear(F.silu(gate) * up, w2[expert])              # [count, H]
        out.index_add_(0, tokens, hidden * flat_weights[pairs, None].to(x.dtype))
    return out


def experts_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """The fused Triton kernel on CUDA, the PyTorch reference elsewhere."""
    if x.is_cuda:  # (a ValueError if an engine on CPU put this process's Triton in interpreter mode)
        return import_kernels("nanovllm.layers.moe_triton", "cuda", "the fused mixture-of-experts kernel"
                              ).triton_experts(x, w13, w2, weights, ids)
    return torch_experts(x, w13, w2, weights, ids)


class FusedExperts(nn.Module):
    """A layer's experts, packed: w13 [E, 2 x I/tp, H] and w2 [E, H, I/tp] on each rank.

    weight_loader(param, tensor, (expert, part)) takes one checkpoint tensor, part being "gate",
    "up" or "down", and records it: `missing_shards()` names what no tensor filled.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        local = divide(intermediate_size, self.tp_size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local), requires_grad=False)
        self._loaded: set[tuple[int, str]] = set()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]):
        expert, part = shard_id
        local = self.w2.shape[2]
        rank_slice = slice(self.tp_rank * local, (self.tp_rank + 1) * local)
        if part == "down":
            check_shape(loaded, (self.hidden_size, self.intermediate_size))
            param.data[expert].copy_(loaded[:, rank_slice])
        else:
            check_shape(loaded, (self.intermediate_size, self.hidden_size))
            offset = 0 if part == "gate" else local
            param.data[expert, offset:offset + local].copy_(loaded[rank_slice])
        self._loaded.add((expert, part))

    def missing_shards(self) -> list[str]:
        return [f"experts.{e}.{part}" for e in range(self.num_experts) for part in ("gate", "up", "down")
                if (e, part) not in self._loaded]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, self.w13, self.w2, weights, ids)


class SparseMoE(nn.Module):
    """Router (`gate`, replicated) + experts; one all-reduce of the output with tensor parallelism."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.tp_size, self.tp_group = tp_size(), tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.tp_size > 1:
            self.tp_group.all_reduce(out)
        return out
