import logging
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from time import perf_counter

import numpy as np

from nanovllm.config import Config
from nanovllm.engine.batch_state import BatchState, SamplingInputs
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.ngram_proposer import NgramProposer, TokenBuffer
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.spec_decode import ACCEPTANCE_MEMORY, SpecStats, draft_limit
from nanovllm.engine.step_batch import StepBatch, expand_runs

FINISHED = SequenceStatus.FINISHED
logger = logging.getLogger(__name__)


class _Refused:
    """A grammar matcher's stand-in once its grammar refused a token: ends the sequence."""
    @staticmethod
    def is_terminated() -> bool:
        return True


REFUSED = _Refused()
STATUS_OF = attrgetter("status")


@dataclass
class ScheduledStep:
    """A step as the scheduler planned it: its sequences in order, with the position of each one's
    first new token and how many it computes. Planning commits it (see Scheduler.schedule)."""
    seqs: list[Sequence] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)  # those that sample, in order: one token each
    new_blocks: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, offset, block ids)
    new_tokens: list[tuple[int, list[int]]] = field(default_factory=list)       # (row, token ids from 0)
    forking: list[Sequence] = field(default_factory=list)  # first samples whose prompt this step computes
    filled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens) with blocks to publish
    fixed_tokens: list[tuple[int, int, int]] = field(default_factory=list)  # (row, position, token): see correct()
    undone: set[Sequence] = field(default_factory=set)  # sequences whose token here correct() dropped
    num_drafts: list[int] = field(default_factory=list)  # per sequence: its draft tokens (speculative decoding)
    num_draft_tokens: int = 0                             # their sum: > 0 in a speculative step
    draft_tokens: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, position, n-gram drafts)
    prompt_logprobs: list[tuple[int, int, int, int]] = field(default_factory=list)  # see StepBatch
    constrained: bool = False  # some sequence has a grammar (structured outputs): complete() feeds it
    offloads: np.ndarray | None = None  # the host tier's copies before the forward (see StepBatch)
    reloads: np.ndarray | None = None

    def batch(self) -> StepBatch:
        """What every rank needs to run this step."""
        num_seqs = len(self.seqs)
        samples = np.ones(num_seqs, dtype=bool) if len(self.sampling) == num_seqs else np.array(self.samples)
        batch = StepBatch(np.fromiter(self.rows, np.int32, num_seqs), np.fromiter(self.starts, np.int32, num_seqs),
                          np.fromiter(self.num_new, np.int32, num_seqs), samples, self.new_blocks, self.new_tokens,
                          self.fixed_tokens)
        if self.num_draft_tokens:
            batch.num_drafts, batch.draft_tokens = np.array(self.num_drafts, dtype=np.int32), self.draft_tokens
        batch.prompt_logprobs = self.prompt_logprobs
        batch.offloads, batch.reloads = self.offloads, self.reloads
        return batch


