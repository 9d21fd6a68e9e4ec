"""flash-attn's kernels (CUDA, `pip install flash-attn`): paged varlen attention for steps with
prefill chunks or cached prefixes, `flash_attn_with_kvcache` for decode-only steps.

It reads the paged cache in pages of 256 tokens, hence block_size % 256 == 0 (Config checks it), and
K/V in the query's dtype only (no kv_cache_dtype="fp8"). Its causal masks are aligned to the bottom
right (query j of n sees keys up to L - n + j), as ours. A sliding-window layer's `window` W is its
window_size (W - 1, 0): each query sees itself and the W - 1 keys before it (layers/sliding_window.py).
"""
import functools
import importlib.util

from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanovllm.layers.backends.torch_ref import TorchBackend
from nanovllm.utils.context import Context


class FlashAttnBackend:
    elementwise = None  # PyTorch's ops; on(device) gives CUDA our fused kernels
    store_kv = staticmethod(TorchBackend.store_kv)  # an index_put; flash-attn has no store kernel

    @classmethod
    @functools.cache
    def on(cls, device: str) -> type:
        """The backend for device: on CUDA, where Triton is installed, with layers/fused_triton.py's
        fused RMSNorm (+ residual), SiLU-and-mul and q/k-norm + RoPE kernels, compiled, as the Triton
        backend has (one launch each where PyTorch's ops take several); elsewhere PyTorch's ops (on
        CPU flash_attn is only the tests' fake, and its engines run in either Triton mode)."""
        if device != "cuda" or importlib.util.find_spec("triton") is None:
            return cls
        from nanovllm.utils.triton_mode import import_kernels
        fused = import_kernels("nanovllm.layers.fused_triton", device, "attention_backend='flash_attn'")
        return type(f"{cls.__name__}Fused", (cls,), {"elementwise": fused})

    @staticmethod
    def forward(q, k, v, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None,
                window: int = 0):
        # (k_scale, v_scale unread: the cache is never fp8 here, Config refuses kv_cache_dtype="fp8")
        window_size = (window - 1, 0) if window else (-1, -1)
        if context.block_tables is None:  # fresh prompts: the new K/V are the whole context
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q=context.cu_seqlens_q, cu_seqlens_k=context.cu_seqlens_k,
                                          max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k,
                                          softmax_scale=scale, causal=True, window_size=window_size)
        if context.decode_only:
            out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context.seq_lens_k,
                                          block_table=context.block_tables, softmax_scale=scale, causal=True,
                                          window_size=window_size)
            return out.squeeze(1)
        return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=context.cu_seqlens_q,
                                      cu_seqlens_k=context.cu_seqlens_k, max_seqlen_q=context.max_seqlen_q,
                                      max_seqlen_k=context.max_seqlen_k, softmax_scale=scale, causal=True,
                                      block_table=context.block_tables, window_size=window_size)
