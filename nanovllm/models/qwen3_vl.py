"""Qwen3-VL: Qwen3's text decoder (q and k normalized per head) with interleaved M-RoPE, and a
vision tower (models/qwen3_vl_vision.py) whose DeepStack features join the hidden states of the
image tokens after the decoder's first layers (models/qwen2_5_vl.py's VisionLanguageModel: the
machinery both families share). Checkpoints: transformers' Qwen3VLForConditionalGeneration, the
text model under model.language_model.*, the tower under model.visual.*."""
from transformers import PretrainedConfig

from nanovllm.layers.rotary_embedding import rope_parameters
from nanovllm.layers.transformer import head_dim_of
from nanovllm.models.qwen2_5_vl import MRotaryEmbedding, VisionLanguageModel
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_vl_vision import Qwen3VisionTower


class Qwen3VLForConditionalGeneration(VisionLanguageModel, Qwen3ForCausalLM):
    def __init__(self, config: PretrainedConfig, max_position: int, vision_config: PretrainedConfig | None = None):
        super().__init__(config, max_position)
        # (interleaved always: transformers' Qwen3-VL does not read mrope_interleaved)
        rotary = MRotaryEmbedding(head_dim_of(config), max_position, rope_parameters(config), interleaved=True)
        self.attach_vision(rotary, vision_config, Qwen3VisionTower)
