"""Qwen2.5-VL: a vision encoder (models/qwen2_5_vl_vision.py) whose image embeddings take the place
of the prompt's image placeholder tokens, and a Qwen2 text decoder with multimodal RoPE.

Multimodal RoPE (M-RoPE): each token has three positions (temporal, height, width) and the head's
rotary frequencies are split into three sections (`mrope_section`, e.g. 16, 24, 24 of 64), each
rotated by one of them. A text token's three positions are equal, so it is plain RoPE there; an
image's tokens take the position of the image's start in time and their row and column of the
merged patch grid in height and width (features/multimodal.py computes them for a prompt). After an
image the text positions continue from the largest position it used, so a sequence's position is
its token index plus a per-request delta (negative for a large image).

The checkpoints are transformers' Qwen2_5_VLForConditionalGeneration: the text model under
model.language_model.*, the vision tower under model.visual.*, lm_head.* (older ones: model.*
and visual.*). features/multimodal.py's runner sets `multimodal_step` before each forward: the
step's three positions per token and the image embeddings of its placeholder tokens.
"""
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary, rope_parameters
from nanovllm.layers.transformer import head_dim_of
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen2_5_vl_vision import Qwen2_5VisionTower
from nanovllm.utils.parallel import HeldElsewhere


@dataclass
class MultimodalStep:
    """A step's image inputs, on the model's device: positions [3, T] (M-RoPE's, every token of the
    step), and the embeddings [K, hidden] of its K placeholder tokens, at `slots` [K] of the flat step."""
    positions: torch.Tensor
    embeddings: torch.Tensor | None = None
    slots: torch.Tensor | None = None


def mrope_grids(num_frequencies: int, sections: list[int], interleaved: bool) -> torch.Tensor:
    """[num_frequencies]: which grid (0 t, 1 h, 2 w) each rotary frequency reads. In three runs of
    `sections` (Qwen2.5-VL: 0..0 1..1 2..2, which must add up), or interleaved (Qwen3-VL, Qwen3.5:
    t h w t h w ..., then t: frequency i is h's if i % 3 == 1 and i < 3 * h, w's if i % 3 == 2 and
    i < 3 * w, else t's, as transformers' recomposition computes it, whatever the sections add up to)."""
    if interleaved:
        i = torch.arange(num_frequencies)
        grids = torch.where((i % 3 == 1) & (i < 3 * sections[1]), 1, 0)
        return torch.where((i % 3 == 2) & (i < 3 * sections[2]), 2, grids)
    if sum(sections) != num_frequencies:
        raise ValueError(f"mrope_section={sections} must add up to the rotary frequencies, {num_frequencies}")
    return torch.repeat_interleave(torch.arange(len(sections)) % 3, torch.tensor(sections))


def mrope_cos_sin(module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A RoPE module's cos and sin [T, 1, d/2] at positions [3, T], each frequency at its grid's position."""
    frequencies = torch.arange(module.grid_of.numel(), device=positions.device)
    rows = positions[module.grid_of].t()                                  # [T, d/2]: each frequency's position
    return module.cos[rows, frequencies].unsqueeze(1), module.sin[rows, frequencies].unsqueeze(1)


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over positions [3, T] (mrope_grids: which grid's position turns each frequency; the
    tables are RotaryEmbedding's); positions [T] (a text-only step) are plain RoPE."""

    def __init__(self, head_dim: int, max_position: int, params: dict, interleaved: bool = False):
        super().__init__(head_dim, max_position,
                         {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved")})
        sections = params.get("mrope_section") or [head_dim // 2, 0, 0]
        self.register_buffer("grid_of", mrope_grids(head_dim // 2, sections, interleaved), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None):
        if positions.dim() == 1:
            return super().forward(positions, q, k, q_norm, k_norm)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = mrope_cos_sin(self, positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class VisionLanguageModel:
    """What Qwen2.5-VL and Qwen3-VL add to their text decoder (a DecoderForCausalLM they subclass
    with this first): the vision tower, M-RoPE, the image embeddings at the step's placeholder
    tokens, and Qwen3-VL's DeepStack: the tower's features of some of its blocks, added to the
    hidden states of those tokens after the decoder's first layers, one layer each.

    config: the text config (Config reads text_config); vision_config: the checkpoint's, from the
    multimodal runner (None: the text model alone, and the vision weights skipped)."""
    engine_layers = takes_images = True  # (the engine runs it with features/multimodal.py's runner and scheduler)

    def attach_vision(self, rotary: nn.Module, vision_config, tower_class):
        """The M-RoPE `rotary` in every attention layer, the tower (if vision_config), no step yet."""
        for layer in self.model.layers:
            if getattr(layer, "self_attn", None) is not None:
                layer.self_attn.rotary_emb = rotary
        self.visual = tower_class(vision_config) if vision_config is not None else HeldElsewhere()
        self.num_deepstack = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
        self.multimodal_step: MultimodalStep | None = None

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        if name.startswith(("model.visual.", "visual.")):  # (the tower's names are its own: not packed)
            return "visual." + name.split("visual.", 1)[1], None
        return super().checkpoint_target(name.replace("model.language_model.", "model.", 1))

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[patches, C*T*P*P], [images, 3] -> the images' embeddings [tokens, hidden], in order; with
        DeepStack, each layer's feature after them: [tokens, hidden * (1 + DeepStack layers)]."""
        out = self.visual(pixel_values.to(self.model.embed_tokens.weight.dtype), grid_thw)
        return torch.cat([out[0], *out[1]], -1) if isinstance(out, tuple) else out

    def embed_step(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """The step's embeddings, the image embeddings at its placeholder tokens; its positions (M-RoPE's
        [3, T] with images); and the DeepStack features of those tokens, one per layer it goes into."""
        hidden, step, features = self.model.embed_tokens(input_ids), self.multimodal_step, []
        if step is not None:
            positions = step.positions
            if step.slots is not None:
                hidden[step.slots], *features = step.embeddings.to(hidden.dtype).chunk(1 + self.num_deepstack, -1)
        return hidden, positions, features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        (hidden, positions, features), residual = self.embed_step(input_ids, positions), None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i < len(features):  # (DeepStack: into the residual stream, hidden + residual, after layer i)
                hidden[self.multimodal_step.slots] += features[i]
        hidden, _ = self.model.norm(hidden, residual)
        return hidden


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel, Qwen2ForCausalLM):
    def __init__(self, config: PretrainedConfig, max_position: int, vision_config: PretrainedConfig | None = None):
        super().__init__(config, max_position)
        rotary = MRotaryEmbedding(head_dim_of(config), max_position, rope_parameters(config))
        self.attach_vision(rotary, vision_config, Qwen2_5VisionTower)
