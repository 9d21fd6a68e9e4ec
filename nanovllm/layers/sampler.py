"""Batched sampling on the device: greedy, temperature, top-k and top-p, reproducible per request.

Sampling uses the exponential-race form of the Gumbel-max trick: with E_i ~ Exp(1) independent,
argmax_i p_i / E_i is distributed as Categorical(p). The noise E is not drawn from a stateful
generator but computed by hashing (request seed, position, token id), so a request's samples
depend on its own seed alone, whatever else shares the batch, and on no Python loop over rows.
"""
import torch
from torch import nn

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # odd, so multiplying by it permutes 32-bit integers


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche ("lowbias32"), on int64 tensors holding values in
    [0, 2**32). Products may overflow int64; they wrap, and the low 32 bits stay exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 samples of Exp(1), a pure function of (seed, position, token id).
    seeds, positions: [B] int64 (seeds in [0, 2**63))."""
    row = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) ^ _mix32(positions & _MASK32)) & _MASK32))
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * _GOLDEN32
    bits = _mix32((row[:, None] + cols[None, :]) & _MASK32)
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 random bits, strictly in (0, 1)
    return -torch.log(uniform)


def apply_top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero all but each row's top_k most likely tokens (top_k <= 0: keep all) and all but the
    smallest set whose mass reaches top_p (the most likely token always stays). probs: [B, V]."""
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = (top_ks[:, None] > 0) & (rank >= top_ks[:, None])
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= mass_before >= top_ps[:, None]
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                top_ps: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                filtered: bool) -> torch.Tensor:
        """logits [B, V]; per-row parameters [B]; temperature 0 is greedy. `filtered`: whether any
        row uses top-k/top-p (skips a sort over the vocabulary when none does). Returns [B] ids."""
        logits = logits.float()
        greedy = logits.argmax(-1)
        sampling = temperatures > 0
        probs = torch.softmax(logits / torch.where(sampling, temperatures, 1.0)[:, None], -1)
        if filtered:
            probs = apply_top_k_top_p(probs, top_ks, top_ps)
        sampled = (probs / exponential_noise(seeds, positions, logits.shape[-1])).argmax(-1)
        return torch.where(sampling, sampled, greedy)
