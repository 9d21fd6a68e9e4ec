"""The reference backend: plain PyTorch, any device. Every other backend is tested against it."""
import torch
import torch.nn.functional as F

from nanovllm.utils.context import Context


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` cached tokens, [length, Hkv, D], read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions of a context over all of it.

    q: [n, H, D]; k, v: [L, Hkv, D] with L >= n. Query i sits at position L - n + i and sees keys
    0 .. L - n + i. Returns [n, H, D].
    """
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
    @staticmethod
    def store_kv(k, v, k_cache, v_cache, slot_mapping):
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v

    @staticmethod
    def forward(q, k, v, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        cu_q, lens_k = context.cu_seqlens_q_cpu, context.seq_lens_k_cpu
        for i in range(len(lens_k)):
            start, end = cu_q[i], cu_q[i + 1]
            if context.block_tables is None:  # no cached context: the new K/V are the whole context
                seq_k, seq_v = k[start:end], v[start:end]
            else:
                seq_k = gather_context(k_cache, context.block_tables[i], lens_k[i])
                seq_v = gather_context(v_cache, context.block_tables[i], lens_k[i])
            out[start:end] = attend(q[start:end], seq_k, seq_v, scale)
        return out
