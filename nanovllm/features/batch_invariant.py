"""Batch-invariant mode (`LLM(..., batch_invariant=True)`): a sequence's tokens and logprobs are
bitwise the same whatever else is in the batch and however its prompt is chunked (RL rollouts
that must replay exactly; comparing a sampler against a reference one request at a time).

Why outputs move with the batch at all. Every op of the forward is row-wise in *meaning*, but a
library picks its kernel by shape: F.linear on M rows tiles (and on CPU even picks GEMV for M=1)
by M, so row 0's sum over K runs in another order, i.e. other float bits, when the batch grows.
Attention's shapes follow a sequence's query length, which chunked prefill changes (a decode token
is a query of 1, the same token inside a prefill chunk one of many), and the Triton backend's
split-KV decode splits each context in a count chosen from the batch's size. Element-wise ops,
RMSNorm's mean over the hidden size, log_softmax, and the sampler (per-row seeded noise,
layers/inverse_transform.py) are already row-invariant: a row's reduction runs over its own
elements in an order fixed by the row's length alone.

What this layer changes, only while a runner of invariant_runner() builds or runs a step (a
TorchFunctionMode, InvariantOps, entered in _build, which captures the CUDA graphs and runs the
memory warm-up, and in run, every step's forward, logits and prompt logprobs):
  F.linear            -> tiled_linear: rows padded to a multiple of ROW_TILE, one GEMM per tile
                         of the same [ROW_TILE, K] shape, so each row's bits depend on its inputs alone.
  F.scaled_dot_product_attention -> tiled_attention: queries in tiles of QUERY_TILE rows, keys in
                         blocks of KEY_BLOCK at fixed absolute positions (0, KEY_BLOCK, ...), an
                         online softmax over the blocks in order. A masked key scores exactly -inf,
                         so it adds exact zeros, and a block wholly past a query's position leaves
                         its (max, sum, acc) bitwise unchanged: a query sees the same arithmetic
                         whether it is decoded alone or sits inside a longer chunk.
  other GEMMs (matmul, mm, bmm, einsum, @): a RuntimeError naming the op, never a silent change.
  the Triton backend:    its split-KV decode gets one split whatever the batch (OneSplitBackend).
What it refuses (ValueError at start-up, check_supported): the flash_attn backend (flash-attn's
split count is its own heuristic of the batch), quantized weights (their kernels tile by M),
mixtures of experts on CUDA (the fused Triton kernel's tiles follow each expert's token count;
on CPU the experts run through F.linear and are invariant), models with layers of other kinds
(linear attention, sliding windows, images: their kernels chunk by the step), speculative
decoding (its drafts are not checked here), and tensor_parallel_size > 2 (an all-reduce of
three or more ranks may sum in an order its algorithm picks by message size; two ranks' a + b
is exact whatever the algorithm).

The cost: padded rows are computed and thrown away (a decode step of one sequence does a
ROW_TILE-row GEMM), one GEMM launch per tile, and attention in Python loops over tiles instead
of one fused kernel. bench.py --batch-invariant measures it.
"""
import dataclasses
import importlib
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nanovllm.config import Config

# Rows per GEMM tile. Every linear layer runs as GEMMs of [ROW_TILE, K] x [K, N], whatever M: on
# CPU 16 rows (measured here with torch 2.13: F.linear's row differs between M = 1, M in {2, 3} and
# M >= 4, and a fixed tile gives a row the same bits at any position in it; 16 keeps a batch-1
# decode step's waste at 15 rows); on CUDA 128, a tensor-core GEMM's usual row tile, so large
# prefills run as full tiles (a decode step of one sequence then pays a 128-row GEMM, still
# bound by reading the weights, as its GEMV was).
ROW_TILE = {"cpu": 16, "cuda": 128}
# Attention tiles: QUERY_TILE query rows against KEY_BLOCK keys per GEMM. Small, as a decode
# step's one query pads to a whole tile; KEY_BLOCK also fixes where the online softmax's partial
# sums start (multiples of it), the one order every chunking of a prompt shares.
QUERY_TILE = 16
KEY_BLOCK = 32
# The Triton backend sizes its decode split count from Context.padded_batch (triton_attn.
# context_num_splits: enough splits that batch * kv heads * splits fills the GPU). Given a batch
# this large it asks for one split on any GPU: each context is one sequential pass, for any batch.
ONE_SPLIT_BATCH = 1 << 30
# The online softmax's starting max: finite, as the Triton kernels' NEG_BIG, so that a row with no
# visible key yet gets exp(-inf - NEG_BIG) = 0 rather than exp(-inf - -inf) = NaN.
NEG_BIG = -1.0e30
# GEMM-like ops with no fixed-tiling version here: reaching one under InvariantOps is an error,
# since it would make the mode silently not invariant.
UNTILED_GEMMS = (torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm, torch.einsum,
                 torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.__matmul__,
                 torch.Tensor.__rmatmul__, F.bilinear)


def row_tile(device: torch.device) -> int:
    return ROW_TILE["cuda" if device.type == "cuda" else "cpu"]


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) ([..., K] x [N, K] -> [..., N]) as GEMMs of a fixed [ROW_TILE, K]
    shape, the rows zero-padded to whole tiles: a library choosing its kernel by shape chooses the
    same one for every tile, so a row's result does not depend on how many rows came with it."""
    rows = x.reshape(-1, x.shape[-1])                                   # [M, K]
    num_rows, tile = rows.shape[0], row_tile(x.device)
    if num_rows == 0:
        return F.linear(x, weight, bias)
    padded = rows.new_zeros(-(-num_rows // tile) * tile, rows.shape[1])  # [ceil(M / tile) * tile, K]
    padded[:num_rows] = rows
    out = torch.cat([F.linear(padded[start:start + tile], weight, bias)
                     for start in range(0, padded.shape[0], tile)])     # [padded rows, N]
    return out[:num_rows].view(*x.shape[:-1], weight.shape[0])


def _visible(num_queries: int, num_keys: int, attn_mask: torch.Tensor | None, is_causal: bool,
             device: torch.device) -> torch.Tensor | None:
    """[n, L] bool, True where query i may see key j (SDPA's semantics: is_causal is top-left
    aligned, j <= i; a boolean mask is used as given); None: every key."""
    if is_causal:
        return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril()
    return attn_mask


def tiled_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """F.scaled_dot_product_attention (query [..., H, n, D], key/value [..., Hkv, L, D]; a boolean
    attn_mask [n, L] or is_causal) in fixed tiles: QUERY_TILE queries x KEY_BLOCK keys a GEMM, an
    online softmax over the key blocks in order, in float32. Query padding rows, key padding and
    masked keys score exactly -inf: they add zeros, so a query's result is the same bits in any
    chunk of any length."""
    if dropout_p:
        raise ValueError(f"batch-invariant attention takes no dropout, got dropout_p={dropout_p}")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(f"batch-invariant attention takes a boolean attn_mask, got {attn_mask.dtype}")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal are exclusive (as in scaled_dot_product_attention)")
    *lead, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[-3], key.shape[-2]
    if num_heads != num_kv_heads:  # GQA: each kv head serves its group of query heads
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=-3)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=-3)
    scale = head_dim ** -0.5 if scale is None else scale
    visible = _visible(num_queries, num_keys, attn_mask, is_causal, query.device)
    q_pad, k_pad = -(-num_queries // QUERY_TILE) * QUERY_TILE, -(-num_keys // KEY_BLOCK) * KEY_BLOCK
    # [B, n, D] -> [B, q_pad, D] (B: the leading dims and heads), zeros appended; likewise keys
    q = F.pad(query.reshape(-1, num_queries, head_dim).float(), (0, 0, 0, q_pad - num_queries))
    k = F.pad(key.reshape(-1, num_keys, head_dim).float(), (0, 0, 0, k_pad - num_keys))
    v = F.pad(value.reshape(-1, num_keys, value.shape[-1]).float(), (0, 0, 0, k_pad - num_keys))
    seen = torch.zeros(q_pad, k_pad, dtype=torch.bool, device=query.device)   # [q_pad, k_pad]
    seen[:num_queries, :num_keys] = True if visible is None else visible
    out = q.new_empty(q.shape[0], q_pad, v.shape[-1])
    for qs in range(0, q_pad, QUERY_TILE):
        q_tile = q[:, qs:qs + QUERY_TILE]                                      # [B, Tq, D]
        m = q.new_full((q.shape[0], QUERY_TILE), NEG_BIG)                      # running max [B, Tq]
        total = q.new_zeros(q.shape[0], QUERY_TILE)                            # running sum [B, Tq]
        acc = q.new_zeros(q.shape[0], QUERY_TILE, v.shape[-1])                 # [B, Tq, Dv]
        for ks in range(0, k_pad, KEY_BLOCK):
            mask = seen[qs:qs + QUERY_TILE, ks:ks + KEY_BLOCK]                 # [Tq, Bk]
            if not mask.any():  # (wholly masked: it would leave m, total, acc bitwise as they are)
                continue
            scores = torch.bmm(q_tile, k[:, ks:ks + KEY_BLOCK].transpose(1, 2)) * scale   # [B, Tq, Bk]
            scores = scores.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(scores - m_new[..., None])
            total = total * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.bmm(p, v[:, ks:ks + KEY_BLOCK])
            m = m_new
        out[:, qs:qs + QUERY_TILE] = acc / torch.where(total > 0, total, 1.0)[..., None]
    return out[:, :num_queries].reshape(*lead, num_heads, num_queries, -1).to(query.dtype)


class InvariantOps(TorchFunctionMode):
    """Routes the model's GEMMs and attention to their fixed-tiling versions (above). Inside a
    handler the mode is off, so tiled_linear's own F.linear calls reach PyTorch directly."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return tiled_linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return tiled_attention(*args, **kwargs)
        if func in UNTILED_GEMMS:
            raise RuntimeError(f"batch_invariant=True: {getattr(func, '__name__', func)} has no fixed-tiling version "
                               f"here (only F.linear and scaled_dot_product_attention are tiled); this model's code "
                               f"path is not batch-invariant")
        return func(*args, **kwargs)


_active = threading.local()  # (modes are per thread: the engine may step in a thread of its own)


@contextmanager
def invariant_ops():
    """InvariantOps for the block, once (a step run while the build's mode is on adds no second one)."""
    if getattr(_active, "on", False):
        yield
        return
    _active.on = True
    try:
        with InvariantOps():
            yield
    finally:
        _active.on = False


class OneSplitBackend:
    """The Triton backend with its split-KV decode at one split whatever the batch: its forward
    sees a Context whose padded_batch is ONE_SPLIT_BATCH (see there). Everything else is its own."""

    def __init__(self, backend):
        self.backend, self.elementwise, self.store_kv = backend, backend.elementwise, backend.store_kv

    def forward(self, q, k, v, k_cache, v_cache, context, *args, **kwargs):
        context = dataclasses.replace(context, padded_batch=ONE_SPLIT_BATCH)
        return self.backend.forward(q, k, v, k_cache, v_cache, context, *args, **kwargs)


def check_supported(config: Config):
    """ValueError naming the option for what this mode cannot make invariant (the module's docstring)."""
    from nanovllm.models import resolve_model_class
    reasons = []
    if config.attention_backend == "flash_attn":
        reasons.append("attention_backend='flash_attn' (flash-attn picks its split-KV count from the batch; use "
                       "'triton' or 'torch')")
    if config.quant_config is not None:
        reasons.append(f"quantized weights ({type(config.quant_config).__name__}: their GEMM kernels tile by the "
                       f"batch's rows)")
    hf = config.hf_config
    if config.device == "cuda" and (getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)):
        reasons.append("a mixture of experts on CUDA (the fused kernel's tiles follow each expert's token count)")
    if getattr(resolve_model_class(hf), "engine_layers", False):
        reasons.append(f"{hf.architectures[0]}'s layers of other kinds (linear attention, sliding windows or images)")
    if config.speculative is not None:
        reasons.append("speculative decoding")
    if config.tensor_parallel_size > 2:
        reasons.append(f"tensor_parallel_size={config.tensor_parallel_size} (an all-reduce over more than 2 ranks "
                       f"may sum in an order chosen by message size)")
    if reasons:
        raise ValueError("batch_invariant=True does not support " + "; ".join(reasons))


class InvariantRunnerMixin:
    """Put before a runner class (invariant_runner): its build and its steps run under InvariantOps."""

    def _build(self, config: Config):
        check_supported(config)  # (here: a refusal closes the runner, and its workers, as any build error does)
        with invariant_ops():  # (the memory warm-up's forward and the CUDA graphs are captured in the mode)
            super()._build(config)

    def _load(self, config: Config):
        super()._load(config)
        for layer in self.attention_layers:
            if getattr(layer.backend, "__name__", None) == "TritonBackend":  # (a class; triton not imported here)
                layer.backend = OneSplitBackend(layer.backend)

    def run(self, batch, model, graphs):
        with invariant_ops():
            return super().run(batch, model, graphs)


# Invariant runner classes by base class. Each is also a module attribute under a name that says
# its base (_class_name), so that pickle finds it by reference in a worker process, where this
# module's __getattr__ builds it again on first lookup.
_CLASSES: dict[type, type] = {}
NAME_PREFIX = "BatchInvariant__"


def _class_name(base: type) -> str:
    """BatchInvariant__<base's module, dots as '__'>__<base's name>: reversible, as a module or
    class name holds no '__' (checked)."""
    parts = [*base.__module__.split("."), base.__qualname__]
    assert all("__" not in p and "." not in p for p in parts), f"cannot name an invariant {base}"
    return NAME_PREFIX + "__".join(parts)


def invariant_runner(runner_class: type) -> type:
    """runner_class (ModelRunner or a subclass, defined at a module's top level) in batch-invariant mode."""
    if runner_class not in _CLASSES:
        name = _class_name(runner_class)
        cls = type(name, (InvariantRunnerMixin, runner_class), {"__module__": __name__, "__qualname__": name})
        _CLASSES[runner_class] = cls
    return _CLASSES[runner_class]


def __getattr__(name: str):
    """An invariant runner class by its _class_name (PEP 562): how a worker process unpickles one."""
    if not name.startswith(NAME_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    *module, base = name[len(NAME_PREFIX):].split("__")
    return invariant_runner(getattr(importlib.import_module(".".join(module)), base))
