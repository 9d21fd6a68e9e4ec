from collections import deque
from dataclasses import dataclass
from time import perf_counter

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """A step on its way to the device: its sequences, each one's num_computed_tokens once the
    step is done, and whether it samples a token in it."""
    seqs: list[Sequence]
    ends: list[int]
    samples: list[bool]


class Scheduler:
    """Continuous batching under a per-step token budget.

    Each step: running sequences first, in admission order (one token each when decoding, the next
    chunk of an unfinished prefill otherwise); then waiting sequences, first come first served,
    while the budget, max_num_seqs and free blocks allow. A prompt longer than the budget left is
    prefilled in chunks over several steps. When a running sequence needs a block and none is
    free, the most recently admitted running sequence is preempted: its blocks are freed and it
    returns to the front of the waiting queue, to be recomputed (its cached blocks may revive).
    """

    def __init__(self, config: Config, block_manager: BlockManager, eos_token_ids: set[int]):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence):
        for s in [seq, *seq.forks]:
            s.stop_ids = set(s.sampling_params.stop_token_ids)
            if not s.sampling_params.ignore_eos:
                s.stop_ids |= self.eos_token_ids
            s.token_limit = min(s.token_limit, self.max_model_len)
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and set each one's num_scheduled_tokens."""
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        block_size = self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_tokens >= seq.token_limit:  # its last token is still in flight (overlap scheduling)
                i += 1
                continue
            computed = seq.num_computed_tokens
            num_tokens = min(seq.num_tokens - computed, budget)
            # (most steps need no new block: skip the block manager then)
            while (computed + num_tokens > len(seq.block_table) * block_size
                   and not self.block_manager.grow(seq, computed + num_tokens)):
                victim = self.running.pop()  # the most recently admitted; never one already scheduled
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = num_tokens
                budget -= num_tokens
                scheduled.append(seq)
                i += 1
        # A victim just preempted is first in line, and may have a token still in flight (overlap
        # scheduling): it waits for that token, and so does everyone behind it.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending or not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence):
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)  # victims are popped newest first, so admission order survives
        self.num_preemptions += 1

    def launched(self, seqs: list[Sequence]) -> ScheduledStep:
        """The scheduled step is on its way to the device: advance each sequence past it. Its
        scheduled tokens count as computed (the next step may build on them), and a sequence that
        samples gets a pending token, whose id complete() fills in."""
        ends, samples = [], []
        block_size = self.block_manager.block_size
        for seq in seqs:
            end = seq.num_computed_tokens + seq.num_scheduled_tokens
            sample = end == seq.num_tokens
            # Publish the blocks the step fills whose tokens the host knows (a decode of a pending
            # token publishes its block in complete()): the next step, scheduled before this one
            # is accounted for, can then find them. Whoever reads them runs after this step.
            num_hashed = len(seq.block_hashes)
            if end >= (num_hashed + 1) * block_size and min(end, len(seq.token_ids)) // block_size > num_hashed:
                self.block_manager.cache_full_blocks(seq, min(end, len(seq.token_ids)))
            seq.num_computed_tokens, seq.num_scheduled_tokens = end, 0
            if sample:
                seq.num_pending += 1
                seq.num_tokens += 1
                if seq.forks:  # the prompt is computed: the other samples now find its blocks cached
                    self.waiting.extendleft(reversed([fork for fork in seq.forks if not fork.is_finished]))
                    seq.forks = []
            ends.append(end)
            samples.append(sample)
        return ScheduledStep(seqs, ends, samples)

    def complete(self, step: ScheduledStep, sampled: list[int], logprobs: list[dict] | None = None
                 ) -> list[Sequence]:
        """Account for a launched step whose results are in: `sampled` holds one token per
        sequence that sampled, in order (and `logprobs` their logprob dicts). Publishes the blocks
        the step filled, appends the tokens, checks the stop conditions. Returns the sequences that
        got a token. With overlap scheduling the next step may already be running: a sequence
        that finished meanwhile (a stop, an abort) may have sampled once more there, and that
        token is dropped here, never returned."""
        updated = []
        now = perf_counter()
        tokens = iter(sampled)
        entries = iter(logprobs) if logprobs is not None else None
        block_size = self.block_manager.block_size
        running, finished = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        for seq, end, sample in zip(step.seqs, step.ends, step.samples):
            if sample:
                token = next(tokens)
                entry = next(entries) if entries is not None else None
            if seq.status is finished:  # its blocks are freed already; a token sampled past its end is dropped
                continue
            # a block filled by a pending token: publish it (a preempted sequence holds no blocks)
            if end // block_size > len(seq.block_hashes) and seq.status is running:
                self.block_manager.cache_full_blocks(seq, end)
            if not sample:
                continue
            seq.num_pending -= 1
            seq.token_ids.append(token)
            if entries is not None and seq.logprobs is not None:
                seq.logprobs.append(entry)
            if seq.first_token_time is None:
                seq.first_token_time = now
            updated.append(seq)
            if token in seq.stop_ids:
                params = seq.sampling_params
                if len(seq.token_ids) - seq.num_prompt_tokens >= params.min_tokens:
                    seq.finish_reason = "stop"
                    seq.stop_reason = token if token in params.stop_token_ids else None
                    self.finish(seq)
                    continue
            if len(seq.token_ids) >= seq.token_limit:
                seq.finish_reason = "length"
                self.finish(seq)
        assert next(tokens, None) is None, "more sampled tokens than sampling sequences"
        return updated

    def postprocess(self, seqs: list[Sequence], sampled: list[int], logprobs: list[dict] | None = None
                    ) -> list[Sequence]:
        """launched() and complete() at once: the synchronous loop's bookkeeping after a step.
        Returns the sequences that finished."""
        updated = self.complete(self.launched(seqs), sampled, logprobs)
        return [seq for seq in updated if seq.is_finished]

    def finish(self, seq: Sequence):
        """Release a sequence from whichever queue holds it (also used to abort a request)."""
        for fork in seq.forks:  # samples not queued yet (the prompt never finished computing)
            fork.status, fork.finish_reason, fork.finish_time = SequenceStatus.FINISHED, seq.finish_reason, perf_counter()
        seq.forks = []
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_blocks(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:  # (a fork may not be queued yet)
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = perf_counter()
