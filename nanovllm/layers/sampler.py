"""Batched sampling on the device: penalties, greedy, temperature, top-k, top-p and min-p,
reproducible per request, with optional log-probabilities. No Python loop over rows.

Sampling draws one uniform number u per row and takes the first token whose cumulative
probability reaches u (inverse transform sampling: one pass over the vocabulary). u is not drawn
from a stateful generator but computed by hashing (request seed, position), so a request's
samples depend on its own seed alone, whatever else shares the batch, and on no Python loop.
"""
from dataclasses import dataclass

import torch
from torch import nn

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # an arbitrary well-mixed constant: it makes the two 24-bit draws of a row differ


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche ("lowbias32"), on int64 tensors holding values in
    [0, 2**32). Products may overflow int64; they wrap, and the low 32 bits stay exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_per_row(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] float64 in (0, 1) with 48 random bits, a pure function of (seed, position).
    seeds, positions: [B] int64 (seeds in [0, 2**63))."""
    row = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) ^ _mix32(positions & _MASK32)) & _MASK32))
    high, low = _mix32((row + _GOLDEN32) & _MASK32) >> 8, _mix32(row ^ _GOLDEN32) >> 8  # 24 bits each
    return ((high << 24) + low).double().add(0.5).mul(2.0 ** -48)


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token i with probability probs[i] / sum(probs), per row: the first index where the
    cumulative sum reaches u * total. Zero-probability tokens are never chosen (their cumulative
    sum equals their predecessor's, which fell short). probs [B, V] (unnormalized), uniform [B]."""
    cdf = probs.double().cumsum(-1)
    target = (uniform * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def apply_top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero all but each row's top_k most likely tokens (top_k <= 0: keep all) and all but the
    smallest set whose mass reaches top_p (the most likely token always stays). probs: [B, V]."""
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = (top_ks[:, None] > 0) & (rank >= top_ks[:, None])
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= mass_before >= top_ps[:, None]
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely token."""
    return probs.masked_fill(probs < min_ps[:, None] * probs.amax(-1, keepdim=True), 0.0)


def apply_penalties(logits: torch.Tensor, seen: tuple[torch.Tensor, torch.Tensor],
                    generated: tuple[torch.Tensor, torch.Tensor], presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties, touching only the logits of tokens that occurred (O(tokens), not O(B x V)).

    seen: (rows, token ids) of every prompt and completion token; generated: (rows, token ids) of
    every completion token, one entry per occurrence. Per-row penalties [B]. The repetition
    penalty divides positive logits of seen tokens and multiplies negative ones; then each
    completion token loses frequency per occurrence and presence once.
    """
    logits = logits.clone()
    rows, cols = seen
    x = logits[rows, cols]
    logits[rows, cols] = torch.where(x > 0, x / repetition[rows], x * repetition[rows])  # duplicates write equal values
    rows, cols = generated
    logits.index_put_((rows, cols), -frequency[rows], accumulate=True)
    unique = torch.unique(rows * logits.shape[-1] + cols)
    rows, cols = unique // logits.shape[-1], unique % logits.shape[-1]
    logits.index_put_((rows, cols), -presence[rows], accumulate=True)
    return logits


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the device, [B] each; optional parts are None when no row
    uses them, so the common case pays for nothing it does not use."""
    temperatures: torch.Tensor
    seeds: torch.Tensor                         # int64
    positions: torch.Tensor                     # int64: position of the token being sampled
    top_ks: torch.Tensor | None = None          # int64, <= 0: off
    top_ps: torch.Tensor | None = None
    min_ps: torch.Tensor | None = None
    penalties: tuple | None = None              # apply_penalties' arguments after the logits
    banned: tuple | None = None                 # (rows, token ids): logits set to -inf (min_tokens)
    num_logprobs: int | None = None             # top-k log-probabilities to return (max over rows)
    all_greedy: bool = False                    # no row samples: skip the noise and softmax


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch):
        """logits [B, V] -> (token ids [B], logprobs or None). Greedy rows (temperature 0) take the
        argmax of the (penalized) logits; logprobs, when asked, come from the raw logits:
        (chosen token's [B], top-k values [B, k], top-k ids [B, k])."""
        logits = logits.float()
        logprobs = None
        if batch.num_logprobs is not None:
            raw = torch.log_softmax(logits, -1)
        if batch.penalties is not None:
            logits = apply_penalties(logits, *batch.penalties)
        if batch.banned is not None:
            logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
        tokens = logits.argmax(-1)
        if not batch.all_greedy:
            sampling = batch.temperatures > 0
            probs = torch.softmax(logits / torch.where(sampling, batch.temperatures, 1.0)[:, None], -1)
            if batch.top_ks is not None:
                probs = apply_top_k_top_p(probs, batch.top_ks, batch.top_ps)
            if batch.min_ps is not None:
                probs = apply_min_p(probs, batch.min_ps)
            sampled = sample_from(probs, uniform_per_row(batch.seeds, batch.positions))
            tokens = torch.where(sampling, sampled, tokens)
        if batch.num_logprobs is not None:
            top = raw.topk(batch.num_logprobs, -1) if batch.num_logprobs > 0 else None
            logprobs = (raw.gather(-1, tokens[:, None])[:, 0], top.values if top else None,
                        top.indices if top else None)
        return tokens, logprobs
