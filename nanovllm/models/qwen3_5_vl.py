"""Qwen3.5 with images: the Hub's Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration
checkpoints, whose text model (models/qwen3_5.py, qwen3_5_moe.py: Gated DeltaNet and gated full
attention) sits beside Qwen3-VL's vision tower without its DeepStack mergers
(models/qwen3_vl_vision.py). The full-attention layers' partial RoPE (a quarter of each head) turns
by the interleaved M-RoPE grids (mrope_section, default 11, 11, 10 of its 32 frequencies).

The engine runs them with the state cache's runner and scheduler and image input's together
(features/multimodal.py: multimodal_classes); a prompt of text alone is Qwen3.5's text model as before.
"""
import torch
from transformers import PretrainedConfig

from nanovllm.layers.rotary_embedding import apply_rotary, rope_parameters
from nanovllm.layers.transformer import head_dim_of
from nanovllm.models.qwen2_5_vl import VisionLanguageModel, mrope_cos_sin, mrope_grids
from nanovllm.models.qwen3_5 import PartialRotaryEmbedding, Qwen3_5ForCausalLM
from nanovllm.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from nanovllm.models.qwen3_vl_vision import Qwen3VisionTower

DEFAULT_MROPE_SECTION = [11, 11, 10]  # (transformers' Qwen3_5TextRotaryEmbedding's)


class PartialMRotaryEmbedding(PartialRotaryEmbedding):
    """PartialRotaryEmbedding over positions [3, T]: its rotary frequencies on interleaved M-RoPE grids."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__(head_dim, max_position,
                         {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved")})
        sections = params.get("mrope_section") or DEFAULT_MROPE_SECTION
        self.register_buffer("grid_of", mrope_grids(self.rotary_dim // 2, sections, True), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if positions.dim() == 1:
            return super().forward(positions, x)
        cos, sin = mrope_cos_sin(self, positions)
        return torch.cat([apply_rotary(x[..., :self.rotary_dim], cos, sin), x[..., self.rotary_dim:]], -1)


class Qwen3_5VisionLanguage(VisionLanguageModel):
    """The tower and M-RoPE on a Qwen3.5 text model, whose layers keep the residual stream themselves."""

    def __init__(self, config: PretrainedConfig, max_position: int, vision_config: PretrainedConfig | None = None):
        super().__init__(config, max_position)
        rotary = PartialMRotaryEmbedding(head_dim_of(config), max_position, rope_parameters(config))
        self.attach_vision(rotary, vision_config, Qwen3VisionTower)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, positions, _ = self.embed_step(input_ids, positions)  # (no DeepStack in Qwen3.5's tower)
        for layer in self.model.layers:
            hidden = layer(positions, hidden)
        return self.model.norm(hidden)


class Qwen3_5ForConditionalGeneration(Qwen3_5VisionLanguage, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(Qwen3_5VisionLanguage, Qwen3_5MoeForCausalLM):
    pass
