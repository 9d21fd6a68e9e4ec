"""Qwen2.5-VL's vision encoder (a checkpoint's model.visual.*), computed as transformers'
modeling_qwen2_5_vl.py computes it (Qwen2_5_VisionTransformerPretrainedModel), step by step:
  patches  the image processor cuts each image into P x P patches, T frames deep (a still image is
           repeated T times), each flattened to C*T*P*P and listed merge block by merge block (the
           m x m patches, m = spatial_merge_size, that become one LLM token are adjacent); one linear
           map embeds a patch (the checkpoint's Conv3d, whose stride is its kernel);
  windows  the merge blocks are reordered window by window: squares of window_size // m // P blocks
           (8 x 8 patches, 112 pixels, in the released checkpoints), frame by frame, row-major, the
           last row and column of windows cut short where the grid is not a multiple of a window;
  blocks   `depth` pre-norm blocks (RMSNorm, eps 1e-6): attention within each window, except in the
           fullatt_block_indexes blocks, which attend over each whole frame; then a SwiGLU MLP with
           biases. q and k turn by a 2D rotary embedding: the first half of each head's rotated
           pairs (dims i, i + head_dim/2) by the patch's row, the second half by its column;
  merger   RMSNorm, then each merge block's m*m patch vectors, concatenated, through Linear, GELU,
           Linear to out_hidden_size: one embedding per LLM image token, put back in the image's
           order (the window reordering undone).
The output equals transformers' Qwen2_5_VLModel.get_image_features(...).pooler_output, its
per-image pieces concatenated. Plain layers, no tensor parallelism: every rank holds the whole tower.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from nanovllm.layers.layernorm import RMSNorm

NORM_EPS = 1e-6  # every RMSNorm of the tower, as transformers hard-codes it


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[num_patches, 2]: each patch's (row, column) in its frame, in the processor's merge-block order."""
    positions = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # (block row, row in block, block column, column in block) -> block by block
        frame = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        positions.append(frame.repeat(t, 1))
    return torch.cat(positions).to(grid_thw.device)


def window_order(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks' order window by window ([num_patches // merge**2], indexes into the
    processor's order), and each window's length in patches."""
    order, lengths, first = [], [], 0
    for t, h, w in grid_thw.tolist():
        blocks = first + torch.arange(t * (h // merge) * (w // merge)).view(t, h // merge, w // merge)
        for frame in blocks:
            for row in range(0, h // merge, window):
                for col in range(0, w // merge, window):
                    in_window = frame[row:row + window, col:col + window].flatten()
                    order.append(in_window)
                    lengths.append(in_window.numel() * merge * merge)
        first += blocks.numel()
    return torch.cat(order).to(grid_thw.device), lengths


def frame_lengths(grid_thw: torch.Tensor) -> list[int]:
    """Each frame's length in patches: the segments of full attention."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


def attend_in_segments(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Attention of [L, heads, head_dim] q/k/v within each consecutive segment of `lengths` tokens."""
    out = [F.scaled_dot_product_attention(q_.transpose(0, 1), k_.transpose(0, 1), v_.transpose(0, 1)).transpose(0, 1)
           for q_, k_, v_ in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
    return torch.cat(out)


class VisionRotaryEmbedding(nn.Module):
    """cos, sin [L, head_dim] of a patch's (row, column): head_dim // 4 frequencies for each axis."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        half = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = (positions[..., None].float() * self.inv_freq).flatten(1)  # [rows' | columns']
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


class VisionAttention(nn.Module):

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        cos, sin = cos[:, None], sin[:, None]  # rotary in float32, as transformers turns it
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        return self.proj(attend_in_segments(q, k, v, lengths).flatten(1))


class VisionMLP(nn.Module):

    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """A pre-norm block: x + attention(norm1(x)), then + mlp(norm2(x)). `norm` (a dim -> module) and
    `mlp` are the family's: RMSNorm and the SwiGLU here, Qwen3-VL's LayerNorm and GELU MLP."""

    def __init__(self, config, norm=lambda dim: RMSNorm(dim, NORM_EPS), mlp: nn.Module | None = None):
        super().__init__()
        self.norm1, self.norm2 = norm(config.hidden_size), norm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        if mlp is None:
            mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.mlp = mlp

    def forward(self, x, cos, sin, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch), applied as the linear map it is on a
    flattened [C, T, P, P] patch."""

    def __init__(self, config):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class PatchMerger(nn.Module):

    def __init__(self, config):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = RMSNorm(config.hidden_size, NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class Qwen2_5VisionTower(nn.Module):
    """Built from a Qwen2_5_VLVisionConfig; parameter names are the checkpoint's under model.visual."""

    def __init__(self, config):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size  # in merge blocks
        self.full_attention_blocks = set(config.fullatt_block_indexes)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotaryEmbedding(config.hidden_size // config.num_heads, theta)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config)

    def num_image_tokens(self, grid_thw) -> int:
        """The LLM tokens (merged embeddings) of an image or video of this (t, h, w) patch grid."""
        t, h, w = (int(n) for n in grid_thw)
        return t * h * w // self.merge ** 2

    def to_window_order(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Reorder [num_patches, ...] rows merge block by merge block (a block's patches stay together)."""
        return x.reshape(-1, self.merge ** 2, *x.shape[1:])[order].flatten(0, 1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[num_patches, C*T*P*P], [num_images, 3] -> [num_patches // merge**2, out_hidden_size]."""
        order, window_lengths = window_order(grid_thw, self.merge, self.window)
        full_lengths = frame_lengths(grid_thw)
        x = self.to_window_order(self.patch_embed(pixel_values), order)
        cos, sin = (self.to_window_order(c, order) for c in self.rotary(patch_positions(grid_thw, self.merge)))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_lengths if i in self.full_attention_blocks else window_lengths)
        return self.merger(x)[torch.argsort(order)]
