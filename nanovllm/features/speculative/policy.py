"""Speculative decoding's bookkeeping on the host: how many drafts a sequence should verify
(draft_limit, the adaptive policy) and the counts vLLM reports (SpecStats)."""

ACCEPTANCE_MEMORY = 0.7     # acceptance_ema = MEMORY * old + (1 - MEMORY) * accepted / drafted
MIN_DRAFT_COST = 0.1        # a draft's cost, relative to a forward, while decode is memory-bound
COMPUTE_BOUND_BATCH = 256   # running sequences at which the step is taken as compute-bound (cost 1)
PROBE_AFTER = 16            # decode steps without drafts after which a sequence drafts once more


def draft_limit(k: int, acceptance_ema: float, steps_since_draft: int, num_running: int, fixed_cost: bool) -> int:
    """How many of its k drafts a sequence should verify this step.

    A draft at position j is accepted only if the j - 1 before it were, with probability about
    acceptance^j; it pays when that beats its cost, the query token it adds to the target's
    forward: small while decode is memory-bound (small batches: the weights are read once whatever
    the tokens), nearly a forward of its own once the batch makes the step compute-bound
    (COMPUTE_BOUND_BATCH). So draft the positions j with acceptance^j > cost. A sequence at none
    drafts once every PROBE_AFTER steps (its text may turn repetitive), which measures its
    acceptance again. fixed_cost: a seeded request's cost ignores the batch, so its draft lengths,
    and its tokens, do not depend on what else runs (the distribution never does).
    """
    load = 0.0 if fixed_cost else min(1.0, num_running / COMPUTE_BOUND_BATCH)
    cost = MIN_DRAFT_COST + (1 - MIN_DRAFT_COST) * load
    limit = 0
    while limit < k and acceptance_ema ** (limit + 1) > cost:
        limit += 1
    if limit == 0 and steps_since_draft >= PROBE_AFTER:
        return 1
    return limit


class SpecStats:
    """Speculative decoding's counts, vLLM's: drafts proposed (sequences that drafted, per step),
    draft tokens, accepted tokens, and accepted tokens at each draft position."""

    def __init__(self, k: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k

    def count(self, num_drafted: int, num_accepted: int):
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
