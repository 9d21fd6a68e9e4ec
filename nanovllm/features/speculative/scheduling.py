"""Speculation, the scheduler's hook for speculative decoding: which drafts a decoding sequence
verifies in a step (propose), the sampling rows they add (sampling_rows), and the accounting of a
verified step (complete: rejected drafts rolled back, Sequence.rollback)."""
import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_batch import StepBatch
from nanovllm.features.speculative.ngram import NgramProposer, TokenBuffer
from nanovllm.features.speculative.policy import ACCEPTANCE_MEMORY, SpecStats, draft_limit


def expand_runs(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """firsts[i], firsts[i] + 1, ..., counts[i] values from each, back to back: the indices of
    runs (a speculative step's rows of each sequence). [N] int64 each -> [sum(counts)] int64."""
    counts = counts.astype(np.int64)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(firsts.astype(np.int64), counts) + offsets


def draft_slots(batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
    """The (row, position) of every draft token of a speculative step, [sum(num_drafts)] int64
    each, in step order: a drafting sequence computes its last token, then its drafts."""
    drafts = batch.num_drafts.astype(np.int64)
    return np.repeat(batch.rows.astype(np.int64), drafts), expand_runs(batch.starts.astype(np.int64) + 1, drafts)


class SpecState:
    """What speculation keeps of one sequence (Sequence.spec)."""
    __slots__ = ("draft_tokens", "accepted_tokens", "acceptance", "steps_since_draft", "buffer", "draft_ids")

    def __init__(self):
        self.draft_tokens = self.accepted_tokens = 0  # its drafts verified, and those accepted
        self.acceptance = 1.0                         # their recent acceptance rate (optimistic at first)
        self.steps_since_draft = 0                    # decode steps since it last drafted (draft_limit)
        self.buffer = None                            # its tokens as numpy, for the n-gram proposer
        self.draft_ids = None                         # its draft ids this step (n-gram; None: the draft model's)


class Speculation:
    def __init__(self, config):
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # n-gram drafts are proposed here, on the host; a draft model's on the device, in the step
        self.proposer = (NgramProposer(self.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
                         if spec.method == "ngram" else None)
        self.stats = SpecStats(self.k)

    def propose(self, seq: Sequence, num_running: int, budget: int) -> int:
        """How many draft tokens a decoding sequence verifies this step (their ids in
        seq.spec.draft_ids when the host proposes them; None: the draft model draws them), or -1:
        they do not fit in the budget left, and it waits for the next step (the first of a step
        always fits). As many as draft_limit allows and the n-gram proposer finds, within its token
        limit (max_tokens, max_model_len: its accepted drafts and the token after them) and a step's
        budget; never fewer for lack of budget in this step, so its drafts, and a seeded request's
        tokens, do not depend on what shares its step."""
        state = seq.spec
        if state is None:
            state = seq.spec = SpecState()
        state.draft_ids = None
        if seq.num_tokens != len(seq.token_ids) or seq.matcher is not None:
            return 0  # (its last token is in flight; a grammar's masks follow one token at a time)
        limit = draft_limit(self.k, state.acceptance, state.steps_since_draft, num_running,
                            fixed_cost=seq.sampling_params.seed is not None)
        room = max(0, min(limit, seq.token_limit - seq.num_tokens - 1, self.max_num_batched_tokens - 1))
        drafts = None
        if self.proposer is not None:
            if state.buffer is None:
                state.buffer = TokenBuffer()
            drafts = self.proposer.propose(state.buffer.view(seq.token_ids), max_len=room) if room else []
            room = len(drafts)
        state.steps_since_draft = 0 if room else state.steps_since_draft + 1
        state.draft_ids = drafts
        return room if 1 + room <= budget else -1

    @staticmethod
    def sampling_rows(batch: StepBatch, rows: np.ndarray, ends: np.ndarray, seqs: list[Sequence]):
        """A sequence with d drafts samples d + 1 rows: one per draft it verifies, and the one
        after. rows, ends (the position each samples), seqs: one per sampling sequence, expanded."""
        counts = batch.num_drafts[batch.samples].astype(np.int64) + 1
        ends = expand_runs(ends - counts + 1, counts)
        return np.repeat(rows, counts), ends, [seq for seq, c in zip(seqs, counts.tolist()) for _ in range(c)]

    def complete(self, scheduler, step, emitted: list[list[int]], logprobs: list[list[dict]] | None
                 ) -> list[Sequence]:
        """Scheduler.complete() for a speculative step (nothing was in flight beside it): each
        sampling sequence emits emitted[i] (its accepted drafts and the token after them) and takes
        back its rejected drafts; one that stops inside the run ends there, the rest dropped."""
        drafts = [step.drafts.get(i, 0) for i, samples in enumerate(step.samples) if samples]
        stopped = []
        for i, (seq, tokens) in enumerate(zip(step.sampling, emitted)):
            seq.rollback(drafts[i] - (len(tokens) - 1))
            if drafts[i]:
                self._count(seq.spec, drafts[i], len(tokens) - 1)
            for j, token in enumerate(tokens):
                scheduler.append_tokens([seq], [token], [logprobs[i][j]] if logprobs is not None else None)
                if seq.matcher is not None:  # (a constrained sequence drafts nothing: one token here)
                    from nanovllm.features.structured_outputs import advance_grammars  # (loaded when used)
                    advance_grammars([seq], [token])
                reasons = scheduler.stop_reasons(seq, token)
                if reasons is not None:
                    stopped.append((seq, reasons))
                    break
        scheduler.finish_stopped(stopped)
        return step.sampling

    def _count(self, state: SpecState, num_drafted: int, num_accepted: int):
        self.stats.count(num_drafted, num_accepted)
        state.draft_tokens += num_drafted
        state.accepted_tokens += num_accepted
        state.acceptance = ACCEPTANCE_MEMORY * state.acceptance + (1 - ACCEPTANCE_MEMORY) * num_accepted / num_drafted
