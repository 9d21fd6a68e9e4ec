"""Mixture-of-experts MLP: a router picks each token's top-k experts; each expert is a gated MLP.

A layer's experts are packed at load time, as the fused kernel wants them, into w13 [experts,
2 x intermediate, hidden] (each expert's gate rows, then its up rows) and w2 [experts, hidden,
intermediate]. With tensor parallelism every rank holds a slice of each expert's intermediate
dimension (column-parallel gate/up, row-parallel down); the output is all-reduced once.

`experts_forward` runs the fused Triton kernel of layers/moe_triton.py on CUDA, `torch_experts`
(readable, the reference) elsewhere.

FP8 experts (`quantization`, a QuantizationConfig; arithmetic in layers/quantization/fp8.py): w13 and
w2 are float8_e4m3fn with float32 scales; the router stays unquantized.
  per output channel   quantization="fp8" on an unquantized checkpoint: the experts load in full
                       precision and `process_weights_after_loading()` quantizes them:
                       w13_scale [E, 2I/tp], w2_scale [E, H]
  per 128 x 128 block  an FP8 checkpoint's `...weight` (fp8) and `...weight_scale_inv` tensors:
                       w13_scale_inv [E, 2I/tp/128, ceil(H/128)] (gate blocks, then up blocks),
                       w2_scale_inv [E, ceil(H/128), I/tp/128]; each rank holds whole blocks.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear, divide
from nanovllm.layers.quantization import QuantizationConfig, fp8
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


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """One expert's weights [N, K] in `dtype`: as they are (scale None), or dequantized per output
    channel (scale [N], block None) or per block (scale [ceil(N/bn), ceil(K/bk)])."""
    if scale is None:
        return w
    if block is None:
        return fp8.dequantize_per_channel(w, scale, dtype)
    return fp8.dequantize_block(w, scale, block, dtype)


def tokens_by_expert(ids: torch.Tensor, num_experts: int):
    """Each expert that has tokens, in order, with its (token, slot) pairs: indices into the flattened
    ids [T, k] (token = pair // k), in token order. The PyTorch references loop over these."""
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)                    # (token, slot) pairs by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, order[start:start + count]
        start += count


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None) -> torch.Tensor:
    """The reference: tokens grouped by expert, one gated MLP per expert that has tokens, each result
    scaled by its routing weight and added back to its token. x [T, H]; w13 [E, 2I, H]; w2 [E, H, I];
    weights, ids [T, k] -> [T, H] in x.dtype. FP8 weights are dequantized first (dequantize_experts)."""
    top_k = ids.shape[1]
    flat_weights = weights.flatten()
    out = torch.zeros_like(x)
    for expert, pairs in tokens_by_expert(ids, w13.shape[0]):
        tokens = pairs // top_k
        w13_e = dequantize_experts(w13[expert], None if w13_scale is None else w13_scale[expert], block, x.dtype)
        w2_e = dequantize_experts(w2[expert], None if w2_scale is None else w2_scale[expert], block, x.dtype)
        gate, up = F.linear(x[tokens], w13_e).chunk(2, dim=-1)
        hidden = F.linear(F.silu(gate) * up, w2_e)                    # [count, H]
        out.index_add_(0, tokens, hidden * flat_weights[pairs, None].to(x.dtype))
    return out


def experts_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    block: tuple[int, int] | None = None) -> torch.Tensor:
    """The fused Triton kernel on CUDA, the PyTorch reference elsewhere."""
    if x.is_cuda:  # (a ValueError if an engine on CPU put this process's Triton in interpreter mode)
        return import_kernels("nanovllm.layers.moe_triton", "cuda", "the fused mixture-of-experts kernel"
                              ).triton_experts(x, w13, w2, weights, ids, w13_scale, w2_scale, block)
    return torch_experts(x, w13, w2, weights, ids, w13_scale, w2_scale, block)


def quantize_experts_per_channel(w: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """w [E, N, K] -> (fp8 [E, N, K], scale float32 [E, N]), one expert at a time so that the float32
    temporaries of fp8.quantize_per_channel are one expert's, not the layer's."""
    q = torch.empty(w.shape, dtype=fp8.FP8, device=w.device)
    scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for expert in range(w.shape[0]):
        q[expert], scale[expert] = fp8.quantize_per_channel(w[expert])
    return nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False)


