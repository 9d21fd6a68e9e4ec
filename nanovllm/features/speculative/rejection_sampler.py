"""Speculative decoding's verification: given each sequence's draft tokens and the target model's
logits at the drafts' positions (plus one), how many drafts the target accepts and the token that
follows them, for the whole batch in one vectorized pass (no Python loop over rows, no host sync).

The rule (Leviathan et al. 2023, Chen et al. 2023) makes the output exactly as likely as the
target's own sampling. A draft token x, proposed with probability q(x), is accepted with
probability min(1, p(x) / q(x)), where p is the target's distribution after the same processing
as plain sampling (penalties, banned tokens, temperature, top-k, top-p, min-p: target_probs). The
first rejected position draws from normalize(max(p - q, 0)) instead, and drafts after it are
dropped; when every draft is accepted, a bonus token is drawn from p at the position after them.
An n-gram draft is deterministic (q one-hot at x): it is accepted with probability p(x), and a
rejection draws from p without x. Greedy rows (temperature 0) accept while the target's argmax
equals the draft, and take the argmax next: greedy output is the same with or without drafts.

Row layout: sequence b owns lengths[b] + 1 consecutive target rows, sequences in order (R =
sum(lengths + 1)): its row j < lengths[b] verifies draft j; its last row gives the bonus token.

Reproducible per request: the uniforms come from uniform_per_row(seed, position), so the output
does not depend on what else shares the batch. The token after the accepted drafts is drawn as
plain sampling draws its position's (the same uniform, from the same unnormalized filtered
probabilities as full_way): a sequence without drafts gets exactly the plain sampler's token. The
acceptance test and a draft model's draws use streams of their own (salted seeds): a draft drawn
with the acceptance test's uniform would be correlated with it, and the output would not follow p.
"""
import torch

from nanovllm.layers.inverse_transform import sample_from, uniform_per_row
from nanovllm.layers.sampler import SamplingBatch, greedy, processed_logits
from nanovllm.layers.top_k_top_p import NUM_CANDIDATES, apply_min_p, apply_top_k_top_p, filter_candidates

ACCEPT_SALT = 0x2545F4914F6CDD1D  # < 2**63: a salted seed stays a valid seed
DRAFT_SALT = 0x6A09E667F3BCC908  # for a draft model's sampling (it must not reuse the streams above)


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The target's distribution at each row (batch: one entry per row), processed as plain
    sampling processes it: (probs [R, V], or None when every row is greedy; argmax [R] of the
    processed logits). probs are the filtered softmax that full_way draws from, not renormalized
    (verify normalizes where it needs to); the kept set is exactly the plain sampler's."""
    logits = processed_logits(logits.float(), batch)
    argmax = greedy(logits)
    if batch.all_greedy:
        return None, argmax
    temperatures = torch.where(batch.temperatures > 0, batch.temperatures, 1.0)  # (greedy rows: unused)
    probs = torch.softmax(logits / temperatures[:, None], -1)
    if batch.top_ks is not None or batch.min_ps is not None:
        probs = filtered(probs, batch.top_ks, batch.top_ps, batch.min_ps)
    return probs, argmax


def filtered(probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
             min_ps: torch.Tensor | None) -> torch.Tensor:
    """apply_top_k_top_p then apply_min_p, bit for bit, without sorting the vocabulary of rows
    that filter_candidates vouches for (nearly all): their kept candidates scattered into zeros.
    The others (rare) are sorted in full, after a host sync to learn which (a speculative step
    waits for its tokens right after anyway). 64 rows x 151,936 on CPU, top-k 50 and top-p 0.9:
    441 ms with the full sort, 51 ms so (scripts: see the closing note of issue 20)."""
    def full(rows: torch.Tensor) -> torch.Tensor:
        out = probs[rows]
        if top_ks is not None:
            out = apply_top_k_top_p(out, top_ks[rows], top_ps[rows])
        if min_ps is not None:
            out = apply_min_p(out, min_ps[rows])
        return out
    if probs.shape[-1] <= NUM_CANDIDATES:
        return full(torch.arange(len(probs), device=probs.device))
    ids, kept, exact = filter_candidates(probs, top_ks, top_ps, min_ps)
    out = torch.zeros_like(probs).scatter_(-1, ids, kept)
    inexact = (~exact).nonzero()[:, 0]
    if len(inexact):
        out[inexact] = full(inexact)
    return out


def verify(probs: torch.Tensor | None, argmax: torch.Tensor, greedy_rows: torch.Tensor, drafts: torch.Tensor,
           lengths: torch.Tensor, draft_probs: torch.Tensor | None, seeds: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each sequence emits this step: its accepted drafts, then one more.

    probs, argmax: target_probs'. greedy_rows [B] bool. drafts [B, K] int64 (entries past a
    sequence's length are ignored), lengths [B] int64 in 0..K. draft_probs [R, V]: the draft
    model's q at each row (row j of a sequence: what draft j was drawn from; its last row unused),
    None for n-gram drafts. seeds [B]; positions [B]: each sequence's first draft position. Returns
    (tokens [B, K + 1], num_emitted [B]): sequence b emits tokens[b, :num_emitted[b]]."""
    num_seqs, k = drafts.shape
    device = drafts.device
    starts = torch.cumsum(lengths + 1, 0) - (lengths + 1)                       # [B] each sequence's first row
    j = torch.arange(k, device=device)[None, :]                                 # [1, K]
    is_draft = j < lengths[:, None]                                             # [B, K]
    rows = torch.where(is_draft, starts[:, None] + j, 0)                        # [B, K] the row verifying draft j
    x = torch.where(is_draft, drafts, 0)
    accepted = argmax[rows] == x                                                # greedy rows' test
    if probs is not None:
        total = probs.sum(-1)                                                   # [R] (filtered: below 1)
        p_x = probs[rows, x] / total[rows]
        q_x = draft_probs[rows, x] if draft_probs is not None else torch.ones_like(p_x)
        u = uniform_per_row((seeds ^ ACCEPT_SALT)[:, None].expand(-1, k).reshape(-1),
                            (positions[:, None] + j).reshape(-1)).view(num_seqs, k)
        accepted = torch.where(greedy_rows[:, None], accepted, u * q_x < p_x)   # with probability min(1, p/q)
    num_accepted = (accepted & is_draft).int().cumprod(1).sum(1)                # [B] the leading run
    last = starts + num_accepted                                                # [B] the row of the next token
    next_token = argmax[last]
    if probs is not None:
        rejected = num_accepted < lengths
        p = probs[last]                                                         # [B, V]
        if draft_probs is not None:
            residual = (p / total[last][:, None] - draft_probs[last]).clamp_(min=0)
        else:  # q one-hot at the rejected draft: p without it
            residual = p.scatter(1, x.gather(1, num_accepted.clamp(max=k - 1)[:, None]), 0.0) if k else p
        # (a rejection has residual mass > 0: it happens only where q(x) > p(x); rounding aside)
        use_residual = rejected & (residual.sum(-1) > 0)
        u = uniform_per_row(seeds, positions + num_accepted)  # (plain sampling's uniform at this position)
        sampled = sample_from(torch.where(use_residual[:, None], residual, p), u)
        next_token = torch.where(greedy_rows, next_token, sampled)
    tokens = torch.cat([x, x.new_zeros(num_seqs, 1)], 1)
    tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return tokens, num_accepted + 1
