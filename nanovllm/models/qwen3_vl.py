"""Qwen3-VL: Qwen3's text decoder (q and k normalized per head) with interleaved M-RoPE, and a
vision tower (models/qwen3_vl_vision.py) whose DeepStack features join the hidden states of the
image tokens after the decoder's first layers (models/qwen2_5_vl.py's VisionLanguageModel: the
machinery both families share). Checkpoints: transformers' Qwen3VLForConditionalGeneration, the
text model under model.language_model.*, the tower under model.visual.*."""
from transformers import PretrainedConfig

from nanovllm.models.qwen2_5_vl import VisionLanguageModel
from nanovllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3VLForConditionalGeneration(VisionLanguageModel, Qwen3ForCausalLM):
    interleaved_mrope = True  # (transformers' Qwen3-VL always interleaves: mrope_interleaved is not read)

    def __init__(self, config: PretrainedConfig, max_position: int, vision_config: PretrainedConfig | None = None):
        super().__init__(config, max_position)
        from nanovllm.models.qwen3_vl_vision import Qwen3VisionTower
        self.attach_vision(config, max_position, vision_config, Qwen3VisionTower)