class FusedExperts(nn.Module):
    """A layer's experts, packed: w13 [E, 2 x I/tp, H] and w2 [E, H, I/tp] on each rank (FP8: see above).
    weight_loader(param, tensor, (expert, part)) takes one checkpoint tensor, part "gate", "up" or
    "down", into w13 / w2 or their block scales; `missing_shards()` names what no tensor filled."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quantization: QuantizationConfig | None = None):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        local = divide(intermediate_size, self.tp_size)
        self.block = self._fp8_block(quantization, local)   # (bn, bk) for block-scaled FP8, else None
        self.quantize_at_load = quantization is not None and not quantization.serialized
        dtype = fp8.FP8 if self.block else None              # None: the model's dtype
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, local, dtype=dtype), requires_grad=False)
        if self.block:
            bn, bk = self.block
            self.w13_scale_inv = nn.Parameter(torch.empty(num_experts, 2 * local // bn, -(-hidden_size // bk),
                                                          dtype=torch.float32), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(num_experts, -(-hidden_size // bn), local // bk,
                                                         dtype=torch.float32), requires_grad=False)
        else:  # per-channel scales, once process_weights_after_loading has quantized the weights
            self.register_parameter("w13_scale", None)
            self.register_parameter("w2_scale", None)
        self._loaded: set[tuple[int, str]] = set()

    def _fp8_block(self, quantization: QuantizationConfig | None, local: int) -> tuple[int, int] | None:
        """The (bn, bk) block of a block-scaled FP8 checkpoint (None: unquantized, or quantized per
        channel at load); ValueError for what the experts cannot hold."""
        if quantization is None:
            return None
        if quantization.method == "awq":
            raise ValueError("AWQ MoE checkpoints are not supported (the experts of a mixture-of-experts model "
                             "have no AWQ kernel); use the unquantized or FP8 checkpoint of this model")
        if quantization.method != "fp8":
            raise ValueError(f"quantization method {quantization.method!r} is not supported for MoE experts; "
                             f"supported: 'fp8'")
        if not quantization.serialized:
            return None
        block = quantization.weight_block_size
        if block is None:
            raise ValueError("FP8 MoE checkpoints need block scales (weight_block_size); per-channel FP8 "
                             "checkpoints are not supported")
        bn, bk = block
        if local % bn or local % bk:
            raise ValueError(f"FP8 block-quantized experts need each rank's share of the expert intermediate size "
                             f"to be whole {bn}x{bk} blocks: intermediate size {self.intermediate_size} / "
                             f"tensor_parallel_size {self.tp_size} = {local} is not a multiple of {bn}"
                             f"{f' and {bk}' if bk != bn else ''}")
        return tuple(block)

    def _rank_slice(self, size: int) -> slice:
        """This rank's `size` rows (or block rows) of a dimension split evenly across ranks."""
        return slice(self.tp_rank * size, (self.tp_rank + 1) * size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]):
        expert, part = shard_id
        if self.block and (param is self.w13_scale_inv or param is self.w2_scale_inv):
            self._load_block_scale(param, loaded, expert, part)
            self._loaded.add((expert, f"{part}.weight_scale_inv"))
            return
        if self.block and loaded.dtype != fp8.FP8:  # copy_ would round it to fp8 with no scale
            raise ValueError(f"expert {expert}'s {part} weight is {loaded.dtype}; an FP8 block-quantized "
                             f"checkpoint holds {fp8.FP8}")
        local = self.w2.shape[2]
        rank_slice = self._rank_slice(local)
        if part == "down":
            check_shape(loaded, (self.hidden_size, self.intermediate_size))
            param.data[expert].copy_(loaded[:, rank_slice])
        else:
            check_shape(loaded, (self.intermediate_size, self.hidden_size))
            offset = 0 if part == "gate" else local
            param.data[expert, offset:offset + local].copy_(loaded[rank_slice])
        self._loaded.add((expert, part))

    def _load_block_scale(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, part: str):
        """A checkpoint's weight_scale_inv [ceil(out/bn), ceil(in/bk)]: this rank's block rows of
        gate/up (after the gate's for up), its block columns of down."""
        bn, bk = self.block
        hidden_blocks_n, hidden_blocks_k = -(-self.hidden_size // bn), -(-self.hidden_size // bk)
        if part == "down":
            check_shape(loaded, (hidden_blocks_n, self.intermediate_size // bk))
            param.data[expert].copy_(loaded[:, self._rank_slice(param.shape[2])])
        else:
            check_shape(loaded, (self.intermediate_size // bn, hidden_blocks_k))
            local_blocks = param.shape[1] // 2
            offset = 0 if part == "gate" else local_blocks
            param.data[expert, offset:offset + local_blocks].copy_(loaded[self._rank_slice(local_blocks)])

    def missing_shards(self) -> list[str]:
        parts = ("gate", "up", "down")
        if self.block:
            parts += tuple(f"{part}.weight_scale_inv" for part in parts)
        return [f"experts.{e}.{part}" for e in range(self.num_experts) for part in parts
                if (e, part) not in self._loaded]

    @torch.no_grad()
    def process_weights_after_loading(self):
        """quantization="fp8" on an unquantized checkpoint: once all is loaded, replace w13 / w2 by
        FP8 ones with per-output-channel scales. A no-op otherwise, and when called again."""
        if not self.quantize_at_load or self.w13.dtype == fp8.FP8:
            return
        self.w13, self.w13_scale = quantize_experts_per_channel(self.w13)
        self.w2, self.w2_scale = quantize_experts_per_channel(self.w2)

    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(w13's scales, w2's): block or per channel; (None, None) for unquantized weights."""
        if self.block:
            return self.w13_scale_inv, self.w2_scale_inv
        return self.w13_scale, self.w2_scale

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, self.w13, self.w2, weights, ids, *self.scales(), self.block)


class SparseMoE(nn.Module):
    """Router (`gate`, replicated) + experts; one all-reduce of the output with tensor parallelism."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 quantization: QuantizationConfig | None = None):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)   # the router: never quantized
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, quantization)
        self.tp_size, self.tp_group = tp_size(), tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.tp_size > 1:
            self.tp_group.all_reduce(out)
        return out
