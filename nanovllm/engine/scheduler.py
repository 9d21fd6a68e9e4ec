from collections import deque
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from nanovllm.config import Config
from nanovllm.engine.batch_state import BatchState, SamplingInputs
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.step_batch import StepBatch

FINISHED = SequenceStatus.FINISHED
PLAIN_DECODE = (1, True)  # a sequence's (tokens it computes, whether it samples) when not in ScheduledStep.chunks


@dataclass
class ScheduledStep:
    """A step as the scheduler planned it: its sequences in order, with the position of each one's
    first new token and how many it computes. Planning commits it (see Scheduler.schedule)."""
    seqs: list[Sequence] = field(default_factory=list)  # (their rows: each one's seq.row, fixed until the step is sent)
    starts: list[int] = field(default_factory=list)
    # {index: (tokens it computes, whether it samples)} for those that are not a plain decode (1, True):
    # two appends per plain decode cost ~8% of a 256-sequence decode step's host work (bench_host.py)
    chunks: dict[int, tuple[int, bool]] = field(default_factory=dict)
    sampling: list[Sequence] = field(default_factory=list)  # those that sample, in order: one token each (schedule())
    new_blocks: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, offset, block ids)
    new_tokens: list[tuple[int, list[int]]] = field(default_factory=list)       # (row, token ids from 0)
    forking: list[Sequence] = field(default_factory=list)  # first samples whose prompt this step computes
    filled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens) with blocks to publish
    fixed_tokens: list[tuple[int, int, int]] = field(default_factory=list)  # (row, position, token): see correct()
    undone: set[Sequence] = field(default_factory=set)  # sequences whose token here correct() dropped
    releases: int = 0  # Scheduler.num_releases when it was planned (complete() checks if any ended since)
    prompt_logprobs: list[tuple[int, int, int, int]] = field(default_factory=list)  # see StepBatch
    constrained: bool = False  # some sequence has a grammar (structured outputs): complete() feeds it
    offloads: np.ndarray | None = None  # the host tier's copies before the forward (see StepBatch)
    reloads: np.ndarray | None = None

    @property
    def num_new(self) -> list[int]:  # (the tokens each computes)
        return [self.chunks.get(i, PLAIN_DECODE)[0] for i in range(len(self.seqs))]

    @property
    def samples(self) -> list[bool]:  # (whether each samples)
        return [self.chunks.get(i, PLAIN_DECODE)[1] for i in range(len(self.seqs))]

    def batch(self) -> StepBatch:
        """What every rank needs to run this step."""
        num_seqs = len(self.seqs)
        num_new, samples = np.ones(num_seqs, dtype=np.int32), np.ones(num_seqs, dtype=bool)
        for i, (n, sample) in self.chunks.items():
            num_new[i], samples[i] = n, sample
        batch = StepBatch(np.fromiter([seq.row for seq in self.seqs], np.int32, num_seqs),
                          np.fromiter(self.starts, np.int32, num_seqs), num_new, samples, self.new_blocks,
                          self.new_tokens, self.fixed_tokens)
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
    (Speculative decoding's subclass, features/speculative/scheduling.py, plans drafts too.)
    """
    Step = ScheduledStep   # what schedule() plans (a subclass's may hold more)
    plans_decodes = False  # whether _schedule_one plans plain decodes too (else they are planned inline)

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
        self.num_releases = 0  # sequences ended so far (with their forks): a caller sees at once that none did
        # preemption_mode="swap": a victim's cached blocks go to the host tier at once (its last,
        # partial block is recomputed); "recompute": they stay cached until reused
        self.swap_on_preemption = config.preemption_mode == "swap"
        self.token_fixes: list[tuple[Sequence, int, int]] = []  # correct()'s, for the next step to write

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
        """Sequences not running yet: the waiting ones, and the forks riding on a request."""
        return sum(1 + len(seq.forks) for seq in self.waiting) + sum(len(seq.forks) for seq in self.running)

    # ---- planning a step ----------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """Plan the next step, or None when there is nothing to run.

        The step is committed as it is planned, so the next one can be planned before this one's
        results are in (overlap scheduling): its sequences' num_computed_tokens count its tokens,
        and each that samples counts the token it will sample in num_tokens."""
        step = self.Step(releases=self.num_releases)
        num_preemptions = self.num_preemptions
        budget = self._schedule(step, self.running, self.max_num_batched_tokens)
        # A step that preempted admits nobody: the memory it freed is the running sequences' to grow into.
        if self.num_preemptions == num_preemptions:
            self._schedule(step, self._admit_waiting(step, budget), budget, admitted=True)
        if not step.seqs:
            return None
        step.sampling = step.seqs if not step.chunks else [
            seq for seq, samples in zip(step.seqs, step.samples) if samples]
        if self.batch_state.num_constrained:  # (complete() feeds their grammars; their masks wait: LLMEngine._launch)
            step.constrained = any(seq.matcher is not None for seq in step.seqs)
        # Publish the blocks this step fills with tokens the host knows (a decode's new token is
        # known a step later: its block is published then), after admission: a sequence admitted
        # now must not hit a block whose K/V this same step computes.
        for seq, num_tokens in step.filled:
            self.block_manager.cache_full_blocks(seq, num_tokens)
        step.fixed_tokens = [(seq.row, position, token) for seq, position, token in self.token_fixes
                             if seq.status is SequenceStatus.RUNNING]  # (else its row is gone: it re-uploads)
        self.token_fixes = []
        self._queue_forks(step)
        step.offloads, step.reloads = self.block_manager.take_copies()
        return step

    def _schedule(self, step: ScheduledStep, seqs: list[Sequence], budget: int, admitted: bool = False) -> int:
        """Put running sequences (admitted: those admitted in this step) in the step, in order, while
        the token budget lasts: a decode's token, else a prefill's next chunk, in new blocks where
        needed (_make_room, which preempts). Returns the budget left. A plain decode, most of a step,
        is planned inline (a call per sequence would cost ~20 µs of a 256-sequence step:
        scripts/bench_host.py); the rest in _schedule_one."""
        add_seq, add_start = step.seqs.append, step.starts.append  # (the step's one loop: bound once)
        block_size = self.block_size
        one_by_one = self.plans_decodes and not admitted
        for seq in seqs:  # (preemption pops from the end of `running`: the loop then ends sooner)
            if budget <= 0:
                break
            num_tokens, start = seq.num_tokens, seq.num_computed_tokens
            if num_tokens >= seq.token_limit:
                continue  # its last token is still in flight (overlap scheduling): nothing left to compute
            if num_tokens - start > 1 or one_by_one or seq.forks:
                n = self._schedule_one(step, seq, budget, admitted)
                if n < 0:
                    break
                budget -= n
                continue
            if num_tokens > len(seq.block_table) * block_size and not self._make_room(step, seq, num_tokens):
                break  # it was preempted itself, the last running
            budget -= 1
            seq.advance(num_tokens, True)  # (its token is in flight till complete())
            add_seq(seq)
            add_start(start)
            if len(seq.token_ids) // block_size > len(seq.block_hashes):  # (published in schedule())
                step.filled.append((seq, len(seq.token_ids)))
        return budget

    def _schedule_one(self, step: ScheduledStep, seq: Sequence, budget: int, admitted: bool,
                      num_drafts: int = 0) -> int:
        """Put seq in the step (a prefill chunk, a decode with forks; with num_drafts, a decode and its
        drafts: admitted says if seq joined in this step, for the subclass that drafts): returns the
        tokens it computes, or -1 if it must wait (it was preempted)."""
        num_tokens, start = seq.num_tokens, seq.num_computed_tokens
        n = min(num_tokens - start, budget) + num_drafts
        end = start + n
        if end > len(seq.block_table) * self.block_size and not self._make_room(step, seq, end):
            return -1
        samples = end == num_tokens + num_drafts  # (drafts as if accepted; the token is in flight till complete())
        seq.advance(end, samples)
        if n != 1 or not samples:
            step.chunks[len(step.seqs)] = (n, samples)
        step.seqs.append(seq)
        step.starts.append(start)
        known = min(end, len(seq.token_ids))  # (blocks full of tokens the host knows: published in schedule())
        if known // self.block_size > len(seq.block_hashes):
            step.filled.append((seq, known))
        if seq.forks or seq.prompt_logprobs is not None:
            self._prompt_computed(step, seq, start, end)
        return n

    def _prompt_computed(self, step: ScheduledStep, seq: Sequence, start: int, end: int):
        """seq computes [start, end) of its prompt: forks queue once it is in; prompt logprobs note the chunk."""
        if seq.forks and end >= seq.num_prompt_tokens:
            step.forking.append(seq)
        if start < seq.num_prompt_tokens - 1 and seq.prompt_logprobs is not None:
            from nanovllm.features.prompt_logprobs import want  # (prompt logprobs' layer: loaded when used)
            want(step.prompt_logprobs, len(step.seqs) - 1, seq, start, end)

    def _make_room(self, step: ScheduledStep, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to num_tokens tokens, noting the new entries in the step; while too
        few blocks are free, preempt the newest running sequence (never one in this step): False if that was seq."""
        offset = len(seq.block_table)
        while not self.block_manager.grow(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        step.new_blocks.append((seq.row, offset, seq.block_table[offset:]))
        return True

    def _admit_waiting(self, step: ScheduledStep, budget: int) -> list[Sequence]:
        """Admit waiting sequences in order while budget, max_num_seqs and free blocks allow (one that
        does not fit stops the queue: no overtaking), each with blocks for all its tokens and a row (returned)."""
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > len(seq.token_ids):
                break  # preempted with a token in flight: its id must reach the host first
            num_cached = self.block_manager.allocate(seq, use_cache=seq.prompt_logprobs is None)
            if num_cached is None:
                break
            self.waiting.popleft()
            seq.admit(num_cached)
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
        seq.evict()
        self.waiting.appendleft(seq)  # victims are popped newest first, so admission order survives
        self.num_preemptions += 1

    def sampling_inputs(self, step: ScheduledStep, batch: StepBatch) -> SamplingInputs:
        """The sampling parameters of the step's sampling rows (one per sampling sequence)."""
        ends = batch.starts + batch.num_new  # the position of the token each sequence samples
        rows = batch.rows
        if len(step.sampling) != len(step.seqs):
            rows, ends = rows[batch.samples], ends[batch.samples]
        return self.batch_state.sampling_inputs(rows.astype(np.int64), ends.astype(np.int64), step.sampling)

    # ---- accounting for a step ----------------------------------------------------------------
    def complete(self, step: ScheduledStep, tokens: list, logprobs: list | None = None) -> list[Sequence]:
        """Account for a launched step whose sampled tokens are in (one per sampling sequence, in
        order; `logprobs` their dicts): append them, finish those that stop, and return those that got one."""
        seqs, tokens, logprobs = self._drop_finished(step, tokens, logprobs)
        may_stop = self.append_tokens(seqs, tokens, logprobs)
        if step.constrained:  # structured outputs' hook (the step's own flag: one preempted since gets its token too)
            from nanovllm.features.structured_outputs import advance_grammars  # (their layer: loaded when used)
            advance_grammars(seqs, tokens)
            may_stop = list(zip(seqs, tokens))  # (a grammar may end any of them)
        self.finish_stopped([(seq, reasons) for seq, token in may_stop
                             if (reasons := self.stop_reasons(seq, token)) is not None])
        return seqs

    def correct(self, step: ScheduledStep, indices: list[int], tokens: list[int], in_flight: ScheduledStep | None):
        """The sampler redrew these sampling rows of `step` (Redo) after writing their first draw into the
        device's token table: the next step writes the right token there, and a step in flight that decoded
        the first draw is undone for them (token dropped, position recomputed). Called before complete(step)."""
        for i in indices:
            seq = step.sampling[i]
            if seq.status is not SequenceStatus.RUNNING or seq in step.undone:
                continue  # its token is dropped (finished or undone), or it was preempted (it uploads its tokens again)
            j = step.seqs.index(seq)
            position = step.starts[j] + step.num_new[j]
            self.token_fixes.append((seq, position, tokens[i]))
            if in_flight is not None and seq in in_flight.seqs:  # it decoded `position` from the first draw
                assert seq.num_computed_tokens == position + 1
                seq.rollback(1)
                in_flight.undone.add(seq)

    def _drop_finished(self, step: ScheduledStep, tokens: list[int], logprobs: list[dict] | None):
        """With overlap scheduling the next step runs while this one is accounted for: a sequence that
        finished meanwhile (a stop, an abort) ran there once more: that token is dropped, as is one correct() undid."""
        seqs = step.sampling
        if self.num_releases == step.releases and not step.undone:  # (most steps: none ended since its planning)
            return seqs, tokens, logprobs
        keep = [i for i, seq in enumerate(seqs) if seq.status is not FINISHED and seq not in step.undone]
        return ([seqs[i] for i in keep], [tokens[i] for i in keep],
                [logprobs[i] for i in keep] if logprobs is not None else None)

    @staticmethod
    def append_tokens(seqs: list[Sequence], tokens: list[int], logprobs: list[dict] | None) -> list[tuple]:
        """Append each one's token (and logprobs); returns (seq, token) where it may end them."""
        may_stop = Sequence.append_each(seqs, tokens, perf_counter())
        if logprobs is not None:
            for seq, entry in zip(seqs, logprobs):
                if seq.logprobs is not None:
                    seq.logprobs.append(entry)
        return may_stop

    @staticmethod
    def stop_reasons(seq: Sequence, token: int) -> tuple[str, int | None] | None:
        """Whether seq, having just appended token, ends, and why: (finish_reason, stop_reason) for a
        stop token (once min_tokens are in), its grammar complete ("error": refused), its length; or None."""
        params = seq.sampling_params
        if token in seq.stop_ids and seq.num_completion_tokens >= params.min_tokens:
            return "stop", token if token in params.stop_token_ids else None  # (EOS: None)
        if seq.matcher is not None and seq.matcher.is_terminated():  # (structured outputs)
            from nanovllm.features.structured_outputs import REFUSED  # (their layer: loaded when used)
            return "error" if seq.matcher is REFUSED else "stop", None
        if len(seq.token_ids) >= seq.token_limit:
            return "length", None
        return None

    def finish_stopped(self, stopped: list[tuple[Sequence, tuple]]):
        """Finish each (sequence, stop_reasons()) and release it (one preempted while its last
        token was in flight waits: it leaves the queue); they leave `running` in one pass."""
        for seq, reasons in stopped:
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            self._release(seq, *reasons)
        if stopped:
            self.running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]

    # ---- finishing ----------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        """End a sequence wherever it is (used to abort a request, and for a stop string)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:  # (a fork may not be queued yet)
            self.waiting.remove(seq)
        self._release(seq, reason, stop_reason)

    def _release(self, seq: Sequence, reason: str, stop_reason: int | str | None):
        """seq ends, for reason: its blocks and row go back, and its samples not queued yet end with it."""
        self.num_releases += 1
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.free_blocks(seq)
            self.batch_state.free_row(seq)
        now = perf_counter()
        seq.finish(reason, stop_reason, now)
        for fork in seq.forks:
            fork.finish(seq.finish_reason, None, now)
        seq.forks = []