class Scheduler:
    """Continuous batching under a per-step token budget.

    Each step: running sequences first, in admission order (one token each when decoding, the next
    chunk of an unfinished prefill otherwise); then waiting sequences, first come first served,
    while the budget, max_num_seqs and free blocks allow. A prompt longer than the budget left is
    prefilled in chunks over several steps. When a running sequence needs a block and none is
    free, the most recently admitted running sequence is preempted: its blocks are freed and it
    returns to the front of the waiting queue, to be recomputed (its cached blocks may revive).
    With speculative decoding a decoding sequence may also run its draft tokens (_drafts), all
    of them verified in the step; complete() then takes back the ones the target rejected.
    """

    def __init__(self, config: Config, block_manager: BlockManager, eos_token_ids: set[int]):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.batch_state = BatchState(config.max_num_seqs)  # the running batch's rows
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        # preemption_mode="swap": a victim's cached blocks go to the host tier at once (its last,
        # partial block is recomputed); "recompute": they stay cached until reused
        self.swap_on_preemption = config.preemption_mode == "swap"
        self.token_fixes: list[tuple[Sequence, int, int]] = []  # correct()'s, for the next step to write
        spec = config.speculative
        self.speculative = spec is not None
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        # n-gram drafts are proposed here, on the host; a draft model's on the device, in the step
        self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                      spec.prompt_lookup_max) if spec is not None and spec.method == "ngram" else None
        self.spec_stats = SpecStats(spec.num_speculative_tokens if spec is not None else 0)

    def add(self, seq: Sequence):
        """Queue a request: its first sample, with the other samples riding on it (its forks)."""
        for s in [seq, *seq.forks]:
            s.stop_ids = set(s.sampling_params.stop_token_ids)
            if not s.sampling_params.ignore_eos:
                s.stop_ids |= self.eos_token_ids
            s.token_limit = min(s.token_limit, self.max_model_len)
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def num_waiting_samples(self) -> int:
        """Sequences not running yet: the waiting ones, and the samples riding on a request (its
        forks) until its prompt is computed, wherever it is."""
        return sum(1 + len(seq.forks) for seq in self.waiting) + sum(len(seq.forks) for seq in self.running)

    # ---- planning a step ----------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """Plan the next step, or None when there is nothing to run.

        The step is committed as it is planned, so the next one can be planned before this one's
        results are in (overlap scheduling): its sequences' num_computed_tokens count its tokens,
        and each sequence that samples counts the token it will sample in num_tokens.
        """
        step = ScheduledStep()
        num_preemptions = self.num_preemptions
        budget = self._schedule(step, self.running, self.max_num_batched_tokens)
        # A step that preempted admits nobody: the memory it freed is the running sequences' to grow into.
        if self.num_preemptions == num_preemptions:
            self._schedule(step, self._admit_waiting(step, budget), budget, draft=False)
        if not step.seqs:
            return None
        # Publish the blocks this step fills with tokens the host knows, after admission: a
        # sequence admitted now must not hit a block whose K/V this same step computes.
        for seq, num_tokens in step.filled:
            self.block_manager.cache_full_blocks(seq, num_tokens)
        step.fixed_tokens = [(seq.row, position, token) for seq, position, token in self.token_fixes
                             if seq.status is SequenceStatus.RUNNING]  # (else its row is gone: it re-uploads)
        self.token_fixes = []
        self._queue_forks(step)
        step.offloads, step.reloads = self.block_manager.take_copies()
        return step

    def _schedule(self, step: ScheduledStep, seqs: list[Sequence], budget: int, draft: bool = True) -> int:
        """Put running sequences in the step, in order, while the token budget lasts: one token
        each when decoding, the next chunk of an unfinished prefill otherwise. A sequence that
        needs a block when none is free preempts the most recently admitted ones (itself, when
        it is that one). Returns the budget left. (The one pass over every sequence of a step:
        its appends are bound once.) draft: decoding sequences may draft (speculative decoding);
        not those admitted in this step, which have their blocks already and must not grow: a
        growth would preempt from the end of `running`, where they are."""
        add_seq, add_num_new, add_row, add_start, add_samples, add_sampling, add_filled = (
            step.seqs.append, step.num_new.append, step.rows.append, step.starts.append, step.samples.append,
            step.sampling.append, step.filled.append)
        block_size = self.block_size
        constrained = self.batch_state.num_constrained > 0
        for seq in seqs:  # (preemption pops from the end of `running`: the loop then ends sooner)
            if budget <= 0:
                break
            num_tokens, start = seq.num_tokens, seq.num_computed_tokens
            if num_tokens >= seq.token_limit:
                continue  # its last token is still in flight (overlap scheduling): nothing left to compute
            if constrained and seq.matcher is not None:
                step.constrained = True  # (its mask waits for its token: LLMEngine._launch)
            num_drafts, draft_ids = (self._drafts(seq) if draft and self.speculative and num_tokens - start == 1
                                     else (0, None))
            if num_drafts and 1 + num_drafts > budget:
                break  # it waits for the next step (see _drafts); the first of a step always fits
            n = num_tokens - start + num_drafts if num_tokens - start < budget else budget
            end = start + n
            if end > len(seq.block_table) * block_size and not self._make_room(step, seq, end):
                break  # it was preempted itself, the last running
            budget -= n
            seq.num_computed_tokens = end
            add_seq(seq)
            add_num_new(n)
            add_row(seq.row)
            add_start(start)
            if self.speculative:
                step.num_drafts.append(num_drafts)
                if num_drafts:
                    step.num_draft_tokens += num_drafts
                    if draft_ids is not None:
                        step.draft_tokens.append((seq.row, num_tokens, draft_ids))
                    num_tokens = end  # (as if every draft is accepted: complete() takes back the rejected ones)
            if end == num_tokens:  # it samples: that token is in flight until complete() reads it
                seq.num_tokens = end + 1
                add_samples(True)
                add_sampling(seq)
            else:
                add_samples(False)
            # Blocks filled by tokens the host knows can be published (whoever reads them runs after
            # this step). A decode's new token is known a step later: its block is published then.
            known = len(seq.token_ids)
            if end < known:
                known = end
            if known // block_size > len(seq.block_hashes):
                add_filled((seq, known))
            if seq.forks and end >= seq.num_prompt_tokens:
                step.forking.append(seq)
            if start < seq.num_prompt_tokens - 1 and seq.prompt_logprobs is not None:
                self._want_prompt_logprobs(step, seq, start, end)
        return budget

    @staticmethod
    def _want_prompt_logprobs(step: ScheduledStep, seq: Sequence, start: int, end: int):
        """The chunk [start, end) of a prompt whose logprobs are asked for: its tokens at p predict
        the prompt tokens at p + 1, those not collected yet (a recomputed prompt skips them)."""
        first = max(start, len(seq.prompt_logprobs) - 1)  # (prompt_logprobs[j]: the token at j)
        last = min(end, seq.num_prompt_tokens - 1)
        if last > first:
            step.prompt_logprobs.append((len(step.seqs) - 1, first - start, last - first,
                                         seq.sampling_params.prompt_logprobs))

    def _drafts(self, seq: Sequence) -> tuple[int, list[int] | None]:
        """How many draft tokens a decoding sequence whose tokens the host knows verifies, and
        their ids when the host proposes them (n-gram; None: the draft model draws them in the
        step). As many as the policy allows (draft_limit) and the n-gram proposer finds, at most
        so many that its accepted drafts and the token after them stay within its token limit
        (max_tokens, max_model_len), and that it fits in a step's budget. Never fewer for lack of
        budget in this step (it waits for the next one instead), so its drafts, and a seeded
        request's tokens, do not depend on what shares its step."""
        if seq.num_tokens != len(seq.token_ids) or seq.matcher is not None:
            return 0, None  # (its last token is in flight; a grammar's masks follow one token at a time)
        fixed_cost = seq.sampling_params.seed is not None
        limit = draft_limit(self.num_speculative_tokens, seq.spec_acceptance, seq.spec_steps_since_draft,
                            len(self.running), fixed_cost)
        room = max(0, min(limit, seq.token_limit - seq.num_tokens - 1, self.max_num_batched_tokens - 1))
        drafts = None
        if self.proposer is not None:
            if seq.token_buffer is None:
                seq.token_buffer = TokenBuffer()
            drafts = self.proposer.propose(seq.token_buffer.view(seq.token_ids), max_len=room) if room else []
            room = len(drafts)
        seq.spec_steps_since_draft = 0 if room else seq.spec_steps_since_draft + 1
        return room, drafts

    def _make_room(self, step: ScheduledStep, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to num_tokens tokens, noting the new entries in the step; while
        too few blocks are free, preempt the most recently admitted running sequence (never one
        already in this step). False when that was seq itself."""
        offset = len(seq.block_table)
        while not self.block_manager.grow(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        step.new_blocks.append((seq.row, offset, seq.block_table[offset:]))
        return True

    def _admit_waiting(self, step: ScheduledStep, budget: int) -> list[Sequence]:
        """Admit waiting sequences, first come first served, while the budget, max_num_seqs and
        free blocks allow (a sequence that does not fit stops the queue: no overtaking). Each gets
        blocks for all its tokens and a row; returns them, to be scheduled."""
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > len(seq.token_ids):
                break  # preempted with a token in flight: its id must reach the host first
            num_cached = self.block_manager.allocate(seq, use_cache=seq.prompt_logprobs is None)
            if num_cached is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if not seq.admitted:
                seq.num_cached_tokens, seq.admitted = num_cached, True
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.batch_state.take_row(seq)
            step.new_blocks.append((seq.row, 0, list(seq.block_table)))
            step.new_tokens.append((seq.row, list(seq.token_ids)))
            admitted.append(seq)
            budget -= seq.num_tokens - num_cached
        return admitted

    def _queue_forks(self, step: ScheduledStep):
        """Samples 2..n of a request wait for the step that computes its prompt, then go first in
        line: their prefix lookups find the prompt's blocks."""
        for seq in reversed(step.forking):
            self.waiting.extendleft(reversed([fork for fork in seq.forks if not fork.is_finished]))
            seq.forks = []

    def _preempt(self, seq: Sequence):
        self.block_manager.free_blocks(seq, swap=self.swap_on_preemption)
        self.batch_state.free_row(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)  # victims are popped newest first, so admission order survives
        self.num_preemptions += 1

    def sampling_inputs(self, step: ScheduledStep, batch: StepBatch) -> SamplingInputs:
        """The sampling parameters of the step's sampling rows (in a speculative step, a sequence
        with d drafts has d + 1 of them: one per draft it verifies, and the one after)."""
        ends = batch.starts + batch.num_new  # the position of the token each sequence samples
        rows, seqs = batch.rows, step.sampling
        if len(step.sampling) != len(step.seqs):
            rows, ends = rows[batch.samples], ends[batch.samples]
        if batch.num_drafts is not None:
            counts = batch.num_drafts[batch.samples].astype(np.int64) + 1
            ends = expand_runs(ends - counts + 1, counts)
            rows, seqs = np.repeat(rows, counts), [seq for seq, c in zip(seqs, counts.tolist()) for _ in range(c)]
        return self.batch_state.sampling_inputs(rows.astype(np.int64), ends.astype(np.int64), seqs)

    # ---- accounting for a step ----------------------------------------------------------------
    def complete(self, step: ScheduledStep, tokens: list[int], logprobs: list[dict] | None = None
                 ) -> list[Sequence]:
        """Account for a launched step whose sampled tokens are in (one per sampling sequence, in
        order; `logprobs` their logprob dicts): append them, and finish the sequences that stop.
        Returns the sequences that got a token."""
        if step.num_draft_tokens:
            return self._complete_verified(step, tokens, logprobs)
        seqs, tokens, logprobs = self._drop_finished(step, tokens, logprobs)
        self._append(seqs, tokens, logprobs)
        if step.constrained:  # (the step's own flag: a sequence preempted since still gets its token)
            self._advance_grammars(seqs, tokens)
        self._finish_stopped(seqs, tokens, step.constrained)
        return seqs

    def _complete_verified(self, step: ScheduledStep, emitted: list[list[int]],
                           logprobs: list[list[dict]] | None) -> list[Sequence]:
        """complete() for a speculative step (run synchronously: nothing was in flight beside it):
        each sampling sequence emits its accepted drafts and the token after them (emitted[i]).
        The rejected drafts are taken back: num_computed_tokens and num_tokens drop by their count
        (their K/V slots are simply written again later). Tokens are appended one at a time, so a
        sequence that stops inside the run ends there, and the rest of the run is dropped."""
        drafts = [d for d, samples in zip(step.num_drafts, step.samples) if samples]
        stopped = []
        for i, (seq, tokens) in enumerate(zip(step.sampling, emitted)):
            rejected = drafts[i] - (len(tokens) - 1)
            seq.num_computed_tokens -= rejected
            seq.num_tokens -= rejected
            if drafts[i]:
                self.spec_stats.count(drafts[i], len(tokens) - 1)
                seq.spec_draft_tokens += drafts[i]
                seq.spec_accepted_tokens += len(tokens) - 1
                seq.spec_acceptance = (ACCEPTANCE_MEMORY * seq.spec_acceptance
                                       + (1 - ACCEPTANCE_MEMORY) * (len(tokens) - 1) / drafts[i])
            for j, token in enumerate(tokens):
                self._append([seq], [token], [logprobs[i][j]] if logprobs is not None else None)
                if seq.matcher is not None:  # (a constrained sequence drafts nothing: one token here)
                    self._advance_grammars([seq], [token])
                if (token in seq.stop_ids or len(seq.token_ids) >= seq.token_limit
                        or (seq.matcher is not None and seq.matcher.is_terminated())) and self._stops(seq, token):
                    stopped.append(seq)
                    break
        for seq in stopped:
            self._release(seq)
        if stopped:
            self.running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]
        return step.sampling

    def correct(self, step: ScheduledStep, indices: list[int], tokens: list[int], in_flight: ScheduledStep | None):
        """The sampler redrew these sampling rows of `step` (Redo) after writing their first draw
        into the device's token table: the next step writes the right token there, and a step in
        flight that already decoded the first draw is undone for them (its token is dropped, and
        they compute that position again). Called before complete(step) with the final tokens."""
        for i in indices:
            seq = step.sampling[i]
            if seq.status is not SequenceStatus.RUNNING or seq in step.undone:
                continue  # its token is dropped (finished or undone), or it was preempted (it uploads its tokens again)
            j = step.seqs.index(seq)
            position = step.starts[j] + step.num_new[j]
            self.token_fixes.append((seq, position, tokens[i]))
            if in_flight is not None and seq in in_flight.seqs:  # it decoded `position` from the first draw
                seq.num_computed_tokens = position
                seq.num_tokens -= 1
                in_flight.undone.add(seq)

    @staticmethod
    def _drop_finished(step: ScheduledStep, tokens: list[int], logprobs: list[dict] | None):
        """With overlap scheduling the next step is already running when this one is accounted
        for, so a sequence that finished meanwhile (a stop, an abort) ran once more there: that
        token is dropped here, as is one that correct() undid."""
        seqs = step.sampling
        if FINISHED not in map(STATUS_OF, seqs) and not step.undone:  # (most steps)
            return seqs, tokens, logprobs
        keep = [i for i, seq in enumerate(seqs) if seq.status is not FINISHED and seq not in step.undone]
        return ([seqs[i] for i in keep], [tokens[i] for i in keep],
                [logprobs[i] for i in keep] if logprobs is not None else None)

    @staticmethod
    def _append(seqs: list[Sequence], tokens: list[int], logprobs: list[dict] | None):
        now = perf_counter()
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
        if logprobs is not None:
            for seq, entry in zip(seqs, logprobs):
                if seq.logprobs is not None:
                    seq.logprobs.append(entry)

    @staticmethod
    def _advance_grammars(seqs: list[Sequence], tokens: list[int]):
        """Feed each constrained sequence's new token to its grammar (its mask allowed it); one
        whose grammar is complete and took its stop token ends (_stops). A token the grammar
        refuses all the same was drawn from a row with no token left (the grammar's mask and the
        request's allowed_token_ids have none in common): that sequence alone ends, with
        finish_reason "error"."""
        for seq, token in zip(seqs, tokens):
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                logger.warning("sequence %s: no token meets its constraints (its grammar refused token %d); ending it "
                               "with finish_reason 'error'", seq.seq_id, token)
                seq.matcher = REFUSED

    def _finish_stopped(self, seqs: list[Sequence], tokens: list[int], constrained: bool):
        """Finish the sequences that sampled a stop token or reached their length limit, or (in a
        step with constrained sequences) whose grammar is complete."""
        stopped = [seq for seq, token in zip(seqs, tokens)
                   if (token in seq.stop_ids or len(seq.token_ids) >= seq.token_limit
                       or (constrained and seq.matcher is not None and seq.matcher.is_terminated()))
                   and self._stops(seq, token)]
        for seq in stopped:
            if seq.status is SequenceStatus.WAITING:  # preempted while its last token was in flight
                self.waiting.remove(seq)
            self._release(seq)
        if stopped:  # they leave `running` in one pass
            self.running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]

    @staticmethod
    def _stops(seq: Sequence, token: int) -> bool:
        """Whether seq, having just appended token, ends; sets its finish and stop reasons."""
        params = seq.sampling_params
        if token in seq.stop_ids and seq.num_completion_tokens >= params.min_tokens:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in params.stop_token_ids else None  # (EOS: None)
            return True
        if seq.matcher is not None and seq.matcher.is_terminated():  # its grammar took its stop token
            seq.finish_reason, seq.stop_reason = "error" if seq.matcher is REFUSED else "stop", None
            return True
        if len(seq.token_ids) >= seq.token_limit:
            seq.finish_reason = "length"
            return True
        return False

    # ---- finishing ----------------------------------------------------------------------------
    def finish(self, seq: Sequence):
        """End a sequence wherever it is (used to abort a request, and for a stop string)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:  # (a fork may not be queued yet)
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence):
        """seq is finished: its blocks and row go back, and its samples not queued yet end with it."""
        now = perf_counter()
        for fork in seq.forks:
            fork.status, fork.finish_reason, fork.finish_time = SequenceStatus.FINISHED, seq.finish_reason, now
        seq.forks = []
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.free_blocks(seq)
            self.batch_state.free_row(seq)
            seq.num_computed_tokens = 0  # (its K/V are gone with its blocks)
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = now
