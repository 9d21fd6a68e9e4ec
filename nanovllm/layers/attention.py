import torch
from torch import nn

from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Paged attention for one layer: stores the step's new K/V by slot, then attends through the
    block tables with the backend the model runner bound (`self.backend`).

    The runner also binds k_cache / v_cache ([num_blocks, block_size, Hkv, D]); before it does,
    and in the start-up warm-up step (no slot mapping), attention runs over the new tokens alone.

    k_scale, v_scale: an fp8 cache (kv_cache_dtype="fp8") stores K / k_scale and V / v_scale
    (backends/torch_ref.py). 1.0 unless the checkpoint has model.layers.N.self_attn.k_scale /
    .v_scale (vLLM's FP8 checkpoints), as vLLM does: e4m3's +-448 covers the K/V values models
    produce. Never computed from the traffic (say the first prefill): every later request's
    output would then depend on which came first, and on its batch. Device tensors, fixed once
    loaded, so a captured CUDA graph reads the right values; a checkpoint may omit them (kv_scale()).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.backend = None
        self.k_cache = self.v_cache = None
        self.k_scale, self.v_scale = kv_scale(), kv_scale()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]"""
        context = get_context()
        if self.k_cache is not None and context.slot_mapping is not None:  # (the warm-up step stores nothing)
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, context.slot_mapping, self.k_scale, self.v_scale)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, context, self.scale, self.k_scale, self.v_scale)
        return out.flatten(1)

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor):
        """A checkpoint's k_scale / v_scale: one positive finite number (a scalar or shape [1]), else a
        ValueError (a scale of 0 makes every K/V infinite, a negative one flips their signs)."""
        if loaded.numel() != 1 or loaded.dim() > 1:
            raise ValueError(f"a KV-cache scale must be one number (a scalar or shape [1]), got shape "
                             f"{tuple(loaded.shape)}")
        value = loaded.float().reshape(())
        if not (torch.isfinite(value) and value > 0):
            raise ValueError(f"a KV-cache scale must be a positive finite number, got {value.item()}")
        param.data.copy_(value)


def kv_scale() -> nn.Parameter:
    """A layer's k_scale or v_scale: a 0-dim float32 parameter, 1.0 until a checkpoint gives one
    (a cache in the model's dtype ignores it)."""
    scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
    scale.optional = True  # (utils/loader.py: not reported missing when the checkpoint has none)
    return scale


def bind_backend(model: nn.Module, backend) -> list[Attention]:
    """Hand the model's Attention layers the backend, and each module with a `kernels` slot (RMSNorm,
    SiluAndMul, RotaryEmbedding) its fused kernels (backend.elementwise; None: PyTorch's ops)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
        elif hasattr(type(module), "kernels"):
            module.kernels = backend.elementwise
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_block_bytes(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of a model with these attention layers, in the cache's dtype (Config.kv_dtype)."""
    per_token = 2 * len(layers) * layers[0].num_kv_heads * layers[0].head_dim * dtype.itemsize
    return block_size * per_token


def bind_kv_cache(layers: list[Attention], num_blocks: int | None, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """A KV cache [K/V, layer, block, slot in block, kv head, head dim] of num_blocks usable blocks,
    each layer handed its slices (None: unbind them). One spare block at the end, never handed
    out: the scratch row's tokens (CUDA-graph padding) write and read there, harmlessly."""
    for layer in layers:
        layer.k_cache = layer.v_cache = None
    if num_blocks is None:
        return None
    cache = torch.zeros(2, len(layers), num_blocks + 1, block_size, layers[0].num_kv_heads, layers[0].head_dim,
                        dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache
