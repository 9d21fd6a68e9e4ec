"""A stand-in for flash-attn written in PyTorch from its documented interface (flash-attn 2.x
`flash_attn_interface.py` docstrings), so the flash_attn backend's integration runs on CPU.

It checks what the real kernels require (argument names, shapes, int32 metadata, pages of 256
tokens) and computes what they compute: softmax(q k^T * softmax_scale) v with the causal mask
aligned to the bottom-right corner when seqlen_q != seqlen_k, GQA when nheads_k < nheads, and
window_size (left, right): query i sees keys i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right.
"""
import torch
import torch.nn.functional as F

__version__ = "2.7.4-fake"
PAGE_MULTIPLE = 256  # flash-attn: "page_block_size must be a multiple of 256"
CALLS = []           # names of the functions called, for tests to inspect


def _attend(q, k, v, scale, causal, window_size=(-1, -1)):
    """q [n, H, D], k/v [L, Hkv, D] -> [n, H, D]."""
    n, length = q.shape[0], k.shape[0]
    heads, kv_heads = q.shape[1], k.shape[1]
    assert heads % kv_heads == 0, "number of heads in key/value must divide number of heads in query"
    k = k.repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:  # bottom-right aligned: query i sees keys j <= i + length - n
        allowed = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    if window_size != (-1, -1):  # (flash-attn: -1 on a side is no bound there)
        left, right = window_size
        key, query = torch.arange(length)[None, :], torch.arange(n)[:, None] + (length - n)
        allowed = ((key >= query - left) | (left < 0)) & ((key <= query + right) | (right < 0))
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), v.float()).to(q.dtype)


def _paged(cache, block_table, length):
    assert block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
    assert cache.shape[1] % PAGE_MULTIPLE == 0, "Paged KV cache block size must be divisible by 256"
    return cache[block_table[: -(-length // cache.shape[1])].long()].flatten(0, 1)[:length]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), or with block_table
    (num_blocks, page_block_size, nheads_k, headdim); cu_seqlens_*: (batch + 1,) int32."""
    CALLS.append("flash_attn_varlen_func")
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32, "cu_seqlens must have dtype int32"
    assert q.dim() == 3 and k.dim() == (4 if block_table is not None else 3)
    assert dropout_p == 0.0 and not return_attn_probs
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        n, length = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        assert n <= max_seqlen_q and length <= max_seqlen_k, "max_seqlen is a bound on every sequence"
        if block_table is None:
            seq_k, seq_v = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        else:
            seq_k, seq_v = _paged(k, block_table[i], length), _paged(v, block_table[i], length)
        out[cu_q[i]:cu_q[i + 1]] = _attend(q[cu_q[i]:cu_q[i + 1]], seq_k, seq_v, scale, causal, window_size)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q: (batch, seqlen, nheads, headdim); k_cache, v_cache: (num_blocks, page_block_size,
    nheads_k, headdim) with block_table (batch, max_num_blocks_per_seq) int32;
    cache_seqlens: (batch,) int32. Returns (batch, seqlen, nheads, headdim)."""
    CALLS.append("flash_attn_with_kvcache")
    assert q.dim() == 4 and k_cache.dim() == 4 and block_table is not None and k is None and v is None
    assert cache_seqlens is not None and cache_seqlens.dtype == torch.int32, "cache_seqlens must be int32"
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i, length in enumerate(cache_seqlens.tolist()):
        seq_k, seq_v = _paged(k_cache, block_table[i], length), _paged(v_cache, block_table[i], length)
        out[i] = _attend(q[i], seq_k, seq_v, scale, causal, window_size)
    return out
