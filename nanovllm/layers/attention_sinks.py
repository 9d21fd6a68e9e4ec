"""Attention sinks (gpt-oss): each head has a learned logit s_h that joins every query's softmax as
one more "key" with no value, so a query can give part of its attention to nothing:

    p_j = exp(l_j) / (exp(s_h) + sum_i exp(l_i)),   out = sum_j p_j v_j

as transformers' eager_attention_forward computes it (the sink column appended to the scores,
softmax, the column dropped). A query whose keys all score far below s_h returns about zero.

SinkAttention is the layer: an Attention over a window (None: a full-attention layer) whose
`sinks` [this rank's heads] are bound into its backend's windowed form. The torch backend
computes the formula above (sliding_window.attend_with_sinks, beside the window's attention);
the Triton kernels add exp(s_h) to their softmax's running sum at the end
(triton_attn._sink_share; split-KV decode in its reduction), which needs no change to the loop.
flash-attn's kernels have no sink term: a model with sinks is refused there at start-up.
"""
import inspect

import torch
from torch import nn

from nanovllm.layers.attention import Attention
from nanovllm.layers.backends.torch_ref import TorchBackend
from nanovllm.layers.sliding_window import WindowBound, WindowedTorchBackend, check_window, window_context
from nanovllm.utils.context import forward_context, get_context
from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import tp_rank, tp_size


class SinkAttention(Attention):
    """Attention with a learned sink logit per head, over a window (int) or the whole context (None)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, window: int | None):
        self.window = None if window is None else check_window(window)
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)  # this rank's heads
        self.tp_rank, self.tp_size = tp_rank(), tp_size()

    @property
    def backend(self):
        return self._windowed

    @backend.setter
    def backend(self, backend):
        if backend is None:
            self._windowed = None
        elif backend is TorchBackend:
            self._windowed = WindowedTorchBackend(self.window, self.sinks)
        elif "sinks" in inspect.signature(backend.forward).parameters:  # the Triton backend's (window 0: none)
            self._windowed = WindowBound(backend, self.window or 0, self.sinks)
        else:
            name = getattr(backend, "__name__", type(backend).__name__)
            raise ValueError(f"attention sinks (gpt-oss) run on attention_backend='torch' or 'triton', not on "
                             f"{name!r}: its kernels have no sink term; pass attention_backend='triton' (CUDA) "
                             f"or 'torch'")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        """The checkpoint's sinks [all heads]: this rank's heads (k_scale / v_scale: Attention's loader)."""
        if param is not self.sinks:
            return Attention.weight_loader(param, loaded)
        heads = param.shape[0]
        check_shape(loaded, (heads * self.tp_size,))
        param.data.copy_(loaded[self.tp_rank * heads:(self.tp_rank + 1) * heads])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.window is None:  # (a full layer: the step's own context)
            return super().forward(q, k, v)
        with forward_context(window_context(get_context())):  # (as SlidingWindowAttention's)
            return super().forward(q, k, v)
