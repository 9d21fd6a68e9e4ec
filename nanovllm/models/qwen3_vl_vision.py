"""Qwen3-VL's vision encoder (a checkpoint's model.visual.*), computed as transformers'
modeling_qwen3_vl.py computes it (Qwen3VLVisionModel), step by step:
  patches    the image processor cuts each image into P x P patches, T frames deep (a still image is
             repeated T times), each flattened to C*T*P*P and listed merge block by merge block (the
             m x m patches, m = spatial_merge_size, that become one LLM token are adjacent); one linear
             map embeds a patch (the checkpoint's Conv3d, whose stride is its kernel, with a bias);
  positions  a learned table of num_position_embeddings = side x side vectors (48 x 48 released),
             resized as an image to each frame's h x w patch grid, bilinearly with the corners aligned
             (the table's corners land on the grid's corner patches), is added to the patch embeddings,
             the same for every frame of a video;
  blocks     `depth` pre-norm blocks (LayerNorm with biases, eps 1e-6): attention over each whole frame
             (no windows in Qwen3-VL), then an MLP (Linear, hidden_act = tanh-approximated GELU, Linear).
             q and k turn by the 2D rotary embedding of Qwen2.5-VL: the first half of each head's rotated
             pairs (dims i, i + head_dim/2) by the patch's row, the second half by its column;
  DeepStack  after each block of deepstack_visual_indexes, the hidden states go through a merger of
             their own (deepstack_merger_list, in the list's order) to out_hidden_size: one feature per
             LLM image token, which the text model adds to its hidden states after its first layers;
  merger     LayerNorm, then each merge block's m*m patch vectors, concatenated, through Linear, GELU
             (exact, erf), Linear to out_hidden_size: one embedding per LLM image token, in image order.
             The DeepStack mergers (use_postshuffle_norm) normalise after concatenating, over m*m*hidden
             features; the last merger normalises each patch vector before.
The outputs equal transformers' Qwen3VLModel.get_image_features(...): pooler_output and every
deepstack_features entry, their per-image pieces concatenated. Quirk: a DeepStack feature is appended
when its block runs, so the list is in block order even where deepstack_visual_indexes is not sorted
(each block still goes through the merger at its index's place in the list). Plain layers, no tensor
parallelism: every rank holds the whole tower.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from nanovllm.models.qwen2_5_vl_vision import VisionBlock, VisionRotaryEmbedding, frame_lengths, patch_positions

NORM_EPS = 1e-6  # every LayerNorm of the tower, as transformers hard-codes it


def interpolated_positions(table: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[num_patches, hidden] float32: the side x side learned position table resized bilinearly (corners
    aligned) to each frame's h x w grid, in the processor's merge-block order, repeated for each frame."""
    side = int(table.shape[0] ** 0.5)
    image = table[:side * side].float().view(side, side, -1).permute(2, 0, 1)[None]  # [1, hidden, side, side]
    positions = []
    for t, h, w in grid_thw.tolist():
        frame = F.interpolate(image, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
        # (hidden, block row, row in block, block column, column in block) -> block by block
        blocks = frame.view(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)
        positions.append(blocks.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(positions)


class VisionMLP(nn.Module):

    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch, with a bias), applied as the linear map it
    is on a flattened [C, T, P, P] patch."""

    def __init__(self, config):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


class PatchMerger(nn.Module):
    """LayerNorm, each merge block's m*m patch vectors concatenated, Linear, GELU, Linear. The norm is
    over one patch vector (the last merger), or over the concatenation (use_postshuffle_norm: DeepStack's)."""

    def __init__(self, config, use_postshuffle_norm: bool):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size ** 2
        self.norm_after_concat = use_postshuffle_norm
        self.norm = nn.LayerNorm(merged if use_postshuffle_norm else config.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.act = nn.GELU()  # exact GELU here, unlike the blocks' tanh approximation
        self.linear_fc2 = nn.Linear(merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.linear_fc1.in_features
        x = self.norm(x.view(-1, merged)) if self.norm_after_concat else self.norm(x).view(-1, merged)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """Built from a Qwen3VLVisionConfig; parameter names are the checkpoint's under model.visual."""

    def __init__(self, config):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.deepstack_layers = list(getattr(config, "deepstack_visual_indexes", None) or [])  # (Qwen3.5's: none)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.rotary = VisionRotaryEmbedding(config.hidden_size // config.num_heads, theta)
        self.blocks = nn.ModuleList([VisionBlock(config, lambda dim: nn.LayerNorm(dim, eps=NORM_EPS), VisionMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act)) for _ in range(config.depth)])
        self.merger = PatchMerger(config, use_postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, use_postshuffle_norm=True) for _ in self.deepstack_layers])

    def num_image_tokens(self, grid_thw) -> int:
        """The LLM tokens (merged embeddings) of an image or video of this (t, h, w) patch grid."""
        t, h, w = (int(n) for n in grid_thw)
        return t * h * w // self.merge ** 2

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[num_patches, hidden]: each patch embedded, plus its learned position interpolated to its grid."""
        x = self.patch_embed(pixel_values)
        return x + interpolated_positions(self.pos_embed.weight, grid_thw, self.merge).to(x.dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """[num_patches, C*T*P*P], [num_images, 3] -> the merged embeddings [num_patches // merge**2,
        out_hidden_size] and the DeepStack features, one such tensor per deepstack_visual_indexes entry."""
        lengths = frame_lengths(grid_thw)
        cos, sin = self.rotary(patch_positions(grid_thw, self.merge))
        x, deepstack = self.embed(pixel_values, grid_thw), []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in self.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
        return self.merger(x), deepstack
