"""SpeculativeScheduler, built in place of the Scheduler (LLMEngine.__init__): which drafts a
decoding sequence verifies in a step (propose, from its _schedule_one), the sampling rows they add
(sampling_inputs), and the accounting of a verified step (complete: rejected drafts rolled back,
Sequence.rollback). Its steps are SpeculativeSteps: the plain step plus each sequence's drafts."""
from dataclasses import dataclass, field

import numpy as np

from nanovllm.engine.scheduler import ScheduledStep, Scheduler
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


@dataclass
class SpeculativeStep(ScheduledStep):
    """A step that may verify drafts: each drafting sequence computes its last token, then its drafts."""
    drafts: dict[int, int] = field(default_factory=dict)  # {index in the step: its drafts}
    draft_tokens: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, position, n-gram drafts)

    def batch(self) -> StepBatch:
        batch = super().batch()
        if self.drafts:  # each sequence's drafts, verified in the step
            batch.num_drafts = np.zeros(batch.num_seqs, dtype=np.int32)
            batch.num_drafts[list(self.drafts)] = list(self.drafts.values())
            batch.draft_tokens = self.draft_tokens
        return batch


class SpeculativeScheduler(Scheduler):
    Step = SpeculativeStep
    plans_decodes = True  # (each decode through _schedule_one: it may draft)

    def __init__(self, config, block_manager, eos_token_ids: set[int]):
        super().__init__(config, block_manager, eos_token_ids)
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        # n-gram drafts are proposed here, on the host; a draft model's on the device, in the step
        self.proposer = (NgramProposer(self.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
                         if spec.method == "ngram" else None)
        self.spec_stats = SpecStats(self.k)

    def _schedule_one(self, step: SpeculativeStep, seq: Sequence, budget: int, admitted: bool,
                      num_drafts: int = 0) -> int:
        """Scheduler._schedule_one, a decode with its drafts (none for a sequence admitted in this
        step: its growth would preempt from the end of `running`, where it is)."""
        if seq.num_tokens - seq.num_computed_tokens == 1 and not admitted:
            num_drafts = self.propose(seq, len(self.running), budget)
            if num_drafts < 0:
                return -1  # its drafts wait for the next step's budget
        n = super()._schedule_one(step, seq, budget, admitted, num_drafts)
        if n > 0 and num_drafts:
            step.drafts[len(step.seqs) - 1] = num_drafts
            if seq.spec.draft_ids is not None:  # (the host's: n-gram) after its last token
                step.draft_tokens.append((seq.row, step.starts[-1] + 1, seq.spec.draft_ids))
        return n

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

    def sampling_inputs(self, step: SpeculativeStep, batch: StepBatch):
        """A sequence with d drafts samples d + 1 rows: one per draft it verifies, and the one after."""
        if batch.num_drafts is None:
            return super().sampling_inputs(step, batch)
        counts = batch.num_drafts[batch.samples].astype(np.int64) + 1
        ends = expand_runs((batch.starts + batch.num_new)[batch.samples] - counts + 1, counts)
        seqs = [seq for seq, c in zip(step.sampling, counts.tolist()) for _ in range(c)]
        return self.batch_state.sampling_inputs(np.repeat(batch.rows[batch.samples].astype(np.int64), counts), ends,
                                                seqs)

    def complete(self, step: SpeculativeStep, emitted: list, logprobs: list | None = None) -> list[Sequence]:
        """Scheduler.complete(), but for a step with drafts (nothing was in flight beside it): each
        sampling sequence emits emitted[i] (its accepted drafts and the token after them) and takes
        back its rejected drafts; one that stops inside the run ends there, the rest dropped."""
        if not step.drafts:
            return super().complete(step, emitted, logprobs)
        drafts = [step.drafts.get(i, 0) for i, samples in enumerate(step.samples) if samples]
        stopped = []
        for i, (seq, tokens) in enumerate(zip(step.sampling, emitted)):
            seq.rollback(drafts[i] - (len(tokens) - 1))
            if drafts[i]:
                self._count(seq.spec, drafts[i], len(tokens) - 1)
            for j, token in enumerate(tokens):
                self.append_tokens([seq], [token], [logprobs[i][j]] if logprobs is not None else None)
                if seq.matcher is not None:  # (a constrained sequence drafts nothing: one token here)
                    from nanovllm.features.structured_outputs import advance_grammars  # (loaded when used)
                    advance_grammars([seq], [token])
                reasons = self.stop_reasons(seq, token)
                if reasons is not None:
                    stopped.append((seq, reasons))
                    break
        self.finish_stopped(stopped)
        return step.sampling

    def _count(self, state: SpecState, num_drafted: int, num_accepted: int):
        self.spec_stats.count(num_drafted, num_accepted)
        state.draft_tokens += num_drafted
        state.accepted_tokens += num_accepted
        state.acceptance = ACCEPTANCE_MEMORY * state.acceptance + (1 - ACCEPTANCE_MEMORY) * num_accepted / num_drafted
