"""top-k, top-p and min-p, exactly as a full sort of the vocabulary defines them, mostly without one
(loaded with the first row that uses one of them, layers/sampler.py).

apply_top_k_top_p / apply_min_p are the semantics (a full sort). draw_filtered reproduces their draw
from each row's NUM_CANDIDATES most likely tokens, with no host sync, and flags the rare rows the
candidates cannot vouch for, drawn again the full way (Redo) when the host reads the step's tokens.
"""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.layers.inverse_transform import sample_from


def apply_top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero all but each row's top_k most likely tokens (top_k <= 0: keep all) and all but the
    smallest set whose mass reaches top_p (the most likely token always stays). probs: [B, V]."""
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = (top_ks[:, None] > 0) & (rank >= top_ks[:, None])
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1)  # (top_p 1: off, whatever the rounding)
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely token."""
    return probs.masked_fill(probs < min_ps[:, None] * probs.amax(-1, keepdim=True), 0.0)


# Candidates per row: a full sort of a 150k vocabulary costs several times the rest of sampling, while
# kept sets almost always lie within the 1024 most likely tokens, which torch.topk finds far cheaper.
NUM_CANDIDATES = 1024
# Margin on comparisons with top_p. The candidates' mass before each rank and the full sort's are two
# float32 cumulative sums over the same leading values, bit-equal on the CPU but not on CUDA, whose
# scans group the additions by the row's length: a few ulps apart (1.2e-7 near 1). So a row is vouched
# for only if no candidate's mass before it lies within this margin of top_p, and a token past the
# candidates counts as dropped only if their mass passes top_p by it. Rows that fail (about 2 * margin
# / the probability of the tokens at the cut) are redrawn.
TOP_P_MARGIN = 1e-6
# Our float64 cumulative sum over the kept candidates and sample_from's over the vocabulary may group
# terms differently (CUDA); each is within V * 2**-53 of the exact sum (2e-11 of the total at V = 150k),
# so a target farther than CDF_TOLERANCE * total from every boundary picks the same token from both;
# nearer (about one row in 10**9 per boundary), the row is redone.
CDF_TOLERANCE = 1e-9


def filter_candidates(probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
                      min_ps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """apply_top_k_top_p then apply_min_p, on each row's NUM_CANDIDATES most likely tokens.
    probs [B, V] -> (ids [B, K], kept probs [B, K] (0: dropped), exact [B]): where exact, the
    full-sort filters keep exactly these tokens with these probabilities and zero all others.

    Why: the K largest values are the same multiset however ties are ordered, so ranks 0..K-1 see
    the same sorted values, mass_before (cumsum is prefix-consistent) and drop decisions. What can
    differ is (a) ranks >= K, unseen: exact needs a proof they are dropped (top_k <= K, mass reached,
    min_p threshold above the last candidate, or probability 0); (b) which token holds a rank in a
    run of equal values (the full sort orders ties its own way, not stably on the CPU): a run must be
    wholly kept or wholly dropped, and the last candidate dropped (its run may continue past K).
    Zero-probability tokens count as dropped: kept or not, they stay 0."""
    k = NUM_CANDIDATES
    vals, ids = probs.topk(k, -1)  # [B, K] descending, ties in topk's own order
    drop = torch.zeros_like(vals, dtype=torch.bool)
    last = vals[:, -1]             # every token past the candidates is at most this likely
    tail_dropped = last == 0
    if top_ks is not None:
        drop |= (top_ks[:, None] > 0) & (torch.arange(k, device=probs.device) >= top_ks[:, None])
        mass_before = vals.cumsum(-1) - vals  # the full sort's first K ranks', up to a few ulps (TOP_P_MARGIN)
        drop |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1)
        tail_dropped |= ((top_ks > 0) & (top_ks <= k)) | (mass_before[:, -1] >= top_ps + TOP_P_MARGIN)
        near_the_cut = ((mass_before - top_ps[:, None]).abs() < TOP_P_MARGIN).any(-1) & (top_ps < 1)
        tail_dropped &= ~near_the_cut  # (not vouched for: see TOP_P_MARGIN)
    if min_ps is not None:
        threshold = min_ps * vals[:, 0]  # the most likely token survives top-k/top-p: it is the max
        drop |= vals < threshold[:, None]
        tail_dropped |= last < threshold
    kept = ~drop & (vals > 0)
    split_tie = ((vals[:, 1:] == vals[:, :-1]) & (kept[:, 1:] != kept[:, :-1])).any(-1)
    return ids, vals.masked_fill(~kept, 0.0), tail_dropped & ~kept[:, -1] & ~split_tie


