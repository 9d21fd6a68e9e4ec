"""The pre-norm decoder-only transformer that Llama, Mistral, Qwen2 and Qwen3 share.

A family is this decoder plus a few `DecoderFlags` (where the biases are, whether q and k are
normalized per head) and, where needed, its own checks; `models/<family>.py` only says which.
Parameter names equal the Hugging Face checkpoint's (model.layers.N.self_attn.o_proj.weight, ...)
except that q/k/v and gate/up are packed into qkv_proj and gate_up_proj: `packed_modules_mapping`
tells the loader which part of which packed matrix each checkpoint tensor fills.
"""
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, check_rope_parameters, rope_parameters
from nanovllm.utils.parallel import HeldElsewhere, stage_layers

# Names transformers gives the activation SiluAndMul computes ("swish" is the same function).
SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True)
class DecoderFlags:
    """What the families differ in; sizes, norms' eps and RoPE are read from config.json."""
    qkv_bias: bool = False  # q/k/v projections have a bias (Qwen2 always; Llama/Qwen3 with attention_bias)
    o_bias: bool = False    # o_proj has a bias (Llama/Qwen3 with attention_bias; never Qwen2)
    qk_norm: bool = False   # RMSNorm over each query and key head before RoPE (Qwen3)
    mlp_bias: bool = False  # gate/up/down projections have a bias (Llama's mlp_bias)


def head_dim_of(config: PretrainedConfig) -> int:
    """config.head_dim when given (it may differ from hidden_size / heads), else that quotient."""
    if getattr(config, "head_dim", None):
        return config.head_dim
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"the config gives no head_dim and hidden_size={config.hidden_size} is not divisible "
                         f"by num_attention_heads={config.num_attention_heads}")
    return config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The config's attention window (None: full); Qwen2/3 need use_sliding_window, Mistral's is always on."""
    if not getattr(config, "use_sliding_window", True):
        return None
    return getattr(config, "sliding_window", None)


def check_decoder_config(config: PretrainedConfig, max_model_len: int | None):
    """ValueError naming the option for whatever this decoder would compute differently from HF. A
    sliding window of at least max_model_len never drops a key: accepted (max_model_len None: unchecked)."""
    act = getattr(config, "hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"hidden_act={act!r} is not supported; supported: {list(SILU_NAMES)}")
    head_dim, kv_heads = head_dim_of(config), num_kv_heads_of(config)
    check_rope_parameters(rope_parameters(config), head_dim)
    if config.num_attention_heads % kv_heads:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    window = sliding_window_of(config)
    if window is not None and max_model_len is not None and window < max_model_len:
        raise ValueError(f"sliding_window={window} is shorter than max_model_len={max_model_len}: sliding-window "
                         f"attention is not supported; pass max_model_len <= {window}")


class DecoderAttention(nn.Module):
    """prefix: the module's name (model.layers.N.self_attn), for its layers' quantization."""

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, flags: DecoderFlags, prefix: str):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          num_kv_heads_of(config), bias=flags.qkv_bias, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=flags.o_bias,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps) if flags.qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps) if flags.qk_norm else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], -1)
        q = q.view(-1, self.num_heads, self.head_dim)      # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)   # [T, Hkv, D]
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)  # (the norms: Qwen3's)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, flags: DecoderFlags, mlp: nn.Module,
                 prefix: str):
        super().__init__()
        self.self_attn = DecoderAttention(config, rotary_emb, flags, f"{prefix}.self_attn")
        self.mlp = mlp  # a GatedMLP, or a mixture of experts
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int, flags: DecoderFlags, build_mlp):
        super().__init__()
        # (a pipeline stage holds some layers: the first stage the embeddings, the last the norm)
        held = stage_layers(config.num_hidden_layers)
        first, last = held.start == 0, held.stop == config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if first else HeldElsewhere()
        # one cos/sin table for all layers (they all rotate alike); a buffer, so no checkpoint name
        rotary_emb = RotaryEmbedding(head_dim_of(config), max_position, rope_parameters(config))
        self.layers = nn.ModuleList(DecoderLayer(config, rotary_emb, flags, build_mlp(config, i, flags),
                                                 f"model.layers.{i}") if i in held else HeldElsewhere()
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if last else HeldElsewhere()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """The causal LM: decoder body, LM head (tied to the embeddings when the config says so).

    A family subclasses it and overrides `flags` (and `check_config` for checks of its own;
    `build_mlp` for layers whose MLP is not the gated one, `checkpoint_target` for checkpoint
    names the packing below does not cover). `max_position` is the engine's max_model_len."""
    # checkpoint name fragment -> (our packed parameter's name fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        return DecoderFlags()

    @classmethod
    def check_config(cls, config: PretrainedConfig, max_model_len: int | None = None):
        check_decoder_config(config, max_model_len)

    @staticmethod
    def build_mlp(config: PretrainedConfig, layer_index: int, flags: DecoderFlags) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, flags.mlp_bias, f"model.layers.{layer_index}.mlp")

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        """Where checkpoint tensor `name` goes: (our parameter's name, shard id or None): a packed
        part to its packed parameter; a layer's KV-cache scales (self_attn.k_scale / v_scale) to its Attention's."""
        if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
            return name.replace(".self_attn.", ".self_attn.attn."), None
        for part, (packed_part, shard_id) in self.packed_modules_mapping.items():
            if part in name:
                return name.replace(part, packed_part), shard_id
        return name, None

    def __init__(self, config: PretrainedConfig, max_position: int):
        super().__init__()
        self.check_config(config, max_position)
        self.config = config
        self.model = DecoderModel(config, max_position, self.flags(config), self.build_mlp)
        # (pipeline parallelism: the first stage's, beside the embeddings; distributed/pipeline.py says why)
        first = not isinstance(self.model.embed_tokens, HeldElsewhere)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if first else HeldElsewhere()
        if first and getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
