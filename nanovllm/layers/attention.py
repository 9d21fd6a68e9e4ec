import torch
from torch import nn

from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Paged attention for one layer: stores the step's new K/V by slot, then attends through the
    block tables with the backend the model runner bound (`self.backend`).

    The runner also binds k_cache / v_cache ([num_blocks, block_size, Hkv, D]); before it does,
    and in the start-up warm-up step (no slot mapping, no block tables), attention runs over the
    new tokens alone.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.backend = None
        self.k_cache = self.v_cache = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]"""
        context = get_context()
        if self.k_cache is not None and context.slot_mapping is not None:  # (the warm-up step stores nothing)
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, context.slot_mapping)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, context, self.scale)
        return out.flatten(1)


def kv_block_bytes(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of a model with these attention layers."""
    per_token = 2 * len(layers) * layers[0].num_kv_heads * layers[0].head_dim * dtype.itemsize
    return block_size * per_token


def bind_kv_cache(layers: list[Attention], num_blocks: int | None, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """A KV cache of num_blocks usable blocks, each layer handed its slices (None: unbind them,
    freeing the old one). [K/V, layer, block, slot in block, kv head, head dim]. One spare block
    at the end, never handed out: the scratch row's tokens (CUDA-graph padding) write and read
    there, harmlessly."""
    for layer in layers:
        layer.k_cache = layer.v_cache = None
    if num_blocks is None:
        return None
    cache = torch.zeros(2, len(layers), num_blocks + 1, block_size, layers[0].num_kv_heads, layers[0].head_dim,
                        dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache
