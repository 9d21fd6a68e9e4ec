"""Qwen3.5 (text): a hybrid decoder, three Gated DeltaNet layers (linear attention with a state per
sequence: layers/gated_delta_net.py) for every full-attention layer (config.layer_types says which).

Where it differs from the shared decoder (layers/transformer.py), each as transformers'
modeling_qwen3_5.py computes it:
- the linear-attention layers keep no K/V: their state lives in a slot pool beside the KV cache
  (features/state_cache.py, the layer the engine adds when config.layer_types lists linear_attention);
- full attention has an output gate: q_proj gives each head its query and a gate of head_dim each
  ([q_h | gate_h], head by head), and the attention output is multiplied by sigmoid(gate);
- RoPE rotates only the first partial_rotary_factor (1/4) of each head's dims; the multimodal
  RoPE's three position grids are equal for text, so it is plain RoPE there;
- every RMSNorm but the gated one inside the DeltaNet scales by (1 + weight) (layers/offset_norm.py),
  q and k normalized per head before RoPE.
Qwen3_5ForConditionalGeneration checkpoints (the Hub's) hold the same text model under
model.language_model.*, beside a vision tower (model.visual.*: models/qwen3_5_vl.py runs it) and
multi-token-prediction weights (mtp.*, skipped).
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.gated_delta_net import GatedDeltaNet
from nanovllm.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear, load_features
from nanovllm.layers.offset_norm import OffsetRMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary, check_rope_parameters, rope_parameters
from nanovllm.layers.transformer import SILU_NAMES, GatedMLP, head_dim_of, num_kv_heads_of
from nanovllm.models.layer_kinds import check_layer_types
from nanovllm.utils.parallel import HeldElsewhere, stage_layers

LAYER_TYPES = ("linear_attention", "full_attention")
# checkpoint prefixes of what a Qwen3_5ForConditionalGeneration checkpoint holds besides the text model
UNUSED_PREFIXES = ("model.visual.", "mtp.")


class PartialRotaryEmbedding(RotaryEmbedding):
    """RoPE on the first `rotary_dim` dims of each head ("neox" pairs within them), the rest passed
    through: transformers' apply_rotary_pos_emb with cos/sin of width rotary_dim. (The tables are
    RotaryEmbedding's for a head of rotary_dim; its fused kernel, which rotates whole heads, is not used.)"""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        super().__init__(self.rotary_dim, max_position,
                         {key: value for key, value in params.items() if key != "partial_rotary_factor"})

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated at its positions."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        rotated = apply_rotary(x[..., :self.rotary_dim], cos, sin)
        return torch.cat([rotated, x[..., self.rotary_dim:]], -1)


class GatedQKVParallelLinear(QKVParallelLinear):
    """q_proj (rows [q_h | gate_h] head by head: 2 * head_dim a head), k_proj and v_proj in one GEMM,
    split as QKVParallelLinear splits them (KV heads copied where there are fewer than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, prefix: str):
        super().__init__(hidden_size, head_dim, num_heads, num_kv_heads, bias, prefix)  # (the heads' split)
        # the layer made again with its q part twice as wide (the weight built above is dropped: start-up only)
        q_size, kv_size = self.num_heads * head_dim * 2, self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, q_size + 2 * kv_size, bias, prefix, [q_size, kv_size, kv_size])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        if shard_id != "q":
            return super().weight_loader(param, loaded, shard_id)
        q_size = self.output_sizes[0]
        load_features(param, loaded, (self.total_num_heads * self.head_dim * 2, self.input_size),
                      out=(self.tp_rank * q_size, q_size, 0))


class GatedAttention(nn.Module):
    """Full attention with an output gate: o_proj(attention(q, k, v) * sigmoid(gate))."""

    def __init__(self, config: PretrainedConfig, rotary_emb: PartialRotaryEmbedding, prefix: str):
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads, bias = config.num_attention_heads, getattr(config, "attention_bias", False)
        self.qkv_proj = GatedQKVParallelLinear(config.hidden_size, self.head_dim, heads, num_kv_heads_of(config),
                                               bias, f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=bias, prefix=f"{prefix}.o_proj")
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim * 2, self.num_kv_heads * self.head_dim
        q_gate, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], -1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, -1)
        q = self.rotary_emb(positions, self.q_norm(q))
        k = self.rotary_emb(positions, self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)))
        out = self.attn(q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim))
        return self.o_proj(out * torch.sigmoid(gate.reshape(num_tokens, -1)))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, rotary_emb: PartialRotaryEmbedding, mlp: nn.Module,
                 prefix: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(config, rotary_emb, f"{prefix}.self_attn")
        self.mlp = mlp  # a GatedMLP, or Qwen3.5-MoE's experts (models/qwen3_5_moe.py)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.layer_type == "linear_attention":
            hidden = hidden + self.linear_attn(normed)
        else:
            hidden = hidden + self.self_attn(positions, normed)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int, build_mlp):
        super().__init__()
        if stage_layers(config.num_hidden_layers) != range(config.num_hidden_layers):
            raise ValueError("pipeline_parallel_size > 1 is not supported for Qwen3.5 (its layers keep the residual "
                             "stream themselves, unlike the shared decoder's stages); use tensor_parallel_size instead")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = PartialRotaryEmbedding(head_dim_of(config), max_position, rope_parameters(config))
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, kind, rotary_emb, build_mlp(config, f"model.layers.{i}.mlp"),
                                f"model.layers.{i}")
            for i, kind in enumerate(config.layer_types))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5's text model (Qwen3_5TextConfig). Pipeline parallelism and speculative decoding are
    not wired in (refused at start-up)."""
    engine_layers = True  # (its layers are of several kinds: features/layer_groups.py)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def check_config(cls, config: PretrainedConfig, max_model_len: int | None = None):
        check_qwen3_5_config(config)

    @staticmethod
    def build_mlp(config: PretrainedConfig, prefix: str) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, False, prefix)

    def __init__(self, config: PretrainedConfig, max_position: int):
        super().__init__()
        self.check_config(config, max_position)
        self.config = config
        self.model = Qwen3_5TextModel(config, max_position, self.build_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.unused = HeldElsewhere()  # where the loader drops the tensors of UNUSED_PREFIXES

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        """Our parameter (and shard id) for checkpoint tensor `name`."""
        if name.startswith(UNUSED_PREFIXES):
            return f"unused.{name}", None
        name = name.replace("model.language_model.", "model.", 1)
        for part, (packed_part, shard_id) in self.packed_modules_mapping.items():
            if f".{part}." in name:
                return name.replace(part, packed_part), shard_id
        return name, None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def check_qwen3_5_config(config: PretrainedConfig):
    """ValueError naming the option for whatever this module would compute differently from HF."""
    check_layer_types(config, LAYER_TYPES, "Qwen3.5")
    act = getattr(config, "hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"hidden_act={act!r} is not supported for Qwen3.5; supported: {list(SILU_NAMES)}")
    head_dim, kv_heads = head_dim_of(config), num_kv_heads_of(config)
    if config.num_attention_heads % kv_heads:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    params = rope_parameters(config)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    check_rope_parameters({key: value for key, value in params.items() if key != "partial_rotary_factor"},
                          rotary_dim)
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads={config.linear_num_value_heads} is not a multiple of "
                         f"linear_num_key_heads={config.linear_num_key_heads}")
