"""Batched sampling on the device: logits processors, greedy, temperature, and (their own module,
layers/top_k_top_p.py, loaded when a row asks) top-k, top-p and min-p; reproducible per request
(layers/inverse_transform.py), with optional log-probabilities. No Python loop over rows.
"""
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanovllm.layers.inverse_transform import sample_from, uniform_per_row


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the device, [B] each; parts no row uses are None (and cost nothing)."""
    temperatures: torch.Tensor | None           # None (with seeds, positions) when all_greedy
    seeds: torch.Tensor | None                  # int64
    positions: torch.Tensor | None              # int64: position of the token being sampled
    top_ks: torch.Tensor | None = None          # int64, <= 0: off
    top_ps: torch.Tensor | None = None
    min_ps: torch.Tensor | None = None
    num_logprobs: int | None = None             # top-k log-probabilities to return (max over rows)
    all_greedy: bool = False                    # no row samples: skip the noise and softmax
    processors: object | None = None            # logits_processors.ProcessorTensors: penalties, grammars, ...


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The float32 logits after the batch's logits processors (features/logits_processors.py): what
    greedy takes the argmax of, and temperature scales (the rejection sampler's target too)."""
    if batch.processors is None:
        return logits
    from nanovllm.features.logits_processors import apply  # (their layer: loaded with the first row that has one)
    return apply(logits, batch.processors)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the first index of each row's maximum, int64 [B]. On CPU through numpy,
    whose argmax is vectorized (about 10x torch's single-threaded one at [256, 512]); the same
    answer, ties and NaNs included (both take the first)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(-1).astype(np.int64, copy=False))
    return logits.argmax(-1)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch):
        """logits [B, V] -> (token ids [B], logprobs or None, Redo or None), with no host sync.
        Greedy rows (temperature 0) take the argmax of the processed logits; logprobs come from the raw
        ones: (chosen token's [B], top-k values [B, k], top-k ids [B, k]). With top-k, top-p or min-p
        over a large vocabulary a few rows may be flagged to be redrawn the full way (Redo) later."""
        logits = logits.float()
        logprobs = redo = raw = None
        if batch.num_logprobs is not None:
            raw = torch.log_softmax(logits, -1)
        logits = processed_logits(logits, batch)
        tokens = greedy(logits)
        if not batch.all_greedy:
            sampling = batch.temperatures > 0
            probs = torch.softmax(logits / torch.where(sampling, batch.temperatures, 1.0)[:, None], -1)
            uniform = uniform_per_row(batch.seeds, batch.positions)
            if batch.top_ks is None and batch.min_ps is None:
                sampled = sample_from(probs, uniform)
            else:
                from nanovllm.layers.top_k_top_p import Redo, draw_filtered  # (the filters' module: loaded when asked for)
                sampled, flagged = draw_filtered(probs, uniform, batch.top_ks, batch.top_ps, batch.min_ps)
                if flagged is not None:  # (greedy rows never need it)
                    redo = Redo(flagged & sampling, probs, uniform, batch.top_ks, batch.top_ps, batch.min_ps, raw)
            tokens = torch.where(sampling, sampled, tokens)
        if batch.num_logprobs is not None:
            top = raw.topk(batch.num_logprobs, -1) if batch.num_logprobs > 0 else None
            logprobs = (raw.gather(-1, tokens[:, None])[:, 0], top.values if top else None,
                        top.indices if top else None)
        return tokens, logprobs, redo
