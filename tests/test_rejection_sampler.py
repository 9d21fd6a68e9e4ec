"""The rejection sampler of speculative decoding (features/speculative/rejection_sampler.py): greedy rows accept
while the target's argmax agrees; sampled rows emit tokens distributed exactly as the target's
processed distribution, whatever the drafts (from a draft model's q or an n-gram), and far from
the draft's own; outputs are reproducible per request, whatever shares the batch.

The statistical bound: for N draws from a distribution over V outcomes, the empirical
distribution's L1 distance exceeds eps with probability at most 2**V * exp(-N * eps**2 / 2)
(Bretagnolle-Huber-Carol). With V = 8, N = 100,000 and a failure probability of 1e-6 per check,
eps = 0.0197: the total-variation distance (L1 / 2) stays below 0.0099."""
import math

import pytest
import torch

from nanovllm.features.speculative.rejection_sampler import DRAFT_SALT, target_probs, verify
from nanovllm.layers.inverse_transform import sample_from, uniform_per_row
from nanovllm.layers.sampler import Sampler, SamplingBatch
from nanovllm.layers.top_k_top_p import apply_min_p, apply_top_k_top_p

V, N = 8, 100_000
TV_BOUND = math.sqrt(2 * (V * math.log(2) + math.log(1e6)) / N) / 2
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, 0.2])
DRAFT_LOGITS = torch.tensor([-1.0, 0.0, 2.0, 1.0, 0.5, -2.0, 1.5, 0.0])  # far from the target's


def batch_of(rows: int, temperature=1.0, top_k=None, top_p=None, min_p=None) -> SamplingBatch:
    full = lambda value, dtype=torch.float32: torch.full((rows,), value, dtype=dtype)  # noqa: E731
    return SamplingBatch(temperatures=full(temperature), seeds=None, positions=None,
                         top_ks=full(top_k or -1, torch.int64) if top_k or top_p else None,
                         top_ps=full(top_p or 1.0) if top_k or top_p else None,
                         min_ps=full(min_p) if min_p else None, all_greedy=temperature == 0)