def full_way(probs: torch.Tensor, uniform: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
             min_ps: torch.Tensor | None) -> torch.Tensor:
    """The reference draw: the full-sort filters, then sample_from. probs [B, V], others [B]."""
    if top_ks is not None:
        probs = apply_top_k_top_p(probs, top_ks, top_ps)
    if min_ps is not None:
        probs = apply_min_p(probs, min_ps)
    return sample_from(probs, uniform)


def draw_filtered(probs: torch.Tensor, uniform: torch.Tensor, top_ks: torch.Tensor | None,
                  top_ps: torch.Tensor | None, min_ps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """full_way(...)'s tokens without sorting the vocabulary or a host sync: sample among
    filter_candidates' kept tokens. probs [B, V], uniform [B] -> (tokens [B], redo [B] bool: the rows
    to draw again the full way; None for a small vocabulary, drawn the full way at once)."""
    k = NUM_CANDIDATES
    if probs.shape[-1] <= k:
        return full_way(probs, uniform, top_ks, top_ps, min_ps), None
    ids, kept, exact = filter_candidates(probs, top_ks, top_ps, min_ps)
    # sample_from accumulates in vocabulary order; dropped tokens add 0 to the sum
    ids, order = ids.sort(-1)
    cdf = kept.gather(-1, order).double().cumsum(-1)                     # [B, K]
    tolerance = cdf[:, -1:] * CDF_TOLERANCE
    target = uniform[:, None] * cdf[:, -1:]                              # [B, 1]
    pos = torch.searchsorted(cdf, target).clamp_(max=k - 1)              # first cdf >= target
    below = torch.where(pos > 0, cdf.gather(-1, (pos - 1).clamp(min=0)), 0.0)
    exact &= ((target - below > tolerance) & (cdf.gather(-1, pos) - target > tolerance))[:, 0]
    return ids.gather(-1, pos)[:, 0], ~exact


def sample_filtered(probs: torch.Tensor, uniform: torch.Tensor, top_ks: torch.Tensor | None,
                    top_ps: torch.Tensor | None, min_ps: torch.Tensor | None) -> torch.Tensor:
    """full_way(...)'s tokens, token for token: draw_filtered, then the rows it cannot vouch for
    redrawn the full way at once (a host sync to learn which; the engine defers it, see Redo)."""
    tokens, redo = draw_filtered(probs, uniform, top_ks, top_ps, min_ps)
    if redo is not None:
        Redo(redo, probs, uniform, top_ks, top_ps, min_ps).redraw_into(tokens)
    return tokens


@dataclass
class Redo:
    """Rows of a step whose draw_filtered token must be drawn again the full way. Learning which takes
    a host sync, so the sampler only flags them; the model runner redraws them when the host reads
    the step's tokens anyway (SampledTokens.result()). With overlap scheduling the next step has read
    the flagged tokens by then: the engine redoes it for those sequences (Scheduler.correct)."""
    mask: torch.Tensor                # [B] bool
    probs: torch.Tensor               # [B, V] what the row was drawn from, kept until then
    uniform: torch.Tensor             # [B]
    top_ks: torch.Tensor | None
    top_ps: torch.Tensor | None
    min_ps: torch.Tensor | None
    raw_logprobs: torch.Tensor | None = None  # [B, V], when logprobs were asked: the redrawn tokens' own

    def redraw(self, rows: torch.Tensor) -> torch.Tensor:
        """The full-way tokens of these rows ([R] indices) -> [R]."""
        pick = lambda t: t[rows] if t is not None else None  # noqa: E731
        return full_way(self.probs[rows], self.uniform[rows], pick(self.top_ks), pick(self.top_ps), pick(self.min_ps))

    def redraw_into(self, tokens: torch.Tensor) -> list[int]:
        """Redraw the flagged rows into tokens ([B], on the device); returns their indices."""
        rows = self.mask.nonzero()[:, 0]  # the host sync
        if rows.numel():
            tokens[rows] = self.redraw(rows)
        return rows.tolist()

    def redraw_flagged(self, mask: torch.Tensor, tokens: list[int], chosen: list[float] | None) -> list[int]:
        """The step's tokens have reached the host (SampledTokens.result(): a sync there is free):
        redraw the rows flagged in mask ([B] bool, on the host) into tokens, and their logprobs
        into chosen (when asked). Returns their indices."""
        rows = torch.from_numpy(np.flatnonzero(mask.numpy())).to(self.probs.device)
        redrawn = self.redraw(rows)
        if chosen is not None:
            for i, value in zip(rows.tolist(), self.raw_logprobs[rows, redrawn].tolist()):
                chosen[i] = value
        for i, token in zip(rows.tolist(), redrawn.tolist()):
            tokens[i] = token
        return rows.tolist()
