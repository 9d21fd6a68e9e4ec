"""gpt-oss (openai/gpt-oss-20b, -120b): a mixture-of-experts decoder whose layers alternate
sliding-window (128) and full attention (config.layer_types), every head with a learned sink.

Where it differs from the shared decoder (layers/transformer.py), each as transformers'
modeling_gpt_oss.py computes it:
- attention sinks: one logit per head joins each query's softmax (layers/attention_sinks.py);
- q/k/v and o projections with biases (attention_bias);
- RoPE scaled by YaRN (factor 32 over 4,096 positions, truncate false), its tables multiplied by
  the attention factor 0.1 ln(32) + 1 (layers/scaled_rope.py);
- the router a linear layer with a bias; each token's top-k *logits* softmaxed among themselves
  (the same weights as a renormalized top-k of the full softmax, computed as HF does), in the
  logits' dtype;
- experts with biases, gate and up interleaved in the checkpoint (gate = columns 0::2, up = 1::2:
  de-interleaved into [gate | up] rows at load), and a clamped SwiGLU:
      gate = min(gate, 7), up = clamp(up, -7, 7), out = (up + 1) * gate * sigmoid(1.702 * gate);
- the checkpoints' experts in MXFP4 (layers/quantization/mxfp4.py), dequantized to the model's
  dtype as they load; transformers' unquantized layout is [E, in, out] (gate_up_proj [E, H, 2I]).

The RMSNorms are the shared decoder's (x / rms(x) rounded to the model's dtype, then scaled), as
vLLM's are; transformers keeps gpt-oss's norm weights in float32 and scales before rounding, which
in bf16 differs in the last bit (float32, the tests' dtype, is the same).

The experts run as PyTorch's per-expert loop on every device (the fused Triton kernel has no biases
nor this activation); the attention on the torch or Triton backend (flash-attn's kernels have no
sink term). Pipeline parallelism is not wired in.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.attention_sinks import SinkAttention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ReplicatedLinear, current_quantization, divide
from nanovllm.layers.moe import tokens_by_expert
from nanovllm.layers.quantization import mxfp4
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from nanovllm.layers.scaled_rope import check_scaled_rope, scaled_rotary_embedding
from nanovllm.layers.transformer import (DecoderFlags, DecoderForCausalLM, DecoderLayer, DecoderModel, head_dim_of,
                                         num_kv_heads_of)
from nanovllm.models.layer_kinds import check_layer_types
from nanovllm.models.sparse import check_experts_per_token, num_experts_of
from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import stage_layers, tp_group, tp_rank, tp_size

LAYER_TYPES = ("sliding_attention", "full_attention")
# checkpoint name suffix -> (our parameter, (projection, what the tensor holds))
EXPERT_TENSORS = {
    "gate_up_proj": ("w13", ("gate_up", "weight")), "gate_up_proj_bias": ("w13_bias", ("gate_up", "bias")),
    "gate_up_proj_blocks": ("w13", ("gate_up", "blocks")), "gate_up_proj_scales": ("w13", ("gate_up", "scales")),
    "down_proj": ("w2", ("down", "weight")), "down_proj_bias": ("w2_bias", ("down", "bias")),
    "down_proj_blocks": ("w2", ("down", "blocks")), "down_proj_scales": ("w2", ("down", "scales")),
}


def route_top_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k logits and their softmax among themselves, in the logits' dtype
    (transformers' GptOssTopKRouter). Returns (weights [T, k], expert ids [T, k])."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), ids


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """A layer's experts on this rank: w13 [E, 2 x I/tp, H] (gate rows, then up rows), w13_bias
    [E, 2 x I/tp], w2 [E, H, I/tp] and w2_bias [E, H], added by rank 0 alone (the partial sums of
    the ranks are all-reduced after). weight_loader takes transformers' tensors ([E, in, out]) or a
    checkpoint's MXFP4 blocks and scales ([E, out, ...]: dequantized once both have come)."""

    def __init__(self, config: PretrainedConfig, mxfp4_checkpoint: bool):
        super().__init__()
        self.num_experts, self.hidden_size = num_experts_of(config), config.hidden_size
        self.intermediate_size, self.mxfp4 = config.intermediate_size, mxfp4_checkpoint
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.tp_rank, local = tp_rank(), divide(config.intermediate_size, tp_size())
        e, h = self.num_experts, self.hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * local, h), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * local), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, local), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self._packed: dict[tuple[str, str], torch.Tensor] = {}  # an MXFP4 half (blocks or scales) until its pair comes
        self._loaded: set[tuple[str, str]] = set()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[str, str]):
        part, kind = shard_id
        if kind in ("blocks", "scales"):
            if not self.mxfp4:
                raise ValueError(f"an MXFP4 {part}_proj_{kind} tensor, but config.json has no quantization_config "
                                 f"with quant_method 'mxfp4'")
            self._packed[part, kind] = loaded
            if (part, "blocks") in self._packed and (part, "scales") in self._packed:
                blocks, scales = self._packed.pop((part, "blocks")), self._packed.pop((part, "scales"))
                self._load_weight(part, self._dequantize(part, blocks, scales))
        elif kind == "bias":
            self._load_bias(part, loaded)
        else:  # transformers' layout, [E, in, out]
            self._load_weight(part, loaded.transpose(1, 2))
        self._loaded.add(shard_id)

    def _full_shape(self, part: str) -> tuple[int, int, int]:
        """A projection's checkpoint shape [E, out, in]."""
        h, i = self.hidden_size, self.intermediate_size
        return (self.num_experts, 2 * i, h) if part == "gate_up" else (self.num_experts, h, i)

    def _dequantize(self, part: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        e, out, inputs = self._full_shape(part)
        check_shape(blocks, (e, out, inputs // mxfp4.GROUP, mxfp4.GROUP // 2))
        check_shape(scales, (e, out, inputs // mxfp4.GROUP))
        # one expert at a time: the lookup's index tensors are a layer's otherwise (GBs for gpt-oss-20b)
        return torch.stack([mxfp4.dequantize(blocks[x], scales[x], self.w13.dtype) for x in range(e)])

    def _rank_rows(self, rows: torch.Tensor) -> torch.Tensor:
        local = self.w2.shape[2]
        return rows[:, self.tp_rank * local:(self.tp_rank + 1) * local]

    def _gate_then_up(self, interleaved: torch.Tensor) -> torch.Tensor:
        """gate_up rows or biases [E, 2I, ...], gate, up, gate, ...: this rank's gate rows, then its up rows."""
        return torch.cat([self._rank_rows(interleaved[:, 0::2]), self._rank_rows(interleaved[:, 1::2])], 1)

    def _load_weight(self, part: str, weight: torch.Tensor):
        """weight [E, out, in]: gate_up's rows interleaved; down's whole."""
        check_shape(weight, self._full_shape(part))
        if part == "gate_up":
            self.w13.data.copy_(self._gate_then_up(weight))
        else:
            self.w2.data.copy_(self._rank_rows(weight.transpose(1, 2)).transpose(1, 2))

    def _load_bias(self, part: str, bias: torch.Tensor):
        check_shape(bias, self._full_shape(part)[:2])
        if part == "gate_up":
            self.w13_bias.data.copy_(self._gate_then_up(bias))
        else:
            self.w2_bias.data.copy_(bias)

    def missing_shards(self) -> list[str]:
        kinds = ("blocks", "scales") if self.mxfp4 else ("weight",)
        wanted = [(part, kind) for part in ("gate_up", "down") for kind in kinds + ("bias",)]
        return [f"{part}_proj{'' if kind == 'weight' else '_' + kind}" for part, kind in wanted
                if (part, kind) not in self._loaded]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> [T, H]: each expert's MLP over its tokens, weighted, summed."""
        top_k, out = ids.shape[1], torch.zeros_like(x)
        down_bias = self.w2_bias if self.tp_rank == 0 else None
        for expert, pairs in tokens_by_expert(ids, self.num_experts):
            tokens = pairs // top_k
            gate, up = F.linear(x[tokens], self.w13[expert], self.w13_bias[expert]).chunk(2, -1)
            hidden = clamped_swiglu(gate, up, self.alpha, self.limit)
            hidden = F.linear(hidden, self.w2[expert], None if down_bias is None else down_bias[expert])
            out.index_add_(0, tokens, hidden * weights.flatten()[pairs, None])
        return out


class GptOssMoE(nn.Module):
    """The router (`router`, with a bias; replicated) and the experts; one all-reduce with TP."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        quantization = current_quantization()
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, num_experts_of(config), bias=True)
        self.experts = GptOssExperts(config, quantization is not None and quantization.method == "mxfp4")
        self.tp_size, self.tp_group = tp_size(), tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_top_logits(self.router(x), self.top_k)
        out = self.experts(x, weights, ids)
        if self.tp_size > 1:
            self.tp_group.all_reduce(out)
        return out


class GptOssDecoderLayer(DecoderLayer):
    """The shared decoder layer, its inner attention a SinkAttention (a window on the sliding layers)."""

    def __init__(self, config: PretrainedConfig, layer_type: str, rotary_emb: RotaryEmbedding, prefix: str):
        flags = DecoderFlags(qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        super().__init__(config, rotary_emb, flags, GptOssMoE(config), prefix)
        attn, window = self.self_attn, config.sliding_window if layer_type == "sliding_attention" else None
        attn.attn = SinkAttention(attn.num_heads, attn.head_dim, attn.head_dim ** -0.5, attn.num_kv_heads, window)


class GptOssModel(DecoderModel):
    """The shared decoder's body (its forward), built with gpt-oss's layers and YaRN table."""

    def __init__(self, config: PretrainedConfig, max_position: int):
        nn.Module.__init__(self)
        if stage_layers(config.num_hidden_layers) != range(config.num_hidden_layers):
            raise ValueError("pipeline_parallel_size > 1 is not supported for gpt-oss; use tensor_parallel_size")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = scaled_rotary_embedding(head_dim_of(config), max_position, rope_parameters(config))
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, kind, rotary_emb, f"model.layers.{i}")
                                    for i, kind in enumerate(config.layer_types))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss (GptOssConfig), its checkpoints MXFP4 (quant_method "mxfp4") or unquantized."""
    engine_layers = True  # (its layers are of several kinds: features/layer_groups.py)

    @classmethod
    def check_config(cls, config: PretrainedConfig, max_model_len: int | None = None):
        check_gpt_oss_config(config)

    def __init__(self, config: PretrainedConfig, max_position: int):
        nn.Module.__init__(self)
        self.check_config(config, max_position)
        self.config = config
        self.model = GptOssModel(config, max_position)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        """sinks to the inner attention's; the experts' tensors (EXPERT_TENSORS) to the packed ones."""
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        head, _, suffix = name.rpartition(".mlp.experts.")
        if head and suffix in EXPERT_TENSORS:
            ours, shard_id = EXPERT_TENSORS[suffix]
            return f"{head}.mlp.experts.{ours}", shard_id
        return super().checkpoint_target(name)


def check_gpt_oss_config(config: PretrainedConfig):
    """ValueError naming the option for whatever this module would compute differently from HF."""
    check_layer_types(config, LAYER_TYPES, "gpt-oss")
    head_dim, kv_heads = head_dim_of(config), num_kv_heads_of(config)
    if config.num_attention_heads % kv_heads:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    check_scaled_rope(rope_parameters(config), head_dim)
    check_experts_per_token(config, "num_local_experts")
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        method = (quantization if isinstance(quantization, dict) else quantization.to_dict()).get("quant_method")
        if method != "mxfp4":
            raise ValueError(f"gpt-oss checkpoints quantized by {method!r} are not supported; supported: 'mxfp4' "
                             f"(the published checkpoints') or unquantized")