def reference(logits, temperature=1.0, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The plain sampler's processed distribution, the full way."""
    probs = torch.softmax(logits / temperature, -1)[None]
    if top_k or top_p:
        probs = apply_top_k_top_p(probs, torch.tensor([top_k or -1]), torch.tensor([top_p or 1.0]))
    if min_p:
        probs = apply_min_p(probs, torch.tensor([min_p]))
    return (probs / probs.sum())[0]


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def run(k: int, drafts_from: str, **processing):
    """N sequences, each with k drafts and the same target logits at every position: drafts drawn
    from the draft distribution q (drafts_from="model") or one fixed token (q one-hot: "ngram")."""
    rows = N * (k + 1)
    probs, argmax = target_probs(LOGITS.expand(rows, V).clone(), batch_of(rows, **processing))
    seeds = torch.arange(N, dtype=torch.int64) * 7919
    positions = torch.full((N,), 40, dtype=torch.int64)
    if drafts_from == "model":
        q = reference(DRAFT_LOGITS, **processing)
        draft_probs = q.expand(rows, V)
        drafts = torch.stack([sample_from(q.expand(N, V), uniform_per_row(seeds ^ DRAFT_SALT, positions + j))
                              for j in range(k)], 1)
    else:
        draft_probs, drafts = None, torch.full((N, k), 5, dtype=torch.int64)  # (one every filter keeps)
    lengths = torch.full((N,), k, dtype=torch.int64)
    tokens, emitted = verify(probs, argmax, torch.zeros(N, dtype=torch.bool), drafts, lengths, draft_probs, seeds,
                             positions)
    return tokens, emitted, drafts


@pytest.mark.parametrize("processing", [{}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8},
                                        {"min_p": 0.2, "temperature": 1.3}],
                         ids=["plain", "temperature", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("drafts_from", ["model", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(processing, drafts_from):
    k = 3
    tokens, emitted, _ = run(k, drafts_from, **processing)
    p = reference(LOGITS, **processing)
    first = torch.bincount(tokens[:, 0], minlength=V).double()
    second = torch.bincount(tokens[emitted >= 2, 1], minlength=V).double()  # (after an accepted first draft)
    assert tv(first, p.double()) < TV_BOUND
    assert tv(second, p.double()) < TV_BOUND * math.sqrt(N / second.sum().item())  # (fewer draws: a wider bound)
    if drafts_from == "model":
        q = reference(DRAFT_LOGITS, **processing)
        assert tv(first, q.double()) > 0.5 * (p - q).abs().sum().item() - TV_BOUND  # far from the draft's own
    assert (emitted >= 1).all() and (emitted <= k + 1).all()


def test_acceptance_rate_is_the_overlap_of_the_two_distributions():
    """A draft drawn from q is accepted with probability sum(min(p, q)), the known rate: the test
    that accepts is the one the rule says, not merely one that keeps the distribution."""
    tokens, emitted, drafts = run(1, "model")
    p, q = reference(LOGITS), reference(DRAFT_LOGITS)
    rate = (emitted == 2).double().mean().item()
    assert abs(rate - torch.minimum(p, q).sum().item()) < 4 * math.sqrt(0.25 / N)
    assert (tokens[emitted == 2, 0] == drafts[emitted == 2, 0]).all()  # accepted drafts are emitted as they are


def test_greedy_rows_accept_while_the_argmax_agrees():
    logits = torch.full((7, V), -5.0)
    chosen = [4, 1, 6, 2, 5, 0, 3]  # the argmax of each target row
    logits[torch.arange(7), torch.tensor(chosen)] = 3.0
    drafts = torch.tensor([[4, 1, 7], [6, 2, 0], [0, 0, 0]])
    lengths = torch.tensor([3, 2, 0])  # sequence 0: rows 0..3; sequence 1: rows 4..6; sequence 2: none
    logits = torch.cat([logits, torch.full((1, V), -5.0)])
    logits[7, 2] = 3.0
    probs, argmax = target_probs(logits, batch_of(8, temperature=0))
    tokens, emitted = verify(probs, argmax, torch.ones(3, dtype=torch.bool), drafts, lengths, None,
                             torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    # sequence 0: drafts 4, 1 agree with rows 0, 1; draft 7 differs from row 2's argmax 6, which comes next
    assert tokens[0, :emitted[0]].tolist() == [4, 1, 6]
    # sequence 1: draft 6 differs from row 4's argmax 5
    assert tokens[1, :emitted[1]].tolist() == [5]
    # sequence 2: no drafts, the plain greedy token
    assert tokens[2, :emitted[2]].tolist() == [2]


def test_all_accepted_draws_a_bonus_token():
    logits = torch.full((3, V), -9.0)
    logits[0, 1] = logits[1, 2] = logits[2, 7] = 9.0  # the target agrees with drafts [1, 2], then wants 7
    probs, argmax = target_probs(logits, batch_of(3))
    tokens, emitted = verify(probs, argmax, torch.zeros(1, dtype=torch.bool), torch.tensor([[1, 2]]),
                             torch.tensor([2]), None, torch.tensor([5]), torch.tensor([10]))
    assert emitted.item() == 3 and tokens[0].tolist() == [1, 2, 7]


def test_outputs_depend_on_the_request_alone():
    """A sequence's tokens are the same alone or in a batch, with other sequences of other
    lengths before it; and change with its seed."""
    torch.manual_seed(0)
    logits = torch.randn(10, V)  # rows: 4, 3 and 3 for the three sequences
    q = torch.softmax(torch.randn(10, V), -1)
    greedy_rows = torch.tensor([False, True, False])
    drafts, lengths = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 0, 1]]), torch.tensor([3, 2, 2])
    seeds, positions = torch.tensor([11, 12, 13]), torch.tensor([5, 9, 2])
    probs, argmax = target_probs(logits, batch_of(10))
    together = verify(probs, argmax, greedy_rows, drafts, lengths, q, seeds, positions)
    rows = slice(7, 10)  # the last sequence's rows (4 + 3 before it)
    alone = verify(probs[rows], argmax[rows], greedy_rows[2:], drafts[2:], lengths[2:], q[rows], seeds[2:],
                   positions[2:])
    n = together[1][2].item()
    assert alone[1].item() == n and alone[0][0, :n].tolist() == together[0][2, :n].tolist()
    runs = {tuple(verify(probs[rows], argmax[rows], greedy_rows[2:], drafts[2:], lengths[2:], q[rows],
                         torch.tensor([seed]), positions[2:])[0][0].tolist()) for seed in range(40)}
    assert len(runs) > 1


def test_without_drafts_a_row_gets_the_plain_samplers_token():
    """A sequence with no drafts in a speculative step draws exactly the token plain sampling
    would (the same uniform, from the same filtered probabilities), so a step's drafts elsewhere
    in the batch change nothing for it."""
    torch.manual_seed(1)
    rows, vocab = 64, 3000  # (more than NUM_CANDIDATES: the plain sampler's candidate path)
    logits = torch.randn(rows, vocab) * 3
    seeds, positions = torch.arange(rows, dtype=torch.int64) * 31, torch.arange(rows, dtype=torch.int64) + 100
    batch = SamplingBatch(temperatures=torch.full((rows,), 0.8), seeds=seeds, positions=positions,
                          top_ks=torch.full((rows,), 50, dtype=torch.int64), top_ps=torch.full((rows,), 0.9),
                          min_ps=torch.full((rows,), 0.05))
    plain, _, redo = Sampler()(logits, batch)
    if redo is not None:
        redo.redraw_into(plain)
    probs, argmax = target_probs(logits, batch)
    tokens, emitted = verify(probs, argmax, torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, 0, dtype=torch.int64),
                             torch.zeros(rows, dtype=torch.int64), None, seeds, positions)
    assert (emitted == 1).all() and tokens[:, 0].tolist() == plain.tolist()


def test_filtered_probabilities_equal_the_full_sort_bit_for_bit():
    """target_probs' filters (features/speculative/rejection_sampler.filtered) give apply_top_k_top_p then
    apply_min_p exactly, over a vocabulary larger than the candidates: rows the candidates vouch
    for (peaked logits) and rows that fall back to the full sort (flat logits, whose top-p nucleus
    reaches past the candidates), with top-k, top-p and min-p, each alone and mixed per row."""
    from nanovllm.features.speculative.rejection_sampler import filtered
    from nanovllm.layers.top_k_top_p import NUM_CANDIDATES, filter_candidates
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 5000, 24
    scale = torch.tensor([4.0] * 16 + [0.1] * 8)[:, None]  # peaked rows, then flat ones
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * scale, -1)
    top_ks = torch.tensor([-1, 5, 50, 2000] * 6)
    top_ps = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.99, 1.0] * 4)
    min_ps = torch.tensor([0.0, 0.05, 0.0, 0.1] * 6)
    for k, p, m in [(top_ks, top_ps, None), (None, None, min_ps), (top_ks, top_ps, min_ps)]:
        expected = probs
        if k is not None:
            expected = apply_top_k_top_p(expected, k, p)
        if m is not None:
            expected = apply_min_p(expected, m)
        exact = filter_candidates(probs, k, p, m)[2]
        assert exact.any() and not exact.all(), "both paths should run"
        assert torch.equal(filtered(probs, k, p, m), expected)
    assert vocab > NUM_CANDIDATES


