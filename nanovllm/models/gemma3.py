"""Gemma 3 (text): a decoder of local (sliding-window) and global attention layers, five local to
one global in the released checkpoints (config.layer_types says which is which).

Where it differs from the shared decoder (layers/transformer.py), each as transformers'
modeling_gemma3.py computes it:
- RMSNorm scales by (1 + weight), in float32 before rounding to the model's dtype (Llama rounds
  first): layers/offset_norm.py; four of them a layer, around attention and the MLP (pre and post each),
  each sublayer's output normalized before it is added to the residual stream;
- q and k normalized per head (the same norm) before RoPE, and scores scaled by
  query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- a RoPE base of its own for each kind of layer (rope_parameters[layer type]: 10,000 local,
  1,000,000 global, the global one linearly scaled in the 4B-27B checkpoints);
- embeddings multiplied by sqrt(hidden_size), rounded to the weights' dtype first (55.5 for 3072 in bf16);
- the MLP's activation gelu with the tanh approximation (gelu_pytorch_tanh);
- the LM head tied to the embeddings; logits optionally soft-capped (final_logit_softcapping).
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.offset_norm import OffsetRMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.layers.scaled_rope import check_scaled_rope, scaled_rotary_embedding
from nanovllm.layers.sliding_window import SlidingWindowAttention
from nanovllm.layers.transformer import (DecoderAttention, DecoderFlags, DecoderForCausalLM, GatedMLP, head_dim_of,
                                         num_kv_heads_of)
from nanovllm.models.layer_kinds import check_layer_types
from nanovllm.utils.parallel import HeldElsewhere, stage_layers

LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATIONS = ("gelu_pytorch_tanh",)


def rope_of(config: PretrainedConfig, layer_type: str) -> dict:
    """The RoPE parameters of one kind of layer, rope_type set."""
    params = dict((getattr(config, "rope_parameters", None) or {}).get(layer_type) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class Gemma3Attention(DecoderAttention):
    """The shared decoder's attention (q/k/v and o projections, biases where attention_bias says),
    with Gemma's (1 + w) q/k norms, its scale query_pre_attn_scalar ** -0.5, and a window on the
    local layers: the norms and the inner Attention are Gemma's, in place of those it builds."""

    def __init__(self, config: PretrainedConfig, layer_type: str, rotary_emb: RotaryEmbedding, prefix: str):
        bias = getattr(config, "attention_bias", False)
        super().__init__(config, rotary_emb, DecoderFlags(qkv_bias=bias, o_bias=bias), prefix)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        scale = config.query_pre_attn_scalar ** -0.5
        if layer_type == "sliding_attention":
            self.attn = SlidingWindowAttention(self.num_heads, self.head_dim, scale, self.num_kv_heads,
                                               config.sliding_window)
        else:
            self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], -1)
        # normalized here, not handed to the RoPE: its fused kernel's norm is Llama's (x * w), not (1 + w)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))


class GeluTanhAndMul(nn.Module):
    """[T, 2d] -> gelu_tanh(x[:, :d]) * x[:, d:] (transformers' gelu_pytorch_tanh of gate, times up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, rotary_emb: RotaryEmbedding, prefix: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_type, rotary_emb, f"{prefix}.self_attn")
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, f"{prefix}.mlp")
        self.mlp.act_fn = GeluTanhAndMul()  # (in place of SiLU)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3TextModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int):
        super().__init__()
        if stage_layers(config.num_hidden_layers) != range(config.num_hidden_layers):
            raise ValueError("pipeline_parallel_size > 1 is not supported for Gemma 3 (its layers keep the "
                             "residual stream themselves, unlike the shared decoder's stages); use "
                             "tensor_parallel_size instead")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden_size) rounded to the model's dtype (built under it), as transformers rounds it;
        # a Python float, so a captured CUDA graph holds no host tensor
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype(), device="cpu")
        self.embed_scale = float(scale)
        # one cos/sin table per kind of layer, shared by the layers of that kind
        ropes = {kind: scaled_rotary_embedding(head_dim_of(config), max_position, rope_of(config, kind))
                 for kind in sorted(set(config.layer_types))}
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, kind, ropes[kind], f"model.layers.{i}")
                                    for i, kind in enumerate(config.layer_types))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3's text model (google/gemma-3-1b-it; Gemma3TextConfig). Pipeline parallelism is not
    wired in (Gemma3TextModel refuses a stage's share of the layers)."""
    engine_layers = True  # (its layers are of several kinds: features/layer_groups.py)

    @classmethod
    def check_config(cls, config: PretrainedConfig, max_model_len: int | None = None):
        check_gemma3_config(config)

    def __init__(self, config: PretrainedConfig, max_position: int):
        nn.Module.__init__(self)
        self.check_config(config, max_position)
        self.config = config
        self.model = Gemma3TextModel(config, max_position)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if logits is None or self.softcap is None:  # (None: a TP rank other than 0)
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's 4B-27B checkpoints (Gemma3Config; Config reads its text_config): the text model under
    language_model.model.* (the Hub's files; transformers' own modules name it model.language_model.*);
    the vision tower and its projector are skipped until the engine runs images."""
    UNUSED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
    TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                     "language_model.lm_head.": "lm_head."}

    def __init__(self, config: PretrainedConfig, max_position: int):
        super().__init__(config, max_position)
        self.unused = HeldElsewhere()  # where the loader drops the tensors of UNUSED_PREFIXES

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        if name.startswith(self.UNUSED_PREFIXES):
            return f"unused.{name}", None
        for prefix, ours in self.TEXT_PREFIXES.items():
            if name.startswith(prefix):
                return super().checkpoint_target(ours + name[len(prefix):])
        return super().checkpoint_target(name)


def check_gemma3_config(config: PretrainedConfig):
    """ValueError naming the option for whatever this module would compute differently from HF."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_activation={act!r} is not supported for Gemma 3; supported: {list(ACTIVATIONS)}")
    check_layer_types(config, LAYER_TYPES, "Gemma 3")
    for option in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(config, option, None):
            raise ValueError(f"{option}={getattr(config, option)!r} is not supported (Gemma 3's text models "
                             f"have none)")
    head_dim, kv_heads = head_dim_of(config), num_kv_heads_of(config)
    if config.num_attention_heads % kv_heads:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    for kind in set(config.layer_types):
        params = rope_of(config, kind)
        if params["rope_type"] not in ("default", "linear"):
            raise ValueError(f"rope_type {params['rope_type']!r} of the {kind} layers is not supported for Gemma 3; "
                             f"supported: ['default', 'linear']")
        check_scaled_rope(params, head_dim)
