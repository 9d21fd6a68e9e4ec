"""Batched sampling on the device: penalties, greedy, temperature, top-k, top-p and min-p,
reproducible per request, with optional log-probabilities. No Python loop over rows.

Sampling draws one uniform number u per row and takes the first token whose cumulative
probability reaches u (inverse transform sampling: one pass over the vocabulary). u is not drawn
from a stateful generator but computed by hashing (request seed, position), so a request's
samples depend on its own seed and logits alone, whatever else shares the batch, and on no Python
loop. (On a GPU the logits themselves may differ in their last bits with the batch's size.)
"""
from dataclasses import dataclass

import numpy as np
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


# sample_from's chunk of the vocabulary: the draw finds its chunk from per-chunk float64 sums, then
# its token from a float64 cumulative sum within that chunk, so it never builds a [B, V] float64
# array (the cost of one pass over the float32 probabilities instead of three over twice the bytes).
CDF_CHUNK = 1024


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token i with probability probs[i] / sum(probs), per row: the first index where the
    cumulative sum reaches u * total (inverse transform sampling), found in two levels (CDF_CHUNK).
    Zero-probability tokens are never chosen (their cumulative sum equals their predecessor's,
    which fell short). probs [B, V] (unnormalized), uniform [B]."""
    num_rows, vocab = probs.shape
    size = min(CDF_CHUNK, vocab)
    num_chunks = -(-vocab // size)
    if num_chunks * size != vocab:  # (padded with zeros: never chosen)
        probs = torch.nn.functional.pad(probs, (0, num_chunks * size - vocab))
    chunks = probs.view(num_rows, num_chunks, size)
    chunk_cdf = chunks.sum(-1, dtype=torch.float64).cumsum(-1)                       # [B, C]
    target = (uniform * chunk_cdf[:, -1])[:, None]                                   # [B, 1]
    chunk = torch.searchsorted(chunk_cdf, target).clamp_(max=num_chunks - 1)         # [B, 1]
    before = torch.where(chunk > 0, chunk_cdf.gather(-1, (chunk - 1).clamp(min=0)), 0.0)
    picked = chunks.gather(1, chunk[:, :, None].expand(num_rows, 1, size))[:, 0]     # [B, size]
    cdf = picked.double().cumsum(-1) + before                                        # [B, size]
    i = torch.searchsorted(cdf, target)
    # The chunk's sum and its cumulative sum round apart by an ulp or so: a target between them
    # would fall off the chunk's end; it takes the chunk's last token of nonzero probability.
    last = size - 1 - (picked.flip(-1) > 0).int().argmax(-1, keepdim=True)
    i = torch.where(i >= size, last, i)
    return (chunk * size + i)[:, 0]


def apply_top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero all but each row's top_k most likely tokens (top_k <= 0: keep all) and all but the
    smallest set whose mass reaches top_p (the most likely token always stays). probs: [B, V].
    This full sort defines the semantics; sample_filtered reproduces it from a few candidates."""
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = (top_ks[:, None] > 0) & (rank >= top_ks[:, None])
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1)  # (top_p 1: off, whatever the rounding)
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely token."""
    return probs.masked_fill(probs < min_ps[:, None] * probs.amax(-1, keepdim=True), 0.0)


# Candidates per row: a full sort of a 150k vocabulary costs several times the rest of sampling,
# while kept sets almost always lie within the 1024 most likely tokens (top_k <= 1023, or top_p /
# min_p reached within them), which torch.topk finds far more cheaply. Other rows fall back.
NUM_CANDIDATES = 1024
# Margin on comparisons with top_p. The candidates' mass before each rank and the full sort's are
# two float32 cumulative sums over the same leading values, bit-equal on the CPU (one term after
# another) but not on CUDA, whose scans group the additions by the row's length: they may differ
# by a few ulps (1.2e-7 near 1). So a row is vouched for only if no candidate's mass before it
# lies within this margin of top_p (a token there could be kept by one and dropped by the other),
# and a token past the candidates counts as dropped only if the candidates' mass passes top_p by
# it. Rows that fail (about 2 * margin / the probability of the tokens at the cut) are redrawn.
TOP_P_MARGIN = 1e-6
# Our float64 cumulative sum over the kept candidates and sample_from's over the whole vocabulary
# may group the terms differently (on CUDA); each is within V * 2**-53 of the exact sum (2e-11 of
# the total for V = 150k). A target farther than CDF_TOLERANCE * total from every boundary picks
# the same token from both; nearer (about one row in 10**9 per boundary), the row is redone.
CDF_TOLERANCE = 1e-9


def filter_candidates(probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
                      min_ps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """apply_top_k_top_p then apply_min_p, on each row's NUM_CANDIDATES most likely tokens.
    probs [B, V] -> (ids [B, K], kept probs [B, K] (0: dropped), exact [B]): where exact, the
    full-sort filters keep exactly these tokens with these probabilities and zero all others.

    Why that holds: the K largest values are the same multiset however ties are ordered, so ranks
    0..K-1 see the same sorted values, hence the same mass_before (cumsum is prefix-consistent)
    and the same drop decision per rank. What can differ is (a) ranks >= K, not seen here: exact
    needs a proof they are dropped (top_k <= K, mass reached, min_p threshold above the last
    candidate, or probability 0); (b) which token holds a rank inside a run of equal values: the
    full sort orders ties its own way (not stably on the CPU), so a run must be wholly kept or
    wholly dropped, and the last candidate dropped (its run may continue past K). Zero-probability
    tokens count as dropped: kept or not, they stay 0."""
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
    """full_way(...)'s tokens without sorting the vocabulary, and without a host sync: sample
    among filter_candidates' kept tokens. Returns (tokens [B], redo [B] bool or None): where redo
    is set the candidates cannot vouch for the token, which must be drawn again the full way (a
    small vocabulary takes the full way at once: redo None). probs [B, V], uniform [B]."""
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
    """Rows of a step whose draw_filtered token must be drawn again the full way. Learning which
    rows takes a host sync, so the sampler only flags them on the device; the model runner redraws
    them when the host reads the step's tokens anyway (SampledTokens.result()). With overlap
    scheduling the next step has read the flagged tokens by then: the engine redoes that step for
    those sequences (Scheduler.correct). Flagged rows are rare: see filter_candidates."""
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


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the device, [B] each; optional parts are None when no row
    uses them, so the common case pays for nothing it does not use."""
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
    """The float32 logits after the batch's logits processors (grammars, allowed_token_ids,
    logit_bias, penalties, min_tokens: features/logits_processors.py): what greedy takes the argmax
    of, and temperature scales (the rejection sampler's target distribution too)."""
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
        Greedy rows (temperature 0) take the argmax of the (penalized) logits; logprobs, when
        asked, come from the raw logits: (chosen token's [B], top-k values [B, k], top-k ids
        [B, k]). With top-k, top-p or min-p over a large vocabulary a few rows may be flagged to be
        redrawn the full way (Redo): their tokens here are not final until then."""
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
                sampled, flagged = draw_filtered(probs, uniform, batch.top_ks, batch.top_ps, batch.min_ps)
                if flagged is not None:  # (greedy rows never need it)
                    redo = Redo(flagged & sampling, probs, uniform, batch.top_ks, batch.top_ps, batch.min_ps, raw)
            tokens = torch.where(sampling, sampled, tokens)
        if batch.num_logprobs is not None:
            top = raw.topk(batch.num_logprobs, -1) if batch.num_logprobs > 0 else None
            logprobs = (raw.gather(-1, tokens[:, None])[:, 0], top.values if top else None,
                        top.indices if top else None)
        return tokens, logprobs, redo