@pytest.mark.parametrize("drafts_from", ["model", "ngram"])
def test_the_bonus_token_and_a_draftless_row_follow_the_target_distribution(drafts_from):
    """The token after a fully accepted run (the bonus position) is drawn from p itself, not from
    a residual: no rejection happened there, whatever the last draft was. And a sequence with no
    drafts in a batch whose others have some draws from p too (its padded draft slots hold token
    0, which must not be taken out of p). Bound: TV_BOUND (false failure 1e-6 per check) widened
    by sqrt(N / draws) for the fewer bonus draws (about p(5) * N = 23,000 with n-gram drafts)."""
    tokens, emitted, _ = run(1, drafts_from)
    p = reference(LOGITS).double()
    bonus = tokens[emitted == 2, 1]
    assert len(bonus) > N // 10
    assert tv(torch.bincount(bonus, minlength=V).double(), p) < TV_BOUND * math.sqrt(N / len(bonus))
    # every other sequence has no drafts (length 0 of K = 2): one row each, drawn from p
    k = 2
    lengths = torch.tensor([0, k] * (N // 2), dtype=torch.int64)
    rows = int((lengths + 1).sum())
    probs, argmax = target_probs(LOGITS.expand(rows, V).clone(), batch_of(rows))
    draft_probs = reference(DRAFT_LOGITS).expand(rows, V) if drafts_from == "model" else None
    seeds = torch.arange(N, dtype=torch.int64) * 104729
    drafts = torch.full((N, k), 5, dtype=torch.int64)
    tokens, emitted = verify(probs, argmax, torch.zeros(N, dtype=torch.bool), drafts, lengths, draft_probs, seeds,
                             torch.full((N,), 40, dtype=torch.int64))
    draftless = tokens[lengths == 0, 0]
    assert (emitted[lengths == 0] == 1).all()
    assert tv(torch.bincount(draftless, minlength=V).double(), p) < TV_BOUND * math.sqrt(N / len(draftless))
