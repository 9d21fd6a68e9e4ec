"""The reference backend: plain PyTorch, any device. Every other backend is tested against it.

An fp8 KV cache (kv_cache_dtype="fp8") holds each layer's K as fp8(clamp(K / k_scale, +-FP8_MAX)),
V likewise with v_scale (0-dim float32 device tensors of the layer; None: 1.0): store_kv
quantizes, and forward dequantizes (fp8.to(q.dtype) * scale) the K/V it gathers from the cache.

A step with no cached context (block_tables None: fresh prompts) attends over its new K/V
quantized and dequantized the same way, i.e. over exactly what the cache now holds. vLLM attends
over the unquantized new K/V there; we do not, so that a token's output depends only on its
context's tokens, not on how the scheduler split a prompt into chunks (a later chunk reads the
earlier ones from the cache), on prefix-cache hits, or on a preemption. Every backend does the same.
"""
import torch
import torch.nn.functional as F

from nanovllm.utils.context import Context

FP8_KV_DTYPE = torch.float8_e4m3fn
# e4m3fn's largest finite value (448.0). It has no infinity: a value past it would become NaN, so
# quantize_kv clamps there.
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[T, Hkv, D] -> the fp8 values stored for it: x / scale, clamped, rounded to nearest even."""
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values read from the cache -> the K/V they stand for, in dtype (the query's)."""
    x = x.to(dtype)
    return x if scale is None else x * scale


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` cached tokens, [length, Hkv, D], read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions of a context over all of it: q [n, H, D], k, v
    [L, Hkv, D] (L >= n) -> [n, H, D]. Query i sits at position L - n + i and sees keys 0 .. L - n + i."""
    n, length = q.shape[0], k.shape[0]
    if n == 1:
        mask, causal = None, False          # a lone last query sees every key
    elif n == length:
        mask, causal = None, True
    else:
        rows = torch.arange(length - n, length, device=q.device)
        mask, causal = torch.arange(length, device=q.device)[None, :] <= rows[:, None], False
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


class TorchBackend:
    elementwise = None  # (the layers' own PyTorch ops)

    @staticmethod
    def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        if k_cache.dtype == FP8_KV_DTYPE:
            k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v

    @staticmethod
    def forward(q, k, v, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
        out = torch.empty_like(q)
        fp8 = k_cache is not None and k_cache.dtype == FP8_KV_DTYPE
        if fp8 and context.block_tables is None:  # what the cache holds for them (see the module's docstring)
            k = dequantize_kv(quantize_kv(k, k_scale), k_scale, q.dtype)
            v = dequantize_kv(quantize_kv(v, v_scale), v_scale, q.dtype)
        cu_q, lens_k = context.cu_seqlens_q_cpu, context.seq_lens_k_cpu
        for i in range(len(lens_k)):
            start, end = cu_q[i], cu_q[i + 1]
            if context.block_tables is None:  # no cached context: the new K/V are the whole context
                seq_k, seq_v = k[start:end], v[start:end]
            else:
                seq_k = gather_context(k_cache, context.block_tables[i], lens_k[i])
                seq_v = gather_context(v_cache, context.block_tables[i], lens_k[i])
                if fp8:
                    seq_k, seq_v = dequantize_kv(seq_k, k_scale, q.dtype), dequantize_kv(seq_v, v_scale, q.dtype)
            out[start:end] = attend(q[start:end], seq_k, seq_v, scale)
        return out
