"""Sliding-window attention (Gemma 3's local layers): query at position p sees the keys at positions
p - window + 1 .. p, `window` tokens itself included, as transformers' sliding_window_overlay
(kv_idx > q_idx - window) on top of the causal mask.

A SlidingWindowAttention layer is an Attention whose backend, when the model runner binds one,
is swapped for a windowed one: it stores K/V as the backend does and attends over the window
alone, reading only the blocks that hold it. Prefix caching, chunked prefill and preemption need
nothing more: a query's window is found from its position in the context (seq_lens_k and the
block table), whoever computed the blocks before. Where the model's layers are grouped
(features/window_blocks.py), these layers have blocks of their own, those of the window alone, and
attend through their group's Context (WindowStep); else they share every block of the sequence
with the full-attention layers.

The torch backend's window is WindowedTorchBackend below; the Triton backend's kernels take it as
an argument (`window=`: each row masks keys before its window, and the loops start at the first
query's window, so a step reads the window's key tiles, not the whole context), and so does the
flash-attn backend (its kernels' window_size).
"""
import inspect
from dataclasses import dataclass

import torch

from nanovllm.layers.attention import Attention
from nanovllm.layers.backends.torch_ref import FP8_KV_DTYPE, TorchBackend, dequantize_kv, quantize_kv
from nanovllm.utils.context import Context, forward_context, get_context


@dataclass
class WindowStep:
    """The step's Context for the sliding-window layers when they have blocks of their own
    (features/window_blocks.py): their block tables and slots; on the step's Context.layer_group."""
    context: Context


def window_context(context: Context) -> Context:
    """What a sliding-window layer attends by: its group's context if it has one, else the step's."""
    return context.layer_group.context if isinstance(context.layer_group, WindowStep) else context


def gather_span(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """A sequence's cached tokens start .. end - 1, [end - start, Hkv, D], reading only their blocks."""
    block_size = cache.shape[1]
    first, last = start // block_size, -(-end // block_size)
    span = cache[block_table[first:last]].flatten(0, 1)
    return span[start - first * block_size:end - first * block_size]


def windowed_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                    length: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The last n = len(q) queries of a context of `length` tokens over its keys length - len(k) ..
    length - 1 (k, v [len(k), Hkv, D]: at least the window of the first query): query i, at
    position length - n + i, sees keys at positions within window - 1 before it, and itself
    (window None: every key before it). sinks [H]: layers/attention_sinks.py's softmax."""
    n = q.shape[0]
    query_pos = torch.arange(length - n, length, device=q.device)[:, None]
    key_pos = torch.arange(length - k.shape[0], length, device=q.device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    if sinks is not None:
        return attend_with_sinks(q, k, v, scale, mask, sinks)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
                      sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head (layers/attention_sinks.py): q [n, H, D], k/v [L, Hkv, D],
    mask [n, L] (True: visible), sinks [H] -> [n, H, D], computed in float32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]    # (the sink's share dropped)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


class WindowedTorchBackend:
    """The torch backend with a window: TorchBackend's store, attention over each query's window
    (None: the whole context, for attention sinks' full layers), with a layer's sinks where it has them."""
    elementwise = None
    store_kv = staticmethod(TorchBackend.store_kv)

    def __init__(self, window: int | None, sinks: torch.Tensor | None = None):
        self.window, self.sinks = window, sinks

    def forward(self, q, k, v, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None):
        out = torch.empty_like(q)
        fp8 = k_cache is not None and k_cache.dtype == FP8_KV_DTYPE
        if fp8 and context.block_tables is None:  # what the cache holds for them (torch_ref.py says why)
            k = dequantize_kv(quantize_kv(k, k_scale), k_scale, q.dtype)
            v = dequantize_kv(quantize_kv(v, v_scale), v_scale, q.dtype)
        cu_q, lens_k = context.cu_seqlens_q_cpu, context.seq_lens_k_cpu
        for i, length in enumerate(lens_k):
            start, end = cu_q[i], cu_q[i + 1]
            # the first query's window
            first_key = 0 if self.window is None else max(0, length - (end - start) - self.window + 1)
            if context.block_tables is None:  # no cached context: the new K/V are the whole context
                seq_k, seq_v = k[start:end][first_key:], v[start:end][first_key:]
            else:
                seq_k = gather_span(k_cache, context.block_tables[i], first_key, length)
                seq_v = gather_span(v_cache, context.block_tables[i], first_key, length)
                if fp8:
                    seq_k, seq_v = dequantize_kv(seq_k, k_scale, q.dtype), dequantize_kv(seq_v, v_scale, q.dtype)
            out[start:end] = windowed_attend(q[start:end], seq_k, seq_v, scale, self.window, length, self.sinks)
        return out


class WindowBound:
    """A backend whose forward takes `window=` (Triton's, flash-attn's), with this layer's window bound
    (0: none), and `sinks=` where the layer has them (layers/attention_sinks.py: Triton's)."""

    def __init__(self, backend, window: int, sinks: torch.Tensor | None = None):
        self.backend, self.window = backend, window
        self.extra = {} if sinks is None else {"sinks": sinks}
        self.elementwise, self.store_kv = backend.elementwise, backend.store_kv

    def forward(self, q, k, v, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None):
        return self.backend.forward(q, k, v, k_cache, v_cache, context, scale, k_scale, v_scale, window=self.window,
                                    **self.extra)


def windowed(backend, window: int):
    """backend's windowed form: the torch reference's, a window-taking backend's (Triton's,
    flash-attn's) with the window bound, else a ValueError naming the backend."""
    if backend is TorchBackend:
        return WindowedTorchBackend(window)
    if "window" in inspect.signature(backend.forward).parameters:
        return WindowBound(backend, window)
    raise ValueError(f"sliding-window attention (window {window}) runs on attention_backend='torch', 'triton' or "
                     f"'flash_attn', not on {getattr(backend, '__name__', backend)!r}")


def check_window(window: int) -> int:
    """window, if a positive int; else a ValueError naming it."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive int, got {window!r}")
    return window


class SlidingWindowAttention(Attention):
    """Attention over the last `window` positions. Binding a backend binds its windowed form."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, window: int):
        self.window = check_window(window)
        super().__init__(num_heads, head_dim, scale, num_kv_heads)

    @property
    def backend(self):
        return self._windowed

    @backend.setter
    def backend(self, backend):
        self._windowed = None if backend is None else windowed(backend, self.window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with forward_context(window_context(get_context())):
            return super().forward(q, k, v)
